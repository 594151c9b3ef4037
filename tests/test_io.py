"""`sciflat.save` / `sciflat.load`: round trips, an inspectable file, refusals."""

import dataclasses
import json
import os
import re as re_module
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sciflat
from helpers import EdgeModels, Tied, inexact_dtypes, random_models, tree_allclose


EDGE = EdgeModels()  # built when a test first reads it


def read_raw(path):
    """What any NumPy user sees in the file, without sciflat."""
    with np.load(path, allow_pickle=False) as z:
        return json.loads(str(z["sciflat_header"])), {k: z[k] for k in z.files}


@pytest.mark.parametrize("name", EDGE)
def test_round_trip_every_edge_model(tmp_path, name):
    model, _ = EDGE[name]
    p, re = sciflat.destructure(model)
    path = tmp_path / "m.npz"
    sciflat.save(path, model)
    loaded = sciflat.load(path, model)
    assert tree_allclose(loaded, re(p), rtol=0, atol=0)
    assert inexact_dtypes(loaded) == inexact_dtypes(re(p))
    # Against the `re` instead of the model: `p` itself, bit for bit.
    p2 = sciflat.load(path, re)
    assert p2.dtype == p.dtype
    np.testing.assert_array_equal(p2, p)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_round_trip_keeps_the_dtype_of_p(tmp_path, dtype):
    model, _ = EDGE["tied_identity"]
    p, re = sciflat.destructure(model, dtype=dtype)
    p = p + jnp.asarray(1 / 3, dtype)  # not exactly representable: rounding would show
    sciflat.save(tmp_path / "m.npz", p, re)
    got = sciflat.load(tmp_path / "m.npz", re)
    assert got.dtype == dtype
    np.testing.assert_array_equal(
        np.asarray(got, np.float64), np.asarray(p, np.float64)
    )


def test_frozen_leaves_round_trip_with_their_filter_spec(tmp_path):
    model = EDGE["mlp_float32"][0]
    filter_spec = lambda x: eqx.is_array(x) and x.ndim == 2  # biases frozen
    p, re = sciflat.destructure(model, filter_spec)
    sciflat.save(tmp_path / "m.npz", p * 2, re)
    loaded = sciflat.load(tmp_path / "m.npz", model, filter_spec=filter_spec)
    assert tree_allclose(loaded, re(p * 2), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"`\.layers\[0\]\.bias`.*trainable.*frozen"):
        sciflat.load(tmp_path / "m.npz", model)  # saved with biases frozen


def test_layout_is_one_typed_record_per_array_leaf_and_its_slots_tile_p():
    model, _ = EDGE["mixed_precision"]
    frozen = {**dict(vars(model)), "f": jnp.ones(3)}  # a frozen floating leaf too
    spec = {**{k: True for k in frozen}, "f": False}
    p, re = sciflat.destructure(frozen, spec)
    layout = re.layout()
    kinds = [(x.path, x.kind) for x in layout]
    assert sorted(kinds) == [
        ("['counts']", "other"),
        ("['f']", "frozen"),
        ("['w32']", "trainable"),
        ("['w64']", "trainable"),
    ]
    assert [x.slice for x in layout.slots] == [slice(0, 2), slice(2, 4)]
    assert sum(x.size for x in layout.slots) == len(p)
    frozen_entry = dict(path="['f']", kind="frozen", shape=[3], dtype="float64")
    assert json.loads(json.dumps(layout.to_json()))[1] == {
        **frozen_entry,
        "tied_to": None,
    }
    tied = sciflat.destructure(EDGE["tied_identity"][0])[1].layout()
    assert [x.path for x in tied.slots] == [".a.weight", ".a.bias"]
    assert [x.tied_to for x in tied] == [None, None, ".a.weight", ".a.bias"]


def test_nonfinite_bfloat16_parameters_are_refused_by_save(tmp_path):
    # bfloat16 is stored as raw 16-bit words; the NaN check must read the values.
    p, re = sciflat.destructure({"w": jnp.array([1.0, jnp.nan], jnp.bfloat16)})
    with pytest.raises(ValueError, match=r"NaN or infinity in `\['w'\]`"):
        sciflat.save(tmp_path / "m.npz", p, re)


