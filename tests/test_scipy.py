"""`sciflat.minimize` and `sciflat.least_squares`: SciPy on a model, in float64.

Compiled functions are cached per (loss, structure, mode), so the many fits of the
small problems below compile a handful of times; the Lotka–Volterra fits share one
forward-mode solve.
"""

import time

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

import sciflat
from helpers import (
    C,
    Quad,
    T,
    Tied,
    TiedNet,
    Y,
    _spy,
    count_traces,
    exp_model,
    exp_residuals,
    float_dtypes_in_jaxpr,
    quad_loss,
    quad_minimum,
    quad_model,
    tied_loss,
)
from sciflat._fitting import problem as _problem, start as _scipy_start
from sciflat._scipy import minimize as _scipy_minimize


METHODS = [
    "Nelder-Mead",
    "Powell",
    "CG",
    "BFGS",
    "Newton-CG",
    "L-BFGS-B",
    "TNC",
    "COBYLA",
    "COBYQA",
    "SLSQP",
    "trust-constr",
    "dogleg",
    "trust-ncg",
    "trust-exact",
    "trust-krylov",
]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_finds_the_minimum(method):
    # SciPy's stopping rules differ per method: a tight `tol` for all but CG and
    # trust-krylov, which stop with "precision loss" (CG) or step to NaN (trust-krylov).
    tol = None if method in ("CG", "trust-krylov") else 1e-10
    res = sciflat.minimize(
        quad_loss, quad_model(), args=(C,), method=method, tol=tol, progress=False
    )
    a, b = quad_minimum()
    assert res.status == "converged", res.message
    assert (
        isinstance(res.model, Quad) and res.p.dtype == res.model.a.dtype == jnp.float64
    )
    np.testing.assert_allclose(res.model.a, a, atol=1e-5)
    np.testing.assert_allclose(res.model.b, b, atol=1e-5)
    assert res.raw is not None and res.loss == pytest.approx(float(res.raw.fun))
    assert len(res.history) >= 1 and res.history[-1] == pytest.approx(
        res.loss, abs=1e-8
    )


#
# What SciPy receives: float64 NumPy values, gradients equal to finite differences.
#


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_gradient_scipy_receives_equals_finite_differences(monkeypatch, mode):
    key = jax.random.key(1)
    lin = eqx.nn.Linear(1, 1, key=key)
    model = TiedNet(Tied(lin, lin), jnp.asarray(0.7, jnp.float32))
    x = jnp.linspace(-1.0, 1.0, 8)[:, None]
    y = jnp.sin(x)
    seen = _spy(monkeypatch, "minimize")
    res = sciflat.minimize(tied_loss, model, args=(x, y), mode=mode, progress=False)
    assert mode in res.message
    fun, x0 = seen["fun"], seen["x0"]
    assert seen["jac"] is True and x0.dtype == np.float64 and x0.shape == (3,)
    value, grad = fun(x0)
    assert isinstance(grad, np.ndarray) and grad.dtype == np.float64
    assert np.asarray(value).dtype == np.float64
    f = lambda x: float(fun(x)[0])
    fd = np.array([(f(x0 + h) - f(x0 - h)) / 2e-6 for h in np.eye(3) * 1e-6])
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(
        value, tied_loss(jax.tree.map(_f64, model), x, y), rtol=1e-12
    )


def _f64(x):
    return x.astype(jnp.float64) if eqx.is_inexact_array(x) else x


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_hessp_is_forward_over_reverse_hessian_vector_product(monkeypatch):
    seen = _spy(monkeypatch, "minimize")
    sciflat.minimize(
        quad_loss, quad_model(), args=(C,), method="Newton-CG", progress=False
    )
    x0, v = seen["x0"], np.arange(1.0, 5.0)
    p, re = sciflat.destructure(quad_model(), dtype=jnp.float64)
    hessian = jax.hessian(lambda p: quad_loss(re(p), C))(p)
    hv = seen["hessp"](x0, v)
    assert isinstance(hv, np.ndarray) and hv.dtype == np.float64
    np.testing.assert_allclose(hv, hessian @ v, rtol=1e-12)


