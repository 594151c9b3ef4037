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
from sciflat import _scipy_programs


#
# least_squares
#


@pytest.mark.parametrize("method", ["lm", "trf"])
def test_jacobian_started_ahead_changes_nothing_but_when_it_runs(monkeypatch, method):
    """The Jacobian dispatched after every residual call (dropped where SciPy rejects
    the step) gives the very same fit as one computed when SciPy asks for it."""
    from sciflat import _scipy_least_squares as ls

    counts = []
    real = _scipy_programs.Programs.first_working

    def counting(self, *a, **k):
        fn, mode = real(self, *a, **k)

        def jac(x, leaves):
            counts[-1] += 1
            return fn(x, leaves)

        return jac, mode

    monkeypatch.setattr(_scipy_programs.Programs, "first_working", counting)
    far = {"amp": jnp.asarray(100.0), "rate": jnp.asarray(10.0)}  # steps get rejected
    fits = []
    for limit in (0.0, np.inf):  # never, always ahead
        monkeypatch.setattr(ls, "_AHEAD_MAX_S", limit)
        counts.append(0)
        fits.append(
            sciflat.least_squares(
                exp_residuals, far, args=(T, Y), method=method, progress=False
            )
        )
    off, ahead = fits
    assert off.status == "converged", off.message
    np.testing.assert_array_equal(ahead.p, off.p)
    np.testing.assert_array_equal(ahead.history, off.history)
    assert ahead.n_evaluations == off.n_evaluations
    assert (ahead.raw.nfev, ahead.raw.njev) == (off.raw.nfev, off.raw.njev)
    # Ahead: one Jacobian per new point; some of them at rejected points, dropped.
    # Off: only those SciPy asks for (and perhaps `lm`'s final one, at a new point).
    assert off.raw.njev <= counts[0] <= off.raw.njev + 1
    assert counts[1] >= counts[0], counts  # more where JAX ran them on a worker
    np.testing.assert_array_equal(ahead.stderr["rate"], off.stderr["rate"])


class _Result:
    """A JAX result as `_JacobianAhead` sees it: ready at once (run on the calling
    thread) or not yet (handed to JAX's worker thread)."""

    def __init__(self, value, ready):
        self.value, self.ready = value, ready

    def is_ready(self):
        return self.ready

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.value, dtype)


@pytest.mark.parametrize("ready", [False, True])
def test_jacobian_ahead_is_used_at_its_own_point_only(monkeypatch, ready):
    from sciflat import _scipy_least_squares as ls

    monkeypatch.setattr(ls, "_AHEAD_MAX_S", np.inf)
    calls = []

    def jac_fn(x, leaves):
        calls.append(float(x[0]))
        return _Result(2.0 * x, ready)

    ahead = ls._JacobianAhead(jac_fn, [])
    x1, x2, x3 = (np.array([v]) for v in (1.0, 2.0, 3.0))
    ahead.start(x1)  # nothing known yet: not started
    np.testing.assert_array_equal(ahead.get(x1), [2.0])
    assert calls == [1.0]
    ahead.start(x2)  # started ahead; SciPy rejects x2 and asks at x3
    ahead.start(x3)
    x3[0] = -9.0  # SciPy reusing its array does not change what was started
    before = len(calls)
    np.testing.assert_array_equal(ahead.get(np.array([3.0])), [6.0])
    # On JAX's worker: started at every new point, so the one at 3 is used. Run on this
    # thread: nothing to hide, so none is started; 3 is computed when asked for.
    assert calls[before:] == ([3.0] if ready else [])
    assert calls[:before] == ([1.0] if ready else [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(ahead.get(x1), [2.0])  # another point: computed
    assert calls[-1] == 1.0


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
