"""PINN: the viscous Burgers equation, trained on one flat float64 vector `p`.

    u_t + u u_x = (0.01/π) u_xx,   x in [-1, 1], t in [0, 1],
    u(x, 0) = -sin(πx),   u(-1, t) = u(1, t) = 0.

The network u(x, t) is an Equinox MLP (Xavier initialisation, inputs scaled to
[-1, 1]); its derivatives come from JAX autodiff. Adam (`sciflat.fit`, Optax), then a
quasi-Newton method on the same flat float64 vector: `sciflat.quasi_newton`'s
self-scaled Broyden (SSBroyden, compiled, strong Wolfe line search), Optimistix's
BFGS, or SciPy's L-BFGS-B (`sciflat.minimize`). The reference solution is the
Cole–Hopf closed form, evaluated by Gauss–Hermite quadrature (as for the classic
dataset of Raissi et al.). The relative L2 error against it is printed while
training: a small loss does not prove a small error.

The default run is the configuration of Kiyani et al. (CMAME 2025: 4 x 20 tanh, 8,000
collocation points resampled by residual, soft initial and boundary terms, Adam, then
SSBroyden), short: 200 Adam steps and 1,000 SSBroyden iterations; `--record` runs it
to 50,000. The original settings of Raissi et al. (2019) are `--paper`, in float64,
float32, or float32 then float64, or with Optimistix's BFGS (see README.md):

    python examples/pinn/train.py
    python examples/pinn/train.py --record --seed 0            # hours on 2 cores
    python examples/pinn/train.py --record --method bfgs       # or ssbfgs, lbfgs-b
    python examples/pinn/train.py --optimizer bfgs             # Raissi's 8 x 20 setup
    python examples/pinn/train.py --paper --report-every 1000
    python examples/pinn/train.py --paper --dtype float32-then-float64
    python examples/pinn/train.py --paper --optimizer bfgs --steps 10000
"""

import argparse
import functools
import os
import sys
import time
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optimistix as optx
import scipy
import scipy.stats

import sciflat


OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "outputs")  # plots

jax.config.update("jax_enable_x64", True)  # float64 exists only with 64-bit mode on

NU = 0.01 / np.pi
X_GRID, T_GRID = np.linspace(-1, 1, 256), np.linspace(0, 0.99, 100)  # the classic grid
LOWER, UPPER = (-1.0, 0.0), (1.0, 0.99)  # the data's bounds, as in the original code

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

    def __init__(self, width, depth, *, key, init="xavier"):
        mlp = eqx.nn.MLP(
            2, "scalar", width, depth, activation=jnp.tanh, dtype=jnp.float32, key=key
        )
        self.mlp = xavier(mlp, key) if init == "xavier" else mlp

    def __call__(self, x, t):
        # Inputs scaled to [-1, 1] with the data's bounds, inside the network.
        lo, hi = jnp.asarray(LOWER), jnp.asarray(UPPER)
        z = jnp.stack([x, t])
        return self.mlp(2 * (z - lo.astype(z.dtype)) / (hi - lo).astype(z.dtype) - 1)


def xavier(mlp, key):
    """Glorot/Xavier: weights truncated normal (at 2σ), σ = √(2/(fan_in + fan_out));
    biases zero. Equinox's default draws both uniformly in ±1/√fan_in."""
    keys = jax.random.split(key, len(mlp.layers))
    layers = []
    for k, layer in zip(keys, mlp.layers, strict=True):
        fan_out, fan_in = layer.weight.shape
        std = np.sqrt(2 / (fan_in + fan_out))
        w = std * jax.random.truncated_normal(k, -2, 2, layer.weight.shape)
        layer = eqx.tree_at(lambda m: m.weight, layer, w.astype(layer.weight.dtype))
        layers.append(eqx.tree_at(lambda m: m.bias, layer, jnp.zeros_like(layer.bias)))
    return eqx.tree_at(lambda m: m.layers, mlp, tuple(layers))