def test_the_file_is_plain_npz_with_a_readable_header(tmp_path):
    model, _ = EDGE["tied_identity"]
    sciflat.save(tmp_path / "m.npz", model)
    head, arrays = read_raw(tmp_path / "m.npz")
    assert set(arrays) == {"p", "sciflat_header"}
    assert head["format"] == "sciflat" and head["format_version"] == 1
    assert head["sciflat_version"] == sciflat.__version__
    leaves = {leaf["path"]: leaf for leaf in head["leaves"]}
    assert leaves[".b.weight"]["tied_to"] == ".a.weight"
    assert head["dtype"] == str(model.a.weight.dtype)
    assert leaves[".a.weight"] == {
        "path": ".a.weight",
        "kind": "trainable",
        "shape": [1, 1],
        "dtype": head["dtype"],
        "offset": 0,
        "size": 1,
        "tied_to": None,
    }
    np.testing.assert_array_equal(arrays["p"], sciflat.destructure(model)[0])


#
# Refusals
#


def test_another_architecture_names_the_first_differing_leaf(tmp_path):
    key = jax.random.key(0)
    sciflat.save(tmp_path / "m.npz", eqx.nn.MLP(2, 1, 8, 1, key=key))
    wider = r"leaf `\.layers\[0\]\.weight`: expected trainable \w+\[9, 2\], found .*\[8, 2\]"
    with pytest.raises(ValueError, match=wider):
        sciflat.load(tmp_path / "m.npz", eqx.nn.MLP(2, 1, 9, 1, key=key))
    deeper = r"leaf `\.layers\[1\]\.weight`: expected trainable \w+\[8, 8\]"
    with pytest.raises(ValueError, match=deeper):
        sciflat.load(tmp_path / "m.npz", eqx.nn.MLP(2, 1, 8, 2, key=key))


def test_an_extra_or_missing_leaf_is_named(tmp_path):
    sciflat.save(tmp_path / "m.npz", {"w": jnp.ones(2)})
    with pytest.raises(
        ValueError, match=r"`like` has 2 array leaves.*one is `\['z'\]`"
    ):
        sciflat.load(tmp_path / "m.npz", {"w": jnp.ones(2), "z": jnp.ones(1)})
    with pytest.raises(ValueError, match=r"file has 1 array leaves.*one is `\['w'\]`"):
        sciflat.load(tmp_path / "m.npz", {})


def test_a_tie_that_differs_is_refused(tmp_path):
    key1, key2 = jax.random.split(jax.random.key(0))
    lin = eqx.nn.Linear(1, 1, key=key1)
    sciflat.save(tmp_path / "m.npz", Tied(lin, lin))
    untied = Tied(lin, eqx.nn.Linear(1, 1, key=key2))
    with pytest.raises(
        ValueError, match=r"`\.b\.weight`.*found.*tied to `\.a\.weight`"
    ):
        sciflat.load(tmp_path / "m.npz", untied)


def test_complex_and_real_are_not_interchangeable(tmp_path):
    model, _ = EDGE["complex_leaf"]
    sciflat.save(tmp_path / "m.npz", model)
    real = eqx.tree_at(lambda m: m.z, model, jnp.ones(2))
    with pytest.raises(ValueError, match=r"`\.z`.*float64\[2\].*complex128\[2\]"):
        sciflat.load(tmp_path / "m.npz", real)


def test_another_dtype_is_an_explicit_choice(tmp_path):
    model64 = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    model32 = eqx.nn.Linear(2, 1, key=jax.random.key(0), dtype=jnp.float32)
    sciflat.save(tmp_path / "m.npz", model64)
    with pytest.raises(
        TypeError, match=r"float64 parameters.*float32.*dtype=jnp.float64"
    ):
        sciflat.load(tmp_path / "m.npz", model32)
    as64 = sciflat.load(tmp_path / "m.npz", model32, dtype=jnp.float64)
    as32 = sciflat.load(tmp_path / "m.npz", model32, dtype=jnp.float32)
    assert inexact_dtypes(as64) == {np.dtype(np.float64)}
    assert inexact_dtypes(as32) == {np.dtype(np.float32)}
    assert tree_allclose(as64, model64, rtol=0, atol=0)
    np.testing.assert_array_equal(as32.weight, model64.weight.astype(np.float32))


def test_float64_file_with_x64_off_says_how_to_fix(tmp_path, x64_off):
    with jax.enable_x64(True):
        sciflat.save(tmp_path / "m.npz", eqx.nn.Linear(2, 1, key=jax.random.key(0)))
    model32 = eqx.nn.Linear(2, 1, key=jax.random.key(0))  # float32 with x64 off
    with pytest.raises(TypeError, match="float64 parameters"):
        sciflat.load(tmp_path / "m.npz", model32)
    with pytest.raises(TypeError, match="jax_enable_x64"):
        sciflat.load(tmp_path / "m.npz", model32, dtype=np.float64)
    assert sciflat.load(
        tmp_path / "m.npz", model32, dtype=jnp.float32
    ).weight.dtype == (jnp.float32)


