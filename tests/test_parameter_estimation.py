"""Parameter estimation: the result is honest (defects of issue 12) and carries
standard errors, correlations and a report, checked against closed forms."""

import sys
import warnings

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import sciflat


def lsq(residuals, model, args=(), **kwargs):
    return sciflat.least_squares(residuals, model, args=args, progress=False, **kwargs)


def mini(loss, model, args=(), **kwargs):
    return sciflat.minimize(loss, model, args=args, progress=False, **kwargs)


def exponential(m, x, y):
    return m["b1"] * (1 - jnp.exp(-m["b2"] * x)) - y


# NIST BoxBOD (higher difficulty): data and certified values from NIST's StRD.
BOXBOD_X = jnp.array([1.0, 2, 3, 5, 7, 10])
BOXBOD_Y = jnp.array([109.0, 149, 149, 191, 213, 224])
BOXBOD = {
    "b1": (2.1380940889e02, 1.2354515176e01),
    "b2": (5.4723748542e-01, 1.0455993237e-01),
}


def digits(estimate, certified):
    return -np.log10(abs(float(estimate) - certified) / abs(certified))


#
# Defects
#


def test_overflowing_sum_of_squares_is_not_nonfinite():
    # From Start 1 a trial step makes the residuals finite but their squares overflow;
    # SciPy shrinks the step. (`filterwarnings = error`: no overflow warning either.)
    start = {"b1": jnp.asarray(1.0), "b2": jnp.asarray(1.0)}
    res = lsq(exponential, start, (BOXBOD_X, BOXBOD_Y))
    assert res.status == "converged", res.message
    # The default tries MINPACK's lm first, which cannot shrink a step to non-finite
    # residuals: trf goes on from the start, and the message says so.
    assert "`trf` ran from the start" in res.message and "method: trf" in res.message
    assert res.n_evaluations > res.raw.nfev
    for name, (value, stderr) in BOXBOD.items():
        assert digits(res.model[name], value) >= 6
        assert digits(res.stderr[name], stderr) >= 4


@pytest.mark.parametrize(
    "start",
    [{"b1": 500.0, "b2": 1e-4}, {"b1": 500.0, "b2": jnp.asarray(1e-4)}, [500.0, 1e-4]],
    ids=["floats", "mixed", "list"],
)
def test_python_floats_in_plain_containers_are_fitted(start):
    x = jnp.linspace(50.0, 800.0, 14)
    y = 240.0 * (1 - jnp.exp(-5.5e-4 * x))
    as_dict = (
        (lambda m: m) if isinstance(start, dict) else (lambda m: dict(b1=m[0], b2=m[1]))
    )
    res = lsq(lambda m, x, y: exponential(as_dict(m), x, y), start, (x, y))
    fitted = as_dict(res.model)
    assert res.success and len(res.p) == 2
    assert float(fitted["b1"]) == pytest.approx(240.0, rel=1e-8)
    assert float(fitted["b2"]) == pytest.approx(5.5e-4, rel=1e-8)
    # minimize, too.
    sse = lambda m, x, y: jnp.sum(exponential(as_dict(m), x, y) ** 2)
    assert len(mini(sse, start, (x, y)).p) == 2


class Rate(eqx.Module):
    rate: float  # a Python float field: static, as everywhere in Equinox


def test_a_module_with_only_float_fields_says_how_to_fit_them():
    with pytest.raises(ValueError, match=r"`\.rate`.*jnp\.asarray"):
        lsq(lambda m, x: m.rate * x - 1.0, Rate(0.5), (jnp.ones(3),))


def test_a_float_field_of_a_module_stays_static():
    model = {"w": jnp.asarray(0.0), "drop": eqx.nn.Dropout(0.25)}
    res = lsq(lambda m, x: m["w"] - x, model, (jnp.ones(3),))
    assert len(res.p) == 1 and res.model["drop"].p == 0.25
    assert type(res.model["drop"].p) is float


