"""`destructure`: one flat real vector for a model, ties kept, rebuilt in `p.dtype`."""

import dataclasses
import functools as ft
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.core  # `jax.core.Tracer`: imported explicitly so type checkers see it
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from ._custom_types import FilterSpec
from ._dtypes import (
    check_representable,
    complex_dtype,
    is_complex,
    is_inexact,
    real_dtype,
)
from ._layout import FROZEN, OTHER, STATIC, TRAINABLE, Layout, Leaf
from ._sharding import replicated_like
from ._validate import as_flat_vector


_M = TypeVar("_M")

#
# The static description of a model: hashable, so `jit` never retraces for it.
#

# One vocabulary with `layout()` and its consumers: a leaf in `p`, cast, kept, static.
_TRAIN, _CAST, _KEEP, _STATIC = TRAINABLE, FROZEN, OTHER, STATIC


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One unique trainable array: where it sits in `p` and what it looks like."""

    offset: int
    size: int  # entries of `p` it takes: twice the array's size when complex
    shape: tuple[int, ...]
    complex: bool
    paths: tuple[str, ...]  # every position the array is used in (more than one = tied)


class _ById:
    """Holds an unhashable static leaf; equal only to itself."""

    def __init__(self, value):
        self.value = value


@dataclasses.dataclass(frozen=True)
class _Spec:
    treedef: Any
    kinds: tuple[tuple[str, Any], ...]  # per leaf: (kind, slot / array index / value)
    slots: tuple[_Slot, ...]
    n_cast: int
    size: int
    dtype: np.dtype
    name: str

    @ft.cached_property
    def _hash(self) -> int:
        return hash((self.treedef, self.kinds, self.slots, self.size, self.dtype))

    def __hash__(self) -> int:
        return self._hash

    @ft.cached_property
    def complex_path(self) -> str | None:
        return next((s.paths[0] for s in self.slots if s.complex), None)


#
# Rebuilding. Under a trace, `lax.split` (whose transpose is one concatenate). On a
# concrete `p` on the CPU, NumPy splits `p` (a view of the same memory) and one
# `device_put` hands the pieces back: nothing is compiled. On an accelerator the data
# stays on `p`'s device: the jitted split, compiled once per model, or, when many leaves
# share a shape, one `dynamic_slice` per leaf whose offset is a runtime argument, so one
# small kernel serves every leaf of that shape (the whole split of 1000 leaves would
# compile for tens of seconds).
#


def _host_complex(real, imag):
    out = np.empty(real.shape, complex_dtype(real.dtype, "a complex leaf"))
    out.real, out.imag = real, imag
    return out


def _assemble(spec: _Spec, p, cast_arrays, split, make_complex):
    slot_arrays = []
    pieces = split(p, [s.size for s in spec.slots]) if spec.slots else []
    for slot, piece in zip(spec.slots, pieces, strict=True):
        if slot.complex:
            half = slot.size // 2
            piece = make_complex(piece[:half], piece[half:])
        slot_arrays.append(piece.reshape(slot.shape))
    real = np.dtype(p.dtype)
    casts = [
        x.astype(complex_dtype(real, "a frozen leaf") if is_complex(x.dtype) else real)
        for x in cast_arrays
    ]
    return slot_arrays, casts


@ft.partial(jax.jit, static_argnums=0)
def _rebuild_traced(spec: _Spec, p, cast_arrays):
    return _assemble(spec, p, cast_arrays, jax.lax.split, jax.lax.complex)


def _rebuild_on_host(spec: _Spec, p: jax.Array, cast_arrays):
    split = lambda x, sizes: np.split(x, np.cumsum(sizes)[:-1])
    host_cast = [np.asarray(x) for x in cast_arrays]
    slot_arrays, casts = _assemble(spec, np.asarray(p), host_cast, split, _host_complex)
    return jax.device_put((slot_arrays, casts), _placement(p))


def _placement(p: jax.Array):
    """Where the leaves of `re(p)` go: a whole copy on each of `p`'s devices, committed
    as `p` is (as the result of an op on `p` would be). An uncommitted `p` gives
    uncommitted leaves: `jax.jit` keys on commitment, so a model rebuilt from a fit's
    `p` then calls a compiled function as the start model did, without compiling it
    again."""
    return replicated_like(p.sharding) if p.committed else None


@ft.partial(jax.jit, static_argnums=(2, 3))
def _take(p, offset, shape: tuple[int, ...], complex_: bool):
    size = int(np.prod(shape, dtype=int))
    if complex_:
        real = jax.lax.dynamic_slice(p, (offset,), (size,))
        imag = jax.lax.dynamic_slice(p, (offset + size,), (size,))
        return jax.lax.complex(real, imag).reshape(shape)
    return jax.lax.dynamic_slice(p, (offset,), (size,)).reshape(shape)


def _rebuild_on_device(spec: _Spec, p: jax.Array, cast_arrays):
    cast_arrays = jax.device_put(cast_arrays, _placement(p))
    if 4 * len({(s.shape, s.complex) for s in spec.slots}) >= len(spec.slots):
        # Few leaves per shape: one compiled split of the whole model (on the CPU,
        # ~40 ms of compilation per leaf, then one dispatch).
        return _rebuild_traced(spec, p, cast_arrays)
    # Many leaves of each shape: one small kernel per shape (~0.2 s to compile on
    # the CPU), one dispatch per leaf.
    offset_dtype = np.int64 if p.size > np.iinfo(np.int32).max else np.int32
    slot_arrays = [
        _take(p, offset_dtype(s.offset), s.shape, s.complex) for s in spec.slots
    ]
    real = np.dtype(p.dtype)
    casts = []
    for x in cast_arrays:
        cplx = is_complex(x.dtype)
        casts.append(x.astype(complex_dtype(real, "a frozen leaf") if cplx else real))
    return slot_arrays, casts


def _on_host(p: jax.Array) -> bool:
    """Whether `re(p)` splits a concrete `p` with NumPy: on the CPU (where NumPy reads
    the same memory) and for `p` spread over several devices."""
    devices = p.sharding.device_set
    return len(devices) > 1 or next(iter(devices)).platform == "cpu"


class Restructure(eqx.Module, Generic[_M]):
    """Rebuilds a model from a flat vector `p`; returned by [`sciflat.destructure`][].

    `re(p)` returns the model with every trainable leaf read from `p`, every floating
    leaf (trainable or frozen) in `p.dtype` and every complex leaf in the matching
    complex dtype. Arrays that were tied stay one array. `re` is a pytree and also
    hashable, so it can be closed over, passed to `jax.jit`, or marked static.

    !!! Example

        ```python
        p, re = sciflat.destructure(model)           # a float32 model
        re                                           # Restructure(MLP, 1153 params, float32)
        model64 = re(p.astype(jnp.float64))          # every floating leaf is float64
        p[re.slice(lambda m: m.layers[0].bias)]      # where one leaf sits in p
        ```
    """

    _spec: _Spec = eqx.field(static=True)
    # Leaves that are not in `p`: frozen floating arrays, then the others. A list, not a
    # tuple: `eqx.tree_at` (Diffrax's BacksolveAdjoint uses it) mangles empty tuples.
    _arrays: list
    _ties: tuple[tuple[Callable, Callable], ...] = eqx.field(static=True, default=())

    def __call__(self, p: Float[Array, " n"]) -> _M:
        spec = self._spec
        p = as_flat_vector(p, spec.size, f"Restructure({spec.name})")
        if spec.complex_path is not None:
            complex_dtype(p.dtype, f"The trainable leaf `{spec.complex_path}`")
        cast_in = self._arrays[: spec.n_cast]
        if isinstance(p, jax.core.Tracer):
            slot_arrays, casts = _rebuild_traced(spec, p, cast_in)
        elif _on_host(p):
            slot_arrays, casts = _rebuild_on_host(spec, p, cast_in)
        else:
            slot_arrays, casts = _rebuild_on_device(spec, p, cast_in)
        return from_pieces(self, (slot_arrays, casts))

    def __len__(self) -> int:
        return self._spec.size

    def __repr__(self) -> str:
        spec = self._spec
        return f"Restructure({spec.name}, {spec.size} params, {spec.dtype.name})"

    def __hash__(self) -> int:
        return hash((self._spec, self._ties, tuple(id(x) for x in self._arrays)))

    def __eq__(self, other: object) -> bool:  # pyright: ignore[reportIncompatibleMethodOverride]
        return (
            type(other) is type(self)
            and self._spec == other._spec
            and self._ties == other._ties
            and len(self._arrays) == len(other._arrays)
            and all(a is b for a, b in zip(self._arrays, other._arrays, strict=True))
        )

    @property
    def dtype(self) -> np.dtype:
        """The dtype `p` was made in by `destructure` (`re` accepts any real dtype)."""
        return self._spec.dtype

    @property
    def paths(self) -> tuple[str, ...]:
        """Path of every trainable leaf position, in `p` order (tied ones share a slot)."""
        return tuple(path for slot in self._spec.slots for path in slot.paths)

    def _structure(self) -> Any:  # a PyTreeDef
        """The tree structure of `re(p)`, without rebuilding it when no tie can change
        it (a tie given to `destructure` may replace a whole submodule)."""
        if not self._ties:
            return self._spec.treedef
        p = jax.ShapeDtypeStruct((self._spec.size,), self._spec.dtype)
        return jtu.tree_structure(eqx.filter_eval_shape(self, p))

    def _marked(self):
        """The model's structure with a `_Mark(i)` in place of leaf `i`."""
        marks = [_Mark(i) for i in range(len(self._spec.kinds))]
        return jtu.tree_unflatten(self._spec.treedef, marks)

    def layout(self) -> Layout:
        """A description of every array leaf of the model, in leaf order.

        One `Leaf` record per array leaf, with `path`, `kind`,
        `shape`, `dtype`, `tied_to` (the first path of the same array, or `None`) and,
        for trainable leaves, `offset`/`size` in `p`. `kind` is `"trainable"` (in `p`;
        `dtype` is the one `re` rebuilds it in), `"frozen"` (floating but not in `p`;
        `dtype` as given) or `"other"` (integer, bool or key arrays, passed through).
        Non-array leaves are left out. `layout().slots` are the entries of `p` (tied
        uses once), `layout().to_json()` what [`sciflat.save`][] writes in a file's
        header and checks a file against.
        """
        spec = self._spec
        marked = jtu.tree_flatten_with_path(self._marked())[0]
        paths = {m.index: jtu.keystr(k) for k, m in marked}
        first: dict[tuple[str, int], str] = {}
        out = []
        for i, (kind, value) in enumerate(spec.kinds):
            if kind == _STATIC:
                continue
            first_path = first.setdefault((kind, value), paths[i])
            tied_to = None if first_path == paths[i] else first_path
            if kind == _TRAIN:
                slot = spec.slots[value]
                dtype = complex_dtype(spec.dtype, "") if slot.complex else spec.dtype
                leaf = Leaf(paths[i], TRAINABLE, slot.shape, str(dtype), tied_to)
                leaf = dataclasses.replace(leaf, offset=slot.offset, size=slot.size)
            else:
                x = self._arrays[value]
                kind_ = FROZEN if kind == _CAST else OTHER
                leaf = Leaf(paths[i], kind_, np.shape(x), str(x.dtype), tied_to)
            out.append(leaf)
        return Layout(out)

    def slice(self, where: str | Callable[[Any], Any]) -> slice:
        """The slice of `p` that a trainable leaf occupies.

        `where` is the leaf's path as in [`Restructure.paths`][] (e.g.
        `".layers[0].weight"`), or a function of the model that returns the leaf, as
        in `eqx.tree_at` (e.g. `lambda m: m.layers[0].weight`). A complex leaf takes
        `2 * size` entries: all real parts, then all imaginary parts.

        !!! Example

            ```python
            p, re = sciflat.destructure(model)
            p[re.slice(lambda m: m.layers[-1].bias)]
            ```
        """
        if callable(where):
            found = where(self._marked())
            if not isinstance(found, _Mark):
                raise ValueError(
                    "`where` must return one leaf of the model, got "
                    f"{type(found).__name__}."
                )
            kind, value = self._spec.kinds[found.index]
            if kind != _TRAIN:
                raise ValueError(
                    "`where` picks a leaf that is not in `p` (it is frozen)."
                )
            slot = self._spec.slots[value]
        else:
            # Accept the path with or without its leading dot.
            key = where.lstrip(".")
            matches = [
                s for s in self._spec.slots if key in (p.lstrip(".") for p in s.paths)
            ]
            if not matches:
                raise KeyError(
                    f"No trainable leaf at path {where!r}; trainable paths are "
                    f"{list(self.paths)[:8]}{'...' if len(self.paths) > 8 else ''}."
                )
            slot = matches[0]
        return slice(slot.offset, slot.offset + slot.size)


