"""`sciflat.BDF`, the variable-order BDF method of PEtab simulations: against a tight
Kvaerno5 solve (stiff and non-autonomous problems, at the tolerances and tighter), a
batch of conditions against each solved alone, its forward derivatives against
central differences of tight solves, its reverse mode (the adjoint of its steps)
against its forward mode, its matrices kept over many steps, a blow-up reported as a
failure, and the state's dtype throughout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st
from jax.extend.core import jaxprs_in_params

import sciflat
from helpers import foreign_float_ops, robertson, tight


pytest.importorskip("diffrax")
from sciflat._petab.bdf import bdf_adjoint, bdf_solve


@pytest.fixture(scope="module")
def x64():
    with jax.enable_x64(True):
        yield


def forced_oscillator(t, y, k):
    # Van der Pol with stiffness k[0], forced: non-autonomous, a parameter per batch.
    return jnp.stack([y[1], k[0] * (1 - y[0] ** 2) * y[1] - y[0] + jnp.sin(t)])


def solve(f, k, y0, ts, rtol=1e-8, atol=1e-12):
    """`bdf_solve` of a batch: `k` `(C, m)`, `y0` `(C, n)`; with its statistics."""
    return bdf_solve(
        f,
        jax.jacfwd(f, argnums=1),
        k,
        y0,
        np.asarray(ts, np.float64),
        rtol,
        atol,
        100_000,
        with_stats=True,
    )


@pytest.mark.slow  # compiles tight Kvaerno5 solves: seconds
def test_bdf_solves_a_stiff_problem_as_a_tight_kvaerno5_solve(x64):
    y0 = jnp.array([1.0, 0.0, 0.0])
    ts = [0.0, 0.1, 1.0, 10.0, 100.0, 1000.0]
    ref = tight(robertson, y0, ts)
    errors = []
    for rtol in (1e-6, 1e-9):
        ys, ok, stats = jax.jit(
            lambda k, y0, rtol=rtol: solve(robertson, k, y0, ts, rtol, 1e-14)
        )(jnp.zeros((1, 0)), y0[None])
        assert bool(ok[0])
        errors.append(float(jnp.max(jnp.abs(ys[0] - ref) / (jnp.abs(ref) + 1e-10))))
        accepted, _rejected, jacobians, matrices, _ = (int(v) for v in stats[0])
        # Its Jacobian and Newton matrix are kept over many steps: the point of it.
        assert jacobians < accepted / 10 and matrices < accepted / 2
    # A solution at the tolerance asked for, and closer at tighter ones (by 43x for
    # 1000x here: the global error of a variable-order method is not proportional).
    assert errors[0] < 1e-5 and errors[1] < 1e-7
    assert errors[1] < errors[0] / 10
    np.testing.assert_allclose(ys[0, 0], y0, rtol=0)  # t = 0: the start itself


@pytest.mark.slow  # compiles tight Kvaerno5 solves: seconds
def test_a_batch_of_conditions_is_each_condition_solved_alone(x64):
    ks = jnp.array([[1.0], [5.0], [20.0]])
    y0s = jnp.array([[2.0, 0.0], [1.0, 0.5], [-1.0, 1.0]])
    ts = [0.0, 0.5, 1.7, 3.0]  # between steps: the BDF's interpolating polynomial
    batch = jax.jit(lambda k, y: solve(forced_oscillator, k, y, ts, 1e-10))
    # One compiled reference for the three conditions (`k` an input, not a constant).
    reference = jax.jit(
        lambda k, y0: tight(lambda t, y, a: forced_oscillator(t, y, k), y0, ts)
    )
    ys, ok, stats = batch(ks, y0s)
    assert bool(jnp.all(ok))
    for c in range(3):
        alone, _, alone_stats = batch(ks[c : c + 1], y0s[c : c + 1])
        np.testing.assert_allclose(ys[c], alone[0], rtol=1e-13, atol=1e-13)
        np.testing.assert_array_equal(stats[c], alone_stats[0])
        ref = reference(ks[c], y0s[c])
        # The global error within 1000x the tolerance asked (7e-8 at most here).
        np.testing.assert_allclose(ys[c], ref, rtol=1e-7, atol=1e-7)
    # The stiffer the oscillator, the more steps: the conditions step on their own.
    assert len({int(s[0]) for s in stats}) == 3


@pytest.mark.slow  # compiles the solve with and without `need`: seconds
def test_a_condition_stops_at_its_last_time(x64):
    # `need`: each condition solved to that many of `ts` (one needs only t = 0). A
    # condition stopped early is the condition alone solved to its own last time,
    # with fewer steps than to the batch's end; its later times are 0.
    ks = jnp.array([[1.0], [5.0], [20.0]])
    y0s = jnp.array([[2.0, 0.0], [1.0, 0.5], [-1.0, 1.0]])
    ts = np.array([0.0, 0.5, 1.7, 3.0, 6.0])
    need = jnp.array([3, 5, 1], jnp.int32)
    f, jac = forced_oscillator, jax.jacfwd(forced_oscillator, argnums=1)
    stop = lambda k, y, m: bdf_solve(
        f, jac, k, y, ts, 1e-10, 1e-12, 10**5, need=m, with_stats=True
    )
    ys, ok, stats = jax.jit(stop)(ks, y0s, need)
    assert bool(jnp.all(ok))
    every, _, every_stats = jax.jit(lambda k, y: solve(f, k, y, ts, 1e-10))(ks, y0s)
    alone, _, alone_stats = jax.jit(lambda k, y: solve(f, k, y, ts[:3], 1e-10))(
        ks[:1], y0s[:1]
    )
    np.testing.assert_allclose(ys[0, :3], alone[0], rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(stats[0], alone_stats[0])
    for c, m in enumerate(need.tolist()):
        np.testing.assert_array_equal(ys[c, m:], 0.0)
        # The same solution as to the end, within the tolerance's global error.
        np.testing.assert_allclose(ys[c, :m], every[c, :m], rtol=1e-7, atol=1e-7)
    assert int(stats[0, 0]) < int(every_stats[0, 0])  # fewer steps
    np.testing.assert_array_equal(stats[1], every_stats[1])  # to the end: the same
    assert int(stats[2, 0]) == 0
    np.testing.assert_array_equal(ys[2, 0], y0s[2])


@pytest.mark.slow  # compiles the solve, its derivative and tight solves: seconds
def test_bdf_forward_derivatives_are_the_solutions(x64):
    # Forward mode through the Newton iterations (the step sizes and matrices taken
    # as constants) against central differences of tight Kvaerno5 solves.
    def dimer(t, y, k):  # dimerisation, stiff for large k[1]
        return jnp.stack(
            [
                -2 * k[0] * y[0] ** 2 + 2 * k[1] * y[1],
                k[0] * y[0] ** 2 - k[1] * y[1],
            ]
        )

    y0 = jnp.array([1.0, 0.5])
    ts = [0.0, 0.05, 0.1]
    k = jnp.array([2.0, 30.0])

    def at_end(k):
        ys, _, _ = solve(dimer, k[None], y0[None], ts, 1e-10, 1e-14)
        return ys[0, -1]

    forward = jax.jit(jax.jacfwd(at_end))(k)
    fn = jax.jit(lambda k: tight(lambda t, y, a: dimer(t, y, k), y0, ts)[-1])
    eps = 1e-6
    central = jnp.stack(
        [(fn(k + eps * e) - fn(k - eps * e)) / (2 * eps) for e in jnp.eye(2)], axis=1
    )
    # (dropping the rhs's tangent in the iterations is 100% off; these are ~1e-9)
    np.testing.assert_allclose(forward, central, rtol=1e-6, atol=1e-9)


@pytest.fixture(scope="module")
def adjoint_and_forward(x64):
    """The forced oscillator's solve, jitted: recorded with its adjoint, and forward
    mode through the plain solve (the Jacobian of the outputs in `(k, y0)`)."""
    ts = np.array([0.0, 0.3, 1.1, 2.0, 3.5])
    f, jac = forced_oscillator, jax.jacfwd(forced_oscillator, argnums=1)

    def plain(k, y0):
        return bdf_solve(f, jac, k, y0, ts, 1e-8, 1e-10, 100_000)[0]

    adjoint = jax.jit(_recorded_adjoint(f, jac, ts))
    return jax.jit(plain), adjoint, jax.jit(jax.jacfwd(plain, argnums=(0, 1)))


def _recorded_adjoint(f, jac, ts):
    """`(k, y0, ys_bar) -> (ys, ok, (k_bar, y0_bar), attempts)`: the recorded solve
    and its adjoint."""

    def adjoint(k, y0, ys_bar):
        solve = functools.partial(bdf_solve, f, jac, k, y0, ts, 1e-8, 1e-10, 100_000)
        ys, ok, kept = solve(record=True)
        replay = lambda point: solve(resume=point)
        bars = bdf_adjoint(f, jac, k, y0, ts, kept, ys_bar, replay)
        return ys, ok, bars, kept["attempts"]

    return adjoint


@pytest.mark.slow  # compiles the recorded solve, its adjoint and forward mode: seconds
@settings(max_examples=6, deadline=None)
@given(
    # A batch of two conditions, each its own stiffness: the programs the test below
    # runs too (each batch size is a compilation of all three; the adjoint of
    # one condition at a time is in `tests/test_petab.py`, chunks of one).
    stiffness=st.lists(st.floats(0.5, 30.0), min_size=2, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_the_adjoint_of_the_steps_is_the_transpose_of_forward_mode(
    adjoint_and_forward, stiffness, seed
):
    # Reverse mode by the adjoint of the accepted steps (`bdf_adjoint`) against
    # forward mode through the plain solve (the same steps), for any cotangent of
    # the outputs: the same derivatives, a batch of conditions each with its own.
    plain, adjoint, forward = adjoint_and_forward
    rng = np.random.default_rng(seed)
    k = jnp.asarray(stiffness)[:, None]
    y0 = jnp.asarray(rng.uniform(-2, 2, (len(stiffness), 2)))
    ys_bar = jnp.asarray(rng.standard_normal((len(stiffness), 5, 2)))
    ys, ok, (k_bar, y0_bar), _ = adjoint(k, y0, ys_bar)
    assert bool(jnp.all(ok))
    np.testing.assert_array_equal(ys, plain(k, y0))  # the record changes nothing
    dk, dy0 = forward(k, y0)  # (C, T, n, C, 1), (C, T, n, C, 2)
    np.testing.assert_allclose(
        k_bar, jnp.einsum("ctn,ctnab->ab", ys_bar, dk), rtol=1e-9, atol=1e-11
    )
    np.testing.assert_allclose(
        y0_bar, jnp.einsum("ctn,ctnab->ab", ys_bar, dy0), rtol=1e-9, atol=1e-11
    )


@pytest.mark.slow  # compiles the recorded solve and its adjoint twice: seconds
def test_an_adjoint_of_many_segments_runs_them_again_from_their_starts(
    adjoint_and_forward, monkeypatch
):
    # The record keeps the rows of the last segment of attempts (`_SEGMENT`) and
    # the solve's state at the start of each; the adjoint runs the earlier segments
    # again from there. Segments of 16 attempts (a dozen or more of them here): the
    # same outputs and derivatives as one segment, and forward mode's.
    from sciflat._petab import bdf

    _, one_segment, forward = adjoint_and_forward
    rng = np.random.default_rng(3)
    k = jnp.array([[2.0], [25.0]])
    y0 = jnp.asarray(rng.uniform(-2, 2, (2, 2)))
    ys_bar = jnp.asarray(rng.standard_normal((2, 5, 2)))
    ys, ok, want, attempts = one_segment(k, y0, ys_bar)
    assert bool(jnp.all(ok)) and int(attempts) < bdf._SEGMENT
    monkeypatch.setattr(bdf, "_SEGMENT", 16)
    f, jac = forced_oscillator, jax.jacfwd(forced_oscillator, argnums=1)
    ts = np.array([0.0, 0.3, 1.1, 2.0, 3.5])
    got_ys, got_ok, got, got_attempts = jax.jit(_recorded_adjoint(f, jac, ts))(
        k, y0, ys_bar
    )
    assert int(got_attempts) == int(attempts) > 10 * 16
    np.testing.assert_array_equal(got_ys, ys)
    np.testing.assert_array_equal(got_ok, ok)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)
    dk, dy0 = forward(k, y0)
    np.testing.assert_allclose(
        got[0], jnp.einsum("ctn,ctnab->ab", ys_bar, dk), rtol=1e-9, atol=1e-11
    )
    np.testing.assert_allclose(
        got[1], jnp.einsum("ctn,ctnab->ab", ys_bar, dy0), rtol=1e-9, atol=1e-11
    )


@pytest.mark.slow  # compiles the solve with its directions and tight solves: seconds
def test_controlled_sensitivities_converge_with_the_tolerance(x64):
    # The derivatives along the state's steps are 1.7e-4 off at rtol 1e-6 on this
    # forced oscillator (their error is not estimated); with their errors in the
    # step's test and choice, as CVODES's `errconS`, 1.9e-5.
    k = jnp.array([5.0])
    y0 = jnp.array([2.0, 0.0])
    ts = np.linspace(0.0, 20.0, 11)
    rtol, atol = 1e-6, 1e-10
    jac = jax.jacfwd(forced_oscillator, argnums=1)

    def plain(k):
        return bdf_solve(
            forced_oscillator, jac, k[None], y0[None], ts, rtol, atol, 10**5
        )

    dk = (k * jnp.eye(1))[:, None, :]  # one direction, scaled to the parameter
    dy0 = jnp.zeros((1, 1, 2))

    @jax.jit
    def controlled(k):
        return bdf_solve(
            forced_oscillator, jac, k[None], y0[None], ts, rtol, atol, 10**5,
            with_stats=True, tangents=(dk, dy0),
        )  # fmt: skip

    ys, ys_t, ok, stats = controlled(k)
    assert bool(ok[0])
    got = ys_t[0, 0] / k[0]
    along_state = jax.jit(jax.jacfwd(lambda k: plain(k)[0][0]))(k)[..., 0]
    fn = jax.jit(lambda k: tight(lambda t, y, a: forced_oscillator(t, y, k), y0, ts))
    h = 1e-5 * k
    ref = (fn(k + h) - fn(k - h)) / (2 * h[0])
    size = float(jnp.max(jnp.abs(ref)))
    assert float(jnp.max(jnp.abs(got - ref))) < 4e-5 * size
    assert float(jnp.max(jnp.abs(along_state - ref))) > 1e-4 * size
    # The solution is one of the tolerance asked for, by more steps.
    ys_plain, _, plain_stats = jax.jit(
        lambda k: solve(forced_oscillator, k[None], y0[None], ts, rtol, atol)
    )(k)
    np.testing.assert_allclose(ys[0], ys_plain[0], rtol=1e-4, atol=1e-6)
    assert int(stats[0, 0]) > int(plain_stats[0, 0])


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 5),
    scale=st.sampled_from([1e-3, 1.0, 1e3, 1e8]),
    seed=st.integers(0, 2**16),
)
def test_the_small_models_inverse_is_lapacks(x64, n, scale, seed):
    # Up to five species the corrector's derivative inverts `I - c J` by Gauss-Jordan
    # elimination in JAX's operations: LAPACK's inverse to rounding, for stiff
    # matrices and rows that need pivoting; a singular matrix gives non-finite
    # entries, as LAPACK's does (so the step's derivative is not used).
    from sciflat._petab.bdf import _JORDAN_UP_TO_STATES, _inverse

    assert n <= _JORDAN_UP_TO_STATES
    rng = np.random.default_rng(seed)
    w = np.eye(n) - scale * rng.standard_normal((3, n, n))
    w[1] = w[1][::-1]  # a small diagonal: pivoting needed
    got, want = np.asarray(jax.jit(_inverse)(w)), np.linalg.inv(w)  # LAPACK's
    size = np.linalg.norm(want, axis=(1, 2)) * np.linalg.norm(w, axis=(1, 2))
    assume(bool(np.all(size < 1e10)))  # well enough conditioned to compare
    err = np.max(np.abs(got - want), axis=(1, 2)) / np.max(np.abs(want), (1, 2))
    assert np.max(err / size) < 1e-14
    singular = w.copy()
    singular[:, :, 0] = 0.0
    inverse = np.asarray(jax.jit(_inverse)(singular))
    assert not np.any(np.all(np.isfinite(inverse), axis=(1, 2)))


def test_a_blow_up_is_a_failed_solve_with_the_solution_before_it(x64):
    # y' = y**2 from 1 leaves every bound at t = 1.
    ys, ok, stats = jax.jit(
        lambda k, y: solve(lambda t, y, k: y**2, k, y, [0.0, 0.5, 2.0])
    )(jnp.zeros((1, 0)), jnp.ones((1, 1)))
    assert not bool(ok[0])
    np.testing.assert_allclose(ys[0, 1, 0], 2.0, rtol=1e-6)  # 1 / (1 - t)
    assert int(stats[0, 0] + stats[0, 1]) < 10_000  # stopped, not at max_steps


def test_an_input_pulse_that_starts_at_zero_is_not_stepped_over(x64):
    # y' = 1e-15 + 10 t exp(-t / 0.01): the vector field is ~0 at t = 0 and at t = 10
    # (the pulse adds 1e-3 between), so the first-step estimates propose the whole
    # interval; the step is bounded by a tenth of the first measurement, as CVODES's.
    def pulse(t, y, k):
        return jnp.stack([1e-15 + 10 * t * jnp.exp(-t / 0.01) + 0 * y[0]])

    want = 1.0 + 1e-3 * (1 - np.exp(-1000.0) * 1001.0)  # the integral to t = 10
    for rtol, atol in [(1e-8, 1e-10), (1e-12, 1e-14)]:
        ys, ok, _ = jax.jit(
            lambda k, y, rtol=rtol, atol=atol: solve(
                pulse, k, y, [0.0, 1.0, 10.0], rtol, atol
            )
        )(jnp.zeros((1, 0)), jnp.ones((1, 1)))
        assert bool(ok[0])
        np.testing.assert_allclose(ys[0, -1, 0], want, rtol=100 * rtol)


def test_bdf_computes_in_the_states_dtype(x64):
    y0 = jnp.array([[1.0, 0.0, 0.0]], jnp.float32)
    k = jnp.zeros((1, 0), jnp.float32)
    fn = lambda k, y: solve(robertson, k, y, [0.0, 1.0, 10.0], 1e-4, 1e-6)[:2]
    ys, ok = jax.jit(fn)(k, y0)
    assert ys.dtype == jnp.float32 and bool(ok[0])
    np.testing.assert_allclose(
        ys[0, -1], tight(robertson, jnp.array([1.0, 0.0, 0.0]), [10.0])[-1], rtol=1e-3
    )
    assert foreign_float_ops(jax.make_jaxpr(fn)(k, y0), jnp.float32) == []
    # and its reverse mode, the record and the adjoint of the steps
    f, jac = robertson, jax.jacfwd(robertson, argnums=1)
    ts = np.array([0.0, 1.0, 10.0])

    def back(k, y):
        solve = functools.partial(bdf_solve, f, jac, k, y, ts, 1e-4, 1e-6, 1000)
        ys, _, kept = solve(record=True)
        replay = lambda point: solve(resume=point)
        return bdf_adjoint(f, jac, k, y, ts, kept, jnp.ones_like(ys), replay)

    _, y_bar = jax.jit(back)(k, y0)
    assert y_bar.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(y_bar)))
    assert foreign_float_ops(jax.make_jaxpr(back)(k, y0), jnp.float32) == []


def _inner_loops(jaxpr) -> list:
    """The `while` loops of a jaxpr, not those inside them."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            found.append(eqn)
        else:
            for sub in jaxprs_in_params(eqn.params):
                found += _inner_loops(sub)
    return found


