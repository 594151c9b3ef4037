"""MINPACK's trial step from the damped normal equations, written for many fits at once.

`lm.py` finds each trial's Levenberg parameter and step from a QR and an SVD of the
scaled Jacobian: LAPACK calls on tiny matrices, one per fit per turn, which cost a
batch of small fits far more than the arithmetic they do. This computes the same
step (in exact arithmetic) from the normal equations of the scaled Jacobian
`J̃ = J D⁻¹`: `(J̃ᵀJ̃ + par I) a = J̃ᵀ f`, each solved by a Cholesky factorisation
whose loops over the `n` parameters are unrolled at trace time, every entry an array
over the fits (the slots of a batch: vector lanes), so that no LAPACK call is left
in the loop. A batch keeps of each evaluation only `JᵀJ`, `Jᵀf` and the norms
MINPACK reads (`moments`), not the Jacobian.

Moré's Newton iteration on `||a(par)|| = delta` is kept as `lm._lmpar` has it: its
derivative needs `||L⁻¹ a||`, one more triangular solve. The normal equations square
the Jacobian's condition number; where a pivot of the Cholesky of `J̃ᵀJ̃` falls below
`TOO_SMALL` times eps (its dtype's) of its diagonal, the step is `ill` and the caller
runs that fit with MINPACK's steps (`lm.minpack_step`) instead.
"""

import jax
import jax.numpy as jnp

from . import lm as _lm


# A Cholesky pivot of `J̃ᵀJ̃` (whose diagonal is at most 1: `diag` holds the largest
# column norms so far) below this many eps of its diagonal element marks the trial
# `ill`: its condition number is then near 1 / eps, where the normal equations can no
# longer be trusted to give the step to a few digits. NIST's StRD problems in
# float64: `benchmarks/bench_many_fits.py --nist-batch` (docs/devdocs/many_fits.md).
TOO_SMALL = 1e4


def _sum(terms: list) -> jax.Array:
    """The terms' sum, one after another (a fixed order). Each term passes through
    a `where` first, so that no product is contracted with the add after it into an
    FMA in one program and not in another (as `lm._sum`): the same bits for any
    number of lanes."""
    total = _uncontracted(terms[0])
    for t in terms[1:]:
        total = total + _uncontracted(t)
    return total


def _uncontracted(t) -> jax.Array:
    huge = _lm._huge(t)
    return jnp.where(t > huge, huge, t)


def cholesky(h: list, par):
    """`h + par I = L Lᵀ` (lower triangles as nested lists of arrays over the
    lanes), the loops over the `n` columns unrolled: `L` and the pivots before their
    square roots. A pivot that is not positive is replaced by the smallest normal
    number (the caller tests the pivots)."""
    n = len(h)
    tiny = jnp.finfo(h[0][0].dtype).tiny
    low: list[list] = [[None] * (i + 1) for i in range(n)]
    pivots = []
    for j in range(n):
        d = _minus(h[j][j] + par, [low[j][k] * low[j][k] for k in range(j)])
        pivots.append(d)
        root = jnp.sqrt(jnp.where(d > tiny, d, tiny))
        low[j][j] = root
        for i in range(j + 1, n):
            s = _minus(h[i][j], [low[i][k] * low[j][k] for k in range(j)])
            low[i][j] = s / root
    return low, pivots


def _minus(x, terms: list):
    """`x` minus each term in turn (each through a `where`, as in `_sum`)."""
    for t in terms:
        x = x - _uncontracted(t)
    return x


def forward(low: list, b: list) -> list:
    """`L⁻¹ b`."""
    y: list = []
    for i in range(len(b)):
        y.append(_minus(b[i], [low[i][k] * y[k] for k in range(i)]) / low[i][i])
    return y


def backward(low: list, y: list) -> list:
    """`L⁻ᵀ y`."""
    n = len(y)
    x: list = [None] * n
    for i in reversed(range(n)):
        x[i] = _minus(y[i], [low[k][i] * x[k] for k in range(i + 1, n)]) / low[i][i]
    return x


