"""`sciflat.profile`: profile-likelihood intervals against the Wald interval of a
linear model (where they are equal), a profile re-solved by SciPy and brentq in the
test, and the cases where lmfit's `conf_interval` has failed.
"""

import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
import scipy.stats

import sciflat


ROOT = pathlib.Path(__file__).resolve().parent.parent
X = np.linspace(0.0, 3.0, 25)
SIGMA = 0.05 + 0.04 * X
Y = 2.5 * np.exp(-1.3 * X) + 0.4 + SIGMA * np.random.default_rng(0).normal(size=25)
ARGS = (X, Y, SIGMA)
START = {"a": 0.0, "b": 0.0, "c": 0.0}


def quadratic(m, x):
    return m["a"] + m["b"] * x + m["c"] * x**2


def residuals(m, x, y, s):
    return (quadratic(m, x) - y) / s


def nll(m, x, y, s):  # Gaussian, σ known (up to a constant)
    return 0.5 * jnp.sum(residuals(m, x, y, s) ** 2)


def _wald(result, level, t_dof=None):
    q = (
        scipy.stats.norm.ppf(0.5 + level / 2)
        if t_dof is None
        else scipy.stats.t.ppf(0.5 + level / 2, t_dof)
    )
    return {
        k: (result.model[k] - q * s, result.model[k] + q * s)
        for k, s in result.stderr.items()
    }


def _assert_wald(prof, result, t_dof=None):
    for level in prof.levels:
        wald = _wald(result, level, t_dof)
        for name, it in prof.interval(level).items():
            lo, hi = wald[name]
            scale = float(result.stderr[name])
            assert not (it.lower_open or it.upper_open)
            assert abs(it.lower - lo) <= 1e-8 * scale, (name, level, it.lower, lo)
            assert abs(it.upper - hi) <= 1e-8 * scale, (name, level, it.upper, hi)


@pytest.fixture(scope="module")
def nll_fit():
    return sciflat.minimize(
        nll, START, args=ARGS, method="BFGS", options=dict(gtol=1e-12), progress=False
    )


@pytest.mark.slow  # 3.5 s: the Hessian and SciPy's refits compile
def test_profile_of_a_nll_is_the_wald_interval_of_a_linear_model(nll_fit):
    # A negative log-likelihood: 2 Δ(-log L) against χ²₁, so the normal quantile.
    # The result has no standard errors (lmfit needs every stderr): the profile does
    # not need them; the reference does.
    assert nll_fit.uncertainty is None
    prof = sciflat.profile(nll_fit, nll, args=ARGS)
    assert prof.method.startswith("SciPy")
    with_errors = sciflat.hessian_uncertainty(nll_fit, nll, args=ARGS)
    _assert_wald(prof, with_errors)
    curve = prof["b"]
    assert curve.statistic.min() == pytest.approx(0.0, abs=1e-9)
    assert np.all(np.diff(curve.values) > 0) and curve.points.shape[1] == 3
    assert "b" in str(prof) and "χ²₁" in str(prof)


@pytest.mark.slow  # 1.6 s: two objectives compile
def test_a_single_profiled_parameter_and_one_parameter_models(nll_fit):
    # lmfit #597: one parameter profiled; and a model of one parameter (no refit).
    one = sciflat.profile(nll_fit, nll, args=ARGS, which="c", levels=(0.9,))
    assert [p.name for p in one.profiles] == ["['c']"]
    mean = lambda m, y: 0.5 * jnp.sum((m["mu"] - y) ** 2)
    y = np.array([1.0, 2.0, 4.0])
    fit = sciflat.minimize(mean, {"mu": 0.0}, args=(y,), progress=False)
    it = sciflat.profile(fit, mean, args=(y,)).interval(0.95)["mu"]
    half = scipy.stats.norm.ppf(0.975) / np.sqrt(3)  # σ = 1 known
    np.testing.assert_allclose(
        [it.lower, it.upper], np.mean(y) + np.array([-1, 1]) * half
    )


@pytest.mark.slow  # 2.0 s (a loaded machine): the fit and the refits compile
def test_a_bound_inside_the_interval_is_an_open_side():
    # lmfit #308 (bounds): the fit sits inside, the bound cuts the 95 % interval.
    bounds = {lambda m: m["c"]: (0.52, 10.0)}
    start = {**START, "c": 1.0}
    fit = sciflat.least_squares(
        residuals, start, args=ARGS, bounds=bounds, progress=False
    )
    prof = sciflat.profile(fit, residuals, args=ARGS, which="c", bounds=bounds)
    it = prof["c"].interval(0.95)
    assert it.lower_open and not it.upper_open and it.lower == pytest.approx(0.52)
    assert "bound" in prof["c"].message and "c" in str(prof) and "*" in str(prof)