def _height(loop) -> int:
    """0 for a loop with no loop inside it, else 1 + the largest of theirs."""
    inner = _inner_loops(loop.params["body_jaxpr"].jaxpr)
    return max((1 + _height(e) for e in inner), default=0)


def _all_loops(jaxpr) -> list:
    out = []
    for eqn in _inner_loops(jaxpr):
        out += [eqn, *_all_loops(eqn.params["body_jaxpr"].jaxpr)]
    return out


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def _largest(jaxpr) -> int:
    """The largest array (bytes) a jaxpr and the jaxprs inside it compute or read."""
    return max(
        int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
        for eqn in _eqns(jaxpr)
        for v in [*eqn.invars, *eqn.outvars]
        if hasattr(getattr(v, "aval", None), "shape")
    )


def test_a_small_models_steps_touch_no_array_above_512_bytes(x64):
    # XLA:CPU runs a loop's body kernel after kernel on the calling thread only where
    # every buffer the body touches is at most 512 bytes, and hands its kernels to a
    # pool of threads otherwise (a small model's solve 1.7 times as long). The
    # outputs (`T` times `n`) are written between runs of the attempts' loop, so that
    # for 8 species the loop around Newton's iteration holds nothing larger.
    def chain(t, y, k):
        return k[0] * (jnp.roll(y, 1) - y) - 0.1 * y**2

    y0 = jnp.linspace(1.0, 2.0, 8)[None]
    ts = np.linspace(0.0, 10.0, 60)
    fn = lambda k, y0: solve(chain, k, y0, ts)
    ys, ok, _ = jax.jit(fn)(jnp.ones((1, 1)), y0)
    assert bool(ok[0]) and ys.shape == (1, 60, 8)
    loops = _all_loops(jax.make_jaxpr(fn)(jnp.ones((1, 1)), y0).jaxpr)
    # The attempts' loop: the one around Newton's iteration (which holds none).
    attempts = [eqn for eqn in loops if _height(eqn) == 1]
    assert len(attempts) == 1
    for eqn in attempts:
        assert _largest(eqn.params["body_jaxpr"].jaxpr) <= 512
    # Below 20 species Newton's products are written as products and sums, which
    # XLA fuses with the rest of an iteration (a batched dot is a kernel of its own:
    # Schwen's llh 1.2 times as long).
    (newton,) = _inner_loops(attempts[0].params["body_jaxpr"].jaxpr)
    body = newton.params["body_jaxpr"].jaxpr
    assert all(eqn.primitive.name != "dot_general" for eqn in _eqns(body))