@dataclasses.dataclass(frozen=True)
class _Mark:
    index: int


#
# Destructuring
#


def _is_array(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _trainable_mask(model, filter_spec, n_leaves: int) -> list[bool]:
    if filter_spec is True:
        return [True] * n_leaves
    sentinel = object()
    filtered = eqx.filter(model, filter_spec, replace=sentinel)
    return [leaf is not sentinel for leaf in jtu.tree_leaves(filtered)]


def _p_dtype(trainable: list[tuple[str, Any]], dtype: DTypeLike | None) -> np.dtype:
    if dtype is not None:
        dtype = np.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"`dtype` must be a real floating dtype, got {dtype.name}: `p` is always "
                "a real vector (complex leaves store their real and imaginary parts)."
            )
        check_representable(dtype, "`dtype`")
        return dtype
    if not trainable:
        return np.dtype(jnp.zeros(()).dtype)  # JAX's default float: float32 or float64
    out = ft.reduce(jnp.promote_types, [real_dtype(x.dtype) for _, x in trainable])
    for path, x in trainable:
        if real_dtype(x.dtype) == out:
            check_representable(out, f"The trainable leaf `{path}`")
    return np.dtype(out)


def _ravel(arrays: list, dtype: np.dtype, like) -> jax.Array:
    """Concatenate on the host when we can: one transfer, no compilation."""
    if any(isinstance(x, jax.core.Tracer) for x in arrays):
        parts = []
        for x in arrays:
            x = jnp.ravel(x)
            parts += [x.real, x.imag] if is_complex(x.dtype) else [x]
        return jnp.concatenate(
            [x.astype(dtype) for x in parts] or [jnp.zeros(0, dtype)]
        )
    parts = []
    for x in arrays:
        x = np.asarray(x).ravel()
        parts += [np.real(x), np.imag(x)] if is_complex(x.dtype) else [x]
    flat = np.concatenate([x.astype(dtype) for x in parts] or [np.zeros(0, dtype)])
    # On the model's device(s), committed as its leaves are (see `_placement`).
    where = like.sharding if isinstance(like, jax.Array) and like.committed else None
    return jax.device_put(flat, where)


