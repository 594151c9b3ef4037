"""`BDF`'s `explicit_first`: the solves of a value tried first by an explicit method
with a stiffness test (`sciflat._petab.explicit.StiffnessTested`), by BDF where it
stops; chosen per problem at its nominal parameters by default; the derivatives
BDF's either way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sciflat
from sciflat._petab.explicit import EXPLICIT_SHARE, StiffnessTested, explicit_budget


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
        "tsit5": read(StiffnessTested()),
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
    # The explicit solve's value, to the bit (so it finished), and the closed
    # form's within the tolerances; BDF's is another solve's.
    value = first.nll(model)
    assert value == problems["tsit5"].nll(model)
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
