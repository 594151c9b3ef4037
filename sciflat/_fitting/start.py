"""The start of a fit (float64; a device fit's in the model's dtype where JAX's
64-bit mode is off), and the flattened start models kept for reuse."""

from collections import OrderedDict
from collections.abc import Hashable

import jax
import jax.core  # `jax.core.Tracer`: imported explicitly so type checkers see it
import jax.numpy as jnp
import numpy as np

from .._dtypes import X64_FIX, x64_enabled
from .._flatten import Restructure, destructure
from .._validate import checked_flat_vector
from .fn_key import Same
from .problem import check_start


def start(
    model, x0, filter_spec, who: str, device: bool = False
) -> tuple[np.ndarray, Restructure]:
    """The float64 starting vector and `re`, or a clear error. A `device` fit computes
    in `p`'s dtype, so with JAX's 64-bit mode off it starts in the model's own dtype
    (float32), which that mode can hold."""
    if not x64_enabled() and device:
        return _narrow_start(model, x0, filter_spec, who)
    if not x64_enabled():
        raise TypeError(
            f"`{who}` runs SciPy, which works in float64, but JAX's 64-bit mode is off, "
            f"so JAX would round every iterate to float32: {X64_FIX} at the start of "
            "your program."
        )
    if isinstance(model, Restructure):
        re = model
        if x0 is None:
            raise TypeError(f"`{who}` got a `Restructure` as `model`: pass `x0=` too.")
        if re.dtype != np.float64:
            raise TypeError(
                f"`{who}` got a `Restructure` for {re.dtype.name}; SciPy works in float64: "
                "use `sciflat.destructure(model, dtype=jnp.float64)`."
            )
    else:
        p, re = _destructured(model, filter_spec)
        if x0 is None:  # float64, of `re`'s length: `destructure` made it
            x0 = p.copy()  # `p` may be kept for the next fit (`_MODELS`)
            check_start(x0, re, who)
            return x0, re
    x0 = checked_flat_vector(x0, len(re), f"`{who}` (`x0`)")
    # An exact conversion: float32 and narrower fit in float64 without rounding.
    x0 = np.array(x0, dtype=np.float64)
    check_start(x0, re, who)
    return x0, re


def _narrow_start(model, x0, filter_spec, who: str) -> tuple[np.ndarray, Restructure]:
    """The start of a device fit with JAX's 64-bit mode off: `p` in the model's dtype
    (the core refuses a leaf that mode cannot hold), `x0` in that dtype exactly."""
    p, re = destructure(model, filter_spec)
    if x0 is None:
        x0 = np.asarray(p)
    else:
        x0 = np.asarray(checked_flat_vector(x0, len(re), f"`{who}` (`x0`)"))
        if not np.can_cast(x0.dtype, re.dtype, "safe"):  # exact, or refused
            raise TypeError(
                f"`{who}` got `x0` of dtype {x0.dtype.name} for a {re.dtype.name} fit "
                f"(JAX's 64-bit mode is off): pass `x0` as {re.dtype.name}."
            )
        x0 = x0.astype(re.dtype)
    check_start(x0, re, who)
    return x0, re


# The same start model fitted to many datasets is flattened once.
_MODELS: OrderedDict[Hashable, tuple[np.ndarray, Restructure]] = OrderedDict()


def _destructured(model, filter_spec) -> tuple[np.ndarray, Restructure]:
    """`destructure(model, filter_spec, dtype=jnp.float64)`, `p` on the host. `re` is
    reused for a model of the same structure when every leaf is a trainable real
    array (`_by_structure`); otherwise both are reused for the same model: the same
    structure and the very same leaf objects. A NumPy leaf (which may be changed in
    place) or a `filter_spec` other than a bool is never reused there."""
    leaves, treedef = jax.tree.flatten(model)
    if (
        filter_spec is True
        and (hit := _by_structure(model, leaves, treedef)) is not None
    ):
        return hit
    mutable = any(isinstance(x, np.ndarray | jax.core.Tracer) for x in leaves)
    if mutable or not isinstance(filter_spec, bool):
        p, re = destructure(model, filter_spec, dtype=jnp.float64)
        return np.asarray(p), re
    key = (treedef, filter_spec, tuple(Same(x) for x in leaves))
    try:
        hit = _MODELS.get(key)
    except TypeError:  # an unhashable static field
        p, re = destructure(model, filter_spec, dtype=jnp.float64)
        return np.asarray(p), re
    if hit is None:
        p, re = destructure(model, filter_spec, dtype=jnp.float64)
        hit = _MODELS[key] = (np.asarray(p), re)
        while len(_MODELS) > 8:
            _MODELS.popitem(last=False)
    return hit


_REAL = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_BY_STRUCTURE: OrderedDict[Hashable, Restructure] = OrderedDict()


def _by_structure(
    model, leaves: list, treedef
) -> tuple[np.ndarray, Restructure] | None:
    """When every leaf is a real floating array, all trainable (`{"b1": 500.0, ...}`
    after `promote_floats`, or a plain Equinox model), `re` depends on the structure
    alone: the tree, the shapes, and which leaves are the same array. A
    fit of new start values then reuses `re` (and so its compiled functions) and
    builds `p` with NumPy; `None` otherwise."""
    if not leaves or not all(
        isinstance(x, jax.Array | np.ndarray)
        and x.dtype in _REAL
        and not isinstance(x, jax.core.Tracer)
        for x in leaves
    ):
        return None
    first: dict[int, int] = {}  # ties are by identity, as in `destructure`
    ties = tuple(first.setdefault(id(x), i) for i, x in enumerate(leaves))
    key = (treedef, tuple(x.shape for x in leaves), ties)  # `p` is float64 anyway
    try:
        re = _BY_STRUCTURE.get(key)
    except TypeError:  # an unhashable static field
        return None
    if re is None:
        p, re = destructure(model, dtype=jnp.float64)
        _BY_STRUCTURE[key] = re
        while len(_BY_STRUCTURE) > 8:
            _BY_STRUCTURE.popitem(last=False)
        return np.asarray(p), re
    _BY_STRUCTURE.move_to_end(key)
    unique = [x for i, x in enumerate(leaves) if ties[i] == i]
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in unique]), re


def clear() -> None:
    _MODELS.clear()
    _BY_STRUCTURE.clear()