def destructure(
    model: _M,
    filter_spec: FilterSpec = True,
    *,
    dtype: DTypeLike | None = None,
    ties: Sequence[tuple[Callable[[_M], Any], Callable[[_M], Any]]] = (),
) -> tuple[Float[Array, " n"], Restructure[_M]]:
    """Flattens the trainable leaves of a model into one real vector `p`.

    Every floating or complex array leaf selected by `filter_spec` goes into `p`, in
    `jax.tree` leaf order; an array used in several places (the same object, or via
    `eqx.nn.Shared`) goes in once, and its gradient is the sum over its uses. `re(p)`
    rebuilds the model computing in `p.dtype`: every floating leaf, frozen ones too, gets
    `p.dtype` and every complex leaf the matching complex dtype. Integer, bool and key
    arrays, Python scalars and functions pass through unchanged.

    !!! Example

        ```python
        model = eqx.nn.MLP(2, 1, 32, 2, key=jax.random.key(0))
        p, re = sciflat.destructure(model)
        grad = jax.grad(lambda p: jnp.sum(re(p)(x)))(p)  # same shape and dtype as p
        ```

    **Arguments:**

    - `model`: any pytree, typically an Equinox module.
    - `filter_spec`: which floating leaves are trainable, as in `eqx.partition`: a bool
        or callable, or a pytree prefix of them. Unselected floating leaves are frozen.
    - `dtype`: dtype of `p`. Default: the promoted real dtype of the trainable leaves.
    - `ties`: pairs `(where, get)` that tie parts of a model built without
        `eqx.nn.Shared`: `where(model)` is dropped from `p` and rebuilt as
        `get(rebuilt)`, e.g. `(lambda m: m.decoder.weight, lambda m: m.encoder.weight.T)`.

    **Returns:**

    `(p, re)`: the flat vector and the [`sciflat.Restructure`][] that rebuilds the model.
    """
    ties = tuple(ties)
    for where, get in ties:
        model = _drop_tied(model, where, get)
    path_leaves, treedef = jtu.tree_flatten_with_path(model)
    mask = _trainable_mask(model, filter_spec, len(path_leaves))
    kinds, keep, cast, cast_paths = [], [], [], []
    # tie key -> paths; insertion order = `p` order
    slots_by_key: dict[Any, list[str]] = {}
    first_leaf: dict[Any, Any] = {}
    slot_index: dict[Any, int] = {}
    cast_by_key: dict[Any, int] = {}
    for i, ((keypath, leaf), selected) in enumerate(
        zip(path_leaves, mask, strict=True)
    ):
        path = jtu.keystr(keypath)
        if not _is_array(leaf):
            kinds.append((_STATIC, leaf if _hashable(leaf) else _ById(leaf)))
            continue
        if not _numeric(leaf.dtype):
            raise TypeError(
                f"Leaf `{path}` is an array of dtype {np.dtype(leaf.dtype)}; sciflat "
                "takes numeric arrays only. Mark it static (`eqx.field(static=True)`) "
                "or convert it."
            )
        # Ties are by identity; a NumPy scalar has no identity worth trusting.
        key = ("scalar", i) if isinstance(leaf, np.generic) else id(leaf)
        if not is_inexact(leaf.dtype):
            kinds.append((_KEEP, len(keep)))
            keep.append(leaf)
        elif selected:
            if key in cast_by_key:
                raise ValueError(_mixed_tie_message(path))
            if key not in slots_by_key:
                slot_index[key] = len(slots_by_key)
                slots_by_key[key], first_leaf[key] = [], leaf
            slots_by_key[key].append(path)
            kinds.append((_TRAIN, slot_index[key]))
        else:
            if key in slots_by_key:
                raise ValueError(_mixed_tie_message(path))
            if key not in cast_by_key:
                cast_by_key[key] = len(cast)
                cast.append(leaf)
                cast_paths.append(path)
            kinds.append((_CAST, cast_by_key[key]))
    trainable = [(paths[0], first_leaf[key]) for key, paths in slots_by_key.items()]
    slot_paths = list(slots_by_key.values())
    p_dtype = _p_dtype(trainable, dtype)
    for leaf, path in zip(cast, cast_paths, strict=True):
        if is_complex(leaf.dtype):  # it too must become complex in `p.dtype`
            complex_dtype(p_dtype, f"The frozen leaf `{path}`")
    slots, offset = [], 0
    for (_, leaf), paths in zip(trainable, slot_paths, strict=True):
        size = int(np.prod(np.shape(leaf), dtype=int)) * (
            2 if is_complex(leaf.dtype) else 1
        )
        if is_complex(leaf.dtype):
            complex_dtype(p_dtype, f"The trainable leaf `{paths[0]}`")
        slots.append(
            _Slot(
                offset,
                size,
                tuple(np.shape(leaf)),
                is_complex(leaf.dtype),
                tuple(paths),
            )
        )
        offset += size
    # Frozen floating arrays come first in `_arrays`: they are cast at rebuild time.
    kinds = [(k, v + len(cast)) if k == _KEEP else (k, v) for k, v in kinds]
    spec = _Spec(
        treedef,
        tuple(kinds),
        tuple(slots),
        len(cast),
        offset,
        p_dtype,
        type(model).__name__,
    )
    leaves = [leaf for _, leaf in trainable]
    p = _ravel(leaves, p_dtype, leaves[0] if leaves else None)
    return p, Restructure(spec, cast + keep, ties)


