"""PINN: the viscous Burgers equation, Adam (Optax) then L-BFGS-B (SciPy) on one `p`.

    u_t + u u_x = (0.01/π) u_xx,   x in [-1, 1], t in [0, 1],
    u(x, 0) = -sin(πx),   u(-1, t) = u(1, t) = 0.

The network u(x, t) is an Equinox MLP; its derivatives come from JAX autodiff. It is
trained with Adam (`sciflat.fit`) and refined with SciPy's L-BFGS-B
(`sciflat.minimize`): both work on the same flat float64 vector, so the second starts
exactly where the first stopped. The reference solution is the Cole–Hopf closed form,
evaluated by Gauss–Hermite quadrature (as for the classic dataset of Raissi et al.).

Run it (under a minute on 2 CPU cores), or the configuration of Raissi et al. (2019):

    python examples/pinn/train.py
    python examples/pinn/train.py --full
"""

import argparse
import os
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.stats

import sciflat


OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "outputs")  # plots

jax.config.update("jax_enable_x64", True)  # float64 exists only with 64-bit mode on

NU = 0.01 / np.pi

#
# The reference: Cole–Hopf, u = -2ν ∂x log φ with φ solving the heat equation.
#


def reference(x, t, n_quad=200):
    """u(x, t) on the grid `x` × `t` (NumPy, float64), by Gauss–Hermite quadrature.

    u(x, t) = -∫ sin(π(x-η)) f(x-η) G(η) dη / ∫ f(x-η) G(η) dη, with
    f(y) = exp(-cos(πy) / (2πν)) and G the heat kernel of variance 2νt.
    """
    z, w = np.polynomial.hermite.hermgauss(n_quad)
    xx, tt = np.meshgrid(x, t, indexing="ij")
    y = xx[..., None] - np.sqrt(4 * NU * tt[..., None]) * z  # x - η at each node
    log_f = -np.cos(np.pi * y) / (2 * np.pi * NU) + np.log(w)
    weight = np.exp(log_f - log_f.max(axis=-1, keepdims=True))  # f is up to e^50
    return -np.sum(np.sin(np.pi * y) * weight, -1) / np.sum(weight, -1)


#
# The network and the physics-informed loss.
#


class PINN(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, width, depth, *, key):
        self.mlp = eqx.nn.MLP(
            2, "scalar", width, depth, activation=jnp.tanh, dtype=jnp.float32, key=key
        )

    def __call__(self, x, t):
        return self.mlp(jnp.stack([x, 2 * t - 1]))  # inputs scaled to [-1, 1]


def residual(model, x, t):
    """u_t + u u_x - ν u_xx at one point, by forward-mode autodiff."""
    u_x = lambda x: jax.jvp(lambda x: model(x, t), (x,), (jnp.ones_like(x),))
    (u, ux), (_, uxx) = jax.jvp(u_x, (x,), (jnp.ones_like(x),))
    ut = jax.jvp(lambda t: model(x, t), (t,), (jnp.ones_like(t),))[1]
    return ut + u * ux - NU * uxx


def loss_fn(model, data):
    """Mean squared PDE residual + mean squared misfit of initial and boundary values."""
    (xf, tf), (xu, tu, u) = data
    f = jax.vmap(residual, (None, 0, 0))(model, xf, tf)
    misfit = jax.vmap(model)(xu, tu) - u
    return jnp.mean(f**2) + jnp.mean(misfit**2)


