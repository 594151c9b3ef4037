"""`RejectionLimit`: a PEtab solve whose steps keep failing stops after a few
rejected steps in a row (as CVODES does), not after `max_steps` of them."""

import diffrax
import jax.numpy as jnp
import numpy as np
import pytest

from sciflat._petab.controller import RejectionLimit


def _solve(controller, field, max_steps=2_000):
    return diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        diffrax.Tsit5(),
        0.0,
        3.0,
        None,
        jnp.array([1.0, 0.5]),
        saveat=diffrax.SaveAt(ts=jnp.array([1.0, 2.0, 3.0])),
        stepsize_controller=controller,
        max_steps=max_steps,
        throw=False,
    )


def _pid():
    return diffrax.PIDController(rtol=1e-8, atol=1e-10)


@pytest.mark.slow
def test_a_solve_whose_steps_all_fail_stops_after_the_limit():
    # Rates that are NaN once t > 0: every step is rejected, however small.
    def broken(t, y, args):
        return jnp.where(t > 0, jnp.nan, -y)

    plain = _solve(_pid(), broken)
    limited = _solve(RejectionLimit(_pid(), max_rejected=30), broken)
    # Without it: every step to `max_steps` (rejected, or zero-length once the step
    # has shrunk below the time's rounding).
    assert plain.result == diffrax.RESULTS.max_steps_reached
    assert int(plain.stats["num_steps"]) == 2_000
    assert limited.result == diffrax.RESULTS.max_steps_rejected
    assert int(limited.stats["num_rejected_steps"]) == 31
    assert int(limited.stats["num_accepted_steps"]) == 0


@pytest.mark.slow
def test_a_solve_that_succeeds_is_the_same_to_the_bit():
    # Rejecting some steps (stiff for an explicit method, a jump in the rate at
    # t = 1.5), never 30 in a row: the limit changes nothing.
    def stiff(t, y, args):
        k = jnp.where(t < 1.5, 1e2, 1e3)
        return jnp.stack([-k * (y[0] - jnp.cos(t)), -y[1]])

    plain = _solve(_pid(), stiff)
    limited = _solve(RejectionLimit(_pid()), stiff)
    assert limited.result == diffrax.RESULTS.successful
    assert int(plain.stats["num_rejected_steps"]) > 0
    np.testing.assert_array_equal(limited.ys, plain.ys)
    assert int(limited.stats["num_steps"]) == int(plain.stats["num_steps"])


def test_the_tolerances_are_the_wrapped_controllers():
    # The implicit solvers' root finders take them from the controller.
    limited = RejectionLimit(diffrax.PIDController(rtol=1e-5, atol=1e-7))
    assert (limited.rtol, limited.atol) == (1e-5, 1e-7)
    with pytest.raises(TypeError):
        RejectionLimit()  # pyright: ignore[reportCallIssue]
