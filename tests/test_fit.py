"""`sciflat.fit`: the Optax loop on the flat vector, its dtypes, stops and checkpoints."""

import importlib.util
import os
import signal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sciflat
import sciflat._fitting.progress
from helpers import float_outputs, inexact_dtypes
from sciflat._optax.step import State, make_step, reuses_value, strong


# A linear least-squares problem: tiny to compile, with a closed-form answer.
T = np.linspace(-1.0, 1.0, 6)
X = np.stack([T, T**2], axis=1)
Y = X @ np.array([1.5, -2.0]) + 0.25


def loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def linear(dtype=jnp.float64):
    return eqx.nn.Linear(2, "scalar", key=jax.random.key(0), dtype=dtype)


def xy(dtype=jnp.float64):
    return jnp.asarray(X, dtype), jnp.asarray(Y, dtype)


ADAM = optax.adam(1e-2)
OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2),
    "lbfgs": lambda: optax.lbfgs(),
    "sgd_schedule": lambda: optax.sgd(optax.exponential_decay(0.1, 10, 0.5)),
}


def hand_loop(model, optimizer, n, dtype=jnp.float64):
    """What the docs show: a loop with nothing but `destructure`."""
    p, re = sciflat.destructure(model, dtype=dtype)
    x, y = xy(dtype)
    state = optimizer.init(p)

    @jax.jit
    def step(p, state):
        value, grad = jax.value_and_grad(lambda p: loss(re(p), x, y))(p)
        updates, state = optimizer.update(grad, state, p)
        return optax.apply_updates(p, updates), state, value

    history = []
    for _ in range(n):
        p, state, value = step(p, state)
        history.append(float(value))
    return p, np.array(history)


def interrupt_at(k):
    def callback(step, value, model):
        if step == k:
            raise KeyboardInterrupt

    return callback


def three_runs(tmp_path_factory, name):
    """A float32-initialised model trained in float64 for 12 steps: uninterrupted, then
    interrupted at step 6 with a checkpoint, then resumed from it. Traces counted."""
    path = tmp_path_factory.mktemp(name) / "ckpt.npz"
    runs, traces = {}, {}
    for run, extra in [
        ("full", {}),
        ("part", dict(checkpoint=path, checkpoint_every=4, callback=interrupt_at(6))),
        ("rest", dict(checkpoint=path, resume=True)),
    ]:
        count = []
        counting = lambda m, x, y, count=count: (count.append(1), loss(m, x, y))[1]
        runs[run] = sciflat.fit(
            counting,
            linear(jnp.float32),
            OPTIMIZERS[name](),
            steps=12,
            args=xy(),
            dtype=jnp.float64,
            progress=False,
            **extra,
        )
        traces[run] = len(count)
    return runs, traces


@pytest.fixture(scope="module")
def adam_runs(tmp_path_factory):
    return three_runs(tmp_path_factory, "adam")


@pytest.fixture(scope="module")
def lbfgs_runs(tmp_path_factory):
    return three_runs(tmp_path_factory, "lbfgs")


#
# Results against references
#


def test_fit_equals_the_hand_written_loop(adam_runs):
    result = adam_runs[0]["full"]
    p, history = hand_loop(linear(jnp.float32), OPTIMIZERS["adam"](), 12)
    assert result.status == "completed" and result.n_steps == 12
    np.testing.assert_allclose(result.history, history, rtol=1e-13)
    np.testing.assert_allclose(result.p, p, rtol=1e-13)
    assert result.loss == pytest.approx(float(loss(result.model, *xy())), rel=1e-14)
    assert result.history[-1] < result.history[0]


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_lbfgs_reaches_the_least_squares_solution(lbfgs_runs):
    result = lbfgs_runs[0]["full"]
    A = np.hstack([X, np.ones((6, 1))])
    coef = np.linalg.lstsq(A, Y, rcond=None)[0]
    got = np.append(np.asarray(result.model.weight), result.model.bias)
    np.testing.assert_allclose(got, coef, rtol=1e-10)
    assert result.loss < 1e-20