@pytest.mark.slow  # compiles the recorded solve twice: seconds
def test_a_small_models_record_goes_through_a_ring_of_the_same_rows(x64, monkeypatch):
    # The recorded solve (the adjoint's forward pass) writes each attempt's row to a
    # ring of a few attempts, copied into the record when it is full: its attempts'
    # loop touches no buffer above 512 bytes, as the plain solve's (the record is
    # 8,192 rows), and the record is the one written row by row, to the bit.
    from sciflat._petab import bdf

    def chain(t, y, k):
        return k[0] * (jnp.roll(y, 1) - y) - 0.1 * y**2

    jac = jax.jacfwd(chain, argnums=1)
    k, y0 = jnp.ones((1, 1)), jnp.linspace(1.0, 2.0, 8)[None]
    ts = np.linspace(0.0, 10.0, 60)

    def recorded(k, y0):
        return bdf_solve(chain, jac, k, y0, ts, 1e-8, 1e-12, 100_000, record=True)

    assert bdf._ring_rows(8 * (8 + len(bdf._RECORD)), bdf._SEGMENT) == 4
    loops = _all_loops(jax.make_jaxpr(recorded)(k, y0).jaxpr)
    attempts = [eqn for eqn in loops if _height(eqn) == 1]
    assert len(attempts) == 1
    assert _largest(attempts[0].params["body_jaxpr"].jaxpr) <= 512
    ys, ok, kept = jax.jit(recorded)(k, y0)
    monkeypatch.setattr(bdf, "_ring_rows", lambda *_: 1)
    rows_ys, rows_ok, rows = jax.jit(lambda k, y0: recorded(k, y0))(k, y0)
    np.testing.assert_array_equal(ok, rows_ok)
    n = int(kept["attempts"])
    assert bool(ok[0]) and int(rows["attempts"]) == n > 10 * 4
    np.testing.assert_array_equal(kept["rows"][:n], rows["rows"][:n])
    np.testing.assert_array_equal(kept["source"], rows["source"])
    np.testing.assert_array_equal(ys, rows_ys)


