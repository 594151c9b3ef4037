"""What recompiles a SciPy fit: compilations reused exactly where `jax.jit` would
(`_scipy_programs`, `_scipy_fn_key`), and start models flattened once (`_scipy_start`).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np

import sciflat
from helpers import (
    C,
    T,
    Y,
    _spy,
    count_traces,
    exp_model,
    exp_residuals,
    quad_loss,
    quad_model,
    tied_loss,
)
from sciflat._fitting import problem as _problem, start as _scipy_start
from sciflat._fitting.fn_key import identity_key


def test_compiled_once_and_reused_for_new_data():
    traces = []

    def loss(m, c):
        traces.append(1)
        return quad_loss(m, c)

    r1 = sciflat.minimize(loss, quad_model(), args=(C,), mode="reverse", progress=False)
    r2 = sciflat.minimize(
        loss, quad_model(), args=(C + 1.0,), mode="reverse", progress=False
    )
    assert r1.raw.nfev > 3 and r2.raw.nfev > 3
    assert len(traces) == 1
    assert not np.allclose(r1.p, r2.p)


def _sum_of_squares(m, t, y):
    return jnp.sum(exp_residuals(m, t, y) ** 2)


def test_second_fit_traces_nothing_for_either_fit():
    fits = [
        lambda y: sciflat.least_squares(
            exp_residuals, exp_model(), args=(T, y), progress=False
        ),
        lambda y: sciflat.minimize(
            _sum_of_squares,
            exp_model(),
            args=(T, y),
            progress=False,
        ),
    ]
    y2 = Y * 2.0
    for fit in fits:
        first = fit(Y)
        # New data of the same shape, a new model object, the same loss: no trace.
        with count_traces() as traces:
            second = fit(y2)
        assert traces == []
        assert first.status == second.status == "converged"
        np.testing.assert_allclose(second.model["amp"], 6.0, rtol=1e-6)
        np.testing.assert_allclose(first.model["amp"], 3.0, rtol=1e-6)
        np.testing.assert_allclose(second.model["rate"], 1.3, rtol=1e-6)
    # Data of another shape is another compilation.
    t, y = T[:10], Y[:10]
    with count_traces() as traces:
        sciflat.least_squares(exp_residuals, exp_model(), args=(t, y), progress=False)
    assert traces


def test_a_compilation_is_reused_for_the_same_loss_only():
    """As under `jax.jit`: the same function object reuses its compilation, a new
    `lambda` (whatever its code and closure) compiles again."""
    loss = lambda m: jnp.sum((m.a - 2.0) ** 2) + m.b**2
    sciflat.minimize(loss, quad_model(), progress=False)
    with count_traces() as traces:
        res = sciflat.minimize(loss, quad_model(), progress=False)
    assert traces == []
    np.testing.assert_allclose(res.model.a, 2.0, atol=1e-6)
    target = np.asarray([1.0, 2.0, 3.0])
    fit = lambda: sciflat.minimize(
        lambda m: jnp.sum((m.a - target) ** 2) + m.b**2, quad_model(), progress=False
    )
    fit()
    target[0] = -5.0  # mutated in place: a new lambda sees it, as under `jax.jit`
    with count_traces() as traces:
        res = fit()
    assert traces
    np.testing.assert_allclose(res.model.a, [-5.0, 2.0, 3.0], atol=1e-6)


def _fit_a(loss):
    return sciflat.minimize(loss, {"a": 0.0}, progress=False).model["a"]


def test_a_changed_class_attribute_is_seen_by_a_new_lambda():
    # Issue 22: keyed by value, the class was keyed by identity and its attribute
    # never read, so the second fit silently returned the first compilation's answer.
    class Config:
        target = 1.0

    run = lambda: _fit_a(lambda m: jnp.sum((m["a"] - Config.target) ** 2))
    np.testing.assert_allclose(run(), 1.0, atol=1e-6)
    Config.target = 5.0
    np.testing.assert_allclose(run(), 5.0, atol=1e-6)
    assert jax.jit(lambda: Config.target * 1.0)() == 5.0  # the reference


def test_a_changed_closed_over_container_is_seen_by_a_new_lambda():
    # Issue 22: a set and a deque were keyed by identity (as library objects), so a
    # new lambda over the same, changed, container reused the first compilation.
    targets, queue = {1.0}, collections.deque([1.0])
    for target in ({1.0}, {1.0, 4.0}):
        targets.clear(), targets.update(target)
        queue.append(max(target))
        a = _fit_a(lambda m: jnp.sum((m["a"] - max(targets)) ** 2))
        np.testing.assert_allclose(a, max(target), atol=1e-6)
        a = _fit_a(lambda m: jnp.sum((m["a"] - queue[-1]) ** 2))
        np.testing.assert_allclose(a, max(target), atol=1e-6)


def test_args_of_arrays_split_as_any_args_do():
    # `args=(x, y)` skips `eqx.partition`; its key must be the general one, so that
    # both ways share compilations, and put the same arrays back.
    import equinox as eqx

    for args in [(np.ones(3), jnp.zeros(2)), (np.float64(2.0),), ()]:
        leaves, rebuild = _problem.split_args(args, to_device=False)
        dynamic, static = eqx.partition(args, eqx.is_array)
        general = _problem._Rebuild(jax.tree.structure(dynamic), static)
        assert rebuild == general and hash(rebuild) == hash(general)
        assert all(a is b for a, b in zip(rebuild(leaves), args, strict=True))
    # Not all arrays: the general way, the float in the key.
    _, mixed = _problem.split_args((np.ones(3), 2.0), to_device=False)
    assert mixed != _problem.split_args((np.ones(3), 3.0), to_device=False)[1]


def test_a_static_argument_of_the_other_sign_is_another_compilation():
    # 0.0 == -0.0 (and hash alike), so keyed by value alone the second fit of the same
    # loss reused the first one's compilation, with +0.0 compiled in: the minimum of
    # this loss is at copysign(1, c). The SciPy fits and `fit` share the key.
    import optax

    loss = lambda m, c: jnp.sum((m["a"] - jnp.copysign(1.0, c)) ** 2)
    adam = optax.adam(0.1)
    for c in (0.0, -0.0, 0.0):
        a = sciflat.minimize(loss, {"a": 0.3}, args=(c,), progress=False).model["a"]
        np.testing.assert_allclose(a, np.copysign(1.0, c), atol=1e-6)
        fitted = sciflat.fit(
            loss, {"a": 0.3}, adam, steps=150, args=(c,), progress=False
        )
        assert np.sign(fitted.model["a"]) == np.copysign(1.0, c)


def test_a_closed_over_generator_draws_anew_for_a_new_lambda():
    rng, reference = np.random.default_rng(0), np.random.default_rng(0)
    for _ in range(2):  # each trace draws the next number, as under `jax.jit`
        a = _fit_a(lambda m: jnp.sum((m["a"] - rng.normal()) ** 2))
        np.testing.assert_allclose(a, reference.normal(), atol=1e-6)


def test_a_callback_writes_into_its_own_fits_list():
    def run():
        seen = []
        loss = lambda m: (
            jax.debug.callback(lambda a: seen.append(float(a)), m["a"])
            or jnp.sum((m["a"] - 1.0) ** 2)
        )
        _fit_a(loss)
        return seen

    first = run()
    second = run()
    assert first and second  # each fit's evaluations in its own list


def test_clear_caches_forgets_compilations():
    loss = lambda m: jnp.sum((m["a"] - 3.0) ** 2)
    _fit_a(loss)
    with count_traces() as traces:
        _fit_a(loss)
    assert traces == []
    sciflat.clear_caches()
    with count_traces() as traces:
        np.testing.assert_allclose(_fit_a(loss), 3.0, atol=1e-6)
    assert traces


def test_a_changed_global_is_seen_by_a_new_lambda():
    global _SCALE
    fit = lambda: sciflat.minimize(
        lambda m: jnp.sum((m.a - _SCALE) ** 2) + m.b**2, quad_model(), progress=False
    )
    _SCALE = 1.0
    np.testing.assert_allclose(fit().model.a, 1.0, atol=1e-6)
    _SCALE = 2.0
    np.testing.assert_allclose(fit().model.a, 2.0, atol=1e-6)


_SCALE = 1.0


def test_matmul_precision_is_part_of_the_key():
    fit = lambda: sciflat.minimize(quad_loss, quad_model(), args=(C,), progress=False)
    fit()
    with count_traces() as traces, jax.default_matmul_precision("highest"):
        fit()
    assert traces  # not the default-precision compilation
    with count_traces() as traces:
        fit()
        with jax.default_matmul_precision("highest"):
            fit()
    assert traces == []  # both are cached now


def test_identity_key_sees_through_sciflats_adapters_only():
    # sciflat's own adapters, made anew per fit, around the same loss: equal.
    wrap = lambda loss: _problem.data_by_keyword(loss)
    assert identity_key(wrap(quad_loss)) == identity_key(wrap(quad_loss))
    assert identity_key(wrap(quad_loss)) != identity_key(wrap(tied_loss))
    # Anyone else's closures, however alike: by identity, as `jax.jit` keys them.
    make = lambda: jax.grad(quad_loss)
    assert identity_key(make()) != identity_key(make())
    f = make()
    assert identity_key(f) == identity_key(f)


def test_a_start_of_the_same_structure_is_flattened_once_with_its_own_values(
    monkeypatch,
):
    calls = []
    real = _scipy_start.destructure
    monkeypatch.setattr(
        _scipy_start, "destructure", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    sciflat.clear_caches()  # whatever other tests fitted before
    seen = _spy(monkeypatch, "minimize")
    loss = lambda m: jnp.sum((m["w"] - 1.0) ** 2) + jnp.sum(m["v"] ** 2)
    fit = lambda model: sciflat.minimize(loss, model, progress=False)
    w = jnp.asarray([3.0, 4.0])
    fit({"w": w, "v": jnp.asarray([5.0, 6.0])})
    fit({"w": w, "v": jnp.asarray([5.0, 6.0])})
    assert len(calls) == 1 and seen["x0"].tolist() == [5.0, 6.0, 3.0, 4.0]
    fit({"w": jnp.asarray([-1.0, 0.5]), "v": np.asarray([7.0, 8.0], np.float32)})
    assert len(calls) == 1 and seen["x0"].tolist() == [7.0, 8.0, -1.0, 0.5]
    mutable = {"w": np.asarray([3.0, 4.0]), "v": np.asarray([1.0, 2.0])}
    mutable["w"][0] = -2.0  # changed in place: the new start is used
    fit(mutable)
    assert len(calls) == 1 and seen["x0"].tolist() == [1.0, 2.0, -2.0, 4.0]
    # Another structure: the same array twice is one parameter vector, tied.
    result = fit({"w": w, "v": w})
    assert len(calls) == 2 and seen["x0"].tolist() == [3.0, 4.0]
    assert result.model["v"] is result.model["w"]
    fit({"w": jnp.asarray([3.0]), "v": w})  # another shape
    assert len(calls) == 3 and seen["x0"].tolist() == [3.0, 4.0, 3.0]
    # Frozen leaves are values `re` holds: flattened once per model, not structure.
    frozen = lambda v: {"w": jnp.asarray([3.0, 4.0]), "k": jnp.asarray(v, jnp.int32)}
    for v in (1, 2):
        sciflat.minimize(
            lambda m: jnp.sum(m["w"] ** 2) * m["k"], frozen(v), progress=False
        )
    assert len(calls) == 5


def test_a_frozen_numpy_leaf_changed_in_place_is_seen_by_the_next_fit():
    # A NumPy frozen leaf is baked into the trace; changed in place, the same loss
    # must compile again (the model is an argument: `jax.jit` would see 5.0).
    k = np.array([1.0])
    loss = lambda m: jnp.sum((m["a"] - m["k"]) ** 2)
    spec = {"a": True, "k": False}
    fit = lambda: sciflat.minimize(
        loss, {"a": jnp.zeros(1), "k": k}, filter_spec=spec, progress=False
    )
    np.testing.assert_allclose(fit().model["a"], 1.0, atol=1e-6)
    k[0] = 5.0
    np.testing.assert_allclose(fit().model["a"], 5.0, atol=1e-6)
