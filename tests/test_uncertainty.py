"""Known measurement errors (`with_known_errors`) and confidence and prediction bands
(`sciflat.band`), each against SciPy, a closed form or finite differences in the test.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
import scipy.special
import scipy.stats

import sciflat


# An exponential decay with known, unequal standard deviations.
X = np.linspace(0.0, 3.0, 25)
SIGMA = 0.05 + 0.04 * X
NOISE = np.random.default_rng(0).normal(size=X.size)
Y = 2.5 * np.exp(-1.3 * X) + 0.4 + SIGMA * NOISE


def decay(m, x):
    return m["a"] * jnp.exp(-m["k"] * x) + m["c"]


def weighted(m, x, y, sigma):
    return (decay(m, x) - y) / sigma


def _curve_fit(absolute_sigma, p0=(2.0, 1.0, 0.0)):
    f = lambda x, a, k, c: a * np.exp(-k * x) + c
    # The exact Jacobian: curve_fit's default finite differences give 8 digits.
    e = lambda x, a, k: np.exp(-k * x)
    jac = lambda x, a, k, c: np.stack([e(x, a, k), -a * x * e(x, a, k), 1 + 0 * x], 1)
    tight = dict(ftol=1e-15, xtol=1e-15, gtol=1e-15)
    return scipy.optimize.curve_fit(
        f, X, Y, p0=p0, sigma=SIGMA, absolute_sigma=absolute_sigma, jac=jac, **tight
    )


@pytest.fixture(scope="module")
def fitted():
    model = {"a": 2.0, "k": 1.0, "c": 0.0}
    return sciflat.least_squares(
        weighted, model, args=(X, Y, SIGMA), progress=False, method="lm"
    )


def test_known_errors_equal_curve_fits_absolute_sigma(fitted):
    # p order is the dict's sorted keys: a, c, k.
    order = [0, 2, 1]
    p = np.asarray(fitted.p)[order]
    popt, pcov_abs = _curve_fit(True, p0=tuple(p))
    _, pcov_rel = _curve_fit(False, p0=tuple(p))
    np.testing.assert_allclose(popt, p, rtol=1e-12)
    known = fitted.with_known_errors()
    cov = known.covariance[np.ix_(order, order)]
    np.testing.assert_allclose(cov, pcov_abs, rtol=1e-10, atol=0)
    # The default is unchanged: curve_fit's absolute_sigma=False.
    np.testing.assert_allclose(
        fitted.covariance[np.ix_(order, order)], pcov_rel, rtol=1e-10
    )
    np.testing.assert_allclose(known.stderr["k"], np.sqrt(pcov_abs[1, 1]), rtol=1e-10)
    np.testing.assert_allclose(known.correlation, fitted.correlation, rtol=1e-10)
    assert known.uncertainty is not None and known.uncertainty.residual_variance is None
    assert "known standard deviations" in known.report()
    assert "known standard deviations" not in fitted.report()
    with pytest.raises(ValueError, match="nothing to unscale"):
        known.with_known_errors()


@pytest.mark.slow  # 5.5 s: compiles the device fit and the batch's pool
def test_known_errors_through_a_transform_the_device_and_a_batch(fitted):
    # Through `Positive` the covariance is the constrained values' (delta method):
    # the same numbers as the plain fit.
    model = {"a": 2.0, "k": sciflat.Positive(1.0), "c": 0.0}
    kw = dict(args=(X, Y, SIGMA), progress=False)
    pos = sciflat.least_squares(weighted, model, method="device", **kw)
    known = fitted.with_known_errors()
    np.testing.assert_allclose(
        pos.with_known_errors().covariance, known.covariance, rtol=1e-7
    )
    assert pos.with_known_errors().uncertainty.scale.endswith("delta method")
    plain = {"a": 2.0, "k": 1.0, "c": 0.0}
    batch = sciflat.least_squares_batch(weighted, plain, **kw).with_known_errors()
    np.testing.assert_allclose(batch.covariance[0], known.covariance, rtol=1e-7)
    np.testing.assert_allclose(batch.stderr["k"][0], known.stderr["k"], rtol=1e-7)
    np.testing.assert_allclose(batch[0].covariance, known.covariance, rtol=1e-7)
    assert "known standard deviations" in batch[0].report()


def test_hessian_uncertainty_of_a_chi2_is_unscaled():
    # A straight line: the Hessian of χ² is exactly 2 JᵀJ, so cov = 2 H⁻¹ = (JᵀJ)⁻¹.
    line = lambda m, x, y, s: (m["a"] * x + m["c"] - y) / s
    chi2 = lambda m, x, y, s: jnp.sum(line(m, x, y, s) ** 2)
    args = (X, Y, SIGMA)
    res = sciflat.minimize(chi2, {"a": 0.0, "c": 0.0}, args=args, progress=False)
    res = sciflat.hessian_uncertainty(res, chi2, args=args, scale="chi2")
    _, pcov = scipy.optimize.curve_fit(
        lambda x, a, c: a * x + c,
        X,
        Y,
        sigma=SIGMA,
        absolute_sigma=True,
        jac=lambda x, a, c: np.stack([x, np.ones_like(x)], 1),
    )
    np.testing.assert_allclose(res.covariance, pcov, rtol=1e-10)
    assert res.uncertainty is not None and res.uncertainty.residual_variance is None
    assert "known standard deviations" in res.report()


#
# Bands
#

XS = np.linspace(-0.5, 4.0, 7)  # new x, some outside the data


def quadratic(m, x):
    return m["a"] + m["b"] * x + m["c"] * x**2


@pytest.fixture(scope="module")
def linear_fit():
    res = lambda m, x, y, s: (quadratic(m, x) - y) / s
    model = {"a": 0.0, "b": 0.0, "c": 0.0}
    return sciflat.least_squares(res, model, args=(X, Y, SIGMA), progress=False)


def _closed_form(new_x):
    """The weighted linear least-squares band: x_new (XᵀWX)⁻¹ x_newᵀ (s² for the
    scaled covariance), and s²."""
    design = np.stack([np.ones_like(X), X, X**2], 1) / SIGMA[:, None]
    beta, *_ = np.linalg.lstsq(design, Y / SIGMA, rcond=None)
    s2 = np.sum((design @ beta - Y / SIGMA) ** 2) / (X.size - 3)
    new = np.stack([np.ones_like(new_x), new_x, new_x**2], 1)
    inner = np.einsum("ij,jk,ik->i", new, np.linalg.inv(design.T @ design), new)
    return new @ beta, inner, s2


def test_band_of_a_linear_model_is_the_closed_form(linear_fit):
    value, inner, s2 = _closed_form(XS)
    dof = X.size - 3
    b = sciflat.band(linear_fit, lambda m: quadratic(m, XS), level=0.9)
    q = scipy.stats.t.ppf(0.95, dof)
    np.testing.assert_allclose(b.value, value, rtol=1e-10)
    np.testing.assert_allclose(b.stderr, np.sqrt(s2 * inner), rtol=1e-10)
    np.testing.assert_allclose(b.upper - b.value, q * np.sqrt(s2 * inner), rtol=1e-10)
    assert b.dof == dof and b.quantile == pytest.approx(q, rel=1e-14)
    # The prediction band adds s² (unweighted sense) or the given noise².
    p = sciflat.band(linear_fit, lambda m: quadratic(m, XS), prediction=True)
    q95 = scipy.stats.t.ppf(0.975, dof)
    np.testing.assert_allclose(p.stderr, np.sqrt(s2 * inner + s2), rtol=1e-10)
    np.testing.assert_allclose(p.lower, value - q95 * p.stderr, rtol=1e-10)
    # Known errors: (XᵀWX)⁻¹ unscaled, normal quantiles.
    known = linear_fit.with_known_errors()
    k = sciflat.band(known, lambda m: quadratic(m, XS), level=0.9)
    np.testing.assert_allclose(k.stderr, np.sqrt(inner), rtol=1e-10)
    assert k.dof is None and k.quantile == pytest.approx(scipy.stats.norm.ppf(0.95))
    with pytest.raises(ValueError, match="`noise`"):
        sciflat.band(known, lambda m: quadratic(m, XS), prediction=True)
    noise = 0.1 + 0.0 * XS
    kp = sciflat.band(known, lambda m: quadratic(m, XS), prediction=True, noise=noise)
    np.testing.assert_allclose(kp.stderr, np.sqrt(inner + noise**2), rtol=1e-10)


def test_band_through_a_transform_and_a_tie(linear_fit):
    # `c` through `Positive`, and `a` as one array used twice (a tie): the same
    # band as the plain model's, from the same data.
    shared = jnp.asarray([0.1])
    model = {"a": shared, "b": 0.0, "c": sciflat.Positive(0.5), "a2": shared}
    value, inner, s2 = _closed_form(XS)

    def curve(m, x):
        return 0.5 * (m["a"][0] + m["a2"][0]) + m["b"] * x + m["c"] * x**2

    res = lambda m, x, y, s: (curve(m, x) - y) / s
    fit = sciflat.least_squares(res, model, args=(X, Y, SIGMA), progress=False)
    assert len(fit.p) == 3
    b = sciflat.band(fit, lambda m: curve(m, XS))
    np.testing.assert_allclose(b.value, value, rtol=1e-9)
    np.testing.assert_allclose(b.stderr, np.sqrt(s2 * inner), rtol=1e-7)


def test_band_of_a_nonlinear_model_against_finite_differences(fitted):
    # The reference: central differences of f in NumPy (float64), step 1e-6.
    b = sciflat.band(fitted, lambda m: decay(m, XS), level=0.95)
    p = np.asarray(fitted.p)  # a, c, k

    def f(q):
        return q[0] * np.exp(-q[2] * XS) + q[1]

    h = 1e-6 * np.maximum(np.abs(p), 1.0)
    jac = np.stack(
        [
            (f(p + h[i] * np.eye(3)[i]) - f(p - h[i] * np.eye(3)[i])) / (2 * h[i])
            for i in range(3)
        ],
        1,
    )
    var = np.einsum("ij,jk,ik->i", jac, fitted.covariance, jac)
    np.testing.assert_allclose(b.stderr, np.sqrt(var), rtol=1e-7)
    np.testing.assert_allclose(b.value, f(p), rtol=1e-12)


def test_band_equals_lmfits_eval_uncertainty(fitted):
    lmfit = pytest.importorskip("lmfit")
    model = lmfit.Model(lambda x, a, k, c: a * np.exp(-k * x) + c)
    params = model.make_params(a=2.0, k=1.0, c=0.0)
    out = model.fit(Y, params, x=X, weights=1 / SIGMA)
    theirs = out.eval_uncertainty(x=XS, sigma=1)
    level = float(scipy.special.erf(1 / np.sqrt(2)))
    ours = sciflat.band(fitted, lambda m: decay(m, XS), level=level)
    # lmfit differentiates at ±0.01 stderr: about 5 digits.
    np.testing.assert_allclose(ours.upper - ours.value, theirs, rtol=1e-4)
    theirs_p = out.dely_predicted
    ours_p = sciflat.band(fitted, lambda m: decay(m, XS), level=level, prediction=True)
    np.testing.assert_allclose(ours_p.upper - ours_p.value, theirs_p, rtol=1e-4)


def test_plot_fit_shades_the_bands(linear_fit, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    predict = lambda m, x: quadratic(m, x)
    fig = sciflat.plot_fit(linear_fit, predict, X, Y, level=0.9, prediction=True)
    top = fig.axes[0]
    conf, pred = top.collections  # the two bands, in that order
    b = sciflat.band(linear_fit, lambda m: quadratic(m, np.sort(X)), level=0.9)
    edges = conf.get_paths()[0].vertices[:, 1]
    assert np.isclose(edges[:, None], b.upper[None]).any(0).all()  # the upper edge
    assert np.isclose(edges[:, None], b.lower[None]).any(0).all()
    assert len(pred.get_paths()[0].vertices) > 0
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert "90% confidence band" in labels and "90% prediction band" in labels
    fig.savefig(tmp_path / "band.png")