def test_gradient_jaxpr_is_float64_only():
    lin = eqx.nn.Linear(1, 1, key=jax.random.key(0))
    model = TiedNet(Tied(lin, lin), jnp.asarray(0.7, jnp.float32))
    x0, re = _scipy_start.start(model, None, True, "minimize")
    data = [jnp.ones((4, 1)), jnp.zeros((4, 1))]
    _, rebuild = _problem.split_args(tuple(data))
    for mode in ("forward", "reverse"):
        fn = _scipy_minimize._build("value_and_grad", tied_loss, re, rebuild, mode)
        assert float_dtypes_in_jaxpr(jax.make_jaxpr(fn)(x0, data)) == {"float64"}


def test_data_after_the_model_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"as `args=\(...\)`.*got 1 positional"):
        sciflat.minimize(quad_loss, quad_model(), C, progress=False)  # pyright: ignore
    with pytest.raises(TypeError, match=r"sciflat.least_squares\(loss, model, args="):
        sciflat.least_squares(exp_residuals, exp_model(), T, Y)  # pyright: ignore
    with pytest.raises(TypeError, match=r"`args` must be a tuple.*got ArrayImpl"):
        sciflat.minimize(quad_loss, quad_model(), args=C)  # pyright: ignore


@pytest.mark.parametrize("fit", ["minimize", "least_squares"])
def test_callback_returning_true_stops_at_that_iterate(fit):
    seen = []

    def callback(step, loss, model):
        seen.append((step, loss, model))
        return step == 2

    if fit == "minimize":
        res = sciflat.minimize(
            quad_loss, quad_model(), args=(C,), callback=callback, progress=False
        )
    else:
        res = sciflat.least_squares(
            lambda m, c: m.a**2 - c,
            quad_model(),
            args=(C,),
            callback=callback,
            progress=False,
        )
    assert [s for s, _, _ in seen] == [1, 2]
    assert res.status == "converged" and res.message.startswith("`callback` asked")
    assert res.n_steps == 2 and list(res.history) == [v for _, v, _ in seen]
    assert res.loss == seen[-1][1]
    np.testing.assert_array_equal(res.model.a, seen[-1][2].a)


def test_auto_mode_by_shape_and_fallback():
    # Few parameters: forward; many: reverse.
    assert (
        "forward"
        in sciflat.minimize(quad_loss, quad_model(), args=(C,), progress=False).message
    )
    big = {"w": jnp.zeros(40)}
    res = sciflat.minimize(lambda m: jnp.sum((m["w"] - 1.0) ** 2), big, progress=False)
    assert "reverse" in res.message
    np.testing.assert_allclose(res.model["w"], 1.0, atol=1e-6)

    # A custom_vjp cannot be differentiated forward: auto falls back to reverse.
    @jax.custom_vjp
    def sq(x):
        return x**2

    sq.defvjp(lambda x: (x**2, x), lambda x, g: (2 * x * g,))
    res = sciflat.minimize(
        lambda m, c: jnp.sum(sq(m.a - c)) + sq(m.b),
        quad_model(),
        args=(C,),
        progress=False,
    )
    assert "reverse" in res.message and res.status == "converged"
    np.testing.assert_allclose(res.model.a, C, atol=1e-6)
    with pytest.raises(TypeError, match="custom_vjp"):
        sciflat.minimize(
            lambda m: sq(m.b), quad_model(), mode="forward", progress=False
        )


#
# Bounds in the model's structure.
#


def _bounded(bounds, **kw):
    return sciflat.minimize(
        quad_loss, quad_model(), args=(C,), bounds=bounds, progress=False, **kw
    )