def make_points(n_u, n_f, *, seed, dtype):
    """`n_u` initial/boundary points and `n_f` Latin-hypercube collocation points."""
    rng = np.random.default_rng(seed)
    x0 = rng.uniform(-1, 1, n_u)
    tb = rng.uniform(0, 1, n_u)
    xu = np.concatenate([x0, np.full(n_u // 2, -1.0), np.full(n_u - n_u // 2, 1.0)])
    tu = np.concatenate([np.zeros(n_u), tb])
    uu = np.concatenate([-np.sin(np.pi * x0), np.zeros(n_u)])
    pick = rng.choice(len(xu), n_u, replace=False)  # n_u of them, as Raissi et al.
    xf, tf = scipy.stats.qmc.LatinHypercube(d=2, rng=rng).random(n_f).T
    xf = 2 * xf - 1
    # The data points are collocation points too, as in the original code.
    xf, tf = np.concatenate([xf, xu[pick]]), np.concatenate([tf, tu[pick]])
    cast = lambda *a: tuple(jnp.asarray(v, dtype) for v in a)
    return cast(xf, tf), cast(xu[pick], tu[pick], uu[pick])


#
# The script.
#


def main(
    *,
    width=20,
    depth=4,
    n_u=100,
    n_f=2000,
    adam_steps=500,
    lbfgs_steps=None,
    lr=1e-3,
    full=False,
    report_every=0,
    out=OUT,
    seed=0,
    progress=True,
):
    """Trains a PINN for Burgers; returns a summary dict with the relative L2 error.

    `full=True` is the configuration of Raissi et al. (2019): 8 hidden layers of 20,
    100 initial/boundary points, 10,000 collocation points, L-BFGS-B to convergence
    (at most 50,000 iterations unless `lbfgs_steps` says otherwise).
    """
    if full:
        depth, n_f = 8, 10_000
    if lbfgs_steps is None:
        lbfgs_steps = 50_000 if full else 3000
    points = make_points(n_u, n_f, seed=seed, dtype=jnp.float64)
    x, t = np.linspace(-1, 1, 256), np.linspace(0, 0.99, 100)  # the classic grid
    u_ref = reference(x, t)
    xx, tt = (jnp.asarray(a.ravel()) for a in np.meshgrid(x, t, indexing="ij"))

    # A float32 network, trained as one float64 vector: the dtype rule.
    model = PINN(width, depth, key=jax.random.key(seed))
    p, re = sciflat.destructure(model, dtype=jnp.float64)
    print(f"{len(re)} parameters, {n_u} data points, {n_f} collocation points")
    predict = eqx.filter_jit(lambda m: jax.vmap(m)(xx, tt).reshape(u_ref.shape))
    error = lambda m: float(np.linalg.norm(predict(m) - u_ref) / np.linalg.norm(u_ref))
    history, t0 = [], time.perf_counter()

    adam = sciflat.fit(
        loss_fn,
        re(p),
        optax.adam(lr),
        steps=adam_steps,
        args=(points,),
        progress=progress,
    )
    history.append(adam.history)
    t_adam = time.perf_counter() - t0
    print(f"Adam:     loss {adam.loss:.3e}, relative L2 error {error(adam.model):.3e}")

    # L-BFGS-B continues from Adam's flat vector itself, with Raissi et al.'s settings.
    lbfgs = sciflat.minimize(
        loss_fn,
        re,
        args=(points,),
        x0=adam.p,
        method="L-BFGS-B",
        progress=progress,
        callback=_report_every(report_every, error, t0),
        options=dict(
            maxiter=lbfgs_steps, maxfun=2 * lbfgs_steps, maxcor=50, maxls=50,
            ftol=np.finfo(float).eps,
        ),
    )  # fmt: skip
    history.append(lbfgs.history)
    history = np.concatenate(history)
    train_time = time.perf_counter() - t0
    err = error(lbfgs.model)
    print(
        f"L-BFGS-B: loss {lbfgs.loss:.3e} after {lbfgs.n_steps} iterations ({lbfgs.message})"
    )
    print(f"relative L2 error vs the Cole–Hopf reference: {err:.3e}")
    print(f"training took {train_time:.1f} s (Adam {t_adam:.1f} s)")
    diverged = not (np.isfinite(lbfgs.loss) and lbfgs.loss < history[0])
    plot = (
        _plot(x, t, u_ref, np.asarray(predict(lbfgs.model)), history, out)
        if out
        else None
    )
    return dict(
        model=lbfgs.model,
        history=history,
        loss=lbfgs.loss,
        error=err,
        diverged=diverged,
        plot=plot,
        train_time=train_time,
    )


def _report_every(n, error, t0):
    """An L-BFGS-B callback printing the error every `n` iterations (0: never)."""

    def callback(step, loss, model):
        if n and step % n == 0:
            elapsed = time.perf_counter() - t0
            print(f"  iteration {step}: loss {loss:.3e}, relative L2 error "
                  f"{error(model):.3e}, {elapsed:.0f} s", flush=True)  # fmt: skip

    return callback


def _plot(x, t, u_ref, u_pred, history, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    extent = (t[0], t[-1], x[0], x[-1])
    panels = [(u_pred, "prediction u(x, t)"), (u_ref, "reference (Cole–Hopf)")]
    panels.append((np.abs(u_pred - u_ref), "|error|"))
    for ax, (z, title) in zip(axes, panels, strict=False):
        im = ax.imshow(z, origin="lower", aspect="auto", extent=extent, cmap="rainbow")
        ax.set(xlabel="t", ylabel="x", title=title)
        fig.colorbar(im, ax=ax)
    axes[3].semilogy(history)
    axes[3].axvline(len(history) - 1, alpha=0)  # keep the full range
    axes[3].set(
        xlabel="Adam step, then L-BFGS-B iteration", ylabel="loss", title="Loss"
    )
    fig.tight_layout()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "burgers.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--width", type=int, default=20, help="hidden width")
    add("--depth", type=int, default=4, help="hidden layers")
    add("--n-f", dest="n_f", type=int, default=2000, help="collocation points")
    add("--adam-steps", type=int, default=500)
    add(
        "--lbfgs-steps",
        type=int,
        help="L-BFGS-B iterations at most (3000; --full 50000)",
    )
    add("--full", action="store_true", help="Raissi et al.: 8x20, 10,000 points")
    add(
        "--report-every",
        type=int,
        default=0,
        help="print the error every N L-BFGS-B steps",
    )
    add("--out", default=OUT, help="folder for the plot")
    add("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    result = main(**vars(_parse()))
    sys.exit(1 if result["diverged"] else 0)
