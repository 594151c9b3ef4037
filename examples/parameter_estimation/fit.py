"""Parameter estimation: Lotka–Volterra rates from noisy data, with scipy.optimize.

    x' = α x - β x y     (prey)
    y' = δ x y - γ y     (predators)

1. The four rates are fitted to noisy observations with SciPy, through sciflat, both
   ways: `sciflat.least_squares` (trust-region reflective, on the residuals) and
   `sciflat.minimize` (L-BFGS-B, on the mean squared error); each rate has its own
   positive bound. `sciflat.multistart` runs the fit from several guesses (one
   compilation) and keeps the best; its standard errors and report come with the
   result (`print(result)`).
2. A universal differential equation: the interaction terms (-β x y, δ x y) are
   replaced by an MLP, and its weights are fitted together with the known-form rates
   α and γ, all in one flat vector `p`.

Run it (under a minute on 2 CPU cores):

    python examples/parameter_estimation/fit.py
    python examples/parameter_estimation/fit.py --noise 0.1 --n-obs 81
"""

import argparse
import os
import sys
import time

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import sciflat


OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "outputs")  # plots

jax.config.update("jax_enable_x64", True)  # SciPy works in float64

TRUE_RATES = dict(alpha=1.5, beta=1.0, gamma=3.0, delta=1.0)
Y0 = (1.0, 1.0)

#
# The models: the rates alone, and the universal differential equation.
#


class LotkaVolterra(eqx.Module):
    alpha: jax.Array
    beta: jax.Array
    gamma: jax.Array
    delta: jax.Array

    def __init__(self, alpha, beta, gamma, delta):
        # float64 scalars: positions in `p`, each with its own bounds.
        self.alpha, self.beta, self.gamma, self.delta = (
            jnp.asarray(v, jnp.float64) for v in (alpha, beta, gamma, delta)
        )

    def __call__(self, t, y, args):
        x, z = y
        return jnp.stack(
            [self.alpha * x - self.beta * x * z, self.delta * x * z - self.gamma * z]
        )


class UDE(eqx.Module):
    """Known-form growth and decay, α x and -γ y; the unknown interaction is
    x y g(x, y) with g an MLP. The factor x y says only what we know (no interaction
    without both species), and keeps the network from simply absorbing α x (it would
    need g ≈ α / y, unbounded as y -> 0)."""

    alpha: jax.Array
    gamma: jax.Array
    interaction: eqx.nn.MLP

    def __init__(self, alpha, gamma, width, *, key):
        self.alpha, self.gamma = jnp.asarray(alpha), jnp.asarray(gamma)
        mlp = eqx.nn.MLP(
            2, 2, width, 2, activation=jnp.tanh, dtype=jnp.float32, key=key
        )
        # Start the unknown term near zero: a small last layer.
        self.interaction = eqx.tree_at(
            lambda m: m.layers[-1].weight, mlp, mlp.layers[-1].weight * 0.1
        )

    def __call__(self, t, y, args):
        x, z = y
        return jnp.stack([self.alpha * x, -self.gamma * z]) + x * z * self.interaction(
            y
        )


def solve(field, ts, *, adjoint=None, rtol=1e-8, full=False):
    """The trajectory from `Y0`, saved at `ts`, in the dtype of `ts` (`full`: Diffrax's
    solution, whose `result` says whether the solve succeeded)."""
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        diffrax.Tsit5(),
        ts[0],
        ts[-1],
        None,
        jnp.asarray(Y0, ts.dtype),
        saveat=diffrax.SaveAt(ts=ts),
        stepsize_controller=diffrax.PIDController(rtol=rtol, atol=rtol),
        adjoint=adjoint or diffrax.RecursiveCheckpointAdjoint(),
        max_steps=4096,
        throw=not full,
    )
    return sol if full else sol.ys


def make_data(n_obs, t_end, noise, *, seed):
    """Observations of the true system with Gaussian noise of `noise` × each state's std."""
    ts = jnp.linspace(0.0, t_end, n_obs)
    ys = np.asarray(solve(LotkaVolterra(**TRUE_RATES), ts))
    rng = np.random.default_rng(seed)
    return ts, jnp.asarray(ys + noise * ys.std(axis=0) * rng.standard_normal(ys.shape))


#
# The losses: four rates are few, so forward-mode derivatives of the solve are cheap.
#


def residuals(model, ts, ys):
    return solve(model, ts, adjoint=diffrax.ForwardMode()) - ys


def mse(model, ts, ys):
    return jnp.mean(residuals(model, ts, ys) ** 2)


