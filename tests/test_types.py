"""The public annotations hold at runtime: jaxtyping checks what the functions return."""

import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import sciflat
from helpers import EdgeModels


def _hint(fn, name: str):
    return typing.get_type_hints(fn)[name]


def test_flat_vectors_match_their_jaxtyping_annotations(tmp_path):
    p_type = typing.get_args(_hint(sciflat.destructure, "return"))[0]
    assert str(p_type) == str(_hint(sciflat.Restructure.__call__, "p"))
    # The annotation really checks: a matrix, an int vector are not flat vectors.
    assert not isinstance(jnp.ones((2, 2)), p_type)
    assert not isinstance(jnp.arange(3), p_type)
    for model, _ in EdgeModels().values():
        p, re = sciflat.destructure(model)
        assert isinstance(p, p_type)
        sciflat.save(tmp_path / "m.npz", p, re)
        assert isinstance(sciflat.load(tmp_path / "m.npz", re), p_type)
    result = sciflat.fit(
        lambda m: jnp.sum(m["w"] ** 2),
        {"w": jnp.ones(3)},
        optax.sgd(0.1),
        steps=2,
        progress=False,
    )
    assert isinstance(result.p, _hint(sciflat.FitResult, "p"))


def test_filter_spec_annotation_accepts_what_destructure_takes():
    spec_type = _hint(sciflat.destructure, "filter_spec")
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    for spec in (True, eqx.is_array, jax.tree.map(lambda _: False, model)):
        assert isinstance(spec, spec_type)
        sciflat.destructure(model, spec)
    assert np.dtype(sciflat.destructure(model)[0].dtype) == np.float64
