"""An explicit Runge-Kutta solve that stops where the problem is stiff: Tsitouras's
5(4) pair (Diffrax's `Tsit5` tableau) in a loop of its own, with the stiffness test of
Hairer's DOPRI5 (Hairer & Wanner, *Solving ODEs II*, §IV.2).

An explicit method's step is bounded by its stability where the problem is stiff,
not by its accuracy: it then takes many more steps than an implicit one, or fails.
The test estimates the largest eigenvalue along a step from its last two stages, both
at `t + h`: `ρ = |f(t + h, y₁) - f(t + h, y₆)| / |y₁ - y₆|`. An accepted step is
stiff where `h ρ > 3.25` (about where the method's stability region meets the
negative real axis); after `limit` stiff steps with no run of 6 others between them
the solve stops, unfinished, so that the caller can solve with a stiff method instead
(`BDF`'s `explicit_first`), and `explicit_budget` says whether a problem's
simulations are worth trying so, from one solve by each method.

The loop is what the PEtab objective's values need and nothing more: no dense
output, no derivatives (they are `BDF`'s), steps that end at the measurement times
(the solution there is the step's own, 5th order), the solution written as each is
reached. Diffrax's `diffeqsolve` with `Tsit5` does the same solve in a general
program (interpolation, saving and event machinery in every step): Crauste et al.
2017's probe traced and compiled in 1.9 s that way against 0.5 s so, and its llh
took 0.38 of `BDF`'s time against 0.26 so.
"""

from collections.abc import Callable
from typing import Any

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt


_TABLEAU = diffrax.Tsit5.tableau
# The stages' times (after the first, at t) and weights, a row a stage (the 7th, at
# `t + h`, is `y₁`'s, so its row is the solution's weights), and the error estimate's.
_C = np.asarray(_TABLEAU.c)
_A = np.stack([np.pad(np.asarray(row), (0, 6 - len(row))) for row in _TABLEAU.a_lower])
_B_ERROR = np.asarray(_TABLEAU.b_error)
# `(y₁ - y₆) / h` as a combination of the stages `f_j` (seven, the last at `y₁`).
_W = np.asarray(_TABLEAU.b_sol) - np.pad(np.asarray(_TABLEAU.a_lower[4]), (0, 2))
_STIFF_H_RHO = 3.25
_CALM_RUN = 6
# Hairer's DOPRI5: the stiff steps that stop the solve.
STIFF_LIMIT = 15
# Rejected steps in a row that end a solve (`RejectionLimit`'s `max_rejected`).
_MAX_REJECTED = 30

# The problems whose simulations `BDF(explicit_first=None)` tries explicitly: fewer
# species than this (the collection's four models of 20 species or more are stiff,
# and a probe of theirs would cost seconds of compilation for nothing) ...
EXPLICIT_BELOW_STATES = 20
# ... and explicit solves that finish in at most this share of `BDF`'s attempts (the
# nine models of the collection that are not stiff take 0.29-0.40 of the attempts;
# Armistead et al. 2024, whose explicit solve finishes, 2.45, and there the explicit
# `nll` about as long as `BDF`'s).
EXPLICIT_SHARE = 0.5


def explicit_budget(steps: np.ndarray, attempts: np.ndarray, most: int) -> int | None:
    """The explicit solve's budget of steps for a problem whose simulations, at its
    nominal parameters, `explicit_solve` solved in `steps` and `BDF` in `attempts`
    (each simulation's, accepted and rejected), or None where they are not worth
    trying explicitly (more than `EXPLICIT_SHARE` of `BDF`'s attempts). The budget
    is `BDF`'s attempts on its longest simulation (at most `most`): where a fit's
    parameters make the explicit solve take more, `BDF` is the cheaper solve."""
    if np.sum(steps) > EXPLICIT_SHARE * np.sum(attempts):
        return None
    return int(min(most, np.max(attempts)))