def ude_mse(model, ts, ys, n=None):
    """Many parameters: reverse mode (the default adjoint). A trial step of L-BFGS-B's
    line search can make the ODE blow up; its loss is then large (so the line search
    backs off) instead of an error, and its gradient finite. With `n`, on the first
    `n` times only: the later ones are solved to the `n`-th and left out, so every
    horizon has the same shapes (one compiled step for all)."""
    n = len(ts) if n is None else n
    sol = solve(model, jnp.minimum(ts, ts[n - 1]), rtol=1e-6, full=True)
    ok = sol.result == diffrax.RESULTS.successful
    keep = (jnp.arange(len(ts)) < n)[:, None]
    # No inf in the gradient of a failed solve, nor of a time left out.
    err = jnp.where(ok & keep, sol.ys - ys, 0.0)
    return jnp.where(ok, jnp.sum(err**2) / (n * ys.shape[1]), 1e6)


POSITIVE = {name: (1e-6, None) for name in TRUE_RATES}  # bounds per leaf, by path


def rate_table(model, stderr=None):
    lines = []
    for name, true in TRUE_RATES.items():
        value = float(getattr(model, name))
        err = "" if stderr is None else f" ± {stderr[name]:.3f}"
        lines.append(
            f"  {name:5s} = {value:.4f}{err}   (true {true}, off by {abs(value - true) / true:.2%})"
        )
    return "\n".join(lines)


#
# The script.
#


def main(
    *,
    n_obs=41,
    t_end=10.0,
    noise=0.05,
    guesses=((1.0, 0.5, 2.0, 0.5), (1.0, 1.5, 2.0, 1.5), (2.0, 1.0, 2.0, 1.0)),
    ude=True,
    ude_t_end=5.0,
    ude_width=16,
    ude_steps=500,
    ude_adam_steps=300,
    out=OUT,
    seed=0,
    progress=True,
):
    """Fits the rates both ways, then the UDE; returns a summary dict."""
    ts, ys = make_data(n_obs, t_end, noise, seed=seed)
    start = LotkaVolterra(*guesses[0])
    summary = dict(initial_mse=float(mse(start, ts, ys)))

    # The fit is not convex (from the first two guesses it stops in a local minimum
    # with a cost 400 times larger): start from a few guesses and keep the best.
    # Compiled once, each start takes milliseconds. (Equal rates would be a poor
    # guess: with y0 = (1, 1) that is an equilibrium, where nothing moves.)
    t0 = time.perf_counter()
    runs = sciflat.multistart(
        sciflat.least_squares,
        residuals,
        start,
        [LotkaVolterra(*g) for g in guesses],
        args=(ts, ys),
        bounds=POSITIVE,
    )
    lsq = runs.best
    # Standard errors from the Jacobian at the solution, in the model's structure.
    stderr = {name: float(getattr(lsq.stderr, name)) for name in TRUE_RATES}
    print(
        f"least_squares (trf) from {len(guesses)} starts, costs "
        f"{', '.join(f'{r.loss:.3g}' for r in runs.results)}: "
        f"{time.perf_counter() - t0:.1f} s"
    )
    print(lsq)  # values ± standard errors, correlations, χ², AIC/BIC, ...
    print(rate_table(lsq.model, stderr))

    t0 = time.perf_counter()
    mini = sciflat.minimize(
        mse,
        LotkaVolterra(*guesses[runs.results.index(lsq)]),
        args=(ts, ys),
        bounds=POSITIVE,
        progress=progress,
    )
    took = time.perf_counter() - t0
    print(
        f"minimize (L-BFGS-B) from the best start: {mini.n_steps} iterations, "
        f"{took:.1f} s"
    )
    print(rate_table(mini.model))
    rel = lambda m: {
        k: abs(float(getattr(m, k)) - v) / v for k, v in TRUE_RATES.items()
    }
    summary.update(
        least_squares=lsq,
        minimize=mini,
        stderr=stderr,
        lsq_rel_error=rel(lsq.model),
        minimize_rel_error=rel(mini.model),
        final_mse=float(mse(lsq.model, ts, ys)),
    )

    if ude:
        summary.update(
            fit_ude(
                ts, ys, ude_t_end, ude_width, ude_steps, ude_adam_steps, seed, progress
            )
        )
    if out:
        ude_plot = dict(result=summary["ude"], t_end=ude_t_end) if ude else None
        summary["plot"] = _plot(ts, ys, lsq.model, ude_plot, out)
    summary["diverged"] = not (summary["final_mse"] < summary["initial_mse"])
    return summary


