"""`BDF`'s `explicit_first`: the solves of a value tried first by an explicit method
with a stiffness test (`sciflat._petab.explicit.explicit_solve`), by BDF where it
stops; chosen per problem at its nominal parameters by default; the derivatives
BDF's either way. And the explicit solve itself, against closed forms and Diffrax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sciflat
from sciflat._petab.explicit import EXPLICIT_SHARE, explicit_budget, explicit_solve


pytest.importorskip("libsbml")  # the `petab` extra (in `test`): always there
from test_petab import SCALE, SD, SD_B, small_nll_of_p, small_problem


# The small problem of test_petab.py (A -> B at rate k / 2, C decaying at 2 k; closed
# forms there), its last measurement at t = 4: not stiff at its nominal k = 0.3, stiff
# at k = 1000 (C's rate 2,000 against an explicit step's stability, about 3 / h).
STIFF_LOG10_K = 3.0
TOLERANCES = dict(rtol=1e-11, atol=1e-13)


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    folder = tmp_path_factory.mktemp("petab")
    path = small_problem(folder / "small")
    read = lambda solver, at=path: sciflat.petab_problem(
        at, solver=solver, **TOLERANCES
    )
    # The same problem, its nominal k stiff.
    stiff = small_problem(
        folder / "stiff",
        parameters_table=[
            ("k", "log10", 1e-3, 1e3, 10**STIFF_LOG10_K, 1),
            ("scale", "lin", 0.1, 10, SCALE, 1),
            ("sd", "log", 1e-3, 10, SD, 1),
            ("sdB", "lin", 0, 1, SD_B, 0),
        ],
    )
    return {
        "auto": read(sciflat.BDF()),
        "first": read(sciflat.BDF(explicit_first=True)),
        "bdf": read(sciflat.BDF(explicit_first=False)),
        "auto, stiff": read(sciflat.BDF(), stiff),
    }


def _with_k(problem, log10_k):
    return dict(problem.nominal, k=jnp.asarray(log10_k, jnp.float64))


def _finished(problem, model):
    """Whether the explicit solve finishes each simulation, within the problem's
    budget of steps."""
    objective = problem._objective
    budget = objective._explicit_budget
    ok = objective._explicit_all(*objective.initial(objective.ext(model)), budget)[1]
    return np.asarray(ok)


@pytest.mark.slow  # compiles an explicit and a BDF solve: seconds
def test_a_model_that_is_not_stiff_is_solved_by_the_explicit_method(problems):
    first = problems["auto"]
    model = first.nominal
    # The explicit solve's value (with the budget given, to the bit: it finished
    # within both budgets), and the closed form's within the tolerances; BDF's is
    # another solve's.
    value = first.nll(model)
    assert _finished(first, model).all()
    assert value == problems["first"].nll(model)
    assert value != problems["bdf"].nll(model)
    p, _ = sciflat.destructure(model, dtype=jnp.float64)
    np.testing.assert_allclose(value, small_nll_of_p(p), rtol=1e-9)


@pytest.mark.slow  # compiles an explicit and a BDF solve: seconds
def test_by_default_the_budget_is_bdfs_attempts_on_its_longest_simulation(problems):
    # Chosen at the first solve, inside the trace of `nll` (above or here).
    auto = problems["auto"]
    auto.nll(auto.nominal)
    budget = auto._objective._explicit_budget
    objective = problems["bdf"]._objective
    constants, x0 = objective.initial(objective.ext(auto.nominal))
    attempts = [
        int(
            np.sum(
                objective._bdf_solve(
                    k, x, objective.tables.union_times, with_stats=True
                )[2][0, :2]
            )
        )
        for k, x in zip(constants[:, None], x0[:, None], strict=True)
    ]
    assert budget == max(attempts)
    assert problems["first"]._objective._explicit_budget == 10_000  # as given


@pytest.mark.slow  # compiles an explicit and a BDF solve: seconds
def test_where_the_model_is_stiff_the_stiffness_test_hands_over_to_bdf(problems):
    first = problems["first"]
    model = _with_k(first, STIFF_LOG10_K)
    assert not _finished(first, model).any()  # the test stopped both simulations
    assert first.nll(model) == problems["bdf"].nll(model)


@pytest.mark.slow  # compiles an explicit and a BDF solve: seconds
def test_by_default_a_model_stiff_at_its_nominal_parameters_is_bdfs(problems):
    stiff = problems["auto, stiff"]
    assert stiff.nll(stiff.nominal) == problems["bdf"].nll(stiff.nominal)
    assert stiff._objective._explicit_budget is None


def test_the_explicit_method_is_chosen_where_it_takes_at_most_half_the_attempts():
    most = 10_000
    assert explicit_budget(np.array([10, 20]), np.array([30, 45]), most) == 45
    share = EXPLICIT_SHARE * 75
    assert explicit_budget(np.array([share]), np.array([30, 45]), most) == 45
    assert explicit_budget(np.array([share + 1]), np.array([30, 45]), most) is None
    assert explicit_budget(np.array([10, 20]), np.array([30, 45]), 40) == 40


@pytest.mark.slow  # compiles the gradients of both solves: seconds
@pytest.mark.parametrize("which, controlled", [("auto", None), ("first", False)])
def test_the_derivatives_are_bdfs_whichever_method_solves_the_value(
    tmp_path, problems, which, controlled
):
    first, bdf = problems[which], problems["bdf"]
    if controlled is False:  # the derivatives along the steps: BDF's steps too
        path = small_problem(tmp_path / "small")
        read = lambda e: sciflat.petab_problem(
            path,
            solver=sciflat.BDF(explicit_first=e, control_sensitivities=False),
            **TOLERANCES,
        )
        first, bdf = read(True), read(False)
    p, re = sciflat.destructure(first.nominal, dtype=jnp.float64)
    grad = jax.jit(jax.value_and_grad(lambda x: first.nll(re(x))))
    bdf_grad = jax.jit(jax.value_and_grad(lambda x: bdf.nll(re(x))))
    for x in (p, p.at[0].set(STIFF_LOG10_K)):
        value, g = grad(x)
        bdf_value, bdf_g = bdf_grad(x)
        assert value == bdf_value
        np.testing.assert_array_equal(g, bdf_g)
        reference = jax.grad(small_nll_of_p)(x)
        np.testing.assert_allclose(g, reference, rtol=1e-7, atol=1e-9)


@pytest.mark.slow  # one compiled llh (the problem's), run at each k drawn
@settings(max_examples=12, deadline=None)
@given(log10_k=st.floats(-2.0, 3.0))
def test_the_llh_is_the_closed_form_whichever_method_solves(problems, log10_k):
    auto = problems["auto"]
    p, re = sciflat.destructure(auto.nominal, dtype=jnp.float64)
    x = p.at[0].set(log10_k)
    np.testing.assert_allclose(auto.nll(re(x)), small_nll_of_p(x), rtol=1e-8)


@pytest.mark.slow  # traces the solves: seconds
def test_explicit_first_computes_in_float64_throughout(problems):
    first = problems["auto"]
    for fn in (first.nll, jax.jacfwd(first.nll)):
        report = sciflat.audit_dtypes(fn, first.nominal, grad=False)
        assert not report.findings, str(report)


@pytest.mark.parametrize(
    "options, error",
    [
        (dict(explicit_first=1), TypeError),
        (dict(explicit_first="yes"), TypeError),
        (dict(explicit_max_steps=0), ValueError),
        (dict(explicit_max_steps=2.5), ValueError),
        (dict(explicit_max_steps=True), ValueError),
    ],
)
def test_explicit_first_options_are_checked(options, error):
    with pytest.raises(error, match="explicit"):
        sciflat.BDF(**options)


@pytest.mark.slow  # compiles the vmapped solves: seconds
def test_under_vmap_the_values_are_bdfs(problems):
    # A batch of parameter sets (a vmapped multi-start) would turn the hand-over's
    # condition into a select, both methods run for every member: BDF alone there.
    auto, bdf = problems["auto"], problems["bdf"]
    p, re = sciflat.destructure(auto.nominal, dtype=jnp.float64)
    ps = jnp.stack([p, p.at[0].set(-0.3), p.at[0].set(STIFF_LOG10_K)])
    batched = jax.jit(jax.vmap(lambda x: auto.nll(re(x))))(ps)
    np.testing.assert_array_equal(batched, jax.vmap(lambda x: bdf.nll(re(x)))(ps))
    np.testing.assert_allclose(batched, jax.vmap(small_nll_of_p)(ps), rtol=1e-8)
    # One at a time, the explicit solve's where it finishes.
    assert auto.nll(re(ps[0])) != batched[0]


#
# The explicit solve itself.
#

# Two species decaying at rates k[0] and k[1]: y(t) = y0 exp(-k t).
_decay = lambda t, y, k: -k * y
_TIMES = np.array([0.0, 0.0, 0.5, 1.0, 2.5, 4.0])


def _solve(k, y0=(1.0, 2.0), dtype=jnp.float64, **options):
    """`explicit_solve` of the decay at `_TIMES`, jitted, tight by default."""
    options = dict(rtol=1e-10, atol=1e-12, most=10_000) | options
    solve = lambda k, y0: explicit_solve(_decay, k, y0, _TIMES, **options)
    return jax.jit(solve)(jnp.asarray(k, dtype), jnp.asarray(y0, dtype))


@settings(max_examples=15, deadline=None)
@given(
    log10_k=st.lists(st.floats(-2.0, 0.5), min_size=2, max_size=2),
    rtol=st.sampled_from([1e-6, 1e-8, 1e-10]),
)
def test_the_explicit_solve_is_the_closed_form_within_its_tolerance(log10_k, rtol):
    k = 10.0 ** np.asarray(log10_k)
    ys, ok, steps = _solve(k, rtol=rtol, atol=rtol * 1e-2)
    assert ok and 0 < steps < 10_000
    exact = np.array([1.0, 2.0]) * np.exp(-np.outer(_TIMES, k))
    # Each step's error is kept to the tolerance; the global error a few times it.
    np.testing.assert_allclose(ys, exact, rtol=30 * rtol, atol=rtol * 1e-2)
    # The times 0 are the initial state, exactly.
    np.testing.assert_array_equal(ys[:2], exact[:2])


def test_the_explicit_solve_agrees_with_diffrax_on_a_nonlinear_model():
    import diffrax

    # Lotka-Volterra: no closed form; Diffrax's Tsit5 at a much tighter tolerance.
    def lotka(t, y, k):
        return jnp.stack(
            [k[0] * y[0] - k[1] * y[0] * y[1], k[1] * y[0] * y[1] - k[2] * y[1]]
        )

    k, y0, ts = jnp.array([1.1, 0.4, 0.9]), jnp.array([2.0, 1.5]), np.linspace(0, 12, 7)
    ys, ok, _ = explicit_solve(lotka, k, y0, ts, 1e-9, 1e-11, 10_000)
    reference = diffrax.diffeqsolve(
        diffrax.ODETerm(lotka),
        diffrax.Tsit5(),
        0.0,
        12.0,
        None,
        y0,
        args=k,
        saveat=diffrax.SaveAt(ts=jnp.asarray(ts)),
        stepsize_controller=diffrax.PIDController(rtol=1e-13, atol=1e-15),
        max_steps=100_000,
    ).ys
    assert ok
    np.testing.assert_allclose(ys, reference, rtol=1e-7)


def test_the_explicit_solve_stops_where_the_problem_is_stiff():
    # A rate of 1e4 over t in [0, 4]: stable explicit steps are below 3.3e-4, the
    # tolerance's steps far longer once the fast mode has decayed.
    k = [1e4, 1.0]
    ys, ok, steps = _solve(k, rtol=1e-6, atol=1e-8)
    assert not ok and steps < 200  # stopped by the test, early
    # Without the test it finishes, in many steps, the closed form's.
    ys, ok, many = _solve(k, rtol=1e-6, atol=1e-8, limit=10**9, most=100_000)
    assert ok and many > 10 * steps
    np.testing.assert_allclose(ys[:, 1], 2.0 * np.exp(-_TIMES), rtol=1e-4)


def test_the_explicit_solve_stops_at_its_budget_and_after_rejections():
    _, ok, steps = _solve([0.3, 1.0], most=5)
    assert not ok and steps == 5
    # NaN rates (a parameter outside the model's domain): every step rejected, and
    # 30 in a row end the solve; the times 0 are still the initial state.
    nan_rates = lambda t, y, k: -k * y * jnp.nan
    ys, ok, steps = explicit_solve(
        nan_rates,
        jnp.array([0.3, 1.0]),
        jnp.array([1.0, 2.0]),
        _TIMES,
        1e-8,
        1e-10,
        10_000,
    )
    assert not ok and steps == 30
    np.testing.assert_array_equal(ys[:2], [[1.0, 2.0], [1.0, 2.0]])


def test_the_explicit_solve_stops_at_need_and_leaves_zeros_after():
    ys, ok, steps = _solve([0.3, 1.0], need=3)
    _, _, all_steps = _solve([0.3, 1.0])
    assert ok and steps < all_steps
    np.testing.assert_array_equal(ys[3:], 0.0)
    np.testing.assert_allclose(ys[2], [np.exp(-0.15), 2 * np.exp(-0.5)], rtol=1e-9)


def test_the_explicit_solve_computes_in_the_states_dtype():
    ys, ok, _ = _solve([0.3, 1.0], rtol=1e-5, atol=1e-7, dtype=jnp.float32)
    assert ok and ys.dtype == jnp.float32
    # Every floating operation in float32 (the auditor of sciflat's dtype rule).
    solve = lambda y, k: explicit_solve(_decay, k, y, _TIMES, 1e-5, 1e-7, 100)[0]
    y, k = jnp.ones(2, jnp.float32), jnp.ones(2, jnp.float32)
    report = sciflat.audit_dtypes(solve, y, k, grad=False)
    assert not report.findings, str(report)
