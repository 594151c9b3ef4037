"""`sciflat.Rodas5P`: the Rosenbrock solver of the PEtab objective, against a tight
Kvaerno5 solve of the same problem (its order, its error estimate, a stiff problem) and
in the dtype of the state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sciflat
from helpers import forced_van_der_pol, robertson, tight


diffrax = pytest.importorskip("diffrax")
optx = pytest.importorskip("optimistix")


@pytest.fixture(scope="module")
def x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.slow  # compiles a tight Kvaerno5 solve: seconds
def test_rodas5p_converges_at_order_five(x64):
    y0 = jnp.array([2.0, 0.0])
    ref = tight(forced_van_der_pol, y0, [2.0])[-1]

    @jax.jit
    def constant_steps(dt):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(forced_van_der_pol),
            sciflat.Rodas5P(),
            0.0,
            2.0,
            dt,
            y0,
            stepsize_controller=diffrax.ConstantStepSize(),
            max_steps=1000,
        )
        assert sol.ys is not None
        return sol.ys[-1]

    errors = [
        float(jnp.max(jnp.abs(constant_steps(2.0 / n) - ref))) for n in (40, 80, 160)
    ]
    ratios = np.array(errors[:-1]) / np.array(errors[1:])
    # Halving the step divides a 5th-order method's error by 2**5 = 32.
    np.testing.assert_allclose(ratios, 32.0, rtol=0.1)


@pytest.mark.slow  # compiles a tight Kvaerno5 solve: seconds
def test_rodas5p_error_estimate_is_the_size_of_the_local_error(x64):
    term = diffrax.ODETerm(forced_van_der_pol)
    y0 = jnp.array([1.3, 0.7])
    hs = (0.00625, 0.0125)
    exact = tight(forced_van_der_pol, y0, hs)
    step = jax.jit(
        lambda h: sciflat.Rodas5P().step(term, 0.0, h, y0, None, None, False)
    )
    estimates, errors = [], []
    for h, y in zip(hs[::-1], exact[::-1], strict=True):
        y1, y_error, *_ = step(h)
        errors.append(float(jnp.max(jnp.abs(y1 - y))))
        estimates.append(float(jnp.max(jnp.abs(y_error))))
    # The estimate is that of the embedded 4th-order solution: local error O(h**5),
    # and it bounds the 5th-order solution's own error.
    assert 24.0 < estimates[0] / estimates[1] < 40.0
    assert all(e > a for e, a in zip(estimates, errors, strict=True))


@pytest.mark.slow  # compiles a tight Kvaerno5 solve: seconds
def test_rodas5p_solves_a_stiff_problem_as_a_tight_kvaerno5_solve(x64):
    y0 = jnp.array([1.0, 0.0, 0.0])
    ts = jnp.array([0.1, 1.0, 10.0, 100.0])
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(robertson),
        sciflat.Rodas5P(),
        0.0,
        100.0,
        None,
        y0,
        saveat=diffrax.SaveAt(ts=ts),
        stepsize_controller=diffrax.ClipStepSizeController(
            diffrax.PIDController(rtol=1e-10, atol=1e-14), step_ts=ts
        ),
        max_steps=10_000,
    )
    assert sol.ys is not None and sol.stats["num_steps"] < 1000
    ref = tight(robertson, y0, ts)
    np.testing.assert_allclose(sol.ys, ref, rtol=1e-7, atol=1e-14)


def test_rodas5p_computes_in_the_states_dtype():
    y0 = jnp.array([1.0, 0.0, 0.0], jnp.float32)
    step = jax.jit(sciflat.Rodas5P().step, static_argnums=(0, 4, 5, 6))
    y1, y_error, *_ = step(diffrax.ODETerm(robertson), 0.0, 1e-3, y0, None, None, False)
    assert y1.dtype == y_error.dtype == jnp.float32


def test_rodas5p_refuses_a_state_that_is_not_one_array(x64):
    with pytest.raises(ValueError, match="one 1-d array"):
        sciflat.Rodas5P().step(
            diffrax.ODETerm(lambda t, y, a: y),
            0.0,
            0.1,
            (jnp.ones(2), jnp.ones(2)),
            None,
            None,
            False,
        )


@pytest.mark.slow  # compiles the solve and both its derivatives: seconds
def test_rodas5p_derivatives_are_those_of_the_discrete_solution(x64):
    # The factorisation's derivative rule (`W`'s tangent applied with the primal
    # factors) against central differences of the same fixed-step solve, and reverse
    # mode (Diffrax's default adjoint, the transpose) against forward mode.
    def solve(k, adjoint):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(
                lambda t, y, k: jnp.stack(  # dimerisation, stiff for large k[1]
                    [
                        -2 * k[0] * y[0] ** 2 + 2 * k[1] * y[1],
                        k[0] * y[0] ** 2 - k[1] * y[1],
                    ]
                )
            ),
            sciflat.Rodas5P(),
            0.0,
            0.1,  # before the equilibrium, which would damp a wrong sensitivity
            0.02,
            jnp.array([1.0, 0.5]),
            args=k,
            stepsize_controller=diffrax.ConstantStepSize(),
            adjoint=adjoint,
        )
        assert sol.ys is not None
        return sol.ys[-1]

    k = jnp.array([2.0, 30.0])
    jacobian = jax.jit(jax.jacfwd(lambda k: solve(k, diffrax.ForwardMode())))
    forward = jacobian(k)
    reverse = jax.jit(
        jax.jacrev(lambda k: solve(k, diffrax.RecursiveCheckpointAdjoint()))
    )(k)
    fn = jax.jit(lambda k: solve(k, diffrax.ForwardMode()))
    eps = 1e-6
    central = jnp.stack(
        [(fn(k + eps * e) - fn(k - eps * e)) / (2 * eps) for e in jnp.eye(2)], axis=1
    )
    # (a wrong rule is 1e-4 off here; the differences are good to ~1e-9)
    np.testing.assert_allclose(forward, central, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(reverse, forward, rtol=1e-12, atol=1e-15)
    # Second derivatives (forward over forward, as a Hessian takes them): the rule
    # differentiated again, `W`'s tangent in it, against central differences of
    # the Jacobian (with `W` held constant in it, 0.6 % off).
    second = jax.jit(jax.jacfwd(jax.jacfwd(lambda k: solve(k, diffrax.ForwardMode()))))
    central = jnp.stack(
        [
            (jacobian(k + eps * e) - jacobian(k - eps * e)) / (2 * eps)
            for e in jnp.eye(2)
        ],
        axis=-1,
    )
    np.testing.assert_allclose(second(k), central, rtol=1e-6, atol=1e-8)