def _decays(n):
    """A linear chain of `n` species, each decaying into the next at rates spread
    over four decades (stiff): its vector field, Jacobian, matrix `A` and initial
    state (the exact solution is `expm(A t) y0`)."""
    rates = np.logspace(-1, 3, n)
    a = np.diag(-rates) + np.diag(rates[:-1], -1)
    a_j = jnp.asarray(a)

    def f(t, y, k):
        return a_j @ y

    y0 = np.zeros(n)
    y0[0] = 1.0
    return f, jax.jacfwd(f, argnums=1), a, y0


@pytest.mark.slow  # compiles two recorded solves: seconds
def test_a_large_models_step_is_kept_unless_it_can_grow_half_again(x64):
    # From 20 species on (`_LARGE_FROM_STATES`) an accepted step's size is kept
    # unless the estimates would move it by at least 1.5 times (CVODES's rule): each
    # move costs an inversion of the Newton matrix. Below, it follows the estimates
    # (SciPy's rule), moves of less than half again among them. Both solve the
    # chain as its matrix exponential does.
    from scipy.linalg import expm

    from sciflat._petab import bdf

    ts = np.array([0.0, 0.5, 2.0, 10.0, 40.0])
    factors = {}
    for n in (bdf._LARGE_FROM_STATES - 1, bdf._LARGE_FROM_STATES):
        f, jac, a, y0 = _decays(n)
        ys, ok, kept = jax.jit(
            lambda k, y0, f=f, jac=jac: bdf_solve(
                f, jac, k, y0, ts, 1e-8, 1e-12, 100_000, record=True
            )
        )(jnp.zeros((1, 0)), jnp.asarray(y0)[None])
        assert bool(ok[0])
        exact = np.stack([expm(a * t) @ y0 for t in ts])
        np.testing.assert_allclose(ys[0], exact, rtol=1e-5, atol=1e-9)
        rows = bdf._record_rows(kept["rows"][: int(kept["attempts"])], n)
        # The moves after accepted steps, but the last few (cut to end at a time).
        moved = rows["accepted"][:, 0] & rows["rescale"][:, 0]
        factors[n] = np.asarray(rows["factor"][:, 0])[np.asarray(moved)][:-3]
    small, large = factors.values()
    assert len(large) > 5 and np.all(large >= bdf._KEEP_STEP_BELOW)
    assert np.any((small > 1) & (small < bdf._KEEP_STEP_BELOW))


