"""A step-size controller that gives up after many rejected steps in a row.

Where an ODE's solution blows up or leaves the region its rates are defined in (a
parameter far from the data, as a multi-start visits), the error estimate stays above
the tolerance, or is NaN, however small the step: Diffrax's adaptive controllers then
shrink the step and try again until `max_steps`, a hundred thousand rejected steps
(3.5 s with forward sensitivities on Crauste et al. 2017, where a solve that succeeds
takes 10 ms). CVODES (AMICI's solver) fails such a step after a few error-test
failures (`mxnef`, 7 by default); this wrapper does the same: after `max_rejected`
rejected steps in a row the solve stops, its result `max_steps_rejected`, and the
objective is infinite there, as at `max_steps`.
"""

from typing import Any

import diffrax
import equinox as eqx
import jax.numpy as jnp


class RejectionLimit(diffrax.AbstractAdaptiveStepSizeController):
    """`controller`, stopped after more than `max_rejected` rejected steps in a row.

    Each rejection shrinks the step (by at least 5× at the PID controller's
    `factormin`, 0.2, when the error is NaN), so 30 in a row is a step at most
    0.2³⁰ ≈ 1e-21 of the one first tried: nothing a solve that will succeed needs."""

    controller: diffrax.AbstractAdaptiveStepSizeController
    max_rejected: int = eqx.field(static=True)

    def __init__(
        self, controller: diffrax.AbstractAdaptiveStepSizeController, max_rejected=30
    ):
        self.controller, self.max_rejected = controller, max_rejected

    # The implicit solvers' root finders read the tolerances here.
    @property
    def rtol(self):  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.controller.rtol

    @property
    def atol(self):  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.controller.atol

    @property
    def norm(self):  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.controller.norm

    def wrap(self, direction: Any) -> "RejectionLimit":
        return eqx.tree_at(
            lambda s: s.controller, self, self.controller.wrap(direction)
        )

    def init(self, terms, t0, t1, y0, dt0, args, func, error_order):
        t1, state = self.controller.init(
            terms, t0, t1, y0, dt0, args, func, error_order
        )
        return t1, (state, jnp.zeros((), jnp.int32))

    def adapt_step_size(
        self, t0, t1, y0, y1_candidate, args, y_error, error_order, controller_state
    ):
        state, in_a_row = controller_state
        keep, next_t0, next_t1, made_jump, state, result = (
            self.controller.adapt_step_size(
                t0, t1, y0, y1_candidate, args, y_error, error_order, state
            )
        )
        in_a_row = jnp.where(keep, 0, in_a_row + 1)
        result = diffrax.RESULTS.where(
            in_a_row > self.max_rejected, diffrax.RESULTS.max_steps_rejected, result
        )
        return keep, next_t0, next_t1, made_jump, (state, in_a_row), result