def _norm2(v: list):
    return _sum([x * x for x in v])


def lmpar(h: list, b: list, delta, par, active):
    """`lm._lmpar` on the normal equations of every lane: `(par, a, ill)`, the
    scaled step `D p = -a` (`a` a list of arrays over the lanes). `ill`: the
    Cholesky of `J̃ᵀJ̃` has a pivot under `TOO_SMALL` eps of its diagonal (then `par`
    and `a` are not to be used). A lane not `active` (its fit has finished, or its
    slot is empty: its step is not used) takes no turn of Moré's iteration.

    One loop: its first turn solves every lane's Gauss–Newton step (`par` 0) and
    sets Moré's bracket from it, the later turns are Moré's iteration, so that the
    program holds one Cholesky and its solves, not two (the turn's compile time)."""
    n = len(b)
    dtype = h[0][0].dtype
    eps = jnp.finfo(dtype).eps
    dwarf = jnp.finfo(dtype).tiny
    gnorm = jnp.sqrt(_norm2(b))
    paru0 = gnorm / delta
    paru0 = jnp.where(paru0 == 0, dwarf / jnp.minimum(delta, 0.1), paru0)

    def solve(par_try):
        low, pivots = cholesky(h, par_try)
        a = backward(low, forward(low, b))
        return pivots, a, jnp.sqrt(_norm2(a)), _norm2(forward(low, a))

    def turn(carry):
        par, parl, paru, fp, a, done, it, gn, ill = carry
        first = it == 0
        par_try = jnp.where(par == 0, jnp.maximum(dwarf, 0.001 * paru), par)
        pivots, a_try, dx, curv_sum = solve(jnp.where(first, 0.0, par_try))
        # The first turn: the Gauss–Newton step, whether it is `ill`, and the
        # bracket of Moré's parameter (MINPACK's `lmpar` before its iteration).
        bad = jnp.zeros(delta.shape, bool)
        for j in range(n):
            bad = bad | (pivots[j] <= TOO_SMALL * eps * h[j][j])
        fp0 = dx - delta
        gauss_newton = fp0 <= 0.1 * delta
        dx_safe = jnp.where(dx > 0, dx, 1.0)
        curvature = curv_sum / dx_safe**2
        parl0 = jnp.where(
            curvature > 0, fp0 / delta / jnp.where(curvature > 0, curvature, 1.0), 0.0
        )
        par0 = jnp.minimum(jnp.maximum(par, parl0), paru0)
        par0 = jnp.where(par0 == 0, gnorm / dx_safe, par0)
        start = (par0, parl0, paru0, fp0, a_try)
        # A later turn: Moré's (its turns counted from 0, as `lm._lmpar`'s).
        stop, new = _lm.more_turn(par_try, dx, curv_sum, fp, parl, paru, delta, it - 1)
        later = _lm.kept(done, (par, parl, paru, fp, a), (*new, a_try))
        kept = jax.tree.map(lambda u, v: jnp.where(first, u, v), start, later)
        # A lane whose step is `ill` (or Gauss–Newton) takes no turn of its own;
        # each lane's own turns are those it takes alone (its counter stops with it).
        done = jnp.where(first, gauss_newton | bad | ~active, done | stop)
        gn = jnp.where(first, gauss_newton, gn)
        ill = jnp.where(first, bad, ill)
        return (*kept, done, it + 1, gn, ill)

    zero = jnp.zeros(delta.shape, dtype)
    false = jnp.zeros(delta.shape, bool)
    init = (par, zero, paru0, zero, [zero] * n, false, 0, false, false)
    par, _, _, _, a, _, _, gn, ill = jax.lax.while_loop(
        lambda c: (c[6] == 0) | ~jnp.all(c[5]), turn, init
    )
    return jnp.where(gn, 0.0, par), a, ill


