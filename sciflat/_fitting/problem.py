"""What every fit takes in, checked the same way: the start, `args`, the loss's output.

The layer under the three fits (`minimize`, `least_squares`, `fit`): each asks here
rather than checking for itself, so a wrong input reads the same whichever fit got it.
"""

import functools as ft
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._layout import names, nonfinite_paths


def check_start(p, re, who: str) -> None:
    """Something to fit, and a finite start."""
    if len(re) == 0:
        raise ValueError(
            f"`{who}`: the model has no trainable floating leaves, so there is nothing "
            "to fit. Check `filter_spec` and that the parameters are floating arrays."
        )
    if not _all_finite(p) and (bad := nonfinite_paths(p, re)):
        raise ValueError(
            f"`{who}`: the starting point is not finite in {names(bad)} (NaN or "
            "infinity)."
        )


def _all_finite(p) -> bool:
    # The usual case, without building the layout (`nonfinite_paths` names the leaves).
    flat = np.asarray(p)
    return flat.dtype in (np.float32, np.float64) and bool(np.isfinite(flat).all())


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _positional(fit: Callable) -> tuple[str, ...]:
    """The names of the parameters `fit` takes positionally (before its `*`)."""
    try:
        params = inspect.signature(fit).parameters.values()
    except (TypeError, ValueError):
        return ("loss", "model")
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def data_by_keyword(fit: Callable[_P, _R]) -> Callable[_P, _R]:
    """Turn data passed after the positional parameters (the old `*args`) into a
    clear error that names the fix."""
    who = fit.__name__
    # The closure holds `fit` and its name only: the compile cache keys sciflat's own
    # wrappers by the identity of what they close over.
    n_positional = len(_positional(fit))

    @ft.wraps(fit)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if len(args) > n_positional:
            raise _data_after(who, _positional(fit), len(args) - n_positional)
        return fit(*args, **kwargs)

    return checked


def _data_after(who: str, names: tuple[str, ...], n: int) -> TypeError:
    written = ", ".join(["loss", *names[1:]])  # `residuals` is a loss, too
    return TypeError(
        f"`{who}` takes the data of the loss as `args=(...)`, a tuple (as "
        "`scipy.optimize.minimize` and every sciflat fit do), but got "
        f"{n} positional argument{'s' * (n > 1)} after `{names[-1]}`: write "
        f"`sciflat.{who}({written}, args=(x, y), ...)`."
    )


def check_args(args, who: str) -> tuple:
    if not isinstance(args, tuple | list):
        raise TypeError(
            f"`{who}`: `args` must be a tuple of the further arguments of the loss, "
            f"e.g. `args=(x, y)` or `args=(x,)`; got {type(args).__name__}."
        )
    return tuple(args)


def split_args(args: tuple, to_device: bool = True) -> tuple[list, Any]:
    """Array leaves of `args` (passed to the compiled call) and a hashable key that
    puts them back (so a second fit with new data reuses the compiled functions).
    NumPy data is put on the device once here, not at every call of the fit; with
    `to_device=False` (a fit that is one call) `jax.jit` copies it at that call."""
    if type(args) is tuple and all(eqx.is_array(x) for x in args):
        # The usual `args=(x, y)`: what `eqx.partition` gives, without its two walks.
        dynamic, static = args, (None,) * len(args)
    else:
        dynamic, static = eqx.partition(args, eqx.is_array)
    leaves, treedef = jax.tree.flatten(dynamic)
    if to_device:
        leaves = [
            jnp.asarray(x) if isinstance(x, np.ndarray | np.generic) else x
            for x in leaves
        ]
    return leaves, _Rebuild(treedef, static)


def _static_key(x) -> tuple:
    return (type(x), x, repr(x) if isinstance(x, float | complex) else None)


class _Rebuild:
    def __init__(self, treedef, static):
        self.treedef, self.static = treedef, static
        flat, static_def = jax.tree.flatten(static)
        try:
            # With the type: 1, 1.0 and True are equal but trace differently; and a
            # float's sign: 0.0 == -0.0, but `copysign` or `1 / x` tell them apart.
            self._key = (treedef, static_def, tuple(map(_static_key, flat)))
            self._hash = hash(self._key)
        except TypeError:  # an unhashable static argument: equal only to itself
            self._hash, self._key = id(self), (id(self),)

    def __call__(self, leaves):
        return eqx.combine(jax.tree.unflatten(self.treedef, leaves), self.static)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, _Rebuild) and self._key == other._key