def test_compiled_once(adam_runs, lbfgs_runs):
    # `loss` is traced per compilation, not per step: 12 steps cost what 6 steps cost.
    for _, traces in (adam_runs, lbfgs_runs):
        assert traces["full"] == traces["rest"]


def test_a_fit_resumed_with_the_same_loss_and_optimizer_compiles_nothing(
    tmp_path, caplog
):
    # The step is one `jax.jit` per (loss, optimiser, structure, static args), the
    # loss and the optimiser by identity: the resumed fit (also the committed arrays
    # of a checkpoint: other input shardings would not show in a trace count) runs the
    # first fit's compilation; a new optimiser object is a new step, as a new
    # function is under `jax.jit`.
    path = tmp_path / "ckpt.npz"
    kwargs = dict(steps=6, args=xy(), progress=False, checkpoint=path)
    adam = optax.adam(0.05)
    compiled = lambda: sum(
        r.getMessage().startswith("Compiling jit(step)") for r in caplog.records
    )
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        sciflat.fit(loss, linear(), adam, callback=interrupt_at(3), **kwargs)
        first = compiled()
        resumed = sciflat.fit(loss, linear(), adam, resume=True, **kwargs)
        second = compiled() - first
        whole = sciflat.fit(
            loss, linear(), optax.adam(0.05), steps=6, args=xy(), progress=False
        )
        third = compiled() - first - second
    assert (first, second, third) == (1, 0, 1)
    assert np.array_equal(resumed.p, whole.p)
    assert np.array_equal(resumed.history, whole.history)


def test_the_final_loss_is_one_compiled_program_kept_for_the_next_fit(caplog):
    # Run eagerly, every op of the loss compiled on its own at the end of a fit (a
    # PINN's loss: 4.5 s, longer than its whole step). The loss at the final `p` is
    # one compiled program, kept as the step is but without the optimiser in its
    # key: a fit with another optimiser compiles its step, not the final loss.
    x = jnp.linspace(0.0, 1.0, 13)  # shapes no other test uses: no eager op cached
    y = jnp.sin(3.0 * x)
    wavy = lambda m, x, y: jnp.mean((jnp.tanh(m["a"] * x) * m["b"] - y) ** 2)
    model = {"a": jnp.asarray(1.0), "b": jnp.asarray(0.5)}
    kwargs = dict(steps=3, args=(x, y), progress=False)
    compiled = lambda name: sum(
        r.getMessage().startswith(f"Compiling jit({name})") for r in caplog.records
    )
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        first = sciflat.fit(wavy, model, optax.adam(0.1), **kwargs)
        counts = [compiled("value"), compiled("tanh")]
        second = sciflat.fit(wavy, model, optax.sgd(0.1), **kwargs)
        counts += [compiled("value"), compiled("step")]
    assert counts == [1, 0, 1, 2]
    for result in (first, second):
        expected = wavy(result.model, x, y)
        np.testing.assert_allclose(result.loss, expected, rtol=1e-14)


def test_the_fitted_model_calls_a_compiled_function_as_the_start_model_did(caplog):
    # `jax.jit` keys on commitment: an uncommitted start model and data give a fitted
    # model with uncommitted leaves, so a function jitted on the start is not compiled
    # again for the result (the neural ODE example's `predict`: twice per run); what
    # is committed stays committed, with one step compilation either way.
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    f = jax.jit(lambda m, x: jnp.sum(jax.vmap(m)(x)))
    model, adam = linear(), optax.adam(0.05)
    f(model, X)
    placed = jax.device_put(xy(), jax.devices()[0])
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        for data, committed in [(xy(), False), (placed, True)]:
            for steps in (3, 5):  # a second fit of the same structure: the same step
                result = sciflat.fit(
                    loss, model, adam, steps=steps, args=data, progress=False
                )
                assert {x.committed for x in arrays(result.model)} == {committed}
                assert result.p.committed is committed
    steps = [
        r for r in caplog.records if r.getMessage().startswith("Compiling jit(step)")
    ]
    assert len(steps) == 2
    f(result.model, X)
    assert f._cache_size() == 2  # pyright: ignore[reportFunctionMemberAccess]
    f(sciflat.fit(loss, model, adam, steps=3, args=xy(), progress=False).model, X)
    assert f._cache_size() == 2  # pyright: ignore[reportFunctionMemberAccess]


