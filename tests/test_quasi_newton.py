"""`sciflat.quasi_newton`: SSBroyden, SSBFGS and BFGS with a strong Wolfe line search."""

import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest
from hypothesis import given, settings, strategies as st

import sciflat
from sciflat._solver.quasi_newton import _Options, _run, update_inverse_hessian
from sciflat._solver.wolfe import Trial, wolfe_search


METHODS = ["ssbroyden", "ssbfgs", "bfgs"]
C1, C2 = 1e-4, 0.9


def rosenbrock(p):
    return jnp.sum(100 * (p[1:] - p[:-1] ** 2) ** 2 + (1 - p[:-1]) ** 2)


def quadratic(p, A, b):
    return 0.5 * p @ A @ p - b @ p


def spd(rng, n, lo=0.6, hi=1.4):
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    m = q @ np.diag(np.linspace(lo, hi, n)) @ q.T
    return jnp.asarray((m + m.T) / 2)  # exactly symmetric


@pytest.fixture(scope="module")
def update():
    return jax.jit(update_inverse_hessian, static_argnames="method")


@pytest.mark.slow  # 20 examples x 3 methods, one compilation each method: seconds
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), alpha=st.floats(0.05, 3.0))
@pytest.mark.parametrize("method", METHODS)
def test_update_meets_the_secant_condition_and_stays_spd(update, method, seed, alpha):
    # On a quadratic y = A s exactly; from any SPD H and any descent step s = -αHg, the
    # update gives H₊ y = s (its definition), exactly symmetric, positive definite.
    rng = np.random.default_rng(seed)
    n = 6
    A, H = spd(rng, n, 0.1, 10.0), spd(rng, n, 0.2, 5.0)
    g = jnp.asarray(rng.standard_normal(n))
    s = -alpha * (H @ g)
    y = A @ s
    for first in (True, False):
        H1 = update(H, s, y, g, jnp.asarray(alpha), method, jnp.asarray(first))
        np.testing.assert_allclose(H1 @ y, s, rtol=1e-9, atol=1e-12)
        assert np.array_equal(H1, H1.T)
        assert np.linalg.eigvalsh(H1).min() > 0
    if method == "bfgs":  # the textbook form (I − ρsyᵀ) H (I − ρysᵀ) + ρssᵀ
        rho, eye = 1 / (y @ s), jnp.eye(n)
        textbook = (eye - rho * jnp.outer(s, y)) @ H @ (eye - rho * jnp.outer(y, s))
        np.testing.assert_allclose(H1, textbook + rho * jnp.outer(s, s), rtol=1e-10)


@pytest.mark.parametrize("method", METHODS)
def test_one_parameter_update_is_the_secant_itself(update, method):
    # With one parameter the secant condition H₊ y = s fixes H₊ = s / y, and every
    # member of the family (SSBroyden's σ^(1/(1-n)) included) must give it.
    H, g = jnp.array([[0.7]]), jnp.array([1.3])
    s = -0.5 * (H @ g)
    y = 3.0 * s
    for first in (True, False):
        H1 = update(H, s, y, g, jnp.asarray(0.5), method, jnp.asarray(first))
        np.testing.assert_allclose(H1, (s / y)[:, None], rtol=1e-14)


def steps_one_by_one(fn, p, method, n, args=()):
    """The iterates p₀, p₁, ... of `quasi_newton`, one call per step (one compilation):
    the inverse Hessian carried from each call to the next by `state=`."""
    ps, states, state = [p], [], None
    for _ in range(n):
        result = sciflat.quasi_newton(
            fn, ps[-1], args=args, method=method, max_steps=1, state=state
        )
        if result.n_steps == 0:
            break
        state = result.raw
        ps.append(result.p)
        states.append(state)
    return ps, states


@pytest.mark.slow  # compiles a whole run per method: seconds on 2 cores
@pytest.mark.parametrize("method", METHODS)
def test_along_a_run_on_a_quadratic_every_update_is_secant_and_spd(method):
    rng = np.random.default_rng(0)
    A, b = spd(rng, 5, 0.1, 10.0), jnp.asarray(rng.standard_normal(5))
    ps, states = steps_one_by_one(quadratic, jnp.zeros(5), method, 6, (A, b))
    assert len(states) >= 4
    for p0, p1, state in zip(ps, ps[1:], states, strict=False):
        s = p1 - p0
        H = state.hessian_inv
        np.testing.assert_allclose(H @ (A @ s), s, rtol=1e-8, atol=1e-12)
        assert np.array_equal(H, H.T) and np.linalg.eigvalsh(H).min() > 0


