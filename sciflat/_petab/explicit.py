"""An explicit method that stops where the problem is stiff: Diffrax's `Tsit5` with the
stiffness test of Hairer's DOPRI5 (Hairer & Wanner, *Solving ODEs II*, §IV.2).

An explicit method's step is bounded by its stability where the problem is stiff,
not by its accuracy: it then takes many more steps than an implicit one, or fails.
The test estimates the largest eigenvalue along a step from its last two stages, both
at `t + h`: `ρ = |f(t + h, y₁) - f(t + h, y₆)| / |y₁ - y₆|`. A step is stiff where
`h ρ > 3.25` (about where `Tsit5`'s stability region meets the negative real axis);
after `limit` stiff steps with no run of 6 others between them, the step fails and the
solve stops (its result `max_steps_reached`), so that the caller can solve with a
stiff method instead (`BDF`'s `explicit_first`), and `explicit_budget` says whether
a problem's simulations are worth trying so, from one solve by each method.
"""

from typing import Any

import diffrax
import jax.numpy as jnp
import numpy as np


_TABLEAU = diffrax.Tsit5.tableau
# `y₁ - y₆` as a combination of the stages `k_j = h f_j` (seven, the last at `y₁`).
_Y1_MINUS_Y6 = np.asarray(_TABLEAU.b_sol) - np.pad(
    np.asarray(_TABLEAU.a_lower[4]), (0, 2)
)
_STIFF_H_RHO = 3.25
_CALM_RUN = 6

# The problems whose simulations `BDF(explicit_first=None)` tries explicitly: fewer
# species than this (the collection's four models of 20 species or more are stiff,
# and a probe of theirs would cost seconds of compilation for nothing) ...
EXPLICIT_BELOW_STATES = 20
# ... and explicit solves that finish in at most this share of `BDF`'s attempts (an
# explicit step costs one to two and a half of `BDF`'s attempts, Crauste et al.
# 2017's and Borghans et al. 1997's: the five models of the collection that are not
# stiff take 0.31-0.35 of the attempts; Armistead et al. 2024, whose explicit solve
# finishes, 2.9).
EXPLICIT_SHARE = 0.5


def explicit_budget(steps: np.ndarray, attempts: np.ndarray, most: int) -> int | None:
    """The explicit solve's budget of steps for a problem whose simulations, at its
    nominal parameters, `StiffnessTested` solved in `steps` and `BDF` in `attempts`
    (each simulation's, accepted and rejected), or None where they are not worth
    trying explicitly (more than `EXPLICIT_SHARE` of `BDF`'s attempts). The budget
    is `BDF`'s attempts on its longest simulation (at most `most`): where a fit's
    parameters make the explicit solve take more, `BDF` is the cheaper solve."""
    if np.sum(steps) > EXPLICIT_SHARE * np.sum(attempts):
        return None
    return int(min(most, np.max(attempts)))


class StiffnessTested(diffrax.Tsit5):
    """`diffrax.Tsit5` whose step fails once `limit` stiff steps came with no run of
    6 others between them.

    **Fields:**

    - `limit`: the stiff steps that stop the solve (Hairer's DOPRI5: 15).
    """

    limit: int = 15

    # The solver's state is `Tsit5`'s and the two counters: `(inner, stiff, calm)`.
    def init(self, terms, t0, t1, y0, args):  # pyright: ignore[reportIncompatibleMethodOverride]
        zero = jnp.zeros((), jnp.int32)
        return super().init(terms, t0, t1, y0, args), zero, zero

    def step(self, terms, t0, t1, y0, args, solver_state: Any, made_jump):  # pyright: ignore[reportIncompatibleMethodOverride]
        inner, stiff, calm = solver_state
        y1, error, dense, inner, result = super().step(
            terms, t0, t1, y0, args, inner, made_jump
        )
        k = dense["k"]
        w = jnp.asarray(_Y1_MINUS_Y6, k.dtype)
        num = jnp.sum((k[6] - k[5]) ** 2)
        den = jnp.sum(sum(w[j] * k[j] for j in range(7)) ** 2)
        is_stiff = num > _STIFF_H_RHO**2 * den
        stiff = jnp.where(
            is_stiff, stiff + 1, jnp.where(calm + 1 >= _CALM_RUN, 0, stiff)
        )
        calm = jnp.where(is_stiff, 0, calm + 1)
        stop = diffrax.RESULTS.max_steps_reached
        result = diffrax.RESULTS.where(stiff >= self.limit, stop, result)
        return y1, error, dense, (inner, stiff, calm), result