# `PINN(...)` as one compiled call: built eagerly, every initialiser op of every layer
# compiles on its own (three times as long: seconds on a CPU).
new_pinn = eqx.filter_jit(PINN)


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
    """As the original code: the 456 initial/boundary points of the classic grid are
    appended to `n_f` Latin-hypercube collocation points, then `n_u` of them are picked
    for the data term."""
    rng = np.random.default_rng(seed)
    xu = np.concatenate([X_GRID, np.full(len(T_GRID), -1.0), np.full(len(T_GRID), 1.0)])
    tu = np.concatenate([np.zeros(len(X_GRID)), T_GRID, T_GRID])
    uu = np.concatenate([-np.sin(np.pi * X_GRID), np.zeros(2 * len(T_GRID))])
    lo, hi = np.asarray(LOWER), np.asarray(UPPER)
    xf, tf = (
        lo + (hi - lo) * scipy.stats.qmc.LatinHypercube(d=2, rng=rng).random(n_f)
    ).T
    xf, tf = np.concatenate([xf, xu]), np.concatenate([tf, tu])
    pick = rng.choice(len(xu), n_u, replace=False)
    cast = lambda *a: tuple(jnp.asarray(v, dtype) for v in a)
    return cast(xf, tf), cast(xu[pick], tu[pick], uu[pick])


def cast_model(model, dtype):
    """Every floating array of `model` in `dtype` (the float32 runs: the network
    computes in float32 while SciPy's iterate stays float64, as in the original)."""
    to = lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a
    return jax.tree.map(to, model)


#
# The script.
#

# The default run (BFGS: under 2 minutes on 2 CPU cores, relative L2 error below 1e-2
# for seeds 0-2), and what Raissi et al.'s Burgers.py does: 8 hidden layers of 20,
# N_u = 100, 10,000 collocation points (plus the 456 boundary ones), no Adam, L-BFGS-B
# to 50,000. A setting given explicitly wins over either.
DEFAULT = dict(
    width=20, depth=8, n_u=100, n_f=4000, adam_steps=0, steps=1500, optimizer="bfgs"
)
PAPER = dict(
    width=20,
    depth=8,
    n_u=100,
    n_f=10_000,
    adam_steps=0,
    steps=50_000,
    optimizer="lbfgs-b",
)


def settings(paper: bool, **given) -> dict:
    """`DEFAULT` (or `PAPER`), with every setting given that is not None instead."""
    chosen = dict(PAPER if paper else DEFAULT)
    chosen.update({k: v for k, v in given.items() if v is not None})
    return chosen


