"""`BDF(explicit_first=True)`: the simulations tried first by an explicit method with a
stiffness test (`sciflat._petab.explicit.StiffnessTested`), by BDF where it stops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sciflat
from sciflat._petab.explicit import StiffnessTested


pytest.importorskip("libsbml")  # the `petab` extra (in `test`): always there
from test_petab import small_nll_of_p, small_problem


# The small problem of test_petab.py (A -> B at rate k / 2, C decaying at 2 k; closed
# forms there), its last measurement at t = 4: not stiff at its nominal k = 0.3, stiff
# at k = 1000 (C's rate 2,000 against an explicit step's stability, about 3 / h).
STIFF_LOG10_K = 3.0
TOLERANCES = dict(rtol=1e-11, atol=1e-13)


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    path = small_problem(tmp_path_factory.mktemp("petab") / "small")
    read = lambda solver, **kw: sciflat.petab_problem(path, solver=solver, **kw)
    return {
        "first": read(sciflat.BDF(explicit_first=True), **TOLERANCES),
        "bdf": read(sciflat.BDF(), **TOLERANCES),
        "tsit5": read(StiffnessTested(), **TOLERANCES),
        "budget": read(
            sciflat.BDF(explicit_first=True, explicit_max_steps=5), **TOLERANCES
        ),
    }


def _with_k(problem, log10_k):
    return dict(problem.nominal, k=jnp.asarray(log10_k, jnp.float64))


def _finished(problem, model):
    objective = problem._objective
    _, ok = objective._explicit_all(*objective.initial(objective.ext(model)))
    return np.asarray(ok)


@pytest.mark.slow  # compiles an explicit and a BDF solve: seconds
def test_a_model_that_is_not_stiff_is_solved_by_the_explicit_method(problems):
    first = problems["first"]
    model = first.nominal
    assert _finished(first, model).all()
    # The explicit solve's value, to the bit, and the closed form's within the
    # tolerances; BDF's is another solve's.
    value = first.nll(model)
    assert value == problems["tsit5"].nll(model)
    assert value != problems["bdf"].nll(model)
    p, _ = sciflat.destructure(model, dtype=jnp.float64)
    np.testing.assert_allclose(value, small_nll_of_p(p), rtol=1e-9)


@pytest.mark.slow  # compiles an explicit and a BDF solve: seconds
def test_where_the_model_is_stiff_the_stiffness_test_hands_over_to_bdf(problems):
    first = problems["first"]
    model = _with_k(first, STIFF_LOG10_K)
    assert not _finished(first, model).any()  # the test stopped both simulations
    assert first.nll(model) == problems["bdf"].nll(model)
    # Past its budget of steps the explicit solve hands over too.
    budget = problems["budget"]
    assert not _finished(budget, budget.nominal).all()
    assert budget.nll(budget.nominal) == problems["bdf"].nll(budget.nominal)


@pytest.mark.slow  # compiles the gradients of both solves: seconds
def test_the_gradient_is_the_forward_sensitivities_of_the_solve_taken(problems):
    first, bdf = problems["first"], problems["bdf"]
    p, re = sciflat.destructure(first.nominal, dtype=jnp.float64)
    grad = jax.jit(jax.value_and_grad(lambda x: first.nll(re(x))))
    # Not stiff: the explicit solve's sensitivities, the closed form's gradient.
    value, g = grad(p)
    assert value == first.nll(re(p))
    np.testing.assert_allclose(g, jax.grad(small_nll_of_p)(p), rtol=1e-7)
    # Stiff: BDF's, to the bit.
    stiff = p.at[0].set(STIFF_LOG10_K)
    value, g = grad(stiff)
    bdf_value, bdf_g = jax.value_and_grad(lambda x: bdf.nll(re(x)))(stiff)
    assert value == bdf_value
    np.testing.assert_array_equal(g, bdf_g)


@pytest.mark.slow  # compiles the second derivatives of both solves: seconds
def test_the_hessian_is_the_closed_forms_whichever_method_solves(problems):
    # (`problem.uncertainty`'s: forward mode over the sensitivities)
    first = problems["first"]
    p, re = sciflat.destructure(first.nominal, dtype=jnp.float64)
    hessian = jax.jit(jax.hessian(lambda x: first.nll(re(x))))
    for x in (p, p.at[0].set(STIFF_LOG10_K)):
        reference = jax.hessian(small_nll_of_p)(x)
        np.testing.assert_allclose(hessian(x), reference, rtol=1e-7, atol=1e-9)


@pytest.fixture(scope="module")
def first_nll(problems):
    """`nll` of the flat vector `(log10 k, scale, log sd)`, compiled once."""
    first = problems["first"]
    p, re = sciflat.destructure(first.nominal, dtype=jnp.float64)
    return jax.jit(lambda x: first.nll(re(x))), p


@pytest.mark.slow  # one compiled llh, run at each k drawn
@settings(max_examples=12, deadline=None)
@given(log10_k=st.floats(-2.0, 3.0))
def test_the_llh_is_the_closed_form_whichever_method_solves(first_nll, log10_k):
    nll, p = first_nll
    x = p.at[0].set(log10_k)
    np.testing.assert_allclose(nll(x), small_nll_of_p(x), rtol=1e-8)


@pytest.mark.slow  # traces the solves: seconds
def test_explicit_first_computes_in_float64_throughout(problems):
    first = problems["first"]
    for fn in (first.nll, jax.jacfwd(first.nll)):
        report = sciflat.audit_dtypes(fn, first.nominal, grad=False)
        assert not report.findings, str(report)


@pytest.mark.parametrize(
    "options, error",
    [
        (dict(explicit_first=1), TypeError),
        (dict(explicit_first=None), TypeError),
        (dict(explicit_max_steps=0), ValueError),
        (dict(explicit_max_steps=2.5), ValueError),
        (dict(explicit_max_steps=True), ValueError),
    ],
)
def test_explicit_first_options_are_checked(options, error):
    with pytest.raises(error, match="explicit"):
        sciflat.BDF(**options)