def test_bounds_by_path_lambda_and_pytree():
    a, _ = quad_minimum()
    by_path = _bounded({".b": (None, 1.0), "a": (0.0, None)})
    by_lambda = _bounded({(lambda m: m.b): (None, 1.0), (lambda m: m.a): (0.0, None)})
    lower = Quad(jnp.zeros(3), None)  # pyright: ignore[reportArgumentType]
    upper = Quad(None, jnp.asarray(1.0))  # pyright: ignore[reportArgumentType]
    by_tree = _bounded((lower, upper))
    for res in (by_path, by_lambda, by_tree):
        assert res.status == "converged", res.message
        np.testing.assert_allclose(res.model.b, 1.0)  # the bound is active
        np.testing.assert_allclose(res.model.a, np.maximum(a, 0.0), atol=1e-6)
    per_entry = _bounded({"a": (np.array([0.6, 0.0, 0.0]), np.array([5.0, 5.0, 5.0]))})
    np.testing.assert_allclose(per_entry.model.a, [0.6, 0.0, a[2]], atol=1e-6)


@pytest.mark.parametrize(
    "bounds, error, match",
    [
        ({"c": (0.0, 1.0)}, ValueError, "does not pick a trainable leaf"),
        ({"a": (np.zeros(2), None)}, ValueError, r"shape \(3,\), got shape \(2,\)"),
        ({"a": 0.0}, TypeError, "must be a pair"),
        ({"a": (1.0, 0.0)}, ValueError, "lower > upper"),
        ({"a": (2.0, None)}, ValueError, "starting point is outside `bounds` at `.a`"),
        ({"a": (np.nan, None)}, ValueError, "NaN"),
        ((Quad(jnp.zeros(3), None), {"b": 1.0}), ValueError, "the upper one differs"),  # pyright: ignore[reportArgumentType]
        ([(0.0, 1.0)] * 4, TypeError, "must be a dict"),
    ],
)
def test_bounds_that_do_not_match_the_model(bounds, error, match):
    with pytest.raises(error, match=match):
        _bounded(bounds)


def test_bounds_need_a_bounded_method_and_agree_on_ties():
    with pytest.raises(ValueError, match="does not take bounds"):
        _bounded({"a": (0.0, None)}, method="BFGS")
    with pytest.raises(ValueError, match="does not take bounds"):
        sciflat.least_squares(
            lambda m: m.a, quad_model(), method="lm", bounds={"a": (0, 1)}
        )
    lin = eqx.nn.Linear(1, 1, key=jax.random.key(0))
    model = Tied(lin, lin)
    lower = jax.tree.map(lambda x: -1.0, model)
    lower = eqx.tree_at(lambda m: m.b.weight, lower, -2.0)
    upper = jax.tree.map(lambda x: 1.0, model)
    with pytest.raises(ValueError, match="tied"):
        sciflat.minimize(
            lambda m: m(jnp.ones(1))[0], model, bounds=(lower, upper), progress=False
        )


#
# Bad input: a clear error before SciPy runs, or a clean stop.
#


def test_x64_off_is_a_type_error_with_the_fix(x64_off):
    with pytest.raises(
        TypeError, match=r'(?s)64-bit mode is off.*jax_enable_x64", True'
    ):
        sciflat.minimize(quad_loss, quad_model(), args=(C,), progress=False)
    with pytest.raises(TypeError, match="64-bit mode is off"):
        sciflat.least_squares(lambda m: m.a, quad_model(), progress=False)


def test_wrong_start_or_model():
    with pytest.raises(ValueError, match="length 4, got 3"):
        sciflat.minimize(
            quad_loss, quad_model(), args=(C,), x0=np.zeros(3), progress=False
        )
    with pytest.raises(ValueError, match=r"not finite in `\.a`"):
        sciflat.minimize(
            quad_loss,
            quad_model(),
            args=(C,),
            x0=np.array([0, np.nan, 0, 0]),
            progress=False,
        )
    with pytest.raises(ValueError, match="no trainable floating leaves"):
        sciflat.minimize(lambda m: 0.0, {"n": jnp.arange(3)}, progress=False)
    _, re = sciflat.destructure(quad_model(), dtype=jnp.float64)
    with pytest.raises(TypeError, match="pass `x0=`"):
        sciflat.minimize(quad_loss, re, args=(C,), progress=False)
    res = sciflat.minimize(quad_loss, re, args=(C,), x0=np.zeros(4), progress=False)
    assert res.status == "converged"
    with pytest.raises(ValueError, match="must return a scalar"):
        sciflat.minimize(lambda m, c: m.a - c, quad_model(), args=(C,), progress=False)
    with pytest.raises(TypeError, match="loss has dtype float32"):
        sciflat.minimize(
            lambda m: m.b.astype(jnp.float32), quad_model(), progress=False
        )
    with pytest.raises(ValueError, match="`method` must be one of"):
        sciflat.minimize(
            quad_loss, quad_model(), args=(C,), method="newton", progress=False
        )
    with pytest.raises(TypeError, match="computes \\['jac'\\] itself"):
        sciflat.minimize(quad_loss, quad_model(), args=(C,), jac=True, progress=False)


