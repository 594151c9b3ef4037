"""Levenberg–Marquardt as MINPACK's `lmder` does it, as one `lax.while_loop`.

Moré's trust-region algorithm (J. J. Moré, "The Levenberg–Marquardt algorithm:
implementation and theory", 1978), step by step as MINPACK's `lmder` and `lmpar`: the
columns scaled by `diag` (the Jacobian's column norms, never decreasing), the
Levenberg parameter found by Moré's safeguarded Newton iteration on
`||D p|| = delta`, the radius updated from the ratio of actual to predicted reduction,
and the `ftol`, `xtol`, `gtol` tests with MINPACK's meanings. Where MINPACK factors
the Jacobian by a pivoted QR and solves each trial by Givens rotations, this factors
the scaled Jacobian once per trial by a QR and an SVD of its `R`: every trial
parameter is then a diagonal solve, in `p`'s dtype (MINPACK's eps is that dtype's).

Each turn of the loop is one trial point: its residuals and Jacobian are evaluated
together (one forward-mode pass), so the loop has no branch to take, and a trial of
a finished fit leaves it as it is: a batch runs one loop of `jax.vmap`-ed trials
(`advance`), each fit taking exactly the turns it takes alone, and every sum is
added in an order the shape alone fixes (`_sum`), so that it computes the same bits
batched and alone. A
non-finite trial (residuals or Jacobian) is a failed step: the radius shrinks, as
for a step that increased the sum of squares; it never stops the fit.
"""

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike


def _eps(x) -> float:
    """MINPACK's machine precision, of `x`'s dtype (the fit computes in `p`'s)."""
    return float(jnp.finfo(jnp.result_type(x)).eps)


def _dwarf(x) -> float:
    return float(jnp.finfo(jnp.result_type(x)).tiny)


def _huge(x) -> float:
    return float(jnp.finfo(jnp.result_type(x)).max)


_IN_ORDER = 64  # `_sum` adds up to this many terms one after another
_FACTOR = 100.0  # MINPACK's initial radius: factor * ||D x0||

# `info` codes: MINPACK's, plus two of ours (0 while running).
NONFINITE_START = -2
# What each code means: `minpack.MESSAGES`.


class Options(NamedTuple):
    """The tolerances, as scalars of the fit's dtype (dynamic: changing them compiles
    nothing)."""

    ftol: Any
    xtol: Any
    gtol: Any
    max_nfev: Any
    diag: Any  # fixed column scales (MINPACK's mode 2); zeros: from the Jacobian


class State(NamedTuple):
    """The loop's one record: the current point and everything MINPACK carries."""

    x: jax.Array
    f: jax.Array  # residuals at x
    jac: jax.Array  # Jacobian at x
    fnorm: jax.Array
    diag: jax.Array
    delta: jax.Array  # trust-region radius, in the scaled norm ||D p||
    par: jax.Array  # Levenberg parameter
    xnorm: jax.Array
    gnorm: jax.Array  # cosine test of the current Jacobian
    nfev: jax.Array
    njev: jax.Array
    info: jax.Array  # 0 while running
    history: jax.Array  # cost at every accepted point (first entries)


