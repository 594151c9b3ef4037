"""`least_squares(method="fides")`: Fides's trust region on the residuals, against
SciPy's `trf` on the same problems, and the one pass per evaluation it relies on."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sciflat
from helpers import T, exp_model, exp_residuals
from sciflat._fitting import programs as _programs


fides = pytest.importorskip("fides")

# Noisy data, so that the minimum has residuals and standard errors to compare.
Y_NOISY = 3.0 * jnp.exp(-1.3 * T) + 0.01 * jax.random.normal(jax.random.key(0), T.shape)


def _fit(method, **kw):
    return sciflat.least_squares(
        exp_residuals,
        exp_model(),
        args=(T, Y_NOISY),
        method=method,
        progress=False,
        **kw,
    )


def test_fides_reaches_trfs_minimum_and_its_standard_errors():
    got, ref = _fit("fides"), _fit("trf")
    assert got.status == "converged", got.message
    assert "Fides" in got.message and "method: fides" in got.message
    for k in ("amp", "rate"):
        np.testing.assert_allclose(got.model[k], ref.model[k], rtol=1e-6)
        np.testing.assert_allclose(got.stderr[k], ref.stderr[k], rtol=1e-4)
    assert got.loss == pytest.approx(ref.loss, rel=1e-9)
    assert np.all(np.diff(got.history) <= 0)  # accepted steps only lower the cost


def test_fides_keeps_to_the_bounds_as_trf_does():
    bounds = {"['rate']": (0.0, 1.0)}  # the unbounded minimum is at 1.3
    got, ref = _fit("fides", bounds=bounds), _fit("trf", bounds=bounds)
    assert got.status == "converged", got.message
    assert float(got.model["rate"]) <= 1.0
    np.testing.assert_allclose(got.model["rate"], 1.0, atol=1e-6)
    np.testing.assert_allclose(got.model["amp"], ref.model["amp"], rtol=1e-5)


def test_fides_takes_residuals_and_jacobian_in_one_call_per_evaluation(monkeypatch):
    calls: dict = {}
    requested: list = []
    real_get = _programs.Programs.get

    def get(self, kind, *a, **k):
        requested.append(kind)
        fn = real_get(self, kind, *a, **k)

        def spy(*args):
            calls[kind] = calls.get(kind, 0) + 1
            return fn(*args)

        return spy

    monkeypatch.setattr(_programs.Programs, "get", get)
    res = _fit("fides")
    assert res.status == "converged", res.message
    # Every point Fides evaluates is one call of the residuals with their Jacobian,
    # none of the residuals alone.
    assert set(calls) == {"both"}, calls
    assert calls["both"] == res.n_evaluations == res.raw.nfev > 2
    assert requested == ["both"]  # the residuals alone are not even traced


def test_fides_with_more_parameters_than_residuals_takes_reverse_mode():
    # Two residuals, three parameters: the Jacobian by reverse mode; the minimum
    # is a manifold, any point of it has zero cost.
    res = sciflat.least_squares(
        lambda m: jnp.stack([m["a"] + m["b"] - 1.0, m["b"] * m["c"] - 2.0]),
        {"a": jnp.array(0.5), "b": jnp.array(0.5), "c": jnp.array(0.5)},
        method="fides",
        progress=False,
    )
    assert res.status == "converged" and "reverse mode" in res.message
    assert res.loss < 1e-12


def test_fides_with_bfgs_and_its_iteration_limit():
    ref = _fit("trf")
    for update in (fides.BFGS(), fides.SSM()):  # gradient only; residuals' own
        got = _fit("fides", hessian_update=update)
        assert got.status == "converged", got.message
        np.testing.assert_allclose(got.model["rate"], ref.model["rate"], rtol=1e-5)
    short = _fit("fides", maxiter=2)
    assert short.status == "max_steps" and "maxiter" in short.message


def test_fides_refuses_options_it_does_not_take():
    with pytest.raises(TypeError, match=r"Fides's options.*loss"):
        _fit("fides", loss="soft_l1")
    with pytest.raises(TypeError, match=r"fides\.HessianApproximation.*str"):
        _fit("fides", hessian_update="bfgs")


def test_fides_stops_at_a_non_finite_start_and_on_callback():
    bad = {"amp": jnp.array(1.0), "rate": jnp.array(-1e3)}  # exp(2000) overflows
    res = sciflat.least_squares(
        exp_residuals, bad, args=(T, Y_NOISY), method="fides", progress=False
    )
    assert res.status == "nonfinite" and "non-finite" in res.message
    seen = []
    res = _fit(
        "fides", callback=lambda step, cost, model: seen.append(cost) or step == 2
    )
    assert res.status == "converged" and "callback" in res.message
    assert len(seen) == 2 and len(res.history) == 2


def _fails_off_finite(x):
    return x


_fails_off_finite = jax.custom_jvp(_fails_off_finite)


@_fails_off_finite.defjvp
def _(primals, tangents):
    # As Lineax in an ODE solve's implicit derivative: a non-finite input raises.
    (x,), (dx,) = primals, tangents
    dx = eqx.error_if(dx, ~jnp.all(jnp.isfinite(x)), "non-finite input")
    return x, dx


def test_fides_rejects_a_trial_point_whose_derivative_raises():
    # The residuals are NaN for rate in (1.5, 4) (a solve that fails there), and
    # their derivative raises at such points; the minimum is at 5, beyond them.
    def residuals(m, t, y):
        r = m["amp"] * jnp.exp(-m["rate"] * t) - y
        bad = (m["rate"] > 1.5) & (m["rate"] < 4.0)
        return _fails_off_finite(jnp.where(bad, jnp.nan, r))

    start = {"amp": jnp.array(1.0), "rate": jnp.array(1.0)}
    y = 3.0 * jnp.exp(-5.0 * T)
    res = sciflat.least_squares(
        residuals, start, args=(T, y), method="fides", progress=False
    )
    # Trial points in the gap were rejected, not raised; the fit ended below it.
    assert res.raw is not None and res.raw.nfev > res.n_steps
    assert float(res.model["rate"]) <= 1.5 and np.isfinite(res.loss)

    # At a point with finite residuals, the run stops there as at a non-finite
    # Jacobian, the best point kept, the error in the message.
    def raising(m, t, y):
        r = m["amp"] * jnp.exp(-m["rate"] * t) - y
        return _refused_above(r, m["rate"])

    # A start where the residuals are NaN and the derivative raises: stopped there,
    # said so (the message names no Jacobian columns then).
    nan_start = {"amp": jnp.array(1.0), "rate": jnp.array(2.0)}
    res = sciflat.least_squares(
        residuals, nan_start, args=(T, y), method="trf", progress=False
    )
    assert res.status == "nonfinite" and "non-finite" in res.message
    for method in ("fides", "trf"):  # SciPy's methods stop there alike
        res = sciflat.least_squares(
            raising, start, args=(T, y), method=method, progress=False
        )
        assert res.status == "nonfinite" and "derivative refused" in res.message
        assert np.isfinite(res.loss)  # the best point seen (`trf`: a trial point)


@jax.custom_jvp
def _refused_above(r, rate):
    return r


@_refused_above.defjvp
def _(primals, tangents):
    (r, rate), (dr, _) = primals, tangents
    dr = eqx.error_if(dr, rate > 1.2, "derivative refused")
    return r, dr