def nan_beyond(m, c):
    # NaN (value and gradient in `.a`) for a > 0.8: L-BFGS-B's steps from 0 go there.
    return quad_loss(m, c) + 0.01 * jnp.sum(jnp.sqrt(0.8 - m.a))


def test_nan_in_the_loss_stops_cleanly_naming_the_leaves():
    model = Quad(jnp.zeros(3), jnp.asarray(0.0))
    # Reverse mode: forward mode would spread the NaN to every leaf (0 * nan).
    res = sciflat.minimize(nan_beyond, model, args=(C,), mode="reverse", progress=False)
    assert res.status == "nonfinite" and not res.success
    assert "The loss is nan at call" in res.message
    assert "the gradient is non-finite in `.a`." in res.message  # `.b` is finite
    assert np.isfinite(res.p).all() and np.isfinite(res.loss)
    assert res.loss == pytest.approx(float(nan_beyond(res.model, C)))


def test_nan_in_the_residuals_stops_cleanly():
    # NaN residuals at the start (a > 0.3): there is no step to reject. (NaN at a
    # trial point is a rejected step: test_a_trial_step_to_non_finite_residuals_...)
    model = Quad(jnp.full(3, 0.5), jnp.asarray(0.0))
    res = sciflat.least_squares(
        lambda m, c: jnp.sqrt(0.3 - m.a) - c + m.b, model, args=(C,), progress=False
    )
    assert res.status == "nonfinite"
    # Issue 23, item 19: what is non-finite and where, and that the data are not it.
    assert (
        "residuals are non-finite at the start, at residuals [0, 1, 2]" in res.message
    )
    assert "the data in `args` are finite" in res.message
    np.testing.assert_array_equal(res.p, [0.5, 0.5, 0.5, 0.0])  # the start


def test_a_trial_step_to_non_finite_residuals_is_rejected_as_in_scipy():
    # sciflat's `trf` stopped at the first trial point with NaN residuals (a > 0.3)
    # where SciPy's rejects the step and goes on. The reference: SciPy's own `trf`
    # with the same Jacobian, start and options, iterate for iterate.
    f = lambda m, c: jnp.sqrt(0.3 - m.a) - c + m.b
    model = Quad(jnp.zeros(3), jnp.asarray(0.0))
    res = sciflat.least_squares(f, model, args=(C,), method="trf", progress=False)
    p0, re = sciflat.destructure(model)
    r = jax.jit(lambda p: f(re(p), C))
    jac = jax.jit(jax.jacfwd(lambda p: f(re(p), C)))
    tol = dict(ftol=1e-12, xtol=1e-12, gtol=1e-12, max_nfev=2000 * 5)
    with np.errstate(invalid="ignore"):
        ref = scipy.optimize.least_squares(
            lambda p: np.asarray(r(p)),
            np.asarray(p0),
            jac=lambda p: np.asarray(jac(p)),
            method="trf",
            **tol,
        )
    assert not np.isfinite(r(p0.at[0].set(0.5))).all()  # NaN beyond
    assert res.status == "converged" and ref.success, res.message
    np.testing.assert_allclose(res.p, ref.x, rtol=1e-12, atol=1e-14)
    assert res.raw.nfev == ref.nfev and res.loss == pytest.approx(ref.cost, abs=1e-20)