def test_nothing_is_unpickled_or_executed(tmp_path):
    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    sciflat.save(tmp_path / "m.npz", model)
    _, arrays = read_raw(tmp_path / "m.npz")
    arrays["p"] = np.array([Boom()], dtype=object)
    np.savez(tmp_path / "evil.npz", **arrays)
    with pytest.raises(ValueError, match="allow_pickle"):
        sciflat.load(tmp_path / "evil.npz", model)
    assert not (tmp_path / "pwned").exists()


def test_foreign_and_newer_files_are_refused(tmp_path):
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    np.savez(tmp_path / "plain.npz", p=np.zeros(3))
    with pytest.raises(ValueError, match="not a sciflat file"):
        sciflat.load(tmp_path / "plain.npz", model)
    sciflat.save(tmp_path / "m.npz", model)
    head, arrays = read_raw(tmp_path / "m.npz")
    head["format_version"] = 99
    arrays["sciflat_header"] = np.array(json.dumps(head))
    np.savez(tmp_path / "new.npz", **arrays)
    with pytest.raises(ValueError, match=r"version 99.*Update sciflat"):
        sciflat.load(tmp_path / "new.npz", model)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    path = tmp_path / "m.npz"
    sciflat.save(path, model)
    before = path.read_bytes()

    def interrupted(f, **arrays):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sciflat.save(path, eqx.nn.Linear(2, 1, key=jax.random.key(1)))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.npz"]


#
# Property: random models with random ties, frozen leaves and dtypes
#

DTYPES = (np.float16, np.float32, np.float64, np.complex64, np.int32)


def _loss(model):
    # A different weight per position, so tied uses contribute different gradients.
    total = 0.0
    for k, (_, x) in enumerate(sorted(model.items())):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            total = total + (k + 1) * jnp.sum(jnp.abs(jnp.sin(x)) ** 2)
    return total


# Jitted with `re` as an argument: a fraction of the cost of tracing op by op.
_grad = jax.jit(jax.grad(lambda p, re: _loss(re(p))))


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
@settings(max_examples=60, deadline=None)
@given(random_models(DTYPES), st.sampled_from([None, np.float32, np.float64]))
def test_round_trip_and_gradient_rule_on_random_models(case, dtype):
    model, spec, _ = case
    try:
        p, re = sciflat.destructure(model, spec, dtype=dtype)
    except TypeError as e:
        # A complex leaf with a float16 `p` (all trainable leaves float16): no complex
        # dtype matches, so destructure refuses it, naming the leaf.
        assert re_module.search(r"leaf `\['u\d+'\]` is complex.*float16", str(e))
        assert any(jnp.iscomplexobj(x) for x in model.values())
        return
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "m.npz")
        sciflat.save(path, p, re)
        p_back = sciflat.load(path, re)
        loaded = sciflat.load(path, model, filter_spec=spec, dtype=p.dtype)
        assert os.listdir(folder) == ["m.npz"]
        # One leaf of another shape: refused, naming that leaf (the first to differ).
        name = sorted(model)[-1]
        other = {**model, name: jnp.zeros((*model[name].shape, 1), model[name].dtype)}
        with pytest.raises(ValueError, match=rf"at leaf `\['{name}'\]`"):
            sciflat.load(path, other, filter_spec=spec, dtype=p.dtype)
    assert p_back.dtype == p.dtype
    np.testing.assert_array_equal(p_back, p)
    assert tree_allclose(loaded, re(p), rtol=0, atol=0)
    assert inexact_dtypes(loaded) == inexact_dtypes(re(p))
    # Destructuring the loaded model gives back the same layout (ties kept) and `p`,
    # and the gradient through it is the same, in `p.dtype`.
    p2, re2 = sciflat.destructure(loaded, spec, dtype=p.dtype)
    # (frozen leaves were rebuilt in `p.dtype`, by the dtype rule)
    drop = lambda layout: [
        dataclasses.replace(e, dtype="") if e.kind == "frozen" else e for e in layout
    ]
    assert drop(re2.layout()) == drop(re.layout())
    np.testing.assert_array_equal(p2, p)
    grad, grad2 = _grad(p, re), _grad(p2, re2)  # one compilation: same structure
    assert grad.dtype == grad2.dtype == p.dtype
    np.testing.assert_array_equal(grad2, grad)


#
# Damaged or inconsistent files: a ValueError naming the file, never a silent cast
#