def _squares(n):
    """A chain of `n` species, each lost into the next at the square of its
    concentration, at rates spread over five decades: stiff, its Jacobian (`2 r y`
    on the diagonal) moving as the species decay. Its vector field, Jacobian and
    initial state."""
    rates = jnp.asarray(np.logspace(-1, 4, n))

    def f(t, y, k):
        flow = rates * y**2
        return jnp.concatenate([jnp.zeros(1), flow[:-1]]) - flow

    y0 = np.zeros(n)
    y0[0] = 1.0
    return f, jax.jacfwd(f, argnums=1), y0


@pytest.mark.slow  # compiles six solves: seconds
def test_a_large_model_renews_its_jacobian_after_a_slow_newton_iteration(
    x64, monkeypatch
):
    # From 20 species on (`_LARGE_FROM_STATES`) a step whose Newton iteration took
    # `_SLOW_NEWTON` iterations or more with an old Jacobian has a fresh one at the
    # next attempt (CVODES renews a Jacobian grown old): more Jacobians, fewer
    # iterations. Below, only a failed iteration renews it: the rule off changes
    # nothing there. Each solve agrees with a tight one.
    from sciflat._petab import bdf

    ts = np.array([0.0, 0.5, 2.0, 10.0, 100.0, 1000.0])
    stats = {}
    for n in (bdf._LARGE_FROM_STATES - 1, bdf._LARGE_FROM_STATES):
        f, jac, y0 = _squares(n)
        k, y = jnp.zeros((1, 0)), jnp.asarray(y0)[None]
        ref, _ = jax.jit(
            lambda k, y, f=f, jac=jac: bdf_solve(
                f, jac, k, y, ts, 1e-12, 1e-16, 100_000
            )
        )(k, y)
        for rule in (bdf._SLOW_NEWTON, None):
            monkeypatch.setattr(bdf, "_SLOW_NEWTON", rule or 10**6)
            ys, ok, st = jax.jit(
                lambda k, y, f=f, jac=jac: bdf_solve(
                    f, jac, k, y, ts, 1e-8, 1e-12, 100_000, with_stats=True
                )
            )(k, y)
            assert bool(ok[0])
            np.testing.assert_allclose(ys, ref, rtol=1e-5, atol=1e-9)
            stats[n, rule is not None] = np.asarray(st[0])
        monkeypatch.undo()
    small, large = bdf._LARGE_FROM_STATES - 1, bdf._LARGE_FROM_STATES
    np.testing.assert_array_equal(stats[small, True], stats[small, False])
    jacobians, iterations = 2, 4  # (the columns of the statistics)
    assert stats[large, True][jacobians] > 2 * stats[large, False][jacobians]
    assert stats[large, True][iterations] < 0.9 * stats[large, False][iterations]