def test_auto_keeps_minpack_when_a_trial_step_overflows():
    # MINPACK rejects the two trial steps that overflow and finds the exact fit, as
    # SciPy's own `least_squares(method="lm")` and `curve_fit` do; `auto` abandoned it
    # for `trf`, which reported success at a wrong fit (b = 3237, chi^2 2.47).
    t = np.linspace(0, 1, 20)
    y = np.exp(-25 * (t - 0.7) ** 2)
    gauss = lambda m, t, y: m["a"] * jnp.exp(-m["b"] * (t - m["mu"]) ** 2) + m["c"] - y
    start = {"a": 1.0, "b": 20.0, "c": 0.0, "mu": 1.2}
    res = sciflat.least_squares(gauss, start, args=(t, y), progress=False)
    g = lambda t, a, b, c, mu: a * np.exp(-b * (t - mu) ** 2) + c
    with np.errstate(over="ignore", invalid="ignore"):
        fitted = scipy.optimize.curve_fit(g, t, y, p0=[1.0, 20.0, 0.0, 1.2])[0]
        own = scipy.optimize.least_squares(
            lambda x: g(t, *x) - y, [1.0, 20.0, 0.0, 1.2], method="lm"
        ).x
    want = {"a": 1.0, "b": 25.0, "c": 0.0, "mu": 0.7}
    for i, name in enumerate(want):
        for ref in (fitted, own):  # SciPy's tolerances (1e-8): to 1e-6
            assert ref[i] == pytest.approx(want[name], abs=1e-6)
        assert float(res.model[name]) == pytest.approx(want[name], abs=1e-10), name
    assert res.success and res.chisqr < 1e-20 and "method: lm" in res.message


@pytest.mark.parametrize("fit", ["minimize", "least_squares"])
def test_keyboard_interrupt_returns_the_best_point_so_far(fit):
    seen = []

    def callback(step, loss, model):
        assert isinstance(model, Quad) and model.a.dtype == jnp.float64
        assert step == len(seen) + 1
        seen.append(loss)
        if len(seen) == 3:
            raise KeyboardInterrupt

    if fit == "minimize":
        res = sciflat.minimize(
            quad_loss,
            quad_model(),
            args=(C,),
            method="BFGS",
            callback=callback,
            progress=False,
        )
        value = float(quad_loss(res.model, C))
    else:
        res = sciflat.least_squares(
            lambda m, c: m.a**2 - c,
            quad_model(),
            args=(C,),
            callback=callback,
            progress=False,
        )
        value = 0.5 * float(jnp.sum((res.model.a**2 - C) ** 2))
    assert res.status == "interrupted" and res.raw is None
    assert list(res.history) == seen and len(seen) == 3
    assert res.loss == pytest.approx(value) and res.loss <= min(seen)


def test_progress_bar_only_when_asked(capsys):
    sciflat.minimize(quad_loss, quad_model(), args=(C,), progress=False)
    assert capsys.readouterr().err == ""
    # tqdm redraws at most every 0.1 s: a slow callback lets it show the loss.
    slow = lambda step, loss, model: time.sleep(0.12)
    sciflat.minimize(
        quad_loss, quad_model(), args=(C,), callback=slow, options={"maxiter": 3}
    )
    err = capsys.readouterr().err
    assert "minimize (L-BFGS-B)" in err and "loss=" in err


#
# Lotka–Volterra: 4 rates recovered by minimize and least_squares.
#

TRUE = np.array([1.5, 1.0, 3.0, 1.0])
TS = jnp.linspace(0.0, 5.0, 26)


class LotkaVolterra(eqx.Module):
    rates: jax.Array

    def __call__(self, t, y, args):
        a, b, c, d = self.rates
        return jnp.stack([a * y[0] - b * y[0] * y[1], -c * y[1] + d * y[0] * y[1]])


def lv_solve(model):
    # ForwardMode: the few-parameter fit differentiates forward (see docs/scipy.md).
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(model),
        diffrax.Tsit5(),
        0.0,
        5.0,
        0.01,
        jnp.asarray([1.0, 1.0]),
        saveat=diffrax.SaveAt(ts=TS),
        adjoint=diffrax.ForwardMode(),
        stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-10),
        max_steps=8192,
    )
    return sol.ys