def test_a_second_fit_reads_its_own_data_through_the_same_step():
    adam = optax.adam(0.05)
    x, y = xy()
    a = sciflat.fit(loss, linear(), adam, steps=5, args=(x, y), progress=False)
    b = sciflat.fit(loss, linear(), adam, steps=5, args=(x, 2 * y), progress=False)
    c = sciflat.fit(
        loss, linear(), optax.adam(0.05), steps=5, args=(x, 2 * y), progress=False
    )
    assert not np.array_equal(a.p, b.p)
    assert np.array_equal(b.p, c.p)


def test_batches_one_per_step_resume_and_running_out(tmp_path):
    path = tmp_path / "ckpt.npz"
    x, y = xy()
    batches = [(x[i % 6 : i % 6 + 2], y[i % 6 : i % 6 + 2]) for i in range(0, 16, 2)]
    batch_loss = lambda m, b: loss(m, *b)
    kwargs = dict(batches=batches, progress=False)
    full = sciflat.fit(batch_loss, linear(), optax.sgd(0.1), **kwargs)
    assert full.status == "completed" and full.n_steps == 8
    assert "ran out after 8 steps" in full.message
    p, re = sciflat.destructure(linear())
    for b in batches:  # plain SGD by hand, batch by batch
        p = p - 0.1 * jax.grad(lambda p, b=b: loss(re(p), *b))(p)
    np.testing.assert_allclose(full.p, p, rtol=1e-13)
    # Stopped by `steps` at 5, resumed: the batches of the steps done are skipped.
    sciflat.fit(
        batch_loss, linear(), optax.sgd(0.1), steps=5, checkpoint=path, **kwargs
    )
    rest = sciflat.fit(
        batch_loss, linear(), optax.sgd(0.1), checkpoint=path, resume=True, **kwargs
    )
    assert rest.n_steps == 8
    np.testing.assert_array_equal(rest.history, full.history)
    np.testing.assert_array_equal(rest.p, full.p)


def test_progress_bar_shows_the_loss(capsys):
    sciflat.fit(loss, linear(), optax.adam(1e-2), steps=3, args=xy(), progress=True)
    assert "loss=" in capsys.readouterr().err