def main(
    *,
    width=None,
    depth=None,
    n_u=None,
    n_f=None,
    adam_steps=None,
    steps=None,
    optimizer=None,
    lr=1e-3,
    init="xavier",
    dtype="float64",
    paper=False,
    report_every=500,
    gtol=1e-5,
    out=OUT,
    seed=0,
    progress=True,
):
    """Trains a PINN for Burgers; returns a summary dict with the relative L2 error.

    The settings left as None come from `DEFAULT`, or with `paper=True` from `PAPER`,
    the configuration of Raissi et al. (2019). `optimizer` is `"bfgs"` (Optimistix's
    BFGS on `p`, a dense inverse Hessian) or `"lbfgs-b"` (SciPy's, through
    `sciflat.minimize`); `steps` bounds its evaluations. `dtype` is
    `"float64"`, `"float32"` (the network computes in float32, as the original), or
    `"float32-then-float64"` (float32 first, then L-BFGS-B goes on in float64 from the
    same point). `report_every` prints the error every that many L-BFGS-B iterations.
    `gtol` is L-BFGS-B's: stop when every entry of the gradient is at most this (SciPy's
    default, 1e-5, as in the original; 0 turns the test off).
    """
    width, depth, n_u, n_f, adam_steps, steps, optimizer = settings(
        paper,
        width=width,
        depth=depth,
        n_u=n_u,
        n_f=n_f,
        adam_steps=adam_steps,
        steps=steps,
        optimizer=optimizer,
    ).values()
    points = make_points(n_u, n_f, seed=seed, dtype=jnp.float64)
    u_ref = reference(X_GRID, T_GRID)
    xx, tt = (
        jnp.asarray(a.ravel()) for a in np.meshgrid(X_GRID, T_GRID, indexing="ij")
    )

    # A float32-initialised network, trained as one float64 vector: the dtype rule.
    model = new_pinn(width, depth, key=jax.random.key(seed), init=init)
    p, re = sciflat.destructure(model, dtype=jnp.float64)
    print(
        f"{len(re)} parameters ({depth} hidden layers of {width}, {init} init), "
        f"{n_u} data points, {n_f} + 456 collocation points, {dtype}, SciPy {scipy.__version__}"
    )
    predict = eqx.filter_jit(lambda m: jax.vmap(m)(xx, tt).reshape(u_ref.shape))
    error = lambda m: float(np.linalg.norm(predict(m) - u_ref) / np.linalg.norm(u_ref))
    log = Log(error, report_every)

    if adam_steps:
        adam = sciflat.fit(
            loss_fn,
            re(p),
            optax.adam(lr),
            steps=adam_steps,
            args=(points,),
            progress=progress,
        )
        p = adam.p
        log.stage("Adam", adam.history, adam.model, adam.n_steps, "")

    stages = ["float32", "float64"] if dtype == "float32-then-float64" else [dtype]
    for stage in stages:
        if optimizer in ("ssbroyden", "ssbfgs"):
            lbfgs = self_scaled(optimizer, stage, re, p, points, steps, log)
        elif optimizer == "bfgs":
            lbfgs = bfgs(stage, re, p, points, steps, log)
        else:
            lbfgs = lbfgs_b(stage, re, p, points, steps, gtol, log, progress)
        # float32 -> float64: the same vector goes on in float64, with `re(p)`
        # computing in float64 from here on (the dtype rule).
        p = lbfgs.p
        names = dict(bfgs="BFGS", ssbroyden="SSBroyden", ssbfgs="SSBFGS")
        log.stage(
            f"{names.get(optimizer, 'L-BFGS-B')} {stage}",
            lbfgs.history,
            lbfgs.model,
            lbfgs.n_steps,
            lbfgs.raw.message if lbfgs.raw is not None else lbfgs.message,
        )

    model, err = re(p), log.errors[-1][1]
    history, steps = np.concatenate(log.history), np.concatenate(log.steps)
    print(f"relative L2 error vs the Cole–Hopf reference: {err:.3e}")
    print(f"training took {log.elapsed():.1f} s")
    diverged = not (np.isfinite(history[-1]) and history[-1] < history[0])
    plot = None
    if out:
        plot = _plot(u_ref, np.asarray(predict(model)), steps, history, log.errors, out)
    return dict(
        model=model,
        p=p,
        history=history,
        loss=float(history[-1]),
        error=err,
        errors=log.errors,
        stages=log.stages,
        diverged=diverged,
        plot=plot,
        train_time=log.elapsed(),
        scipy=scipy.__version__,
    )


def lbfgs_b(dtype, re, p, points, steps, gtol, log, progress):
    """L-BFGS-B with Raissi et al.'s settings, the network computing in `dtype`."""
    if dtype == "float32":
        pts32 = jax.tree.map(lambda a: a.astype(jnp.float32), points)
        # SciPy gets the float32 loss as float64, as TensorFlow's SciPy interface did.
        loss = lambda m, pts: loss_fn(cast_model(m, jnp.float32), pts32).astype(
            jnp.float64
        )
    else:
        loss = loss_fn
    # The largest entry of the gradient, printed beside the error: what `gtol` tests
    # (the network has no tied parameters, so the model's gradient is p's).
    grad = eqx.filter_jit(
        lambda m: jnp.max(
            jnp.abs(sciflat.destructure(eqx.filter_grad(loss)(m, points))[0])
        )
    )
    report = log.reporter(dtype, grad)
    options = dict(
        maxiter=steps,
        maxfun=steps,
        maxcor=50,
        maxls=50,
        ftol=np.finfo(float).eps,
        gtol=gtol,
    )
    return sciflat.minimize(
        loss,
        re,
        args=(points,),
        x0=p,
        method="L-BFGS-B",
        progress=progress,
        callback=lambda step, loss, model: report(loss, model),
        options=options,
    )