_REAL_FIX = {
    "The residuals": "to fit a complex model to complex data, return "
    "`jnp.concatenate([r.real, r.imag])` (both parts), or `jnp.abs(r)`",
    "The loss": "return a real number, e.g. `jnp.sum(jnp.abs(r) ** 2)` for complex "
    "residuals `r`",
}


def check_float64(out, what: str) -> None:
    dtype = jnp.dtype(jnp.result_type(out))
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"{what} must be real: expected float64, got {dtype.name}. SciPy fits "
            f"real numbers; {_REAL_FIX.get(what, 'return a real array')}."
        )
    if dtype != jnp.float64:
        raise TypeError(
            f"{what} has dtype {dtype.name}; the model computes in float64 "
            "here, so something in it casts. Find it with `sciflat.audit_dtypes`."
        )


def residual_vector(out) -> jax.Array:
    """The residuals as one flat vector, or an error that says what is expected."""
    if not isinstance(out, jax.Array | np.ndarray | np.generic | float | int | complex):
        raise TypeError(
            "`residuals` must return an array (any shape: it is flattened) or a "
            f"number, got {type(out).__name__} of structure {jax.tree.structure(out)}. "
            "Join the parts yourself: `jnp.concatenate([jnp.ravel(r) for r in "
            "jax.tree.leaves(out)])` or `jax.flatten_util.ravel_pytree(out)[0]` (not "
            "done for you: a returned `(residuals, aux)` would be fitted as residuals)."
        )
    return jnp.ravel(out)  # pyright: ignore[reportArgumentType]


def residual_fn(residuals: Callable, re: Callable, rebuild: Callable) -> Callable:
    """`(x, leaves) -> residuals(re(x), *args)` as one float64 vector, or a clear
    error (`leaves`, `rebuild`: `args` as `split_args` splits them)."""

    def r(x, leaves):
        out = residual_vector(residuals(re(x), *rebuild(leaves)))
        check_float64(out, "The residuals")
        return out

    return r


def _indices(bad: np.ndarray) -> str:
    """`[1, 3]`, or `[(0, 1), (2, 0)]` for a 2-d array, at most 10 shown."""
    shown = [int(i[0]) if len(i) == 1 else tuple(int(j) for j in i) for i in bad[:10]]
    more = f" ... ({len(bad)} in all)" if len(bad) > 10 else ""
    return str(shown)[:-1] + more + "]" if more else str(shown)


def _nonfinite_args(args: tuple) -> list[str]:
    """`` `args[1]` is non-finite at [2] `` for each floating leaf of `args` with a NaN
    or infinity."""
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        if not (eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)):
            continue
        arr = np.asarray(leaf)
        wide = (
            np.complex128
            if jnp.issubdtype(arr.dtype, jnp.complexfloating)
            else np.float64
        )
        bad = np.argwhere(~np.isfinite(np.atleast_1d(arr.astype(wide))))
        if len(bad):
            found.append(
                f"`args{jax.tree_util.keystr(path)}` is non-finite at {_indices(bad)}"
            )
    return found


def nonfinite_start_message(what: str, args: tuple, residuals=None) -> str:
    """Why a fit stopped at its first evaluation: what is non-finite, where, and
    whether the data (`args`) are the cause."""
    text = f"{what} non-finite at the start"
    if residuals is not None:
        bad = np.argwhere(~np.isfinite(np.atleast_1d(np.asarray(residuals))))
        text += f", at residuals {_indices(bad)} ({len(bad)} of {np.size(residuals)})"
    data = _nonfinite_args(args)
    if data:
        text += (
            "; in the data, " + "; ".join(data) + ". Drop those points (e.g. keep "
            "`np.isfinite(y)`) or fill them"
        )
    else:
        text += (
            "; the data in `args` are finite, so the model is not defined at the "
            "starting point: start where it is (or constrain the parameter with "
            "`sciflat.Positive` & co.)"
        )
    return text + ". Nothing was fitted; `p` is the start."