def test_progress_in_a_log_is_plain_lines_and_live_on_a_terminal(capsys, monkeypatch):
    # Not a terminal (a CI log, a file): whole lines, no carriage-return animation:
    # here one at the start and one at the end (the fit is shorter than LOG_INTERVAL).
    sciflat.fit(loss, linear(), ADAM, steps=50, args=xy(), progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 2, lines
    assert "0/50" in lines[0] and "50/50" in lines[1] and "loss=" in lines[1]
    # On a terminal: tqdm's live bar, redrawn in place.
    monkeypatch.setattr(sciflat._fitting.progress, "_is_terminal", lambda stream: True)
    sciflat.fit(loss, linear(), ADAM, steps=3, args=xy(), progress=True)
    assert "\r" in capsys.readouterr().err


def test_progress_in_a_notebook_without_ipywidgets_is_the_text_bar(capsys, monkeypatch):
    # tqdm's widget needs ipywidgets; without it, the text bar (no error, no warning).
    monkeypatch.setattr(sciflat._fitting.progress, "in_notebook", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    sciflat.fit(loss, linear(), ADAM, steps=3, args=xy(), progress=True)
    assert "3/3" in capsys.readouterr().err


#
# The dtype rule through Optax
#


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float64_step_computes_in_float64_only(name):
    optimizer = OPTIMIZERS[name]()
    p, re = sciflat.destructure(linear(jnp.float32), dtype=jnp.float64)
    state = strong(optimizer.init(p), p.dtype)
    step = make_step(loss, re, optimizer, (None, None), reuses_value(state))
    args = (State(p, state, p, jnp.asarray(jnp.inf), p), None, xy())
    jaxpr = jax.make_jaxpr(step)(*args)
    avals = {a.str_short(short_dtypes=True) for _, a in float_outputs(jaxpr)}
    out = jax.eval_shape(step, *args)
    (new_p, new_state, *_), value, *_ = out
    assert new_p.dtype == value.dtype == jnp.float64
    assert inexact_dtypes(new_state) <= {np.dtype(np.float64)}
    if name == "sgd_schedule":
        # Optax's schedules compute the learning rate in float32 (0.1 becomes
        # 0.10000000149); it is a scalar, cast to float64 before it meets an update.
        assert {a for a in avals if not a.startswith("f64")} <= {"f32[]"}
    else:
        assert all(a.startswith("f64") for a in avals), avals


@pytest.mark.parametrize("name", ["adamw", "sgd_schedule"])
def test_float32_model_trained_in_float64_is_float64_throughout(name):
    result = sciflat.fit(
        loss,
        linear(jnp.float32),
        OPTIMIZERS[name](),
        steps=3,
        args=xy(),
        dtype=jnp.float64,
        progress=False,
    )
    assert result.p.dtype == jnp.float64
    assert inexact_dtypes(result.model) == {np.dtype(np.float64)}
    assert inexact_dtypes(result.raw) <= {np.dtype(np.float64)}
    assert np.isfinite(result.loss)


def test_float32_model_trained_in_float64_adam_and_lbfgs(adam_runs, lbfgs_runs):
    for runs, _ in (adam_runs, lbfgs_runs):
        for result in runs.values():
            assert result.p.dtype == jnp.float64
            assert inexact_dtypes(result.model) == {np.dtype(np.float64)}
            assert inexact_dtypes(result.raw) <= {np.dtype(np.float64)}


#
# Stops: non-finite, Ctrl-C, callback
#


def sqrt_loss(model):
    # `b` walks down under SGD until sqrt(b) is NaN; `w` stays finite throughout.
    return jnp.sum(model["w"] ** 2) + jnp.sqrt(model["b"][0])


def test_nonfinite_stops_with_step_leaf_and_last_finite_point(capsys):
    model = {"w": jnp.ones(2), "b": jnp.array([0.5])}
    result = sciflat.fit(sqrt_loss, model, optax.sgd(0.3), steps=50, progress=False)
    assert capsys.readouterr().err == ""  # progress=False: silent
    assert result.status == "nonfinite"
    k = result.n_steps
    assert 0 < k < 50 and len(result.history) == k
    assert f"at step {k}" in result.message
    assert "`['b']`" in result.message and "`['w']`" not in result.message
    # The returned point is the last one whose loss was finite: step k - 1, by hand too.
    p, re = sciflat.destructure(model)
    for _ in range(k - 1):
        p = p - 0.3 * jax.grad(lambda p: sqrt_loss(re(p)))(p)
    np.testing.assert_allclose(result.p, p, rtol=1e-13)
    assert result.loss == result.history[-1] == pytest.approx(float(sqrt_loss(re(p))))
    assert result.raw is None  # the state after the bad step is not handed out


def test_nonfinite_from_the_start_names_the_leaf():
    model = {"w": jnp.ones(2), "b": jnp.array([-1.0])}
    result = sciflat.fit(sqrt_loss, model, optax.sgd(0.3), steps=5, progress=False)
    assert result.status == "nonfinite" and result.n_steps == 0
    assert "at step 0" in result.message and "`['b']`" in result.message
    np.testing.assert_array_equal(result.p, sciflat.destructure(model)[0])


def test_ctrl_c_returns_the_best_point_so_far():
    result = sciflat.fit(
        loss,
        linear(),
        optax.sgd(0.9),
        steps=100,
        args=xy(),
        progress=False,
        callback=interrupt_at(6),
    )
    assert result.status == "interrupted" and result.n_steps == 6
    assert "Interrupted" in result.message
    assert result.loss == min(result.history)
    assert float(loss(result.model, *xy())) == pytest.approx(result.loss, rel=1e-14)


@pytest.fixture
def python_sigint():
    """SIGINT with Python's own handler, as in a terminal (a shell starts a
    background job, where the suite may run, with SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_real_sigint_stops_after_the_current_step(python_sigint):
    def callback(step, value, model):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    result = sciflat.fit(
        loss,
        linear(),
        optax.adam(1e-2),
        steps=100,
        args=xy(),
        progress=False,
        callback=callback,
    )
    assert result.status == "interrupted" and result.n_steps == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_process_that_ignores_or_handles_sigint_keeps_its_behaviour():
    # `fit` catches Ctrl-C only over Python's own handler: ignored stays ignored
    # (every step runs), and a handler of the process's own is the one called.
    seen = []

    def callback(step, value, model):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    kwargs = dict(steps=6, args=xy(), progress=False, callback=callback)
    before = signal.getsignal(signal.SIGINT)
    try:
        for handler in (signal.SIG_IGN, lambda signum, frame: seen.append(signum)):
            signal.signal(signal.SIGINT, handler)
            result = sciflat.fit(loss, linear(), ADAM, **kwargs)
            assert result.status == "completed" and result.n_steps == 6
            assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen == [signal.SIGINT]


def test_sigint_without_callback_or_checkpoint(tmp_path, python_sigint):
    # No callback and no checkpoint: step k+1 is dispatched before step k's loss is
    # read. Ctrl-C must still record every step run and leave a usable state.
    x, y = xy()

    def batches():
        for i in range(100):
            if i == 3:
                os.kill(os.getpid(), signal.SIGINT)
            yield x, y

    batch_loss = lambda m, b: loss(m, *b)
    result = sciflat.fit(batch_loss, linear(), ADAM, batches=batches(), progress=False)
    assert result.status == "interrupted" and result.n_steps == 3
    full = sciflat.fit(
        batch_loss, linear(), ADAM, steps=3, batches=batches(), progress=False
    )
    np.testing.assert_array_equal(result.history, full.history)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(result.raw))
    assert result.loss == min(result.history)


def test_callback_sees_the_model_and_can_stop():
    seen = []

    def callback(step, value, model):
        seen.append((step, value, float(loss(model, *xy()))))
        return step == 4

    result = sciflat.fit(
        loss,
        linear(),
        optax.adam(1e-2),
        steps=100,
        args=xy(),
        progress=False,
        callback=callback,
    )
    assert result.status == "converged" and result.n_steps == 4
    assert [s for s, _, _ in seen] == [1, 2, 3, 4]
    # The callback's model is the one after step k, whose loss history records next.
    assert seen[0][2] == pytest.approx(result.history[1], rel=1e-14)


#
# Checkpoints
#


def test_resume_equals_an_uninterrupted_run_bit_for_bit(adam_runs, lbfgs_runs):
    for runs, _ in (adam_runs, lbfgs_runs):
        full, part, rest = runs["full"], runs["part"], runs["rest"]
        assert part.status == "interrupted" and "checkpoint written" in part.message
        assert part.n_steps == 6 and rest.status == "completed" and rest.n_steps == 12
        np.testing.assert_array_equal(rest.history, full.history)
        np.testing.assert_array_equal(rest.p, full.p)
        assert jax.tree.all(jax.tree.map(np.array_equal, rest.raw, full.raw))


def test_checkpoint_is_a_loadable_model_file(tmp_path):
    path = tmp_path / "ckpt.npz"
    result = sciflat.fit(
        loss,
        linear(),
        optax.adam(1e-2),
        steps=5,
        args=xy(),
        progress=False,
        checkpoint=path,
        checkpoint_every=2,
    )
    np.testing.assert_array_equal(
        sciflat.load(path, sciflat.destructure(linear())[1]), result.p
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz"]  # no temp files left


def test_a_crash_while_writing_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, adam_runs
):
    path = tmp_path / "ckpt.npz"
    writes = []
    real_savez = np.savez

    def failing_savez(f, **arrays):
        writes.append(1)
        if len(writes) == 2:
            f.write(b"half a file")
            raise OSError("disk full")
        real_savez(f, **arrays)

    monkeypatch.setattr(np, "savez", failing_savez)
    kwargs = dict(
        steps=12, args=xy(), dtype=jnp.float64, progress=False, checkpoint=path
    )
    with pytest.raises(OSError, match="disk full"):
        sciflat.fit(
            loss,
            linear(jnp.float32),
            OPTIMIZERS["adam"](),
            checkpoint_every=2,
            **kwargs,
        )
    monkeypatch.undo()
    # Step 2's checkpoint, intact; no temp file.
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz"]
    rest = sciflat.fit(
        loss, linear(jnp.float32), OPTIMIZERS["adam"](), resume=True, **kwargs
    )
    np.testing.assert_array_equal(rest.history, adam_runs[0]["full"].history)


def test_an_existing_checkpoint_is_never_overwritten_silently(tmp_path):
    path = tmp_path / "ckpt.npz"
    kwargs = dict(steps=2, args=xy(), progress=False, checkpoint=path)
    sciflat.fit(loss, linear(), optax.adam(1e-2), **kwargs)
    with pytest.raises(ValueError, match=r"already exists.*resume=True"):
        sciflat.fit(loss, linear(), optax.adam(1e-2), **kwargs)
    with pytest.raises(ValueError, match="optimiser the checkpoint was written with"):
        sciflat.fit(loss, linear(), optax.sgd(0.1), resume=True, **kwargs)
    no_bias = eqx.nn.Linear(2, "scalar", use_bias=False, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"first extra one is `\.bias`"):
        sciflat.fit(loss, no_bias, optax.adam(1e-2), resume=True, **kwargs)
    again = sciflat.fit(loss, linear(), optax.adam(1e-2), resume=False, **kwargs)
    assert again.n_steps == 2


def test_bfloat16_fit_checkpoints_and_resumes_exactly(tmp_path):
    # bfloat16 has no NumPy dtype of its own: stored as raw 16-bit words, restored bit
    # for bit, together with the bfloat16 Adam moments.
    path = tmp_path / "ckpt.npz"
    kwargs = dict(steps=6, args=xy(jnp.bfloat16), dtype=jnp.bfloat16, progress=False)
    full = sciflat.fit(loss, linear(), ADAM, **kwargs)
    sciflat.fit(
        loss, linear(), ADAM, checkpoint=path, callback=interrupt_at(3), **kwargs
    )
    rest = sciflat.fit(loss, linear(), ADAM, checkpoint=path, resume=True, **kwargs)
    assert rest.p.dtype == jnp.bfloat16
    assert inexact_dtypes(rest.raw) == {np.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(rest.history, full.history)
    np.testing.assert_array_equal(rest.p.view(jnp.uint16), full.p.view(jnp.uint16))


def test_a_loss_in_another_dtype_than_p_is_refused():
    # The strict rule, as `minimize`'s: a float32 loss of a float64 `p` means something
    # in the loss casts, and the fit would silently run in float32.
    loss32 = lambda m, x, y: loss(m, x, y).astype(jnp.float32)
    with pytest.raises(TypeError, match=r"`loss` returns float32.*`p` is float64"):
        sciflat.fit(loss32, linear(), ADAM, steps=1, args=xy(), progress=False)


def _quadratic(m):
    return (m["b1"] - 3.0) ** 2 + (m["b2"] - 2.0) ** 2


@pytest.mark.parametrize("b2_dtype", [jnp.float32, jnp.float64])
def test_python_floats_in_a_dict_are_fitted_in_the_dtype_of_p(b2_dtype):
    # Issue 12: `{"b1": 1.0, "b2": array}` once fitted b2 only and reported success.
    model = {"b1": 1.0, "b2": jnp.asarray(0.1, b2_dtype)}
    result = sciflat.fit(_quadratic, model, optax.adam(0.2), steps=300, progress=False)
    assert len(result.p) == 2 and result.p.dtype == b2_dtype
    for name, want in (("b1", 3.0), ("b2", 2.0)):
        assert result.model[name].dtype == b2_dtype
        np.testing.assert_allclose(result.model[name], want, atol=1e-3)


def test_python_floats_alone_follow_jax_default_float(x64_off):
    result = sciflat.fit(
        _quadratic, {"b1": 1.0, "b2": 0.5}, optax.adam(0.2), steps=300, progress=False
    )
    assert result.p.dtype == jnp.float32
    np.testing.assert_allclose(result.p, [3.0, 2.0], atol=1e-3)


def test_a_module_of_python_floats_only_is_refused_by_name():
    class Rates(eqx.Module):
        k: float = 1.0

    with pytest.raises(ValueError, match=r"`\.k`.*jnp\.asarray"):
        sciflat.fit(lambda m: m.k**2, Rates(), optax.adam(0.1), steps=2, progress=False)


def test_a_non_finite_update_of_a_leaf_the_loss_does_not_read_stops_the_fit(tmp_path):
    # float16: Adam's eps (1e-8) underflows to 0, so the update of `b`, whose gradient
    # is 0, is 0 / 0. Loss and gradient stay finite: the fit ended "max_steps" with NaN
    # in `p`, and `save` then refused the result. The reference: Adam by hand.
    model = {"a": jnp.asarray(1.0, jnp.float16), "b": jnp.asarray(1.0, jnp.float16)}
    f = lambda m: (m["a"] - 2.0) ** 2
    opt = optax.adam(1e-2)
    p0, re = sciflat.destructure(model)
    update, _ = opt.update(jax.grad(lambda p: f(re(p)))(p0), opt.init(p0), p0)
    assert bool(jnp.isnan(optax.apply_updates(p0, update)[1]))  # the defect's cause
    for steps in (1, 5):  # the bad update last, or a step at it
        res = sciflat.fit(f, model, opt, steps=steps, progress=False)
        assert res.status == "nonfinite" and not res.success
        assert "`['b']`" in res.message
        np.testing.assert_array_equal(res.p, p0)  # the last finite point: the start
        np.testing.assert_array_equal(res.history[:1], [float(f(model))])
        sciflat.save(tmp_path / "m.npz", res.p, res.re)  # finite: accepted


def test_a_completed_fit_is_a_success():
    # `fit` runs the steps it is given: running them all, without a non-finite stop,
    # is what it was asked to do (SciPy's budget stop, "max_steps", stays no success:
    # test_parameter_estimation.py).
    x, y = xy()
    res = sciflat.fit(
        loss, linear(), optax.sgd(0.1), steps=5, args=(x, y), progress=False
    )
    assert res.status == "completed" and res.success and res.n_steps == 5
    assert "completed (success)" in str(res)
    bad = sciflat.fit(
        lambda m, x, y: jnp.log(-loss(m, x, y)),
        linear(),
        optax.sgd(0.1),
        steps=5,
        args=(x, y),
        progress=False,
    )
    assert bad.status == "nonfinite" and not bad.success