def bfgs(dtype, re, p, points, steps, log):
    """Optimistix's BFGS on the flat vector, in `dtype`: a dense inverse Hessian (3,021²
    entries here, 73 MB in float64), the whole loop compiled. Every step is one
    evaluation of the loss and its gradient; the loss is recorded every 100 of them
    and the error reported every `log.every`."""
    dtype = jnp.dtype(dtype)
    # The dtype rule: `re(p)` computes in `p.dtype`, so float32 is `p.astype`.
    p = p.astype(dtype)
    points = jax.tree.map(lambda a: a.astype(dtype), points)
    fn = lambda p, points: (loss_fn(re(p), points), None)
    # No tolerance stops it (as `ftol` = eps for L-BFGS-B): only `steps`, or a step
    # that makes the loss non-finite.
    solver = optx.BFGS(rtol=0.0, atol=0.0)
    f_struct = jax.ShapeDtypeStruct((), dtype)
    state = solver.init(fn, p, points, {}, f_struct, None, frozenset())

    @eqx.filter_jit
    def advance(p, state, n):
        def body(i, carry):
            p, state = carry
            return solver.step(fn, p, points, {}, state, frozenset())[:2]

        p, state = jax.lax.fori_loop(0, n, body, (p, state))
        return p, state, loss_fn(re(p), points)

    every = log.every or steps
    chunk = min(100, every)
    done, message = 0, f"reached {steps} evaluations"
    history = [(0, float(loss_fn(re(p), points)))]  # the start, then every chunk
    while done < steps:
        n = jnp.asarray(min(chunk, steps - done))  # traced: one compilation
        p_next, state_next, loss = advance(p, state, n)
        if not jnp.isfinite(loss):
            message = f"stopped: the loss became non-finite after {done} evaluations"
            break
        p, state, done = p_next, state_next, done + int(n)
        history.append((done, float(loss)))
        if done % every == 0:
            log.report(f"BFGS {dtype.name}", log.step + done, float(loss), re(p))
    return types.SimpleNamespace(
        p=p, model=re(p), history=history, n_steps=done, raw=None, message=message
    )


#
# The record configuration: Kiyani et al., CMAME 446, 118308 (2025).
#

# 2-20x4-1 tanh, 8,000 collocation points resampled by residual (RAD) every 500
# iterations, 500 initial and 500 boundary points weighted 5, 1,000 Adam steps, then a
# self-scaled quasi-Newton method with a strong Wolfe line search, float64.
RECORD = dict(
    width=20,
    depth=4,
    n_f=8000,
    n_ic=500,
    n_bc=500,
    weight=5.0,
    adam_steps=1000,
    steps=50_000,
    every=500,
    method="ssbroyden",
)


# The default run (`python examples/pinn/train.py`): the record configuration, short,
# on half its collocation points (about a minute on 2 cores).
QUICK = dict(steps=1000, adam_steps=200, n_f=4000)


def record_loss(model, data, weight=RECORD["weight"]):
    """Mean squared residual + `weight` × (initial misfit + boundary misfit), each a
    mean square (soft constraints)."""
    (xf, tf), (xi, ui), (xb, tb) = data
    f = jax.vmap(residual, (None, 0, 0))(model, xf, tf)
    u0 = jax.vmap(model)(xi, jnp.zeros_like(xi)) - ui
    ub = jax.vmap(model)(xb, tb)
    return jnp.mean(f**2) + weight * (jnp.mean(u0**2) + jnp.mean(ub**2))


def record_points(rng, n_f, n_ic, n_bc):
    """Uniform collocation points, initial points (t = 0), boundary points (x = ±1)."""
    lo, hi = np.asarray(LOWER), np.asarray(UPPER)
    xf, tf = (lo + (hi - lo) * rng.random((n_f, 2))).T
    xi = rng.uniform(-1, 1, n_ic)
    xb, tb = rng.choice([-1.0, 1.0], n_bc), rng.uniform(0, UPPER[1], n_bc)
    cast = lambda *a: tuple(jnp.asarray(v, jnp.float64) for v in a)
    return cast(xf, tf), cast(xi, -np.sin(np.pi * xi)), cast(xb, tb)