def fit_ude(ts, ys, t_end, width, steps, adam_steps, seed, progress):
    """The UDE on the first `t_end` of the data: α, γ and the MLP share one `p`."""
    model = UDE(1.0, 2.0, width, key=jax.random.key(seed))
    p, re = sciflat.destructure(model, dtype=jnp.float64)  # float32 MLP, one float64 p
    print(f"UDE: {len(re)} parameters in one {p.dtype} vector (α, γ, then the MLP)")
    t0, n_steps, model = time.perf_counter(), 0, re(p)
    keep = ts <= t_end
    # The true trajectory, solved as the data were (the same compiled solve).
    y_true = solve(LotkaVolterra(**TRUE_RATES), ts)[keep]
    ts, ys = ts[keep], ys[keep]
    initial = float(ude_mse(model, ts, ys))
    # Adam on a growing window, then L-BFGS-B: from a poor start, L-BFGS-B alone (or
    # on the whole window at once) finds a local minimum where α = 0. The window is
    # data (`n`), and the optimiser one object: the second window reuses the step.
    adam_opt = optax.adam(1e-2)
    for horizon in (0.3 * t_end, t_end):
        n = np.int64(np.sum(np.asarray(ts) <= horizon))
        adam = sciflat.fit(
            ude_mse,
            model,
            adam_opt,
            steps=adam_steps,
            args=(ts, ys, n),
            progress=progress,
        )
        model, n_steps = adam.model, n_steps + adam.n_steps
    result = sciflat.minimize(
        ude_mse,
        model,
        args=(ts, ys),
        progress=progress,
        bounds={"alpha": (1e-6, None), "gamma": (1e-6, None)},
        options=dict(maxiter=steps),
    )
    n_steps += result.n_steps
    fit = result.model
    # How well the network learned the interaction, along the true trajectory.
    x, z = y_true[:, 0], y_true[:, 1]
    truth = jnp.stack([-TRUE_RATES["beta"] * x * z, TRUE_RATES["delta"] * x * z], -1)
    learned = x[:, None] * z[:, None] * jax.vmap(fit.interaction)(y_true)
    term_error = float(jnp.linalg.norm(learned - truth) / jnp.linalg.norm(truth))
    took = time.perf_counter() - t0
    print(
        f"UDE (Adam then L-BFGS-B, {n_steps} steps, {took:.1f} s): mse {initial:.3g} ->"
    )
    print(
        f"  {result.loss:.3e}; α = {float(fit.alpha):.4f} (true {TRUE_RATES['alpha']}), "
    )
    print(
        f"  γ = {float(fit.gamma):.4f} (true {TRUE_RATES['gamma']}); interaction term off"
    )
    print(
        f"  by {term_error:.2%} (relative L2 along the true trajectory, t <= {t_end})"
    )
    return dict(ude=result, ude_term_error=term_error, ude_initial_mse=initial)


def _plot(ts, ys, model, ude, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fine = jnp.linspace(ts[0], ts[-1], 400)
    fig, axes = plt.subplots(1, 2 if ude is None else 3, figsize=(15 if ude else 10, 4))
    fitted = solve(model, fine)
    for i, name in enumerate(["prey x", "predators y"]):
        axes[0].plot(ts, ys[:, i], "o", c=f"C{i}", ms=3, label=f"data: {name}")
        axes[0].plot(fine, fitted[:, i], c=f"C{i}", label=f"fit: {name}")
    axes[0].set(xlabel="t", title="least_squares fit of the rates")
    axes[0].legend(fontsize=8)
    axes[1].plot(ys[:, 0], ys[:, 1], "o", ms=3, c="k", label="data")
    axes[1].plot(fitted[:, 0], fitted[:, 1], label="rates fit")
    axes[1].set(xlabel="prey x", ylabel="predators y", title="Phase plane")
    if ude is not None:
        # The UDE saw only t <= ude_t_end: the rest of the curve is extrapolation.
        u = solve(ude["result"].model, fine)
        axes[1].plot(u[:, 0], u[:, 1], "--", label="UDE")
        for i in range(2):
            axes[2].plot(ts, ys[:, i], "o", ms=3, c=f"C{i}")
            axes[2].plot(fine, u[:, i], "--", c=f"C{i}")
        axes[2].axvline(ude["t_end"], c="gray", lw=0.8)
        axes[2].set(
            xlabel="t", title="UDE: fitted left of the line, extrapolated right"
        )
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "lotka_volterra.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--n-obs", dest="n_obs", type=int, default=41, help="observation times")
    add("--noise", type=float, default=0.05, help="noise, as a fraction of each std")
    add("--no-ude", dest="ude", action="store_false", help="skip the UDE")
    add("--ude-steps", type=int, default=500, help="L-BFGS-B iterations for the UDE")
    add("--out", default=OUT, help="plot folder")
    add("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    result = main(**vars(_parse()))
    sys.exit(1 if result["diverged"] else 0)