def pairs(n: int) -> list[tuple[int, int]]:
    """The lower triangle's entries `(i, j)`, `j <= i`, row after row."""
    return [(i, j) for i in range(n) for j in range(i + 1)]


def moments(f, jac) -> tuple[_lm._Measure, jax.Array, jax.Array]:
    """What a fit keeps of an evaluation, every slot's at once: `(measure, g, a)`,
    `lm._measure`'s reading of it (finiteness, norms, `gnorm`), `g = Jᵀf` `(K, n)`
    and the lower triangle of `JᵀJ` `(K, n (n + 1) / 2)` (`pairs`), from `f` `(K, m)`
    and `jac` `(K, m, n)`.

    One pass over the Jacobian (`_in_order`): the `(n + 1) (n + 2) / 2` sums of
    products a fit needs, so that the batch carries `n (n + 3) / 2` numbers a fit
    from turn to turn rather than its `m · n` Jacobian (the scaled normal equations
    follow from them: `equations`). Each square has `x * 0` added, as in
    `lm._measure`: it is NaN exactly where `x` is not finite."""
    n = jac.shape[-1]
    cols = [jac[..., i] for i in range(n)]
    square = lambda x: x * x + x * 0
    terms = [square(cols[i]) if i == j else cols[i] * cols[j] for i, j in pairs(n)]
    terms += [cols[i] * f for i in range(n)] + [square(f)]
    sums = _in_order(terms)
    a = jnp.stack(sums[: len(pairs(n))], axis=-1)
    g = jnp.stack(sums[len(pairs(n)) : -1], axis=-1)
    fsq = sums[-1]
    squares = jnp.stack([a[:, i * (i + 3) // 2] for i in range(n)], axis=-1)
    ok = ~jnp.isnan(fsq) & ~jnp.any(jnp.isnan(squares), axis=-1)
    fnorm, cols_norm = jnp.sqrt(fsq), jnp.sqrt(squares)
    # MINPACK's `gnorm` (`lm._gnorm`): the largest cosine of `f` and a column.
    live = (cols_norm > 0) & (fnorm[:, None] > 0)
    safe = jnp.where(live, cols_norm * fnorm[:, None], 1.0)
    gnorm = jnp.max(jnp.where(live, jnp.abs(g) / safe, 0.0), axis=-1)
    return _lm._Measure(ok, fnorm, cols_norm, gnorm), g, a


def _in_order(terms: list) -> list:
    """The sums over the last axis of every array of `terms` (each `(K, m)`), each
    adding its `m` terms one after another in the order of the axis, whatever `K`:
    each slot's sums are computed as in a batch of one. One variadic reduction, into
    which XLA fuses the products: every sum in one pass over the Jacobian, none of
    it copied. Each term passes through `_uncontracted` first (no product is fused
    with its add into an FMA in one program and not in another). XLA's `jnp.sum`
    over the residuals gave other bits for 1 and 64 slots (Misra1a's 14 residuals;
    fits 2e-10 apart); a reduction of several operands at once adds in order."""
    terms = [_uncontracted(t) for t in terms]
    zeros = tuple(jnp.zeros((), t.dtype) for t in terms)
    add = lambda u, v: tuple(x + y for x, y in zip(u, v, strict=True))
    return list(jax.lax.reduce(tuple(terms), zeros, add, (terms[0].ndim - 1,)))


def equations(states: _lm.State) -> tuple[list, list]:
    """Every slot's scaled normal equations `h` (`J̃ᵀJ̃`, lower triangle) and `b`
    (`J̃ᵀ f`) for `J̃ = J D⁻¹`, from what the slots keep of their last accepted
    evaluation (`moments`: `states.jac` holds `JᵀJ`, `states.f` `Jᵀf`), each entry an
    array over the slots."""
    n = states.x.shape[1]
    d = [states.diag[:, i] for i in range(n)]
    at = {ij: k for k, ij in enumerate(pairs(n))}
    h = [
        [states.jac[:, at[i, j]] / d[i] / d[j] for j in range(i + 1)] for i in range(n)
    ]
    b = [states.f[:, i] / d[i] for i in range(n)]
    return h, b


def steps(states: _lm.State, h: list, b: list) -> tuple[_lm.Step, jax.Array]:
    """Every slot's trial step from its normal equations `h`, `b` (`equations`),
    and where it is `ill` (the batch then stops that fit and runs it again with
    MINPACK's steps, `lm.minpack_step`)."""
    par, a, ill = lmpar(h, b, states.delta, states.par, states.info == 0)
    n = len(b)
    # ||J̃ a||² = aᵀ J̃ᵀJ̃ a, from the lower triangle.
    quad = [h[i][i] * a[i] * a[i] for i in range(n)] + [
        2 * h[i][j] * a[i] * a[j] for i in range(n) for j in range(i)
    ]
    jnorm2 = _sum(quad)
    jnorm = jnp.sqrt(jnp.where(jnorm2 > 0, jnorm2, 0.0))
    dx = jnp.stack(a, axis=-1)
    pnorm = jnp.sqrt(_norm2(a))
    return _lm.Step(par=par, dx=dx, pnorm=pnorm, jnorm=jnorm), ill


# The covariance from the normal equations only where every Cholesky pivot of the
# column-scaled `J̃ᵀJ̃` is above this many eps of its diagonal (at most 1e-3 of it):
# its relative error is then below about 1e-8 in float64, 1e-4 in float32;
# elsewhere the caller computes it from an SVD of the Jacobian.
COV_TOO_SMALL = 1e8


def covariance(h: list, scale, cost, m: int):
    """Every lane's covariance `s² (JᵀJ)⁻¹`, as `lm`'s device fit computes it from an
    SVD, here from the Cholesky factor of the normal equations `h` of the scaled
    Jacobian `J̃ = J / scale` (`equations`' lower triangle, each entry an array over the
    lanes; `scale` `(K, n)`, `cost` `(K,)`), each column normalised to 1; and
    `full`: whether every pivot is above `COV_TOO_SMALL` eps of its diagonal (else
    the covariance is not to be used: the caller computes it from the Jacobian)."""
    n = len(h)
    k = cost.shape[0]
    norms = [jnp.sqrt(h[i][i]) for i in range(n)]
    norms = [jnp.where(x > 0, x, 1.0) for x in norms]
    hs = [[h[i][j] / (norms[i] * norms[j]) for j in range(i + 1)] for i in range(n)]
    low, pivots = cholesky(hs, 0.0)
    eps = jnp.finfo(cost.dtype).eps
    full = jnp.ones((k,), bool)
    for j in range(n):
        full = full & (pivots[j] > min(COV_TOO_SMALL * eps, 1e-3) * hs[j][j])
    # The normalised (J̃ᵀJ̃)⁻¹, its `n` columns solved at once: row `i` of every
    # right-hand side is one `(n, K)` array (a program n times shorter to compile
    # than a solve per column, with the same operations on each entry).
    eye = jnp.eye(n, dtype=cost.dtype)[:, :, None] * jnp.ones((k,), cost.dtype)
    inverse = jnp.stack(backward(low, forward(low, list(eye))))  # [i, j]: column j
    # The columns of J: norms[i] * scale[i]; where J̃'s is 0, J's is taken as 1.
    d = jnp.stack(
        [jnp.where(h[i][i] > 0, norms[i] * scale[:, i], 1.0) for i in range(n)]
    )
    s2 = 2.0 * cost / (m - n) if m > n else jnp.full((k,), jnp.nan, cost.dtype)
    cov = s2 * inverse / (d[:, None] * d[None, :])
    return jnp.moveaxis(cov, -1, 0), full