def rad(residuals, rng, n_f, pool=100_000, k=1.0, c=1.0):
    """Residual-based adaptive distribution (Wu et al., CMAME 403, 2023): `n_f` points
    drawn from a uniform `pool` with probability ∝ |r|^k / mean(|r|^k) + c."""
    lo, hi = np.asarray(LOWER), np.asarray(UPPER)
    x, t = (lo + (hi - lo) * rng.random((pool, 2))).T
    r = np.abs(np.asarray(residuals(jnp.asarray(x), jnp.asarray(t)))) ** k
    prob = r / r.mean() + c
    pick = rng.choice(pool, n_f, replace=False, p=prob / prob.sum())
    return jnp.asarray(x[pick]), jnp.asarray(t[pick])


def record(
    *,
    steps=None,
    method=None,
    seed=0,
    adam_steps=None,
    every=None,
    stop_at=None,
    out=OUT,
    progress=True,
    **given,
):
    """The record configuration (`RECORD`, any setting given instead): Adam, then
    `method` (`"ssbroyden"`, `"ssbfgs"`, `"bfgs"`: `sciflat.quasi_newton`, compiled;
    or `"lbfgs-b"`: SciPy's, 50 pairs, restarted at each resampling) in chunks of
    `every` iterations, the collocation points resampled by RAD between chunks. Prints
    the relative L2 error after each chunk, and stops early once it is at most
    `stop_at` (if given); returns a summary dict."""
    cfg = {**RECORD, **{k: v for k, v in given.items() if v is not None}}
    steps = RECORD["steps"] if steps is None else steps
    method = method or RECORD["method"]
    adam_steps = RECORD["adam_steps"] if adam_steps is None else adam_steps
    every = every or RECORD["every"]
    rng = np.random.default_rng(seed)
    model = new_pinn(cfg["width"], cfg["depth"], key=jax.random.key(seed))
    p, re = sciflat.destructure(model, dtype=jnp.float64)
    data = record_points(rng, cfg["n_f"], cfg["n_ic"], cfg["n_bc"])
    u_ref = reference(X_GRID, T_GRID)
    xx, tt = (
        jnp.asarray(a.ravel()) for a in np.meshgrid(X_GRID, T_GRID, indexing="ij")
    )
    predict = jax.jit(lambda p: jax.vmap(re(p))(xx, tt).reshape(u_ref.shape))
    error = lambda p: float(np.linalg.norm(predict(p) - u_ref) / np.linalg.norm(u_ref))
    res_fn = jax.jit(lambda p, x, t: jax.vmap(residual, (None, 0, 0))(re(p), x, t))
    loss = lambda m, data: record_loss(m, data, cfg["weight"])
    fn = lambda p, data: loss(re(p), data)  # one function object: one compilation
    print(
        f"record configuration: {len(re)} parameters ({cfg['depth']} x {cfg['width']}), "
        f"{cfg['n_f']} RAD collocation points every {every}, {cfg['n_ic']} + "
        f"{cfg['n_bc']} initial/boundary points (weight {cfg['weight']:g}), "
        f"{adam_steps} Adam steps, then {method} to {steps} iterations, float64",
        flush=True,
    )
    t0 = time.perf_counter()
    curve = [(0, error(p))]
    history = [(0, float(fn(p, data)))]
    if adam_steps:
        adam = sciflat.fit(
            loss,
            re(p),
            optax.adam(1e-3),
            steps=adam_steps,
            args=(data,),
            progress=progress,
        )
        p = adam.p
        history.append((adam_steps, adam.loss))
        curve.append((adam_steps, error(p)))
        print(
            f"  Adam {adam_steps}: loss {adam.loss:.3e}, relative L2 "
            f"{curve[-1][1]:.3e}, {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    state, done, reason, fails = None, 0, f"reached {steps} iterations", 0
    while done < steps:
        if done or adam_steps:  # resample by residual (RAD)
            xf, tf = rad(functools.partial(res_fn, p), rng, cfg["n_f"])
            data = ((xf, tf), *data[1:])
        n = min(every, steps - done)
        if method == "lbfgs-b":
            options = dict(
                maxiter=n,
                maxfun=2 * n,
                maxcor=50,
                maxls=50,
                ftol=np.finfo(float).eps,
                gtol=0.0,
            )
            res = sciflat.minimize(
                loss,
                re,
                args=(data,),
                x0=p,
                method="L-BFGS-B",
                progress=False,
                options=options,
            )
            taken, status = max(res.n_steps, 1), res.status
        else:
            res = sciflat.quasi_newton(
                fn, p, args=(data,), method=method, max_steps=n, state=state
            )
            state, taken, status = res.raw, res.n_steps, res.status
        p, done = res.p, done + taken
        history.append((adam_steps + done, res.loss))
        curve.append((adam_steps + done, error(p)))
        print(
            f"  {method} {done}: loss {res.loss:.3e}, relative L2 {curve[-1][1]:.3e}, "
            f"{time.perf_counter() - t0:.0f} s ({status})",
            flush=True,
        )
        fails = fails + 1 if status in ("failed", "nonfinite") or taken == 0 else 0
        if fails >= 2 or status == "nonfinite":
            reason = f"stopped after {done} iterations: {res.message}"
            break
        if stop_at is not None and curve[-1][1] <= stop_at:
            reason = (
                f"relative L2 error {curve[-1][1]:.2e} <= {stop_at:g} after {done} "
                "iterations"
            )
            break
    elapsed = time.perf_counter() - t0
    print(f"relative L2 error vs the Cole–Hopf reference: {curve[-1][1]:.3e}")
    print(f"{reason}; training took {elapsed:.1f} s")
    steps_, losses = (np.asarray(a, float) for a in zip(*history, strict=True))
    plot = (
        _plot(u_ref, np.asarray(predict(p)), steps_, losses, curve, out)
        if out
        else None
    )
    return dict(
        p=p,
        error=curve[-1][1],
        errors=curve,
        loss=float(losses[-1]),
        iterations=done,
        reason=reason,
        train_time=elapsed,
        plot=plot,
    )


def self_scaled(method, dtype, re, p, points, steps, log):
    """`sciflat.quasi_newton` (SSBroyden or SSBFGS, strong Wolfe line search, whole loop
    compiled) on the flat vector in `dtype`, for `steps` iterations, in chunks of
    `log.every` (the error reported after each; the inverse Hessian goes on by
    `state=`, one compilation)."""
    dtype = jnp.dtype(dtype)
    p = p.astype(dtype)
    points = jax.tree.map(lambda a: a.astype(dtype), points)
    fn = _QN_LOSS.setdefault(re, lambda p, points: loss_fn(re(p), points))
    history, state, done, message = [(0, float(fn(p, points)))], None, 0, ""
    while done < steps:
        n = min(log.every or steps, steps - done)
        res = sciflat.quasi_newton(
            fn, p, args=(points,), method=method, max_steps=n, state=state
        )
        p, state, done = res.p, res.raw, done + res.n_steps
        history.append((done, res.loss))
        message = f"({res.status}: {res.n_evaluations} evaluations in the last chunk)"
        log.report(f"{method} {dtype.name}", log.step + done, res.loss, re(p))
        if res.status != "max_steps":
            message = res.message
            break
    return types.SimpleNamespace(
        p=p, model=re(p), history=history, n_steps=done, raw=None, message=message
    )


_QN_LOSS: dict = {}  # one loss function per `re`: `quasi_newton` compiles once for it


class Log:
    """The loss history, the error every `every` iterations, and each stage's summary."""

    def __init__(self, error, every):
        self.error, self.every = error, every
        self.history, self.steps, self.errors, self.stages = [], [], [], []
        self.t0, self.step = time.perf_counter(), 0

    def elapsed(self):
        return time.perf_counter() - self.t0

    def report(self, name, step, loss, model, grad=None):
        err = self.error(model)
        self.errors.append((step, err))
        gradient = "" if grad is None else f", max|gradient| {float(grad(model)):.1e}"
        print(
            f"  {name} iteration {step}: loss {loss:.3e}, relative L2 "
            f"error {err:.3e}{gradient}, {self.elapsed():.0f} s",
            flush=True,
        )

    def reporter(self, name, grad):
        count = [self.step]

        def report(loss, model):
            count[0] += 1
            if self.every and count[0] % self.every == 0:
                self.report(name, count[0], loss, model, grad)

        return report

    def stage(self, name, history, model, n, message):
        """`history`: the loss per iteration, or (iteration, loss) pairs."""
        history = np.asarray(history, dtype=float)
        if history.ndim == 1:  # one loss per iteration
            history = np.stack([np.arange(1, len(history) + 1), history], 1)
        self.steps.append(self.step + history[:, 0])
        self.history.append(history[:, 1])
        self.step += n
        err = self.error(model)
        self.errors.append((self.step, err))
        loss = float(self.history[-1][-1]) if len(history) else np.nan
        self.stages.append(
            dict(
                stage=name,
                steps=n,
                loss=loss,
                error=err,
                message=str(message),
                time=self.elapsed(),
            )
        )
        print(
            f"{name}: {n} iterations, loss {loss:.3e}, relative L2 error {err:.3e}, "
            f"{self.elapsed():.0f} s {message}",
            flush=True,
        )


def compare_precision(*, steps=2000, seed=0, repeats=20, **kwargs):
    """The float32 PINN at DEFAULT and at HIGHEST matmul precision: the same training
    run under each setting (relative L2 error, loss, time), and the median time of one
    loss-and-gradient evaluation, interleaved. On a CPU both are the same; on a GPU
    (TF32) or TPU (bfloat16 passes) they are not. Returns one dict per setting.

        python examples/pinn/train.py --compare-precision
    """
    points = make_points(
        100, kwargs.get("n_f", DEFAULT["n_f"]), seed=seed, dtype=jnp.float32
    )
    model = new_pinn(
        kwargs.get("width", DEFAULT["width"]),
        kwargs.get("depth", DEFAULT["depth"]),
        key=jax.random.key(seed),
    )
    p, re = sciflat.destructure(model, dtype=jnp.float32)
    rows = {}
    for setting in ("default", "highest"):
        with jax.default_matmul_precision(None if setting == "default" else setting):
            run = main(
                dtype="float32",
                steps=steps,
                seed=seed,
                out=None,
                progress=False,
                report_every=0,
                **kwargs,
            )
            step = jax.jit(jax.value_and_grad(lambda p: loss_fn(re(p), points)))
            jax.block_until_ready(step(p))  # compiled under this setting
        rows[setting] = dict(
            setting=setting,
            error=run["error"],
            loss=run["loss"],
            iterations=run["stages"][-1]["steps"],
            time=run["train_time"],
            step=step,
        )
    times = {k: [] for k in rows}
    for _ in range(repeats):  # interleaved, after compilation
        for k, row in rows.items():
            t0 = time.perf_counter()
            jax.block_until_ready(row["step"](p))
            times[k].append(time.perf_counter() - t0)
    for k, row in rows.items():
        del row["step"]
        row["eval_ms"] = 1e3 * float(np.median(times[k]))
    name = kwargs.get("optimizer") or DEFAULT["optimizer"]
    print(f"{jax.devices()[0].device_kind}: float32 PINN, {steps} steps of {name}")
    for row in rows.values():
        print(
            f"  {row['setting']:>8}: relative L2 {row['error']:.3e}, loss "
            f"{row['loss']:.3e}, {row['iterations']} iterations, {row['time']:.1f} s; "
            f"loss+gradient {row['eval_ms']:.2f} ms"
        )
    return list(rows.values())


def _plot(u_ref, u_pred, steps, history, errors, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    extent = (T_GRID[0], T_GRID[-1], X_GRID[0], X_GRID[-1])
    panels = [(u_pred, "prediction u(x, t)"), (u_ref, "reference (Cole–Hopf)")]
    panels.append((np.abs(u_pred - u_ref), "|error|"))
    for ax, (z, title) in zip(axes, panels, strict=False):
        im = ax.imshow(z, origin="lower", aspect="auto", extent=extent, cmap="rainbow")
        ax.set(xlabel="t", ylabel="x", title=title)
        fig.colorbar(im, ax=ax)
    axes[3].semilogy(steps, history, label="loss")
    steps, errs = zip(*errors, strict=True)
    axes[3].semilogy(steps, errs, "o-", label="relative L2 error")
    axes[3].set(xlabel="iteration (or evaluation, BFGS)", title="Loss and error")
    axes[3].legend()
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
    add("--width", type=int, help="hidden width (20)")
    add("--depth", type=int, help="hidden layers (8)")
    add(
        "--n-f",
        dest="n_f",
        type=int,
        help="collocation points (4,000; --record: 8,000)",
    )
    add("--adam-steps", type=int, help="Adam steps first (0)")
    add(
        "--steps",
        "--lbfgs-steps",
        dest="steps",
        type=int,
        help="evaluations at most (1,500; L-BFGS-B: also its maxiter)",
    )
    add("--init", choices=["xavier", "equinox"], default="xavier")
    add(
        "--dtype",
        choices=["float64", "float32", "float32-then-float64"],
        default="float64",
    )
    add(
        "--paper",
        action="store_true",
        help="Raissi et al.: 8x20, 10,000 points, L-BFGS-B to 50,000",
    )
    add("--report-every", type=int, default=500, help="print the error every N steps")
    add("--gtol", type=float, default=1e-5, help="L-BFGS-B's gtol (0: off)")
    add(
        "--optimizer",
        choices=["ssbroyden", "ssbfgs", "bfgs", "lbfgs-b"],
        help="sciflat.quasi_newton's SSBroyden or SSBFGS, Optimistix's BFGS, or "
        "SciPy's L-BFGS-B (--paper's)",
    )
    add(
        "--record",
        action="store_true",
        help="Kiyani et al. (2025): 4x20, RAD, Adam, then SSBroyden to 50,000",
    )
    add(
        "--method",
        choices=["ssbroyden", "ssbfgs", "bfgs", "lbfgs-b"],
        help="the quasi-Newton method of --record (ssbroyden)",
    )
    add(
        "--stop-at",
        type=float,
        help="--record: stop once the relative L2 error is at most this (off)",
    )
    add("--out", default=OUT, help="folder for the plot")
    add("--seed", type=int, default=0)
    add(
        "--compare-precision",
        action="store_true",
        help="float32 at DEFAULT vs HIGHEST matmul precision (for GPUs and TPUs)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    flags = vars(_parse())
    if flags.pop("compare_precision"):
        compare_precision(steps=flags["steps"] or 2000, seed=flags["seed"])
        sys.exit(0)
    method, long_run = flags.pop("method"), flags.pop("record")
    stop_at = flags.pop("stop_at")
    # Raissi et al.'s setup (`main`) when asked for by its flags; else the record
    # configuration, short by default (`QUICK`), to 50,000 iterations with --record.
    raissi = flags["paper"] or flags["optimizer"] or flags["dtype"] != "float64"
    raissi = raissi or any(flags[k] is not None for k in ("width", "depth", "n_f"))
    if long_run or not raissi:
        short = {} if long_run else QUICK
        run = record(
            steps=flags["steps"] or short.get("steps"),
            method=method,
            seed=flags["seed"],
            adam_steps=flags["adam_steps"]
            if flags["adam_steps"] is not None
            else short.get("adam_steps"),
            n_f=flags["n_f"] or short.get("n_f"),
            stop_at=stop_at,
            out=flags["out"],
        )
        sys.exit(0 if np.isfinite(run["error"]) else 1)
    result = main(**flags)
    sys.exit(1 if result["diverged"] else 0)