def test_bad_levels_and_names_are_errors(nll_fit):
    with pytest.raises(ValueError, match="`levels`"):
        sciflat.profile(nll_fit, nll, args=ARGS, levels=(95,))
    with pytest.raises(ValueError, match="`which`: no parameter named 'd'"):
        sciflat.profile(nll_fit, nll, args=ARGS, which="d")
    with pytest.raises(TypeError, match="`result`"):
        sciflat.profile("fit", nll, args=ARGS)
    with pytest.raises(ValueError, match="`batch=True` needs residuals"):
        sciflat.profile(nll_fit, nll, args=ARGS, batch=True)  # a scalar -log L


#
# The batch of refits (least squares): slow, each compiles a pool
#


@pytest.fixture(scope="module")
def ls_fit():
    return sciflat.least_squares(residuals, START, args=ARGS, progress=False)


@pytest.mark.slow  # compiles the batch's pool (about 5 s)
def test_profile_of_residuals_is_the_wald_interval_of_a_linear_model(ls_fit):
    # Scaled covariance: Δχ²/s² against F(1, m - n) = t², the Student-t Wald interval.
    prof = sciflat.profile(ls_fit, residuals, args=ARGS)
    assert prof.method.startswith("one least_squares_batch")
    _assert_wald(prof, ls_fit, t_dof=len(X) - 3)
    # Known errors: Δχ² against χ²₁, the normal quantile; the same compiled pool.
    known = ls_fit.with_known_errors()
    _assert_wald(sciflat.profile(known, residuals, args=ARGS), known)


def _nist():
    spec = importlib.util.spec_from_file_location("nist", ROOT / "benchmarks/nist.py")
    assert spec is not None and spec.loader is not None
    nist = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nist)
    return nist


@pytest.mark.slow  # compiles the batch's pool (about 5 s)
def test_nist_misra1a_against_brentq_on_a_profile_resolved_by_scipy():
    nist = _nist()
    problem = nist.read(ROOT / "tests/data/nist_strd/Misra1a.dat")
    x, y = np.asarray(problem.x), np.asarray(problem.y)
    start = problem.start(1)
    fit = sciflat.least_squares(problem.residuals, start, args=(x, y), progress=False)
    prof = sciflat.profile(fit, problem.residuals, args=(x, y), levels=(0.95,))

    # The reference: each side's root of the profile, every point re-solved by
    # MINPACK from the fit at tolerances 1e-15, in NumPy.
    def r(b):
        return b[0] * (1 - np.exp(-b[1] * x)) - y

    best = scipy.optimize.least_squares(
        r, list(start.values()), method="lm", xtol=1e-15
    )
    chi0, dof = 2 * best.cost, len(y) - 2
    threshold = scipy.stats.f.ppf(0.95, 1, dof) * chi0 / dof
    for j, name in enumerate(["b1", "b2"]):

        def excess(v, j=j):
            fixed = lambda rest: r(np.insert(rest, j, v))
            sol = scipy.optimize.least_squares(
                fixed, np.delete(best.x, j), method="lm", xtol=1e-15, ftol=1e-15
            )
            return 2 * sol.cost - chi0 - threshold

        it = prof[name].interval(0.95)
        se = float(fit.stderr[name])
        lo = scipy.optimize.brentq(excess, best.x[j] - 5 * se, best.x[j], xtol=1e-14)
        hi = scipy.optimize.brentq(excess, best.x[j], best.x[j] + 5 * se, xtol=1e-14)
        np.testing.assert_allclose([it.lower, it.upper], [lo, hi], rtol=1e-6)
        assert hi - best.x[j] != pytest.approx(best.x[j] - lo, rel=1e-3)  # asymmetric