def _sum(x, axis: int = 0):
    """The sum along `axis`, in an order that the shape alone fixes, so that a fit
    of a batch (under `vmap`) computes what its single fit computes, to the bit.

    XLA reduces a batch in another order than one vector, and contracts a product
    and the add after it into one FMA in one program and not in the other: with
    `jnp.sum(x * x)`, the fits of a batch of 1,000 (NIST's Misra1a, noisy replicates)
    left their single fits in the last bits of every norm, and 66 of 334 ended more
    than 1e-10 apart (up to 1.5e-8, some after another number of evaluations). So:
    zeros up to a power of two (adding one changes no sum), then elementwise adds of
    halves; the terms first pass through a `where` that caps them at the largest
    float (every finite term as it is; +inf becomes that float), which is not a
    product, so no add is contracted with one. (`jnp.minimum` does the same but
    made DanWood's single fit 1.2x slower; the `where` costs nothing measurable.)"""
    x = jnp.moveaxis(x, axis, 0)
    huge = _huge(x)
    x = jnp.where(x > huge, huge, x)
    if x.shape[0] == 0:
        return jnp.zeros(x.shape[1:], x.dtype)
    if x.shape[0] <= _IN_ORDER:
        # Term after term: one fused loop, where each level of the tree below is
        # written to memory (a batch of 10,000 25-term sums: 5x faster).
        total = x[0]
        for term in x[1:]:
            total = total + term
        return total
    size = 1 << (x.shape[0] - 1).bit_length()
    x = jnp.pad(x, [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    while x.shape[0] > 1:
        x = x[: x.shape[0] // 2] + x[x.shape[0] // 2 :]
    return x[0]


def _norm(x):
    return jnp.sqrt(_sum(x * x))


def _gnorm(f, jac, fnorm, cols):
    """MINPACK's `gnorm`: the largest cosine between `f` and a column of `jac`
    (whose norms are `cols`)."""
    safe = jnp.where((cols > 0) & (fnorm > 0), cols * fnorm, 1.0)
    cosines = jnp.where(
        (cols > 0) & (fnorm > 0), jnp.abs(_sum(jac * f[:, None])) / safe, 0.0
    )
    return jnp.max(cosines)


class _Measure(NamedTuple):
    ok: jax.Array  # every residual and every entry of the Jacobian finite
    fnorm: jax.Array
    cols: jax.Array  # the Jacobian's column norms
    gnorm: jax.Array


def _measure(f, jac) -> _Measure:
    """What MINPACK reads of an evaluation (the start's or a trial point's), in one
    pass over the Jacobian for its finiteness and its column norms: each square
    has `x * 0` added (0, or NaN where `x` is not finite: a finite square can
    overflow to inf, never to NaN), so that a sum is NaN exactly where a term is not
    finite (`jnp.isfinite` of every entry was a reduction of its own, 1.6 ms a turn
    of a batch of 3,495 Gaussian spots: more than the Jacobian)."""
    fsq = _sum(f * f + f * 0)
    csq = _sum(jac * jac + jac * 0)
    ok = ~jnp.isnan(fsq) & ~jnp.any(jnp.isnan(csq))
    fnorm, cols = jnp.sqrt(fsq), jnp.sqrt(csq)
    return _Measure(ok, fnorm, cols, _gnorm(f, jac, fnorm, cols))


def _decompose(jac, f, diag, serial: bool = False):
    """The scaled Jacobian `J D⁻¹ = U S Vᵀ` (a QR, then an SVD of the n × n `R`):
    `(s, V, g = Uᵀ f)`. `serial`: under `vmap`, one matrix at a time
    (`one_at_a_time`)."""
    n = jac.shape[1]
    qr = one_at_a_time(_qr_r) if serial else _qr_r
    r = qr(jnp.concatenate([jac / diag, f[:, None]], axis=1))
    ur, s, vt = (one_at_a_time(svd) if serial else svd)(r[:n, :n])
    return s, vt.T, _sum(ur * r[:n, n, None])


def _qr_r(a):
    return jnp.linalg.qr(a, mode="r")


def svd(a):
    """`a = U S Vᵀ` (thin). On the CPU by LAPACK's `gesvd`: 2.8× faster than `gesdd`
    (JAX's default) for the small matrices of these fits (1.4 against 4.0 µs each
    for 2 × 2, measured under `vmap`), with the same singular values."""
    cpu = jax.default_backend() == "cpu"
    algorithm = jax.lax.linalg.SvdAlgorithm.QR if cpu else None
    return jax.lax.linalg.svd(a, full_matrices=False, algorithm=algorithm)


def one_at_a_time(fn: Callable) -> Callable:
    """`fn` (of arrays), which `jax.vmap` calls on one member of the batch at a time
    (a `lax.map`) rather than once on the stacked batch.

    For LAPACK's decompositions in a program that several CPU devices run at once:
    jaxlib 0.10's batched LAPACK kernels split a batch over XLA's intra-op thread
    pool and wait for the pieces on the pool thread they run on; once every pool
    thread runs a device's program, each waits for pieces no thread is left to run,
    and the program hangs (`least_squares_batch` of Misra1a, 1,000 fits on 2 CPU
    devices, on 2 cores). A batch of one matrix is not split. The same LAPACK call
    on each matrix, so the same numbers."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = tuple(
            a if batched else jnp.broadcast_to(a, (axis_size, *jnp.shape(a)))
            for a, batched in zip(args, in_batched, strict=True)
        )
        out = jax.lax.map(lambda xs: fn(*xs), args)
        return out, jax.tree.map(lambda _: True, out)

    return wrapped


def more_turn(par_try, dx, curv_sum, fp, parl, paru, delta, it):
    """One turn of Moré's iteration (MINPACK's `lmpar`) after a trial `par_try` whose
    step has the scaled norm `dx`: whether to stop, and the next Levenberg parameter,
    its bracket and the step's miss of the radius. Newton's correction comes from the
    step's curvature, `curv_sum / dx²`."""
    fp_try = dx - delta
    stop = (
        (jnp.abs(fp_try) <= 0.1 * delta)
        | ((parl == 0) & (fp_try <= fp) & (fp < 0))
        | (it == 9)
    )
    dx_s = jnp.where(dx > 0, dx, 1.0)
    curv = curv_sum / dx_s**2
    parc = fp_try / delta / jnp.where(curv > 0, curv, 1.0)
    parl_new = jnp.where(fp_try > 0, jnp.maximum(parl, par_try), parl)
    paru_new = jnp.where(fp_try < 0, jnp.minimum(paru, par_try), paru)
    par_next = jnp.where(stop, par_try, jnp.maximum(parl_new, par_try + parc))
    return stop, (par_next, parl_new, paru_new, fp_try)


def kept(done, old, new):
    """`new`, except where `done`: a finished member of a batch stays as it was."""
    return jax.tree.map(lambda o, n: jnp.where(done, o, n), old, new)


def _lmpar(s, g, delta, par, m):
    """Moré's Levenberg parameter for the radius `delta` (MINPACK's `lmpar`), with
    the scaled Jacobian given by its singular values `s` and `g = Uᵀ f`. Returns
    `(par, a)`: the scaled step is `D p = -V a`."""
    n = s.shape[0]
    cutoff = jnp.max(s) * _eps(s) * max(m, n)
    determined = s > cutoff
    s_safe = jnp.where(determined, s, 1.0)
    a_gn = jnp.where(determined, g / s_safe, 0.0)  # Gauss–Newton, rank-truncated
    dxnorm = _norm(a_gn)
    fp = dxnorm - delta
    gauss_newton = fp <= 0.1 * delta
    # Newton's lower bound (only when the Jacobian has full rank), and the upper one.
    dx_safe = jnp.where(dxnorm > 0, dxnorm, 1.0)
    curvature = _sum(jnp.where(determined, a_gn**2 / s_safe**2, 0.0)) / dx_safe**2
    parl = jnp.where(
        jnp.all(determined) & (curvature > 0),
        fp / delta / jnp.where(curvature > 0, curvature, 1.0),
        0.0,
    )
    gnorm = _norm(s * g)
    paru = gnorm / delta
    paru = jnp.where(paru == 0, _dwarf(s) / jnp.minimum(delta, 0.1), paru)
    par = jnp.minimum(jnp.maximum(par, parl), paru)
    par = jnp.where(par == 0, gnorm / dx_safe, par)

    def turn(carry):
        par, parl, paru, fp, a, done, it = carry
        par_try = jnp.where(par == 0, jnp.maximum(_dwarf(s), 0.001 * paru), par)
        a_try = s * g / (s * s + par_try)
        curv_sum = _sum(a_try**2 / (s * s + par_try))
        stop, new = more_turn(
            par_try, _norm(a_try), curv_sum, fp, parl, paru, delta, it
        )
        return (
            *kept(done, (par, parl, paru, fp, a), (*new, a_try)),
            done | stop,
            it + 1,
        )

    # At most 10 iterations, as MINPACK; a finished one is carried unchanged (under
    # `vmap` the loop runs until every member is done).
    init = (par, parl, paru, fp, a_gn, gauss_newton, jnp.zeros((), jnp.int32))
    par, _, _, _, a, _, _ = jax.lax.while_loop(lambda c: ~c[5], turn, init)
    return jnp.where(gauss_newton, 0.0, par), jnp.where(gauss_newton, a_gn, a)


def initial_state(f_and_jac: Callable, x0, options: Options, history: int) -> State:
    f, jac = f_and_jac(x0)
    return started(x0, f, jac, options, history)


def started(
    x0, f, jac, options: Options, history: int, measure: _Measure | None = None
) -> State:
    """The state of a fit at its start `x0`, whose residuals `f` and Jacobian `jac`
    are given (`initial_state` evaluates them; a batch evaluates a new fit's start
    in the same pass as the other slots' trial points). Where `measure` (what
    `_measure` reads of them) is given, `f` and `jac` are only carried: a batch with
    the normal equations keeps `Jᵀf` and `JᵀJ` there instead (`normal.moments`)."""
    ok, fnorm, cols, gnorm = _measure(f, jac) if measure is None else measure
    from_jac = jnp.where(cols > 0, cols, 1.0)
    fixed = jnp.any(options.diag > 0)
    diag = jnp.where(fixed, options.diag, from_jac)
    xnorm = _norm(diag * x0)
    delta = jnp.where(xnorm > 0, _FACTOR * xnorm, _FACTOR)
    info = jnp.where(ok, jnp.where(gnorm <= options.gtol, 4, 0), NONFINITE_START)
    zero = jnp.zeros((), jnp.int32)
    return State(
        x=x0,
        f=f,
        jac=jac,
        fnorm=fnorm,
        diag=diag,
        delta=delta,
        par=jnp.zeros((), x0.dtype),
        xnorm=xnorm,
        gnorm=gnorm,
        nfev=zero + 1,
        njev=zero + 1,
        info=info.astype(jnp.int32),
        history=jnp.full((history,), jnp.nan, x0.dtype).at[:1].set(0.5 * fnorm**2),
    )


class Step(NamedTuple):
    """A trial step in the scaled variables: the Levenberg parameter, `D p = -dx`,
    `pnorm = ||dx||` and `jnorm = ||J D⁻¹ dx||` (for the predicted reduction)."""

    par: jax.Array
    dx: jax.Array
    pnorm: jax.Array
    jnorm: jax.Array


def minpack_step(state: State, serial: bool = False) -> Step:
    """The trial step of `state` as MINPACK's `lmpar` finds it, from a QR and an SVD
    of the scaled Jacobian. `serial`: see `_decompose`."""
    s, v, g = _decompose(state.jac, state.f, state.diag, serial)
    par, a = _lmpar(s, g, state.delta, state.par, state.f.shape[0])
    return Step(par=par, dx=_sum(v * a, axis=1), pnorm=_norm(a), jnorm=_norm(s * a))


def trial(
    f_and_jac: Callable, state: State, options: Options, serial: bool = False
) -> State:
    """One trial step of `lmder`'s inner loop, and its acceptance and tests. A
    finished fit (`info` not 0) is returned as it is, so that a batch can run every
    member's trial at every turn (`advance`). `serial`: see `_decompose`."""
    return accept(f_and_jac, state, minpack_step(state, serial), options)


def accept(f_and_jac: Callable, state: State, step: Step, options: Options) -> State:
    """The trial point of `step`: its residuals and Jacobian, MINPACK's acceptance,
    radius and parameter updates, and its tests. A finished fit is returned as it
    is."""
    x_new = trial_point(state, step)
    f_new, jac_new = f_and_jac(x_new)
    return accepted(state, step, x_new, f_new, jac_new, options)


def trial_point(state: State, step: Step):
    """The point `step` tries: `x - D⁻¹ dx`."""
    return state.x - step.dx / state.diag


def accepted(
    state: State,
    step: Step,
    x_new,
    f_new,
    jac_new,
    options: Options,
    measure: _Measure | None = None,
) -> State:
    """`accept` with the trial point's residuals `f_new` and Jacobian `jac_new`
    given (and what `_measure` reads of them, where `measure` is given: `started`)."""
    running = state.info == 0
    first = state.njev == 1  # MINPACK's `iter == 1`: no step accepted yet
    par, pnorm = step.par, step.pnorm
    delta = jnp.where(first, jnp.minimum(state.delta, pnorm), state.delta)
    measure = _measure(f_new, jac_new) if measure is None else measure
    ok, fnorm1, cols1, gnorm1 = measure
    fnorm1 = jnp.where(ok, fnorm1, jnp.inf)
    fnorm = state.fnorm
    fsafe = jnp.where(fnorm > 0, fnorm, 1.0)
    actred = jnp.where(0.1 * fnorm1 < fnorm, 1 - (fnorm1 / fsafe) ** 2, -1.0)
    temp1 = step.jnorm / fsafe
    temp2 = jnp.sqrt(par) * pnorm / fsafe
    prered = temp1**2 + temp2**2 / 0.5
    dirder = -(temp1**2 + temp2**2)
    ratio = jnp.where(prered != 0, actred / jnp.where(prered != 0, prered, 1.0), 0.0)
    # The radius and the parameter, as MINPACK updates them.
    denom = dirder + 0.5 * actred
    shrink = jnp.where(
        actred >= 0, 0.5, 0.5 * dirder / jnp.where(denom != 0, denom, 1.0)
    )
    shrink = jnp.where((0.1 * fnorm1 >= fnorm) | (shrink < 0.1), 0.1, shrink)
    bad = ratio <= 0.25
    grow = ~bad & ((par == 0) | (ratio >= 0.75))
    delta = jnp.where(
        bad,
        shrink * jnp.minimum(delta, pnorm / 0.1),
        jnp.where(grow, pnorm / 0.5, delta),
    )
    par = jnp.where(bad, par / shrink, jnp.where(grow, 0.5 * par, par))
    accept = (ratio >= 1e-4) & ok & running
    pick = lambda new, old: jnp.where(accept, new, old)
    x = pick(x_new, state.x)
    f = pick(f_new, state.f)
    jac = pick(jac_new, state.jac)
    fnorm = pick(fnorm1, fnorm)
    xnorm = pick(_norm(state.diag * x_new), state.xnorm)
    nfev = state.nfev + running.astype(jnp.int32)
    njev = state.njev + accept.astype(jnp.int32)
    # The tests, in MINPACK's order.
    eps = _eps(state.x)
    ftol_ok = (
        (jnp.abs(actred) <= options.ftol)
        & (prered <= options.ftol)
        & (0.5 * ratio <= 1)
    )
    xtol_ok = delta <= options.xtol * xnorm
    info = jnp.where(
        ftol_ok & xtol_ok, 3, jnp.where(xtol_ok, 2, jnp.where(ftol_ok, 1, 0))
    )
    late = jnp.where(
        nfev >= options.max_nfev,
        5,
        jnp.where(
            (jnp.abs(actred) <= eps) & (prered <= eps) & (0.5 * ratio <= 1),
            6,
            jnp.where(delta <= eps * xnorm, 7, jnp.where(state.gnorm <= eps, 8, 0)),
        ),
    )
    info = jnp.where(info == 0, late, info)
    # A new Jacobian: MINPACK's next outer iteration scales by it and tests `gtol`.
    gnorm = pick(gnorm1, state.gnorm)  # of the accepted point's `f` and `jac`
    fixed = jnp.any(options.diag > 0)
    diag = jnp.where(accept & ~fixed, jnp.maximum(state.diag, cols1), state.diag)
    info = jnp.where((info == 0) & accept & (gnorm <= options.gtol), 4, info)
    history = state.history
    at = jnp.minimum(njev - 1, history.shape[0] - 1)
    # One entry written in place (a `where` of the whole history would copy it).
    history = history.at[at].set(jnp.where(accept, 0.5 * fnorm**2, history[at]))
    # What the accepted step does not already keep (`pick`) of a finished fit.
    keep = lambda new, old: jnp.where(running, new, old)
    return State(
        x=x,
        f=f,
        jac=jac,
        fnorm=fnorm,
        diag=diag,
        delta=keep(delta, state.delta),
        par=keep(par, state.par),
        xnorm=xnorm,
        gnorm=gnorm,
        nfev=nfev,
        njev=njev,
        info=keep(info, state.info).astype(jnp.int32),
        history=history,
    )


def solve(f_and_jac: Callable, x0, options: Options, history: int = 1) -> State:
    """The whole fit from `x0`: the final `State` (`info` > 0, or the start's
    `NONFINITE_START`). Traceable and `vmap`-able."""
    state = initial_state(f_and_jac, x0, options, history)
    one = lambda st: trial(f_and_jac, st, options)
    return advance(one, state, np.iinfo(np.int32).max)


def advance(trials: Callable[[State], State], states: State, turns) -> State:
    """At most `turns` turns of `trials` while any fit of `states` runs: the loop of
    `solve` (`trials` one `trial` of its fit), also run in pieces by a batch (one
    `trial` of every slot, e.g. its `vmap`) whose host starts new fits in the slots
    of finished ones.

    A finished fit is left as it is by `trial` itself, so the loop carries a batch
    whole: a `vmap` of each fit's own loop would select between the old and the new
    state of every member at every turn, a copy of every Jacobian (Gpufit's spots,
    722 members: 13.3 µs a member and turn against 9.7 without the copy). Each fit
    takes exactly the turns it would take alone."""

    def body(carry):
        st, i = carry
        return trials(st), i + 1

    return jax.lax.while_loop(
        lambda c: jnp.any(c[0].info == 0) & (c[1] < turns), body, (states, 0)
    )[0]


def empty_states(k: int, n: int, m: int, dtype: DTypeLike = np.float64) -> State:
    """`k` slots holding no fit (zeros, NumPy: `jax.jit` copies them at the call),
    each marked finished (`info` is `NONFINITE_START`), so that a loop carries them
    unchanged."""
    f64 = lambda *shape: cast(jax.Array, np.zeros((k, *shape), dtype))
    i32 = lambda: cast(jax.Array, np.zeros(k, np.int32))
    return State(
        x=f64(n),
        f=f64(m),
        jac=f64(m, n),
        fnorm=f64(),
        diag=f64(n),
        delta=f64(),
        par=f64(),
        xnorm=f64(),
        gnorm=f64(),
        nfev=i32(),
        njev=i32(),
        info=i32() + NONFINITE_START,
        history=f64(1),
    )