def lv_residuals(model, data):
    return (lv_solve(model) - data).ravel()


def lv_loss(model, data):
    return jnp.sum(lv_residuals(model, data) ** 2)


@pytest.fixture(scope="module")
def lv_data():
    clean = lv_solve(LotkaVolterra(jnp.asarray(TRUE)))
    noise = np.random.default_rng(0).normal(size=clean.shape)
    return clean, clean * (1 + 0.01 * noise)


START = LotkaVolterra(jnp.asarray([1.2, 0.8, 2.6, 1.2]))
POSITIVE = {"rates": (0.0, None)}


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
@pytest.mark.parametrize("fit", ["minimize", "least_squares"])
def test_lotka_volterra_rates_recovered(lv_data, fit):
    clean, noisy = lv_data
    if fit == "minimize":
        run = lambda data: sciflat.minimize(
            lv_loss,
            START,
            args=(data,),
            bounds=POSITIVE,
            progress=False,
            options={"ftol": 0.0, "gtol": 1e-12, "maxiter": 500},
        )
    else:
        run = lambda data: sciflat.least_squares(
            lv_residuals,
            START,
            args=(data,),
            bounds=POSITIVE,
            progress=False,
            xtol=1e-14,
            ftol=1e-14,
        )
    exact = run(clean)
    assert (
        exact.status in ("converged", "max_steps") and "forward mode" in exact.message
    )
    np.testing.assert_allclose(exact.model.rates, TRUE, rtol=1e-6)
    np.testing.assert_allclose(run(noisy).model.rates, TRUE, rtol=0.02)


def _blas_threads():
    from threadpoolctl import threadpool_info

    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_blas_threads_limited_during_the_fit_only():
    before, during = _blas_threads(), []
    record = lambda step, loss, model: during.append(_blas_threads())
    fit = lambda **kw: sciflat.minimize(
        quad_loss,
        quad_model(),
        args=(C,),
        callback=record,
        progress=False,
        options={"maxiter": 2},
        **kw,
    )
    fit()
    assert during and all(set(threads) == {1} for threads in during)
    assert _blas_threads() == before
    during.clear()
    fit(blas_threads=None)
    assert during and all(threads == before for threads in during)
    with pytest.raises(ValueError, match="`blas_threads` must be"):
        fit(blas_threads=0)


def test_scipy_iterate_reaches_the_model_unrounded(monkeypatch):
    # 1 + 1e-12 is not a float32: rounded, the loss at the target would not be zero.
    target = jnp.asarray([1.0 + 1e-12, -(1.0 + 3e-12)])
    loss = lambda m, c: jnp.sum((m["w"] - c) ** 2)
    seen = _spy(monkeypatch, "minimize")
    sciflat.minimize(
        loss, {"w": jnp.zeros(2, jnp.float32)}, args=(target,), progress=False
    )
    value, grad = seen["fun"](np.asarray(target))
    assert value == 0.0 and np.all(grad == 0.0)
    value, _ = seen["fun"](np.asarray(target) + np.array([1e-12, 0.0]))
    assert value == pytest.approx(1e-24, rel=1e-3)


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_a_failed_mode_is_remembered(lv_data):
    def loss(m, data):  # the default adjoint: forward mode fails, reverse works
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(m),
            diffrax.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.asarray([1.0, 1.0]),
            saveat=diffrax.SaveAt(ts=TS[:6]),
        )
        return jnp.sum((sol.ys - data[:6]) ** 2)

    fit = lambda: sciflat.minimize(
        loss, START, args=(lv_data[0],), options={"maxiter": 2}, progress=False
    )
    assert "reverse" in fit().message
    with count_traces() as traces:
        assert "reverse" in fit().message
    assert traces == []
    # Asked for explicitly, the failed mode raises its own error again.
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        sciflat.minimize(
            loss, START, args=(lv_data[0],), mode="forward", progress=False
        )