def explicit_solve(
    rhs: Callable[[Any, Any, Any], Any],
    constants: jax.Array,
    y0: jax.Array,
    ts: npt.NDArray[np.float64],
    rtol: float,
    atol: float,
    most: int,
    need: jax.Array | int | None = None,
    limit: int = STIFF_LIMIT,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Solves `dy/dt = rhs(t, y, constants)` from `t = 0` (one simulation:
    `constants` `(k,)`, `y0` `(n,)`) to `ts[need - 1]` (`ts` sorted, `>= 0`; `need`
    by default all of them), in `y0`'s dtype. Returns the solution at `ts`
    `(T, n)` (0 after `need`, as `bdf_solve`'s), whether the solve finished, and
    its steps (accepted and rejected). It has not finished where `limit` stiff
    steps came with no run of 6 others between them, where `most` steps did not
    reach the end, or where 30 steps in a row were rejected (a blow-up, NaN rates:
    `RejectionLimit`'s rule).

    Each step's error is estimated by the embedded 4th-order solution and kept
    within `atol + rtol * max(|y|, |y₁|)` in the root mean square (Diffrax's
    `PIDController` norm); the next step is `0.9 err^(-1/5)` times this one, 0.2 to
    10 times (at most 1 after a rejection). A step is cut to end at the next
    measurement time; where it did, the next starts from the step before the cut
    (or from the controller's proposal, where it is larger)."""
    dtype = y0.dtype
    ts_j = jnp.asarray(ts, dtype)
    n_out = len(ts)
    need = jnp.asarray(n_out if need is None else need, jnp.int32)
    rtol_, atol_ = jnp.asarray(rtol, dtype), jnp.asarray(atol, dtype)
    c, a, b_error, w = (jnp.asarray(v, dtype) for v in (_C, _A, _B_ERROR, _W))
    f = lambda t, y: rhs(t, y, constants)
    rms = lambda v: jnp.sqrt(jnp.mean(v**2))

    # The first step: Hairer's rule (Diffrax's for `dt0=None`), error order 5.
    f0 = f(jnp.zeros((), dtype), y0)
    scale = atol_ + rtol_ * jnp.abs(y0)
    d0, d1 = rms(y0 / scale), rms(f0 / scale)
    small = (d0 < 1e-5) | (d1 < 1e-5)
    h0 = jnp.where(small, 1e-6, 0.01 * d0 / jnp.where(small, 1.0, d1))
    d2 = rms((f(h0, y0 + h0 * f0) - f0) / scale) / h0
    most_d = jnp.maximum(d1, d2)
    h1 = jnp.where(
        most_d <= 1e-15, jnp.maximum(1e-6, 1e-3 * h0), (0.01 / most_d) ** 0.2
    )
    h_first = jnp.minimum(100 * h0, h1)

    # The solution at the times 0 is y0; the loop starts at the first later one.
    at_zero = ts_j <= 0
    ys = jnp.where(at_zero[:, None] & (jnp.arange(n_out) < need)[:, None], y0, 0)
    first_out = jnp.asarray(int(np.sum(np.asarray(ts) <= 0)), jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    state = dict(
        t=jnp.zeros((), dtype),
        y=y0,
        f=f0,
        h=h_first,
        out=first_out,
        ys=ys,
        steps=zero,
        rejected=zero,
        stiff=zero,
        calm=zero,
    )

    def going(s: dict) -> jax.Array:
        stuck = (s["rejected"] >= _MAX_REJECTED) | (s["stiff"] >= limit)
        return (s["out"] < need) & (s["steps"] < most) & ~stuck

    def step(s: dict) -> dict:
        t, y, out = s["t"], s["y"], s["out"]
        slot = jnp.minimum(out, n_out - 1)  # the next measurement time's row
        t_out = ts_j[slot]
        cut = s["h"] >= t_out - t
        t1 = jnp.where(cut, t_out, t + s["h"])
        h = t1 - t
        ks, yi = [s["f"]], y
        for i in range(6):  # the 7th stage is at y1 (first same as last)
            yi = y + h * sum(a[i, j] * ks[j] for j in range(i + 1))
            ks.append(f(t + c[i] * h, yi))
        y1 = yi
        error = h * sum(b_error[j] * ks[j] for j in range(7))
        ratio = rms(error / (atol_ + rtol_ * jnp.maximum(jnp.abs(y), jnp.abs(y1))))
        ok = ratio <= 1  # False where NaN
        factor = 0.9 * jnp.where(ratio > 0, ratio, 1e-10) ** -0.2
        factor = jnp.clip(factor, 0.2, jnp.where(ok, 10.0, 1.0))
        factor = jnp.where(jnp.isfinite(ratio), factor, 0.2)
        h_next = jnp.where(ok & cut, jnp.maximum(h * factor, s["h"]), h * factor)
        # Hairer's test on accepted steps: h ρ = |f₇ - f₆| / |Σ w_j f_j|.
        num = jnp.sum((ks[6] - ks[5]) ** 2)
        den = jnp.sum(sum(w[j] * ks[j] for j in range(7)) ** 2)
        is_stiff = num > _STIFF_H_RHO**2 * den
        stiff = jnp.where(
            is_stiff,
            s["stiff"] + 1,
            jnp.where(s["calm"] + 1 >= _CALM_RUN, 0, s["stiff"]),
        )
        calm = jnp.where(is_stiff, 0, s["calm"] + 1)
        reached = ok & cut
        ys = s["ys"].at[slot].set(jnp.where(reached, y1, s["ys"][slot]))
        keep = lambda new, old: jnp.where(ok, new, old)
        return dict(
            t=keep(t1, t),
            y=keep(y1, y),
            f=keep(ks[6], s["f"]),
            h=h_next,
            out=out + reached.astype(jnp.int32),
            ys=ys,
            steps=s["steps"] + 1,
            rejected=jnp.where(ok, 0, s["rejected"] + 1),
            stiff=keep(stiff, s["stiff"]),
            calm=keep(calm, s["calm"]),
        )

    s = jax.lax.while_loop(going, step, state)
    return s["ys"], s["out"] >= need, s["steps"]
