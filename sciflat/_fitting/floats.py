"""Python floats in a fitted model: parameters in plain containers, static in modules.

`{"b1": 500.0, "b2": 1e-4}` is how scientists (and lmfit users) write a few scalar
parameters, so in a fit a Python float in a dict, list or tuple becomes a parameter,
as if written `np.float64(...)`. A Python float that is a field of an `eqx.Module`
stays static, as everywhere in Equinox (`eqx.nn.Dropout.p` is a setting, not a
parameter). `destructure` itself is unchanged: it never turns a float into an array.
"""

from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.typing import DTypeLike

from .._dtypes import real_dtype


def promote_floats(model: Any, who: str, dtype: DTypeLike = np.float64) -> Any:
    """`model` with every Python float outside an `eqx.Module` made a 0-d array of
    `dtype` (SciPy's fits: float64).

    Raises a ValueError naming the floats when they are all the model has to fit but
    sit in modules, where they stay static: a silent fit of nothing is never right."""
    is_module = lambda x: isinstance(x, eqx.Module)
    promote = lambda x: np.asarray(x, dtype) if type(x) is float else x
    model = jax.tree.map(promote, model, is_leaf=is_module)
    if not any(_is_floating_array(leaf) for leaf in jax.tree.leaves(model)):
        leaves = jax.tree_util.tree_leaves_with_path(model)
        floats = [jax.tree_util.keystr(k) for k, v in leaves if isinstance(v, float)]
        if floats:
            names = ", ".join(f"`{p}`" for p in floats[:8])
            raise ValueError(
                f"`{who}`: the model has no floating arrays to fit; its Python floats "
                f"{names} are fields of an `eqx.Module`, which Equinox treats as static "
                "settings. To fit them, store arrays: `self.rate = jnp.asarray(rate)` "
                "(or `rate: float = eqx.field(converter=jnp.asarray)`)."
            )
    return model


def _is_floating_array(x: Any) -> bool:
    if not isinstance(x, jax.Array | np.ndarray | np.generic):
        return False
    return bool(np.issubdtype(x.dtype, np.inexact))


def float_dtype(model: Any, dtype: DTypeLike | None) -> np.dtype:
    """The dtype a Python float joins `p` in for `sciflat.fit`: `dtype` if given, else
    that of the model's floating arrays (promoted, real), else JAX's default float."""
    if dtype is not None:
        return np.dtype(dtype)
    arrays = [x for x in jax.tree.leaves(model) if _is_floating_array(x)]
    if not arrays:
        return np.dtype(jax.dtypes.canonicalize_dtype(float))
    return real_dtype(jax.numpy.result_type(*(x.dtype for x in arrays)))