@pytest.mark.parametrize("stored", [np.float64, np.int32])
def test_data_that_disagree_with_the_header_dtype_are_refused(tmp_path, stored):
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0), dtype=jnp.float32)
    sciflat.save(tmp_path / "m.npz", model)
    head, arrays = read_raw(tmp_path / "m.npz")
    assert head["dtype"] == "float32"
    arrays["p"] = arrays["p"].astype(stored)  # the header still says float32
    np.savez(tmp_path / "bad.npz", **arrays)
    match = rf"bad\.npz'.*holds {np.dtype(stored).name} data.*header says float32"
    with pytest.raises(ValueError, match=match):
        sciflat.load(tmp_path / "bad.npz", model)
    with pytest.raises(ValueError, match=match):
        sciflat.load(tmp_path / "bad.npz", sciflat.destructure(model)[1])


def test_flipped_bytes_name_the_file(tmp_path):
    model = eqx.nn.Linear(20, 10, key=jax.random.key(0))
    sciflat.save(tmp_path / "m.npz", model)
    data = bytearray((tmp_path / "m.npz").read_bytes())
    middle = len(data) // 3  # inside the stored `p`: its CRC no longer matches
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    (tmp_path / "flipped.npz").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"flipped\.npz'.*damaged"):
        sciflat.load(tmp_path / "flipped.npz", model)


def test_a_broken_json_header_names_the_file(tmp_path):
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    sciflat.save(tmp_path / "m.npz", model)
    _, arrays = read_raw(tmp_path / "m.npz")
    arrays["sciflat_header"] = np.array('{"format": "sciflat", "leaves": [')
    np.savez(tmp_path / "broken.npz", **arrays)
    with pytest.raises(ValueError, match=r"broken\.npz'.*header is not valid JSON"):
        sciflat.load(tmp_path / "broken.npz", model)


def test_load_flattens_the_skeleton_in_the_dtype_asked_for(tmp_path):
    # Found by the random-model property: a float16 model with a frozen complex leaf
    # has no p of its own dtype (no complex float16), but loads in float32.
    model = {"u0": jnp.asarray(0.75, jnp.float16), "u1": jnp.asarray(1.2 + 0.5j)}
    spec = {"u0": True, "u1": False}
    p, re = sciflat.destructure(model, spec, dtype=jnp.float32)
    path = str(tmp_path / "m.npz")
    sciflat.save(path, p, re)
    loaded = sciflat.load(path, model, filter_spec=spec, dtype=jnp.float32)
    assert loaded["u0"].dtype == jnp.float32 and loaded["u1"].dtype == jnp.complex64
    assert float(loaded["u0"]) == 0.75 and loaded["u1"] == model["u1"].astype(
        jnp.complex64
    )


def test_a_file_loads_only_into_the_transforms_it_was_saved_with(tmp_path):
    # Saved {"a": Positive(2.0)}, loaded into {"a": Log(2.0)}: the raw number under
    # another transform gave a = 6.39 silently. The reference: the saved value.
    path = tmp_path / "m.npz"
    sciflat.save(path, {"a": sciflat.Positive(2.0), "b": jnp.asarray(1.0)})
    back = sciflat.load(path, {"a": sciflat.Positive(5.0), "b": jnp.asarray(0.0)})
    assert float(sciflat.unwrap(back)["a"]) == pytest.approx(2.0, rel=1e-6)
    for other, named in [
        (sciflat.Log(2.0), "Log()"),
        (sciflat.Interval(2.0, 0.0, 10.0), "Interval(lower=0.0, upper=10.0)"),
    ]:
        with pytest.raises(ValueError) as info:
            sciflat.load(path, {"a": other, "b": jnp.asarray(0.0)})
        text = str(info.value)
        assert "at leaf `['a']`" in text and "Positive()" in text and named in text
    assert read_raw(path)[0]["transforms"] == {"['a'].raw": "Positive()"}
    # The parameters of a transform count: Interval(0, 10) is not Interval(0, 5).
    sciflat.save(path, {"a": sciflat.Interval(2.0, 0.0, 10.0)})
    with pytest.raises(ValueError, match=r"upper=10\.0.*upper=5\.0"):
        sciflat.load(path, {"a": sciflat.Interval(2.0, 0.0, 5.0)})


def test_a_file_written_before_transforms_were_recorded_still_loads(tmp_path):
    # Files of format version 1 written before the header had `transforms`.
    path = tmp_path / "m.npz"
    sciflat.save(path, {"a": sciflat.Positive(2.0)})
    head, arrays = read_raw(path)
    del head["transforms"]
    arrays["sciflat_header"] = np.array(json.dumps(head))
    np.savez(tmp_path / "old.npz", **arrays)
    back = sciflat.load(tmp_path / "old.npz", {"a": sciflat.Positive(1.0)})
    assert float(sciflat.unwrap(back)["a"]) == pytest.approx(2.0, rel=1e-6)
