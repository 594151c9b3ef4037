"""`sciflat.least_squares` on the SciPy path: methods, MINPACK, the Jacobian's mode
and the Jacobian started ahead (`_scipy_least_squares`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sciflat
from helpers import (
    T,
    Y,
    _spy,
    exp_model,
    exp_residuals,
)
from sciflat._fitting import programs as _scipy_programs


#
# least_squares
#


def test_numpy_data_is_put_on_the_device_once_per_fit(monkeypatch):
    kinds = []
    real_get = _scipy_programs.Programs.get

    def get(self, *a, **k):
        fn = real_get(self, *a, **k)

        def spy(x, leaves):
            kinds.extend(type(leaf) for leaf in leaves)
            return fn(x, leaves)

        return spy

    monkeypatch.setattr(_scipy_programs.Programs, "get", get)
    data = (np.asarray(T), np.asarray(Y))
    res = sciflat.least_squares(exp_residuals, exp_model(), args=data, progress=False)
    assert res.status == "converged", res.message
    np.testing.assert_allclose([res.model["amp"], res.model["rate"]], [3.0, 1.3])
    assert kinds and all(issubclass(k, jax.Array) for k in kinds), set(kinds)


@pytest.mark.parametrize("method", ["trf", "dogbox", "lm"])
def test_least_squares_methods(method):
    res = sciflat.least_squares(
        exp_residuals, exp_model(), args=(T, Y), method=method, progress=False
    )
    assert res.status == "converged", res.message
    np.testing.assert_allclose(
        [res.model["amp"], res.model["rate"]], [3.0, 1.3], rtol=1e-8
    )
    assert res.loss == pytest.approx(res.raw.cost) and "forward" in res.message


def test_least_squares_auto_method_is_curve_fits(monkeypatch):
    # "auto", as curve_fit and lmfit: MINPACK's lm without bounds ...
    minpack = _spy(monkeypatch, "leastsq")
    fit = lambda **kw: sciflat.least_squares(
        exp_residuals, exp_model(), args=(T, Y), progress=False, **kw
    )
    res = fit()
    assert "Dfun" in minpack and "method: lm" in res.message
    assert res.status == "converged"
    np.testing.assert_array_equal(res.p, fit(method="lm").p)
    seen = _spy(monkeypatch, "least_squares")
    # ... trf with bounds, with a robust loss, or with fewer residuals than parameters.
    fit(bounds={"['rate']": (0.0, None)})
    assert seen["method"] == "trf"
    assert "method: trf" in fit(loss="soft_l1").message
    wide = {"w": jnp.zeros(30)}
    r = lambda m: jnp.stack([jnp.sum(m["w"]) - 1.0, jnp.sum(m["w"] ** 2) - 1.0])
    assert "method: trf" in sciflat.least_squares(r, wide, progress=False).message


@pytest.mark.parametrize("x_scale", ["jac", 1.0, np.array([2.0, 0.5])])
def test_least_squares_lm_is_scipys_lm(x_scale):
    # sciflat runs MINPACK as `leastsq` does; the iterates are `least_squares`' own
    # (`verbose`, an option MINPACK does not take, sends the fit through the latter).
    fit = lambda **kw: sciflat.least_squares(
        exp_residuals,
        exp_model(),
        args=(T, Y),
        method="lm",
        x_scale=x_scale,
        progress=False,
        **kw,
    )
    ours, scipys = fit(), fit(verbose=0)
    np.testing.assert_array_equal(ours.p, scipys.p)
    for name in ("nfev", "njev", "status", "cost", "success", "optimality"):
        assert ours.raw[name] == scipys.raw[name], name
    np.testing.assert_array_equal(ours.raw.jac, scipys.raw.jac)
    np.testing.assert_array_equal(ours.raw.fun, scipys.raw.fun)
    assert ours.history.tolist() == scipys.history.tolist()
    assert ours.stderr == scipys.stderr


def test_least_squares_jacobian_mode_by_shape(monkeypatch):
    seen = _spy(monkeypatch, "least_squares")
    sciflat.least_squares(
        exp_residuals, exp_model(), args=(T, Y), method="trf", progress=False
    )
    x0 = seen["x0"]
    jac = seen["jac"](x0)
    assert jac.dtype == np.float64 and jac.shape == (20, 2)
    fd = np.stack(
        [(seen["fun"](x0 + h) - seen["fun"](x0 - h)) / 2e-6 for h in np.eye(2) * 1e-6],
        1,
    )
    np.testing.assert_allclose(jac, fd, rtol=1e-6, atol=1e-9)
    # More parameters than residuals: reverse mode; `mode` overrides.
    wide = {"w": jnp.zeros(30)}
    r = lambda m: jnp.stack([jnp.sum(m["w"]) - 1.0, jnp.sum(m["w"] ** 2) - 1.0])
    assert "reverse" in sciflat.least_squares(r, wide, progress=False).message
    assert (
        "forward"
        in sciflat.least_squares(r, wide, mode="forward", progress=False).message
    )