def test_bdf_options_are_checked():
    assert sciflat.BDF() == sciflat.BDF(max_order=5)
    assert hash(sciflat.BDF(3)) == hash(sciflat.BDF(3))
    for bad in (0, 6, 2.0):
        with pytest.raises(ValueError, match="max_order"):
            sciflat.BDF(max_order=bad)
    # controlled by default up to `CONTROL_UP_TO` directions, else as asked
    from sciflat._petab.bdf import CONTROL_UP_TO

    assert sciflat.BDF().control_sensitivities is None
    assert sciflat.BDF().controls(CONTROL_UP_TO)
    assert not sciflat.BDF().controls(CONTROL_UP_TO + 1)
    assert sciflat.BDF(control_sensitivities=True).controls(10**4)
    assert not sciflat.BDF(control_sensitivities=False).controls(1)
    with pytest.raises(TypeError, match="control_sensitivities"):
        sciflat.BDF(control_sensitivities=1)  # type: ignore[arg-type]
    # reverse mode by the adjoint from `ADJOINT_FROM_DIRECTIONS` directions (and
    # beyond `CONTROL_UP_TO`) or from `ADJOINT_FROM_STATES` species, else as asked
    from sciflat._petab.bdf import ADJOINT_FROM_DIRECTIONS, ADJOINT_FROM_STATES

    assert sciflat.BDF().reverse(CONTROL_UP_TO + 1, 3)
    assert sciflat.BDF().reverse(ADJOINT_FROM_DIRECTIONS, 3)
    assert sciflat.BDF().reverse(2, ADJOINT_FROM_STATES)
    small = (ADJOINT_FROM_DIRECTIONS - 1, ADJOINT_FROM_STATES - 1)
    assert not sciflat.BDF().reverse(*small)
    assert sciflat.BDF(adjoint=True).reverse(1, 1)
    assert not sciflat.BDF(adjoint=False).reverse(10**4, 10**3)
    with pytest.raises(TypeError, match="adjoint"):
        sciflat.BDF(adjoint="yes")  # type: ignore[arg-type]
