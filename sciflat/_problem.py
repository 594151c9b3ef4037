"""What every fit takes in, checked the same way: the start, `args`, the loss's output.

The layer under the three fits (`minimize`, `least_squares`, `fit`): each asks here
rather than checking for itself, so a wrong input reads the same whichever fit got it.
"""

import functools as ft
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._layout import names, nonfinite_paths


def check_start(p, re, who: str) -> None:
    """Something to fit, and a finite start."""
    if len(re) == 0:
        raise ValueError(
            f"`{who}`: the model has no trainable floating leaves, so there is nothing "
            "to fit. Check `filter_spec` and that the parameters are floating arrays."
        )
    if bad := nonfinite_paths(p, re):
        raise ValueError(
            f"`{who}`: the starting point is not finite in {names(bad)} (NaN or "
            "infinity)."
        )


_P = ParamSpec("_P")
_R = TypeVar("_R")


def data_by_keyword(fit: Callable[_P, _R]) -> Callable[_P, _R]:
    """Turn data passed after the model (the old `*args`) into a clear error."""
    who = fit.__name__

    @ft.wraps(fit)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if len(args) > 2:
            n = len(args) - 2
            raise TypeError(
                f"`{who}` takes the data of the loss as `args=(...)`, a tuple (as "
                f"`scipy.optimize.{who}` and `sciflat.fit` do), but got {n} positional "
                f"argument{'s' * (n > 1)} after `model`: write "
                f"`sciflat.{who}(loss, model, args=(x, y), ...)`."
            )
        return fit(*args, **kwargs)

    return checked


def check_args(args, who: str) -> tuple:
    if not isinstance(args, tuple | list):
        raise TypeError(
            f"`{who}`: `args` must be a tuple of the further arguments of the loss, "
            f"e.g. `args=(x, y)` or `args=(x,)`; got {type(args).__name__}."
        )
    return tuple(args)


def split_args(args: tuple) -> tuple[list, Any]:
    """Array leaves of `args` (passed to the compiled call) and a hashable key that
    puts them back (so a second fit with new data reuses the compiled functions).
    NumPy data is put on the device once here, not at every call of the fit."""
    dynamic, static = eqx.partition(args, eqx.is_array)
    leaves, treedef = jax.tree.flatten(dynamic)
    leaves = [
        jnp.asarray(x) if isinstance(x, np.ndarray | np.generic) else x for x in leaves
    ]
    return leaves, _Rebuild(treedef, static)


class _Rebuild:
    def __init__(self, treedef, static):
        self.treedef, self.static = treedef, static
        flat, static_def = jax.tree.flatten(static)
        try:
            # With the type: 1, 1.0 and True are equal but trace differently.
            self._key = (treedef, static_def, tuple((type(x), x) for x in flat))
            self._hash = hash(self._key)
        except TypeError:  # an unhashable static argument: equal only to itself
            self._hash, self._key = id(self), (id(self),)

    def __call__(self, leaves):
        return eqx.combine(jax.tree.unflatten(self.treedef, leaves), self.static)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, _Rebuild) and self._key == other._key


def check_float64(out, what: str) -> None:
    dtype = jnp.result_type(out)
    if dtype != jnp.float64:
        raise TypeError(
            f"{what} has dtype {jnp.dtype(dtype).name}; the model computes in float64 "
            "here, so something in it casts. Find it with `sciflat.audit_dtypes`."
        )
