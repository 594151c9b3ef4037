"""`PetabProblem.hierarchical`: the noise parameters in closed form, each against a
tight numerical minimisation of the whole problem's −log L over them alone, the
profiled −log L against the whole one, its derivatives against finite differences."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

import sciflat


pytest.importorskip("libsbml")  # the `petab` extra (in `test`): always there
from test_petab import SMALL_MEASUREMENTS, small_problem


# The small problem of test_petab.py (A -> B, C decaying; closed forms there), with
# every observable's σ a parameter: `sd` (obsA, normal, log scale), `sdB` (obsB,
# normal on the log10 scale of the data, log10 scale), `sdC` (obsC, Laplace, linear
# scale); `sdD` is obsD's σ plus 0.1, and `scale` is obsA's observable parameter: those
# stay outer, with `k` (the model's rate).
TABLE = [
    ("k", "log10", 1e-3, 1e3, 0.3, 1),
    ("scale", "lin", 0.1, 10, 1.7, 1),
    ("sd", "log", 1e-3, 10, 0.2, 1),
    ("sdB", "log10", 1e-3, 10, 0.15, 1),
    ("sdC", "lin", 0, 10, 0.1, 1),
    ("sdD", "lin", 0, 10, 0.1, 1),
]
OBSERVABLES = [
    ("obsA", "observableParameter1_obsA * A", "noiseParameter1_obsA", "lin", "normal"),
    ("obsC", "C", "noiseParameter1_obsC", "lin", "laplace"),
    ("obsB", "B", "noiseParameter1_obsB", "log10", "normal"),
    ("obsD", "A + B", "noiseParameter1_obsD + 0.1", "lin", "normal"),
]
NOISE = {"obsA": "sd", "obsB": "sdB", "obsC": "sdC", "obsD": "sdD"}
OBS_D = [("obsD", "low", 3.1, 1.0, "", ""), ("obsD", "high", 5.8, 2.0, "", "")]
MEASUREMENTS = [
    (o, c, y, t, op, NOISE[o]) for o, c, y, t, op, _ in [*SMALL_MEASUREMENTS, *OBS_D]
]
CLOSED = ("sd", "sdB", "sdC")
# The problem is not stiff: an explicit method, whose programs compile in a fraction
# of the default implicit one's time (the closed forms do not depend on the solver).
EXPLICIT = diffrax.Tsit5()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("petab") / "mixed"
    path = small_problem(
        folder, MEASUREMENTS, parameters_table=TABLE, observables=OBSERVABLES
    )
    problem = sciflat.petab_problem(path, rtol=1e-10, atol=1e-12, solver=EXPLICIT)
    return problem, problem.hierarchical()


@pytest.fixture(scope="module")
def normal(tmp_path_factory):
    """Normal noise only (no obsC): the problem has residuals."""
    folder = tmp_path_factory.mktemp("petab") / "normal"
    rows = [m for m in MEASUREMENTS if m[0] != "obsC"]
    table = [t for t in TABLE if t[0] != "sdC"]
    observables = [o for o in OBSERVABLES if o[0] != "obsC"]
    path = small_problem(folder, rows, parameters_table=table, observables=observables)
    problem = sciflat.petab_problem(path, rtol=1e-10, atol=1e-12, solver=EXPLICIT)
    return problem, problem.hierarchical()


def floor(problem, k):
    lower = problem.bounds[0][k]
    return max(lower, 1e-9) if problem.scales[k] == "lin" else lower


def minimise_over_sigma(problem, dynamic, names):
    """The whole problem's −log L minimised over the noise parameters `names` alone,
    the others at `dynamic`, within the bounds (L-BFGS-B, tight, from the table's
    nominal values)."""
    upper = problem.bounds[1]
    fixed = {k: v for k, v in dynamic.items() if k not in names}

    def f(x):
        model = {**fixed, **{k: jnp.asarray(v) for k, v in zip(names, x, strict=True)}}
        return problem.nll(model)

    value_and_grad = jax.value_and_grad(f)
    x0 = np.array([float(problem.nominal[k]) for k in names])
    out = optimize.minimize(
        lambda x: tuple(map(np.asarray, value_and_grad(jnp.asarray(x)))),
        x0,
        jac=True,
        method="L-BFGS-B",
        # σ = 0 (a linear scale's lower bound) is -log L = nan: kept off it.
        bounds=[(floor(problem, k), upper[k]) for k in names],
        options=dict(ftol=1e-15, gtol=1e-12, maxiter=1000),
    )
    return dict(zip(names, out.x, strict=True)), out.fun


def test_which_noise_parameters_are_in_closed_form_and_why_not(mixed):
    problem, hier = mixed
    assert hier.profiled == CLOSED
    assert hier.parameter_ids == ("k", "scale", "sdD")
    assert set(hier.nominal) == set(hier.bounds[0]) == {"k", "scale", "sdD"}
    assert "enters the model" in hier.refused["k"]
    assert "observable parameter" in hier.refused["scale"]
    assert "not σ alone" in hier.refused["sdD"]
    assert "closed_form=['sd', 'sdB', 'sdC']" in repr(hier)
    with pytest.raises(ValueError, match="'sdD' cannot be computed in closed form"):
        problem.hierarchical(noise=["sdD"])
    with pytest.raises(TypeError, match="sequence of parameter ids"):
        problem.hierarchical(noise="sd")
    # A subset: the others stay outer.
    assert problem.hierarchical(noise=["sdB"]).parameter_ids == (
        "k",
        "scale",
        "sd",
        "sdC",
        "sdD",
    )
    with pytest.raises(ValueError, match="dict of its outer parameters"):
        hier.nll(problem.nominal)


@pytest.mark.slow  # compiles the solves and the whole problem's gradient: seconds
@pytest.mark.parametrize("where", ["nominal", "away"])
def test_closed_form_sigma_is_the_minimum_of_the_whole_nll(mixed, where):
    problem, hier = mixed
    dynamic = dict(problem.nominal)
    if where == "away":  # obsA's residuals far larger: sd's σ̂ is clipped at 10
        dynamic = {**dynamic, "k": jnp.asarray(1.2), "scale": jnp.asarray(10.0)}
    outer = hier.outer(dynamic)
    full = hier.full(outer)
    want, fun = minimise_over_sigma(problem, dynamic, CLOSED)
    for k in CLOSED:
        np.testing.assert_allclose(float(full[k]), want[k], rtol=1e-6, atol=1e-7)
    if where == "away":
        assert float(full["sd"]) == problem.bounds[1]["sd"]
    # The profiled −log L is the whole one at the closed form, and the minimum.
    np.testing.assert_allclose(float(hier.nll(outer)), float(problem.nll(full)))
    np.testing.assert_allclose(float(hier.nll(outer)), fun, rtol=1e-12)
    np.testing.assert_allclose(float(hier.llh(outer)), -float(problem.nll(full)))


@pytest.mark.slow  # compiles the gradients through the solves: seconds
def test_profiled_gradient_matches_finite_differences_in_both_modes(mixed):
    _, hier = mixed
    p, re = sciflat.destructure(hier.nominal, dtype=jnp.float64)
    f = lambda x: hier.nll(re(x))
    reverse = jax.grad(f)(p)
    forward = jax.jacfwd(f)(p)
    h = 1e-6
    fd = [(f(p.at[i].add(h)) - f(p.at[i].add(-h))) / (2 * h) for i in range(len(p))]
    np.testing.assert_allclose(forward, reverse, rtol=1e-10)
    np.testing.assert_allclose(reverse, np.array(fd), rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # compiles the residuals and their Jacobian: seconds
def test_profiled_residuals_square_to_the_nll_and_give_its_gradient(normal):
    problem, hier = normal
    assert hier.profiled == ("sd", "sdB")
    p, re = sciflat.destructure(hier.nominal, dtype=jnp.float64)
    r = hier.residuals(re(p))
    np.testing.assert_allclose(
        0.5 * float(jnp.sum(r**2)) + problem.residual_offset,
        float(hier.nll(re(p))),
        rtol=1e-12,
    )
    # Jᵀr is the profile's gradient (the closed-form σ held fixed in J: at σ̂ the
    # derivative in σ is zero), here against central differences of the profile.
    jac = jax.jacfwd(lambda x: hier.residuals(re(x)))(p)
    f = lambda x: hier.nll(re(x))
    h = 1e-6
    fd = [(f(p.at[i].add(h)) - f(p.at[i].add(-h))) / (2 * h) for i in range(len(p))]
    np.testing.assert_allclose(jac.T @ r, np.array(fd), rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # two fits through the solves: seconds
def test_a_hierarchical_fit_reaches_the_whole_problems_optimum(normal):
    problem, hier = normal
    kwargs = dict(method="trf", progress=False)
    outer = sciflat.least_squares(
        hier.residuals, hier.nominal, bounds=hier.bounds, **kwargs
    )
    whole = sciflat.least_squares(
        problem.residuals, problem.nominal, bounds=problem.bounds, **kwargs
    )
    full = hier.full(outer.model)
    np.testing.assert_allclose(
        float(problem.nll(full)), float(problem.nll(whole.model)), rtol=1e-9
    )
    for k in problem.parameter_ids:
        np.testing.assert_allclose(
            float(full[k]), float(whole.model[k]), rtol=1e-4, atol=1e-5
        )
    # The same starts as the whole problem's, without the closed-form parameters.
    starts = hier.sample_starts(3, seed=1)
    whole_starts = problem.sample_starts(3, seed=1)
    assert [{k: float(v) for k, v in s.items()} for s in starts] == [
        {k: float(s[k]) for k in hier.parameter_ids} for s in whole_starts
    ]