@pytest.mark.slow  # compiles a whole run per method: seconds on 2 cores
@pytest.mark.parametrize("method", METHODS)
def test_rosenbrock_converges(method):
    p0 = jnp.array([-1.2, 1.0, -1.2, 1.0, 0.5])
    result = sciflat.quasi_newton(
        rosenbrock, p0, method=method, max_steps=300, gtol=1e-10
    )
    assert result.status == "converged" and result.success
    np.testing.assert_allclose(result.p, np.ones(5), atol=1e-8)
    assert result.loss < 1e-18 and result.history[0] == rosenbrock(p0)
    assert len(result.history) == result.n_steps + 1
    assert np.all(np.diff(result.history) < 0)  # every step lowers the loss


@pytest.mark.slow  # compiles a whole run per method: seconds on 2 cores
@pytest.mark.parametrize("method", METHODS)
def test_wolfe_conditions_hold_at_every_accepted_step(method):
    # Recomputed independently of the solver, at each pair of consecutive iterates:
    # f(p₁) ≤ f(p₀) + c1 ∇f(p₀)·s and |∇f(p₁)·s| ≤ c2 |∇f(p₀)·s|, s = p₁ − p₀.
    ps, states = steps_one_by_one(rosenbrock, jnp.array([-1.2, 1.0]), method, 60)
    vg = jax.jit(jax.value_and_grad(rosenbrock))
    assert len(states) > 20
    for p0, p1, state in zip(ps, ps[1:], states, strict=False):
        (f0, g0), (f1, g1), s = vg(p0), vg(p1), p1 - p0
        if jnp.max(jnp.abs(g0)) < 1e-7:
            break  # the last steps, at rounding level
        assert f1 <= f0 + C1 * (g0 @ s)
        assert jnp.abs(g1 @ s) <= C2 * jnp.abs(g0 @ s)
        assert bool(state.wolfe[0])
    # ... and what the solver records over one run says the same at every step.
    run = sciflat.quasi_newton(
        rosenbrock, jnp.array([-1.2, 1.0]), method=method, max_steps=200, gtol=1e-9
    ).raw
    k = int(run.n_steps)
    f, alpha = run.history[: k + 1], run.step_size[:k]
    slope0, slope = run.slope0[:k], run.slope[:k]
    assert np.all(run.wolfe[:k]) and np.all(slope0 < 0)
    assert np.all(f[1:] <= f[:-1] + C1 * alpha * slope0)
    assert np.all(np.abs(slope) <= C2 * np.abs(slope0))


@pytest.mark.slow  # three compiled searches: seconds on a loaded machine
@pytest.mark.parametrize(
    "f, start, d, longer",
    [
        (lambda x: (x - 10.0) ** 2, 0.0, 0.5, True),  # the unit step is too short
        (lambda x: x**4, 1.0, -100.0, False),  # ... far too long
        (lambda x: jnp.where(x < -0.5, jnp.nan, (x - 0.2) ** 2), 1.0, -4.0, False),
    ],
)
def test_line_search_brackets_and_zooms_to_a_wolfe_step(f, start, d, longer):
    vg = lambda x: jax.value_and_grad(lambda x: f(x[0]))(x)
    p, d = jnp.array([start]), jnp.array([d])
    f0, g0 = vg(p)
    out = wolfe_search(vg, p, d, Trial(jnp.array(0.0), f0, g0 @ d, g0))
    alpha = out.point.alpha
    f1, g1 = vg(p + alpha * d)
    assert bool(out.wolfe) and (alpha > 1 if longer else alpha < 1)
    assert f1 <= f0 + C1 * alpha * (g0 @ d) and jnp.abs(g1 @ d) <= C2 * jnp.abs(g0 @ d)
    np.testing.assert_allclose([out.point.f, out.point.slope], [f1, g1 @ d])


@pytest.mark.slow  # compiles a whole run per method: seconds on 2 cores
def test_bfgs_takes_optimistix_bfgs_iterates():
    # Where both accept the unit step (a well-conditioned quadratic, H₀ = I), plain
    # BFGS and optimistix.BFGS (backtracking from 1) take the same iterates.
    rng = np.random.default_rng(1)
    A, b = spd(rng, 5), jnp.asarray(rng.standard_normal(5))
    fn = lambda p, args: quadratic(p, A, b)
    ours, states = steps_one_by_one(fn, jnp.zeros(5), "bfgs", 5, (None,))
    assert all(float(s.step_size[0]) == 1.0 for s in states)  # the unit step, always
    solver = optx.BFGS(rtol=0.0, atol=0.0)
    aux = lambda p, args: (fn(p, args), None)
    y = jnp.zeros(5)
    state = solver.init(
        aux, y, None, {}, jax.ShapeDtypeStruct((), y.dtype), None, frozenset()
    )
    theirs = []
    for _ in range(len(ours) + 1):
        y, state, _ = solver.step(aux, y, None, {}, state, frozenset())
        if not theirs or not np.array_equal(y, theirs[-1]):
            theirs.append(y)
    assert len(theirs) >= len(ours)
    np.testing.assert_allclose(
        np.stack(ours), np.stack(theirs[: len(ours)]), rtol=1e-12, atol=1e-14
    )
    np.testing.assert_allclose(ours[-1], jnp.linalg.solve(A, b), atol=1e-2)


