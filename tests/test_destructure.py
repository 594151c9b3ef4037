"""The contract of `destructure` and `re`, one test per sentence of the docstring."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import sciflat
from helpers import (
    EdgeModels,
    Mixed,
    Tied,
    inexact_dtypes,
    run_on_host_devices,
    tree_allclose,
)


EDGE = EdgeModels()  # built when a test first reads it

#
# Which leaves go into `p`, and in which order
#


def test_floating_and_complex_arrays_go_in_everything_else_passes_through():
    fn = lambda x: x + 1
    key = jax.random.key(0)
    model = {
        "f32": jnp.ones(2, jnp.float32),
        "np": np.full(3, 2.0, np.float32),
        "z": jnp.array([1 + 2j], jnp.complex64),
        "ints": jnp.arange(4),
        "bools": np.array([True, False]),
        "key": key,
        "py": 3.5,
        "fn": fn,
    }
    p, re = sciflat.destructure(model)
    # jax.tree order: keys sorted -> bools, f32, fn, ints, key, np, py, z.
    assert re.paths == ("['f32']", "['np']", "['z']")
    np.testing.assert_array_equal(p, [1, 1, 2, 2, 2, 1, 2])  # complex: real, then imag
    rebuilt = re(p)
    for name in ("ints", "bools", "key", "py", "fn"):
        assert rebuilt[name] is model[name]


def test_order_is_jax_tree_leaf_order():
    model = eqx.nn.MLP(2, 3, 4, 2, key=jax.random.key(0))
    p, _ = sciflat.destructure(model)
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    np.testing.assert_array_equal(p, jnp.concatenate([x.ravel() for x in leaves]))


@pytest.mark.parametrize("name", sorted(EDGE))
def test_length_counts_unique_trainable_scalars(name):
    model, _ = EDGE[name]
    p, re = sciflat.destructure(model)
    unique = {id(x): x for x in jax.tree.leaves(model) if eqx.is_inexact_array(x)}
    expected = sum(x.size * (2 if jnp.iscomplexobj(x) else 1) for x in unique.values())
    assert len(p) == len(re) == expected
    assert p.ndim == 1 and jnp.issubdtype(p.dtype, jnp.floating)


def test_filter_spec_freezes_leaves():
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda s: s.layers[-1].bias, spec, replace=True)
    p, re = sciflat.destructure(model, spec)
    assert re.paths == (".layers[1].bias",) and p.shape == (2,)
    rebuilt = re(p.astype(jnp.float64))
    # Frozen floating leaves follow p's dtype too, with their values.
    assert rebuilt.layers[0].weight.dtype == jnp.float64
    np.testing.assert_allclose(rebuilt.layers[0].weight, model.layers[0].weight)


def test_a_tie_cannot_be_half_frozen():
    w = jnp.ones(2)
    with pytest.raises(ValueError, match=r"\['b'\].*trainable everywhere or frozen"):
        sciflat.destructure({"a": w, "b": w}, {"a": True, "b": False})


def test_empty_model_gives_an_empty_vector():
    p, re = sciflat.destructure(())
    assert p.shape == (0,) and p.dtype == jnp.float64  # JAX's default float (x64 on)
    assert re(p) == ()
    p, re = sciflat.destructure({"n": jnp.arange(3)})
    assert p.shape == (0,) and re(p)["n"].dtype == jnp.arange(3).dtype


#
# The dtype of `p`, and the dtype rule of `re(p)`
#


def test_p_has_the_promoted_dtype_of_the_trainable_leaves():
    assert sciflat.destructure({"a": jnp.ones(2, jnp.float32)})[0].dtype == jnp.float32
    mixed, _ = EDGE["mixed_precision"]
    assert sciflat.destructure(mixed)[0].dtype == jnp.float64
    half = {"a": jnp.ones(1, jnp.bfloat16), "b": jnp.ones(1, jnp.float16)}
    assert sciflat.destructure(half)[0].dtype == jnp.float32
    assert (
        sciflat.destructure({"z": jnp.ones(1, jnp.complex64)})[0].dtype == jnp.float32
    )
    assert sciflat.destructure(mixed, dtype=jnp.bfloat16)[0].dtype == jnp.bfloat16


DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", sorted(set(EDGE) - {"complex_leaf"}))
def test_every_floating_leaf_is_rebuilt_in_p_dtype(name, dtype):
    model, _ = EDGE[name]
    p, re = sciflat.destructure(model, eqx.is_inexact_array)
    rebuilt = re(p.astype(dtype))
    assert inexact_dtypes(rebuilt) <= {np.dtype(dtype)}
    # Frozen leaves obey the rule too.
    q, re_frozen = sciflat.destructure(model, False, dtype=dtype)
    assert q.shape == (0,)
    assert inexact_dtypes(re_frozen(q)) <= {np.dtype(dtype)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_complex_leaves_get_the_matching_complex_dtype(dtype):
    model, _ = EDGE["complex_leaf"]
    p, re = sciflat.destructure(model, dtype=dtype)
    expected = jnp.complex64 if dtype == jnp.float32 else jnp.complex128
    rebuilt = re(p)
    assert rebuilt.z.dtype == expected and rebuilt.w.dtype == dtype
    np.testing.assert_allclose(rebuilt.z, model.z)
    # Frozen complex leaves too.
    _, re_frozen = sciflat.destructure(model, False, dtype=dtype)
    assert re_frozen(jnp.zeros(0, dtype)).z.dtype == expected


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_complex_leaf_with_a_half_precision_p_is_an_error(dtype):
    model, _ = EDGE["complex_leaf"]
    with pytest.raises(TypeError, match=r"`\.z`.*no complex counterpart"):
        sciflat.destructure(model, dtype=dtype)
    p, re = sciflat.destructure(model)
    with pytest.raises(TypeError, match=r"`\.z`.*no complex counterpart"):
        re(p.astype(dtype))
    # A frozen complex leaf, too, is refused up front with its path.
    with pytest.raises(TypeError, match=r"frozen leaf `\.z`.*no complex counterpart"):
        sciflat.destructure(model, lambda x: x.dtype != jnp.complex64, dtype=dtype)


def test_mixed_precision_model_computes_in_p_dtype():
    model, x = EDGE["mixed_precision"]
    p, re = sciflat.destructure(model)
    for dtype in (jnp.float32, jnp.float64):
        out = re(p.astype(dtype))(x.astype(dtype))
        assert out.dtype == dtype
        assert inexact_dtypes(re(p.astype(dtype))) == {np.dtype(dtype)}
    assert re(p).counts.dtype == model.counts.dtype  # ints untouched


#
# Ties
#


def test_identity_ties_share_one_array_after_rebuild():
    model, _ = EDGE["nested_tie"]
    p, re = sciflat.destructure(model)
    assert len(p) == 2
    rebuilt = re(p * 3)
    assert rebuilt.layers[0].weight is rebuilt.layers[2].weight


def test_python_and_numpy_scalars_are_never_tied():
    s = np.float64(1.0)
    model = {"a": s, "b": s, "c": 2.0, "d": 2.0}
    p, re = sciflat.destructure(model)
    assert p.shape == (2,)  # the NumPy scalars, each its own entry; Python floats pass
    assert re(jnp.array([1.0, 2.0]))["c"] == 2.0


#
# Transformations
#


def test_jit_does_not_retrace_for_a_new_p():
    model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
    p, re = sciflat.destructure(model)
    traces = []

    def loss(p, re):
        traces.append(None)
        return jnp.sum(re(p)(jnp.ones(2)))

    as_pytree = jax.jit(loss)
    as_static = jax.jit(loss, static_argnums=1)
    for f in (as_pytree, as_static):
        traces.clear()
        f(p, re)
        f(p + 1, re)
        f(p * 2, sciflat.destructure(model)[1])  # an equal `re` from a new call
        assert len(traces) == 1
    assert hash(re) == hash(sciflat.destructure(model)[1])


def test_rebuilt_leaves_are_committed_as_p_is():
    # `jax.jit` keys on commitment: a model rebuilt from an uncommitted `p` (what a
    # SciPy fit returns) must call a compiled function as the start model did, with
    # no second compilation; a committed `p` gives committed leaves (they follow it).
    model = {"a": jnp.asarray(1.5, jnp.float64), "w": jnp.ones(3)}
    p, re = sciflat.destructure(model)
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    for q, committed in [(p, False), (jax.device_put(p, jax.devices()[0]), True)]:
        assert q.committed is committed
        assert {x.committed for x in arrays(re(q))} == {committed}
    f = jax.jit(lambda m: m["a"] * jnp.sum(m["w"]))
    f(model)
    result = sciflat.least_squares(
        lambda m: jnp.concatenate([m["w"] - 2.0, (m["a"] - 3.0)[None]]),
        model,
        progress=False,
    )
    assert float(f(result.model)) == pytest.approx(18.0)
    assert f._cache_size() == 1  # pyright: ignore[reportFunctionMemberAccess]


def test_vmap_of_parameter_vectors_gives_an_ensemble():
    model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
    p, re = sciflat.destructure(model)
    ps = jnp.stack([p, 2 * p, -p])
    ensemble = eqx.filter_vmap(re)(ps)
    assert ensemble.layers[0].weight.shape == (3, *model.layers[0].weight.shape)
    x = jnp.ones(2)
    outs = jax.vmap(lambda q: re(q)(x))(ps)
    for i in range(3):
        np.testing.assert_allclose(outs[i], re(ps[i])(x), rtol=1e-6)


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_forward_mode_and_hessian_agree_with_the_plain_pytree():
    model, x = EDGE["tied_identity"]
    p, re = sciflat.destructure(model, dtype=jnp.float64)
    f = lambda p: jnp.sum(jnp.tanh(re(p)(x)) ** 2)
    np.testing.assert_allclose(jax.jacfwd(f)(p), jax.grad(f)(p), rtol=1e-6)
    v = jnp.array([0.3, -1.0])
    _, tangent = jax.jvp(f, (p,), (v,))
    np.testing.assert_allclose(tangent, jax.grad(f)(p) @ v, rtol=1e-6)
    # Hessian against the plain two-parameter function (weight, bias used twice).
    plain = lambda wb: jnp.sum(jnp.tanh(2 * (wb[0] * x + wb[1])) ** 2)
    np.testing.assert_allclose(jax.hessian(f)(p), jax.hessian(plain)(p), rtol=1e-6)


def test_gradient_of_a_mixed_model_matches_the_plain_pytree():
    model, x = EDGE["mixed_precision"]
    p, re = sciflat.destructure(model)
    grad = jax.grad(lambda p: re(p)(x))(p)
    ref = eqx.filter_grad(lambda m: m(x))(model)
    expected = jnp.concatenate([ref.w32.astype(p.dtype), ref.w64])
    np.testing.assert_allclose(grad, expected)


#
# Errors, never silent casts
#


def test_wrong_length_names_both_sizes():
    p, re = sciflat.destructure(EDGE["mlp_float32"][0])
    with pytest.raises(
        ValueError,
        match=rf"Restructure\(MLP\) expected a vector of length {len(p)}, got {len(p) - 1}",
    ):
        re(p[:-1])
    with pytest.raises(ValueError, match=r"1-D vector.*got shape \(1, "):
        re(p[None])


@pytest.mark.parametrize(
    "bad, match",
    [
        (jnp.zeros(2, jnp.int32), "got dtype int32"),
        (jnp.zeros(2, bool), "got dtype bool"),
        (jnp.zeros(2, jnp.complex64), "never become complex"),
        ("ab", "got str"),
    ],
)
def test_non_real_p_is_a_type_error(bad, match):
    _, re = sciflat.destructure({"a": jnp.ones(2)})
    with pytest.raises(TypeError, match=match):
        re(bad)


def test_float64_numpy_p_with_x64_off_is_refused(x64_off):
    _, re = sciflat.destructure({"a": jnp.ones(2)})
    for bad in (np.ones(2), [1.0, 2.0]):
        with pytest.raises(TypeError, match=r"64-bit mode is off.*jax_enable_x64"):
            re(bad)
    assert re(np.ones(2, np.float32))["a"].dtype == jnp.float32
    with pytest.raises(TypeError, match=r"`dtype` has dtype float64.*jax_enable_x64"):
        sciflat.destructure({"a": jnp.ones(2)}, dtype=np.float64)
    with pytest.raises(TypeError, match=r"`\['w'\]` has dtype float64"):
        sciflat.destructure({"w": np.ones(2)})


def test_lists_and_numpy_p_are_accepted_when_exact():
    _, re = sciflat.destructure({"a": jnp.ones(2)})
    assert re([1.0, 2.0])["a"].dtype == jnp.float64
    assert re(np.ones(2, np.float32))["a"].dtype == jnp.float32


def test_unsupported_leaf_names_its_path():
    model = {"layer": {"w": np.array([object(), 1], dtype=object)}}
    with pytest.raises(
        TypeError, match=r"`\['layer'\]\['w'\]` is an array of dtype object"
    ):
        sciflat.destructure(model)


def test_bad_dtype_argument():
    with pytest.raises(TypeError, match="real floating dtype, got int32"):
        sciflat.destructure({"a": jnp.ones(1)}, dtype=jnp.int32)


#
# Round trip, repr and lookup
#


@pytest.mark.parametrize("name", sorted(EDGE))
def test_round_trip(name):
    model, _ = EDGE[name]
    p, re = sciflat.destructure(model)
    # The same values, every floating leaf in `p.dtype` (float32 -> float64 is exact).
    complex_p = (1j * np.zeros((), p.dtype)).dtype
    in_p_dtype = lambda x: (
        x.astype(complex_p if jnp.iscomplexobj(x) else p.dtype)
        if eqx.is_inexact_array(x)
        else x
    )
    assert tree_allclose(re(p), jax.tree.map(in_p_dtype, model), rtol=0, atol=0)
    q, _ = sciflat.destructure(re(p))
    np.testing.assert_array_equal(p, q)
    assert q.dtype == p.dtype


def test_agrees_with_ravel_pytree_on_untied_single_dtype_models():
    model = eqx.nn.MLP(3, 2, 5, 2, key=jax.random.key(3))
    params = eqx.filter(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)
    p, re = sciflat.destructure(model)
    np.testing.assert_array_equal(p, flat)
    assert tree_allclose(eqx.filter(re(2 * p), eqx.is_inexact_array), unravel(2 * flat))


def test_repr_len_and_slices():
    model = Tied(*(2 * [eqx.nn.Linear(2, 3, key=jax.random.key(0), dtype=jnp.float32)]))
    p, re = sciflat.destructure(model)
    assert repr(re) == "Restructure(Tied, 9 params, float32)"
    assert len(re) == 9 and re.dtype == jnp.float32
    assert re.slice(".b.bias") == re.slice("a.bias") == slice(6, 9)
    assert re.slice(lambda m: m.b.weight) == slice(0, 6)
    np.testing.assert_array_equal(p[re.slice(lambda m: m.a.bias)], model.a.bias)
    with pytest.raises(KeyError, match=r"No trainable leaf at path 'c\.bias'"):
        re.slice("c.bias")


def test_numpy_model_is_rebuilt_as_jax_arrays_in_p_dtype():
    model, _ = EDGE["numpy_leaves"]
    p, re = sciflat.destructure(model)
    rebuilt = re(p.astype(jnp.float32))
    assert isinstance(rebuilt["w"], jax.Array) and rebuilt["w"].dtype == jnp.float32
    assert rebuilt["i"] is model["i"]


def test_mixed_model_round_trip_values():
    model = Mixed(jnp.ones(2, jnp.float32), jnp.full(2, 0.5), jnp.arange(2))
    p, re = sciflat.destructure(model)
    rebuilt = re(p)
    np.testing.assert_array_equal(rebuilt.w32, model.w32)
    np.testing.assert_array_equal(rebuilt.w64, model.w64)
    assert rebuilt.name == "mixed"


def test_a_tie_declared_by_transform_without_shared():
    k1, k2 = jax.random.split(jax.random.key(4))
    enc = eqx.nn.Linear(3, 2, key=k1, dtype=jnp.float32)
    dec = eqx.nn.Linear(2, 3, key=k2, dtype=jnp.float32)
    model = (enc, dec)
    ties = [(lambda m: m[1].weight, lambda m: m[0].weight.T)]
    p, re = sciflat.destructure(model, ties=ties, dtype=jnp.float64)
    assert len(p) == 6 + 2 + 3 and "[1].weight" not in re.paths
    rebuilt = re(p)
    np.testing.assert_array_equal(rebuilt[1].weight, rebuilt[0].weight.T)
    x = jnp.linspace(-1.0, 1.0, 3)
    loss = lambda m: jnp.sum(m[1](jnp.tanh(m[0](x))) ** 2)
    grad = jax.grad(lambda p: loss(re(p)))(p)
    tied = eqx.tree_at(lambda m: m[1].weight, model, model[0].weight.T)
    g = jax.grad(loss)(jax.tree.map(lambda a: a.astype(jnp.float64), tied))
    np.testing.assert_allclose(
        grad[re.slice(".[0].weight")], (g[0].weight + g[1].weight.T).ravel(), rtol=1e-10
    )
    with pytest.raises(ValueError, match="structure, shapes and dtypes"):
        sciflat.destructure(
            model, ties=[(lambda m: m[1].weight, lambda m: m[0].weight)]
        )


#
# Eager `re(p)` on an accelerator: the pieces are cut on `p`'s device. Forced here on
# the CPU (where `re` normally splits with NumPy) and compared with the NumPy path.
#


@pytest.fixture
def device_path(monkeypatch):
    import sciflat._flatten as flatten

    monkeypatch.setattr(flatten, "_on_host", lambda p: False)
    return flatten


def _same_rebuild(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if eqx.is_array(x):
            assert np.dtype(x.dtype) == np.dtype(y.dtype) and np.shape(x) == np.shape(y)
            if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert x is y or x == y


@pytest.mark.parametrize(
    "name, dtype",
    [
        (name, dtype)
        for name in sorted(EDGE)
        for dtype in (jnp.float16, jnp.float64)
        if not (name == "complex_leaf" and dtype == jnp.float16)  # refused, above
    ],
    ids=str,
)
def test_eager_rebuild_on_device_matches_the_numpy_path(name, dtype, device_path):
    model, _ = EDGE[name]
    p, re = sciflat.destructure(model)
    q = (p + 1).astype(dtype)
    on_device = re(q)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_path, "_on_host", lambda p: True)
        on_host = re(q)
    _same_rebuild(on_device, on_host)
    arrays = jax.tree.leaves(eqx.filter(on_device, eqx.is_inexact_array))
    assert all(isinstance(x, jax.Array) and x.devices() == q.devices() for x in arrays)
    if name in ("tied_identity", "nested_tie"):
        leaves = jax.tree.leaves(on_device)
        assert len({id(x) for x in leaves}) < len(leaves)  # the tie is one array


def test_eager_rebuild_on_device_compiles_one_kernel_per_leaf_shape(device_path):
    # 200 leaves of one shape (one no other test uses) and 3 of another: 2 kernels.
    model = [jnp.full((3, 7), float(i)) for i in range(200)] + [jnp.ones(11)] * 3
    model += [jnp.ones(11), jnp.ones(11)]
    p, re = sciflat.destructure(model)
    before = device_path._take._cache_size()
    rebuilt = re(p)
    assert device_path._take._cache_size() - before <= 2
    re(p * 2)
    assert device_path._take._cache_size() - before <= 2
    for i in range(200):
        np.testing.assert_array_equal(rebuilt[i], np.full((3, 7), float(i)))


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_eager_rebuild_on_device_stays_on_p_device():
    """Two forced host devices, `p` on the second: both device paths (the whole split,
    and one kernel per shape for many same-shape leaves) leave every array there."""
    import textwrap

    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, equinox as eqx, sciflat, sciflat._flatten as F
        F._on_host = lambda p: False
        cpu0, cpu1 = jax.devices()
        mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
        spec = eqx.tree_at(lambda m: m.layers[0].bias, jax.tree.map(lambda _: True, mlp), False)
        many = [jnp.ones(3)] * 2 + [jnp.ones(3) for _ in range(9)]
        for model, spec in [(mlp, spec), (many, True)]:
            p, re = sciflat.destructure(model, spec)
            q = jax.device_put(p, cpu1)
            arrays = jax.tree.leaves(eqx.filter(re(q), eqx.is_array))
            assert {x.devices().pop() for x in arrays} == {cpu1}
        print("ok")
        """
    )
    run_on_host_devices(code)