class _TiedMarker:
    """Stands where a tied target was dropped; `re` puts `get(model)` back there."""

    def __repr__(self) -> str:
        return "<tied>"


_TIED = _TiedMarker()


def _drop_tied(model, where, get):
    source = eqx.filter_eval_shape(get, model)
    target = eqx.filter_eval_shape(where, model)
    if eqx.tree_equal(source, target) is not True:
        raise ValueError(
            "A tie's `get(model)` must have the structure, shapes and dtypes of "
            f"`where(model)`; got {source} for `get` and {target} for `where`."
        )
    return eqx.tree_at(where, model, replace_fn=lambda _: _TIED)


def _numeric(dtype) -> bool:
    return any(
        jnp.issubdtype(dtype, kind)
        for kind in (jnp.number, jnp.bool_, jax.dtypes.prng_key, jax.dtypes.extended)
    )


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _mixed_tie_message(path: str) -> str:
    return (
        f"Leaf `{path}` is the same array as another leaf, but one of the two is "
        "trainable and the other frozen by `filter_spec`. A tied array must be "
        "trainable everywhere or frozen everywhere."
    )


def complex_arrays(re: Restructure) -> tuple[bool, ...]:
    """For each unique trainable array of `re`'s model, in `p` order (`pieces`' first
    list), whether it is complex."""
    return tuple(s.complex for s in re._spec.slots)


def pieces(re: Restructure, p: jax.Array) -> tuple[list, list]:
    """The arrays `re(p)` is made of (its trainable leaves, its frozen floating leaves
    in `p.dtype`), computed inside a compiled program, which can return them:
    `from_pieces(re, pieces)` is then `re(p)` without another dispatch."""
    spec = re._spec
    return _rebuild_traced(spec, p, re._arrays[: spec.n_cast])


def from_pieces(re: Restructure[_M], pieces: tuple[list, list]) -> _M:
    """The model from the arrays `pieces` returned (a function, not a method: an
    Equinox method is a new bound-method module at every access)."""
    spec = re._spec
    slot_arrays, casts = pieces
    arrays = re._arrays
    leaves = []
    for kind, value in spec.kinds:
        if kind == _TRAIN:
            leaves.append(slot_arrays[value])
        elif kind == _CAST:
            leaves.append(casts[value])
        elif kind == _KEEP:
            leaves.append(arrays[value])
        else:
            leaves.append(value.value if isinstance(value, _ById) else value)
    model = jtu.tree_unflatten(spec.treedef, leaves)
    for where, get in re._ties:
        model = eqx.tree_at(where, model, get(model))
    return model