@pytest.mark.slow  # compiles the batch's pool (about 5 s)
def test_through_a_transform_and_a_tie_and_an_open_side():
    # k through `Positive`, the amplitude an array used twice (a tie). The data only
    # bound k from below (the rise is over before the first x): the upper side is
    # open, flagged, and the lower side is the profile of the plain model's.
    x = np.linspace(0.1, 5.0, 20)
    y = 1 - np.exp(-50 * x) + 0.01 * np.random.default_rng(1).normal(size=20)
    amp = jnp.asarray([1.0])
    model = {"a": amp, "k": sciflat.Positive(5.0), "a2": amp}
    rise = lambda m, x, y: (
        0.5 * (m["a"][0] + m["a2"][0]) * (1 - jnp.exp(-m["k"] * x)) - y
    )
    fit = sciflat.least_squares(rise, model, args=(x, y), progress=False)
    assert len(fit.p) == 2
    prof = sciflat.profile(fit, rise, args=(x, y))
    k = prof["k"].interval(0.95)
    assert k.upper_open and not k.lower_open and k.upper > 1e3
    assert "open" in prof["k"].message
    a = prof["a[0]"].interval(0.95)
    assert not (a.lower_open or a.upper_open) and a.lower < a.value < a.upper
    # The lower end of k: where the profile of the plain model, re-solved for the
    # amplitude in closed form (it is linear), crosses the threshold.
    chi0 = float(2 * fit.loss)
    dof = len(x) - 2
    threshold = scipy.stats.f.ppf(0.95, 1, dof) * chi0 / dof

    def excess(k):
        g = 1 - np.exp(-k * x)
        best_a = g @ y / (g @ g)
        return np.sum((best_a * g - y) ** 2) - chi0 - threshold

    ref = scipy.optimize.brentq(excess, 1.0, k.value, xtol=1e-13)
    assert k.lower == pytest.approx(ref, rel=1e-6)


@pytest.mark.slow  # 1.8 s (a loaded machine): the SciPy refits' programs compile
def test_a_negative_parameter_and_its_asymmetric_interval_exactly():
    # lmfit #64, #91 (the root finder's signs): a negative rate, an asymmetric
    # profile. The reference: for a fixed rate the amplitude is linear, solved in
    # closed form, and brentq finds where 2 Δ(-log L) crosses χ²₁ (σ known).
    x = np.linspace(0.0, 2.0, 8)
    s = 0.05
    y = 2.0 * np.exp(-1.5 * x) + s * np.random.default_rng(3).normal(size=8)

    def nll(m, x, y):
        return 0.5 * jnp.sum(((m["a"] * jnp.exp(m["b"] * x) - y) / s) ** 2)

    fit = sciflat.minimize(nll, {"a": 1.0, "b": -1.0}, args=(x, y), progress=False)
    prof = sciflat.profile(fit, nll, args=(x, y), which="b", levels=(0.99,))
    it = prof["b"].interval(0.99)

    def chi2(b):
        g = np.exp(b * x)
        return np.sum(((g @ y / (g @ g)) * g - y) ** 2) / s**2

    best = scipy.optimize.minimize_scalar(chi2, bracket=(-2.0, -1.0), tol=1e-14).x
    excess = lambda b: chi2(b) - chi2(best) - scipy.stats.chi2.ppf(0.99, 1)
    lo = scipy.optimize.brentq(excess, best - 1.0, best, xtol=1e-14)
    hi = scipy.optimize.brentq(excess, best, best + 1.0, xtol=1e-14)
    assert lo < it.value < hi < 0
    np.testing.assert_allclose([it.lower, it.upper], [lo, hi], rtol=1e-7)
    assert hi - best != pytest.approx(best - lo, rel=1e-2)  # asymmetric


@pytest.mark.slow  # 2.2 s (a loaded machine): matplotlib, and the programs compile
def test_profiles_plot_and_static_args(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    x = np.linspace(0.0, 2.0, 8)
    y = 1.0 + 0.5 * x + 0.1 * np.random.default_rng(4).normal(size=8)

    def nll_line(m, x, y, power):  # `power`: a Python int, static in the programs
        return 0.5 * jnp.sum((m["a"] + m["b"] * x**power - y) ** 2 / 0.01)

    args = (x, y, 1)
    fit = sciflat.minimize(nll_line, {"a": 0.0, "b": 0.0}, args=args, progress=False)
    prof = sciflat.profile(fit, nll_line, args=args)
    fig = prof.plot()
    assert len(fig.axes) == 2
    line = fig.axes[0].lines[0]
    np.testing.assert_allclose(line.get_xdata(), prof["a"].values)
    np.testing.assert_allclose(line.get_ydata(), prof["a"].statistic)
    fig.savefig(tmp_path / "profiles.png")