def test_max_steps_is_not_success_and_says_what_to_change():
    start = {"b1": jnp.asarray(1.0), "b2": jnp.asarray(1.0)}
    res = lsq(exponential, start, (BOXBOD_X, BOXBOD_Y), max_nfev=3)
    assert res.status == "max_steps" and not res.success
    assert "Raise `max_nfev` (it was 3)" in res.message
    assert res.raw is not None and not res.raw.success  # as SciPy says


#
# Uncertainty against the closed form of linear regression
#


def line(m, x, y):
    return m["a"] + m["b"] * x - y


@pytest.fixture(scope="module")
def line_data():
    rng = np.random.default_rng(0)
    x = jnp.asarray(np.linspace(0.0, 3.0, 20))
    return x, jnp.asarray(1.0 + 2.0 * x + 0.1 * rng.standard_normal(20))


def closed_form(x, y):
    design = np.stack([np.ones_like(x), x], 1)
    coef, rss, *_ = np.linalg.lstsq(design, y, rcond=None)
    s2 = rss[0] / (len(x) - 2)
    return coef, s2 * np.linalg.inv(design.T @ design), rss[0]


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), noise=st.floats(1e-3, 10.0))
def test_least_squares_covariance_is_the_closed_form(seed, noise):
    rng = np.random.default_rng(seed)
    x = np.sort(rng.uniform(-2.0, 5.0, 20))
    y = 1.0 - 3.0 * x + noise * rng.standard_normal(20)
    coef, cov, rss = closed_form(x, y)
    res = lsq(line, {"a": 0.0, "b": 0.0}, (jnp.asarray(x), jnp.asarray(y)))
    np.testing.assert_allclose(res.p, coef, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(res.covariance, cov, rtol=1e-6)
    assert float(res.stderr["b"]) == pytest.approx(np.sqrt(cov[1, 1]), rel=1e-6)
    corr = cov[0, 1] / np.sqrt(cov[0, 0] * cov[1, 1])
    assert res.correlation[0, 1] == pytest.approx(corr, rel=1e-6)
    assert res.chisqr == pytest.approx(rss, rel=1e-8) and res.n_data == 20
    assert res.redchi == pytest.approx(rss / 18, rel=1e-8)
    assert res.aic == pytest.approx(20 * np.log(rss / 20) + 4, rel=1e-8)


@pytest.mark.parametrize("scale", ["sse", "mse", "nll"])
def test_minimize_covariance_from_the_hessian(line_data, scale):
    x, y = line_data
    _, cov, rss = closed_form(np.asarray(x), np.asarray(y))
    sigma = 0.1
    losses = {
        "sse": lambda m, x, y: jnp.sum(line(m, x, y) ** 2),
        "mse": lambda m, x, y: jnp.mean(line(m, x, y) ** 2),
        "nll": lambda m, x, y: 0.5 * jnp.sum(line(m, x, y) ** 2) / sigma**2,
    }
    loss = losses[scale]
    res = mini(loss, {"a": 0.0, "b": 0.0}, (x, y), options=dict(gtol=1e-12))
    res = sciflat.hessian_uncertainty(res, loss, args=(x, y), scale=scale, n_data=20)
    design = np.stack([np.ones_like(x), x], 1)
    want = sigma**2 * np.linalg.inv(design.T @ design) if scale == "nll" else cov
    np.testing.assert_allclose(res.covariance, want, rtol=1e-5)
    if scale != "nll":
        assert res.chisqr == pytest.approx(rss, rel=1e-6)


def test_a_hessian_that_is_not_symmetric_is_said_so(line_data):
    # A derivative rule exact to first order only (`b` held constant in the
    # derivative in `a`): the Hessian's two mixed entries differ, and
    # `hessian_uncertainty` says so rather than use one of them silently.
    @jax.custom_jvp
    def sse(m, x, y):
        return jnp.sum(line(m, x, y) ** 2)

    @sse.defjvp
    def sse_jvp(primals, tangents):
        m, x, y = primals
        dm = tangents[0]
        r = line(m, x, y)
        held = line({"a": m["a"], "b": jax.lax.stop_gradient(m["b"])}, x, y)
        return sse(m, x, y), 2 * jnp.sum(held * dm["a"] + r * x * dm["b"])

    x, y = line_data
    exact = lambda m, x, y: jnp.sum(line(m, x, y) ** 2)
    res = mini(exact, {"a": 0.0, "b": 0.0}, (x, y), options=dict(gtol=1e-12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the exact Hessian: nothing said
        sciflat.hessian_uncertainty(res, exact, args=(x, y), scale="sse", n_data=20)
    with pytest.warns(UserWarning, match="Hessian is not symmetric"):
        sciflat.hessian_uncertainty(res, sse, args=(x, y), scale="sse", n_data=20)


@pytest.mark.parametrize("scale", ["sse", "mse"])
def test_hessian_uncertainty_of_a_least_squares_result_is_its_jacobian_one(
    line_data, scale
):
    # A `least_squares` result's `loss` is SciPy's cost, ½Σr²: read as Σr² it gave
    # standard errors √2 too small. The reference: the Jacobian covariance of the same
    # result (equal for a linear model, whose Hessian is exactly 2 JᵀJ).
    x, y = line_data
    res = lsq(line, {"a": 0.0, "b": 0.0}, (x, y))
    reduce = jnp.sum if scale == "sse" else jnp.mean
    loss = lambda m, x, y: reduce(line(m, x, y) ** 2)
    got = sciflat.hessian_uncertainty(res, loss, args=(x, y), scale=scale, n_data=20)
    np.testing.assert_allclose(got.covariance, res.covariance, rtol=1e-8)
    assert got.chisqr == pytest.approx(res.chisqr, rel=1e-10)


def test_covariance_of_an_optax_fit_from_the_hessian(line_data, x64_off):
    """`sciflat.fit` results carry `re` too: the covariance of a float32 Optax fit,
    computed in float64 (with 64-bit mode on), matches the closed form."""
    import optax

    x, y = line_data
    _, cov, rss = closed_form(np.asarray(x), np.asarray(y))
    sse = lambda m, x, y: jnp.sum((m["a"] + m["b"] * x - y) ** 2)
    start = {"a": jnp.float32(0.0), "b": jnp.float32(0.0)}
    data = (jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
    res = sciflat.fit(sse, start, optax.adam(0.05), steps=3000, args=data)
    assert res.p.dtype == jnp.float32 and res.re is not None
    with pytest.raises(TypeError, match="64-bit mode is off"):
        sciflat.hessian_uncertainty(res, sse, args=data, scale="sse", n_data=20)
    with jax.enable_x64(True):
        data64 = (jnp.asarray(x), jnp.asarray(y))
        res = sciflat.hessian_uncertainty(res, sse, args=data64, scale="sse", n_data=20)
    # Adam in float32 stops within float32's reach of the minimum: the loss (and so
    # s^2) to ~1e-4 relative, the Hessian (constant here) exactly.
    np.testing.assert_allclose(res.covariance, cov, rtol=1e-3)
    assert res.chisqr == pytest.approx(rss, rel=1e-3)


def test_unidentifiable_direction_is_named_and_the_rest_is_exact(line_data):
    x, y = line_data
    # Only a + c is determined: their standard errors are NaN, b's is the closed form.
    res = lsq(
        lambda m, x, y: m["a"] + m["c"] + m["b"] * x - y,
        {"a": 0.0, "b": 0.0, "c": 0.0},
        (x, y),
    )
    _, cov, _ = closed_form(np.asarray(x), np.asarray(y))
    assert np.isnan(res.stderr["a"]) and np.isnan(res.stderr["c"])
    assert float(res.stderr["b"]) == pytest.approx(np.sqrt(cov[1, 1]), rel=1e-6)
    (direction,) = res.uncertainty.unidentifiable
    assert "['a']" in direction and "['c']" in direction and "['b']" not in direction
    assert "not determined by the data: 1 a -1 c" in str(res)


def test_fewer_residuals_than_parameters_undetermined_are_nan_the_rest_exact():
    # 3 residuals, 4 parameters, only `a` in them: b, c, d are undetermined (NaN, and
    # named), a's error is the closed form, s² = Σr² / (m - rank) = Σr² / 2: the thin
    # SVD showed 3 of the 4 directions (d ± 0, a √2 too large).
    y = np.array([1.0, 2.0, 4.0])
    res = lsq(
        lambda m, y: m["a"] - y + 0.0 * (m["b"] + m["c"] + m["d"]),
        {"a": 0.0, "b": 1.0, "c": 2.0, "d": 3.0},
        (jnp.asarray(y),),
    )
    # The reference by hand: J = [1, 0, 0, 0] per residual, its pseudo-inverse.
    jac = np.tile([1.0, 0.0, 0.0, 0.0], (3, 1))
    rank = np.linalg.matrix_rank(jac)
    s2 = np.sum((y - y.mean()) ** 2) / (len(y) - rank)
    want = np.sqrt(s2 * np.linalg.pinv(jac.T @ jac)[0, 0])
    assert want == pytest.approx(np.sqrt(np.var(y, ddof=1) / 3))  # the closed form
    assert float(res.model["a"]) == pytest.approx(y.mean(), rel=1e-7)  # trf (m < n)
    assert float(res.stderr["a"]) == pytest.approx(want, rel=1e-8)
    for name in ("b", "c", "d"):
        assert np.isnan(res.stderr[name]), name
    assert len(res.uncertainty.unidentifiable) == 3
    assert res.redchi is None  # undefined, not Σr² / (3 - 4) < 0


def test_reduced_chi_square_is_undefined_without_more_residuals_than_parameters():
    # 5 parameters, 3 residuals: Σr² / (m - n) was -2.33, printed in the report.
    y = jnp.array([1.0, 2.0, 4.0])
    res = lsq(
        lambda m, y: jnp.stack([m["a"], m["a"] + m["b"], m["c"] * 0 + 3]) - y,
        {"a": 0.0, "b": 0.0, "c": 1.0, "d": 1.0, "e": 1.0},
        (y,),
    )
    assert res.chisqr == pytest.approx(2.0 * res.loss) and res.chisqr > 0
    assert res.redchi is None
    text = str(res)
    assert "reduced chi-square:  undefined (3 residuals, 5 parameters" in text
    assert "-2.33" not in text


@pytest.mark.parametrize("case", ["sqrt", "logistic"])
def test_a_fit_whose_standard_errors_cannot_be_computed_is_returned(case):
    # A non-finite Jacobian at the final point made NumPy's SVD raise ("SVD did not
    # converge"): the fit was lost. Now its outcome comes back, the standard errors
    # NaN and the report saying why. The reference: the cost at `p`, by NumPy.
    if case == "sqrt":  # d/da sqrt(a t) is 0/0 at t = 0
        t = np.linspace(0, 3, 10)
        y = np.sqrt(2 * t)
        f = lambda m, t, y: jnp.sqrt(m["a"] * t) - y
        model = {"a": 1.0}
    else:  # exp(-k (t - t0)) overflows far from t0: inf * 0 in the Jacobian
        t = np.linspace(0.0, 19.0, 20)
        y = 10 / (1 + np.exp(-0.8 * (t - 9.0)))
        f = lambda m, t, y: m["a"] / (1 + jnp.exp(-m["k"] * (t - m["t0"]))) - y
        model = {"a": 968.4, "k": 802.0, "t0": 18.55}
    res = lsq(f, model, (jnp.asarray(t), jnp.asarray(y)))
    r = np.asarray(f(res.model, t, y))
    assert np.isfinite(r).all()
    assert res.loss == pytest.approx(0.5 * np.sum(r**2), rel=1e-12)
    assert np.isnan(res.covariance).all()
    for name in model:
        assert np.isnan(res.stderr[name])
    assert "Jacobian at `p` is non-finite" in res.uncertainty.scale
    assert "so the standard errors cannot be computed" in str(res)


def test_a_non_finite_hessian_gives_undefined_standard_errors_not_an_error():
    # The Hessian route of the same defect: d²/da² sqrt(a t) is NaN at t = 0.
    t = np.linspace(0, 3, 10)
    sse = lambda m, t, y: jnp.sum((jnp.sqrt(m["a"] * t) - y) ** 2)
    res = mini(sse, {"a": 1.0}, (jnp.asarray(t), jnp.asarray(np.sqrt(2 * t))))
    got = sciflat.hessian_uncertainty(
        res, sse, args=(t, np.sqrt(2 * t)), scale="sse", n_data=10
    )
    assert np.isnan(got.stderr["a"]) and got.loss == res.loss
    assert "Hessian at `p` is non-finite" in str(got)


def test_tied_parameters_count_once_and_frozen_have_none(line_data):
    x, y = line_data
    slope = jnp.asarray(1.0)
    model = {"a": jnp.asarray(0.0), "b1": slope, "b2": slope, "k": jnp.asarray(0.5)}
    res = lsq(
        lambda m, x, y: m["a"] + m["b1"] * x + m["k"] * m["b2"] * x - y,
        model,
        (x, y),
        filter_spec={"a": True, "b1": True, "b2": True, "k": False},
    )
    # y = a + 1.5 b x: the closed form's slope error divided by 1.5.
    _, cov, _ = closed_form(np.asarray(x), np.asarray(y))
    assert len(res.p) == 2 and res.covariance.shape == (2, 2)
    assert float(res.stderr["b1"]) == pytest.approx(np.sqrt(cov[1, 1]) / 1.5, rel=1e-6)
    assert float(res.stderr["b2"]) == float(res.stderr["b1"])
    assert res.stderr["k"] is None


def test_report_reads_like_lmfit(line_data):
    x, y = line_data
    res = lsq(line, {"a": 0.0, "b": 0.0}, (x, y))
    text = str(res)
    assert text == res.report()
    for piece in (
        "[[Fit Statistics]]",
        "chi-square:",
        "reduced chi-square:",
        "Akaike info crit:",
        "Bayesian info crit:",
        "function evals:",
        "converged (success)",
        "[[Variables]]",
        "[[Correlations]]",
        "C(a, b)",
    ):
        assert piece in text, piece
    b = float(res.model["b"])
    assert f"b:  {b: .8g} +/- {float(res.stderr['b']):.4g}" in text
    # Correlations below the threshold are left out.
    assert "C(a, b)" not in res.report(min_correlation=1.0)


def test_result_without_uncertainty_says_how_to_get_it(line_data):
    x, y = line_data
    res = mini(
        lambda m, x, y: jnp.sum(line(m, x, y) ** 2), {"a": 0.0, "b": 0.0}, (x, y)
    )
    with pytest.raises(ValueError, match="hessian_uncertainty"):
        res.stderr  # noqa: B018
    assert "[[Variables]]" in str(res)


def test_plot_fit_draws_data_fit_and_residuals(line_data, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    x, y = line_data
    res = lsq(line, {"a": 0.0, "b": 0.0}, (x, y))
    fig = sciflat.plot_fit(res, lambda m, x: m["a"] + m["b"] * x, x, y)
    top, bottom = fig.axes
    assert len(top.lines) == 2  # data and fit
    np.testing.assert_allclose(
        bottom.lines[0].get_ydata(), np.asarray(line(res.model, x, y))
    )
    fig.savefig(tmp_path / "fit.png")
    assert (tmp_path / "fit.png").stat().st_size > 1000


def test_plot_fit_hands_predict_the_values_the_residuals_saw(line_data):
    # Issue 23, item 14: `predict` gets the unwrapped model, as the residuals did.
    import matplotlib

    matplotlib.use("Agg")
    x, y = line_data
    res = lsq(line, {"a": 0.0, "b": sciflat.Positive(1.0)}, (x, y))
    fig = sciflat.plot_fit(res, lambda m, x: m["a"] + m["b"] * x, x, y)
    # The reference: the same residuals on the unwrapped model, by hand.
    np.testing.assert_allclose(
        fig.axes[1].lines[0].get_ydata(),
        np.asarray(line(sciflat.unwrap(res.model), x, y)),
    )


def test_plot_fit_without_matplotlib_names_the_extra(line_data, monkeypatch):
    x, y = line_data
    res = lsq(line, {"a": 0.0, "b": 0.0}, (x, y))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"pip install 'sciflat\[plot\]'"):
        sciflat.plot_fit(res, lambda m, x: m["a"] + m["b"] * x, x, y)