@pytest.mark.slow  # a whole run and its audit: seconds on 2 cores
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_dtype_preserved_end_to_end(dtype):
    p0 = jnp.array([-1.2, 1.0], dtype)
    result = sciflat.quasi_newton(rosenbrock, p0, max_steps=50)
    st_ = result.raw
    assert result.p.dtype == dtype and st_.hessian_inv.dtype == dtype
    assert st_.history.dtype == dtype and st_.grad.dtype == dtype
    assert result.history.dtype == np.float64  # FitResult's, as every fit's
    # The auditor finds no operation in another float dtype in the whole compiled run.
    options = _Options("ssbroyden", 5, 0.0, C1, C2, 25)
    H, first = jnp.eye(2, dtype=dtype), jnp.array(False)
    run = lambda p: _run(lambda p: rosenbrock(p), p, (), H, first, options).p
    report = sciflat.audit_dtypes(run, p0, grad=False)
    assert len(report) == 0 and report.n_checked > 50, str(report)


@pytest.mark.slow  # compiles a whole run per method: seconds on 2 cores
def test_args_change_without_recompiling():
    traces = []

    def fn(p, A, b):
        traces.append(1)
        return quadratic(p, A, b)

    rng = np.random.default_rng(2)
    for _ in range(3):
        A, b = spd(rng, 4), jnp.asarray(rng.standard_normal(4))
        result = sciflat.quasi_newton(fn, jnp.zeros(4), args=(A, b), gtol=1e-10)
        np.testing.assert_allclose(result.p, jnp.linalg.solve(A, b), atol=1e-9)
    assert 0 < len(traces) <= 4  # traced by the first call only (value and gradient)
    n = len(traces)
    sciflat.quasi_newton(fn, jnp.zeros(4), args=(A, b), gtol=1e-10)
    assert len(traces) == n


def test_a_resumed_run_reuses_the_first_runs_compilation(caplog):
    # `p` committed to a device, as a fit's result is: the fresh state goes where `p`
    # is, so a run resumed from its state (outputs of the first run, committed there)
    # is the same compiled program, not a second compilation (3.6 s of the PINN
    # example's chunked SSBroyden run, per chunk size).
    fn = lambda p, a: jnp.sum((p - a) ** 2) + 0.5 * jnp.sum(p**4)
    a = jnp.arange(3.0)
    # Committed, and weakly typed (a Python scalar's type): the run returns a strong `p`.
    for p in (
        jax.device_put(jnp.asarray([0.5, -0.5, 2.0]), jax.devices()[0]),
        jnp.full(3, 0.25),
    ):
        first = sciflat.quasi_newton(fn, p, args=(a,), max_steps=2)
        caplog.clear()
        with jax.log_compiles(), caplog.at_level("WARNING"):
            again = sciflat.quasi_newton(
                fn, first.p, args=(a,), max_steps=2, state=first.raw
            )
        compiled = [
            r for r in caplog.records if "Compiling jit(_run)" in r.getMessage()
        ]
        assert not compiled
        whole = sciflat.quasi_newton(fn, p, args=(a,), max_steps=4)
        np.testing.assert_allclose(again.p, whole.p, rtol=1e-12)


def test_wrong_inputs_are_refused():
    with pytest.raises(ValueError, match="`method` must be one of"):
        sciflat.quasi_newton(rosenbrock, jnp.zeros(2), method="lbfgs")  # type: ignore
    with pytest.raises(ValueError, match="flat 1-D vector, got shape"):
        sciflat.quasi_newton(rosenbrock, jnp.zeros((2, 2)))
    with pytest.raises(ValueError, match="0 < c1 < c2 < 1"):
        sciflat.quasi_newton(rosenbrock, jnp.zeros(2), c1=0.9, c2=0.1)
    state = sciflat.quasi_newton(rosenbrock, jnp.zeros(2), max_steps=1).raw
    with pytest.raises(ValueError, match="inverse Hessian of shape"):
        sciflat.quasi_newton(rosenbrock, jnp.zeros(3), state=state)
    with pytest.raises(TypeError, match="real floating"):
        sciflat.quasi_newton(rosenbrock, jnp.zeros(2, int))


@pytest.mark.slow  # compiles a whole run per method: seconds on 2 cores
def test_nonfinite_start_and_re():
    bad = sciflat.quasi_newton(lambda p: jnp.log(p[0]), jnp.array([-1.0, 0.0]))
    assert bad.status == "nonfinite" and bad.n_steps == 0
    p, re = sciflat.destructure({"a": jnp.array([-1.2]), "b": jnp.array(1.0)})
    result = sciflat.quasi_newton(
        lambda p: rosenbrock(p), p, re=re, gtol=1e-10, max_steps=300
    )
    np.testing.assert_allclose(result.model["a"], [1.0], atol=1e-8)
