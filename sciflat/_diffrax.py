"""Diffrax right-hand sides for a destructured model: `diffeqsolve(..., args=re(p))`."""

import functools as ft
from collections.abc import Callable
from typing import Any, Literal, ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, ArrayLike, Shaped

from ._custom_types import PyTree
from ._dtypes import complex_dtype, is_complex, is_inexact, real_dtype
from ._flatten import Restructure
from ._transforms import raw_to_values, unwrap


_P = ParamSpec("_P")
_R = TypeVar("_R")
Signature = Literal["y", "t,y", "t,y,args"]
_SIGNATURES = ("y", "t,y", "t,y,args")


class VectorField(eqx.Module):
    """An ODE right-hand side `f(t, y, args)` for a model destructured by sciflat.

    Made by [`sciflat.vector_field`][]; see there. It is an `eqx.Module`, so an
    `ODETerm` holding it is a pytree with a fixed structure and `jit` never retraces
    for a new `VectorField` built from the same `re`.
    """

    # A pytree field: `re` may hold arrays (frozen and integer leaves), which Equinox
    # refuses in static fields. BacksolveAdjoint then carries an adjoint for the frozen
    # floating arrays too: correct, and discarded.
    re: Restructure[Any]
    signature: Signature = eqx.field(static=True)

    def __call__(
        self, t: ArrayLike, y: PyTree[Shaped[Array, "..."]], args: Any
    ) -> PyTree[Shaped[Array, "..."]]:
        params, extra = self._split(args)
        if self._is_model(params):
            model, dtype = params, _model_dtype(params)
        else:
            # The flat vector: rebuilt at every evaluation, inside Diffrax's loop.
            dtype = np.dtype(params.dtype)
            model = self.re(params)
        # The model sees constrained values, as a fit's loss does: `re(p)` holds each
        # `sciflat.Positive` & co. as its node (`raw`), which the model cannot compute
        # with. Inside the loop, as the hand-written `softplus(raw)` would be.
        model = unwrap(model)
        _check_state(y, dtype, "`y`")
        # Time is not a parameter: it reaches the model in `p.dtype`, so a float64
        # time axis never promotes a float32 model (nor the reverse).
        t = jnp.asarray(t).astype(dtype)
        if self.signature == "y":
            out = model(y)
        elif self.signature == "t,y":
            out = model(t, y)
        else:
            out = model(t, y, extra)
        _check_state(out, dtype, "The model's output `dy/dt`", like=y)
        return out

    def _is_model(self, x) -> bool:
        return jax.tree.structure(x) in self._model_structures()

    def _model_structures(self) -> tuple[Any, Any]:
        """The structures of `re(p)` and of `sciflat.unwrap(re(p))`, the model a fit
        hands its loss (each transform node replaced by one array)."""
        treedef = self.re._structure()
        marks = jtu.tree_unflatten(treedef, [object()] * treedef.num_leaves)
        return treedef, jax.tree.structure(raw_to_values(marks))

    def _split(self, args):
        """`args` as `(model or p, extra)`."""
        if self._is_model(args) or _is_flat(args):
            return args, None
        if isinstance(args, tuple) and len(args) == 2:
            if self._is_model(args[0]) or _is_flat(args[0]):
                return args
        got = (
            f"a tuple of length {len(args)}"
            if isinstance(args, tuple)
            else f"{type(args).__name__} of structure {jax.tree.structure(args)}"
        )
        raise TypeError(
            "`args` of `diffeqsolve` must be the model rebuilt by `re(p)` (or "
            "`(re(p), extra)`, where `extra` is handed to the model as its own "
            f"`args`), or the flat vector `p` (or `(p, extra)`); got {got}. The model "
            f"has structure {self._model_structures()[0]}."
        )


def _is_flat(x) -> bool:
    """Whether `x` is meant as the flat vector: a real floating array (`re` checks
    its shape)."""
    return hasattr(x, "dtype") and jnp.issubdtype(np.dtype(x.dtype), jnp.floating)


def _model_dtype(model) -> np.dtype:
    """The one real dtype of a model's floating leaves (`p.dtype` for `re(p)`)."""
    found: tuple[str, np.dtype] | None = None
    for path, leaf in jtu.tree_flatten_with_path(model)[0]:
        if not eqx.is_inexact_array(leaf):
            continue
        dtype = np.dtype(real_dtype(leaf.dtype))
        if found is None:
            found = (jtu.keystr(path), dtype)
        elif dtype != found[1]:
            raise TypeError(
                f"The model passed as `args` has floating leaves in two dtypes: "
                f"`{found[0]}` is {found[1].name} and `{jtu.keystr(path)}` is "
                f"{dtype.name}. Pass `re(p)`: it rebuilds every floating leaf in "
                "`p.dtype`."
            )
    if found is None:
        return np.dtype(jnp.zeros(()).dtype)
    return found[1]


def _check_state(y, dtype: np.dtype, what: str, like=None) -> None:
    leaves, treedef = jax.tree.flatten_with_path(y)
    if like is not None and treedef != jax.tree.structure(like):
        raise ValueError(
            f"{what} must have the structure of `y`: expected {jax.tree.structure(like)}, "
            f"got {treedef}."
        )
    for path, leaf in leaves:
        got = np.dtype(jnp.result_type(leaf))
        if not is_inexact(got):
            raise TypeError(
                f"{what}{jax.tree_util.keystr(path)} has dtype {got.name}; "
                "an ODE state must be floating."
            )
        want = complex_dtype(dtype, what) if is_complex(got) else dtype
        if got != want:
            raise TypeError(
                f"{what}{jax.tree_util.keystr(path)} has dtype {got.name}, but `p` has "
                f"dtype {dtype.name}: the state and the parameters must agree, or one "
                "half of the solve silently runs in the lower precision. Make `y0` "
                f"{want.name} (e.g. `y0.astype(jnp.{want.name})`) or build `p` in "
                f"{got.name} (`sciflat.destructure(model, dtype=jnp.{got.name})`). "
                "Note that Diffrax promotes `y0` to the dtype of `t0`, `t1`, `dt0` and "
                "`SaveAt(ts=...)`: give those in the same dtype too."
            )


def _no_args_flag(f: Callable[_P, _R]) -> Callable[_P, _R]:
    """`vector_field(re, args="model")`, the flag of an earlier version: a TypeError
    naming the fix, not Python's "unexpected keyword argument"."""

    @ft.wraps(f)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if "args" in kwargs:
            raise TypeError(
                f"`vector_field` no longer takes `args=` (got {kwargs['args']!r}): the "
                "field reads what Diffrax's `args` holds, the model `re(p)` or the flat "
                "vector `p`, by its structure. Write `sciflat.vector_field(re)` (or "
                "`sciflat.vector_field(re, signature)`) and pass `args=re(p)` to "
                "`diffeqsolve`."
            )
        return f(*args, **kwargs)

    return checked


@_no_args_flag
def vector_field(
    re: Restructure[Any], signature: Signature = "t,y,args"
) -> VectorField:
    """An ODE right-hand side for Diffrax whose parameters are the flat vector `p`.

    Pass the rebuilt model `re(p)` as Diffrax's `args` (or `(re(p), extra)`, where
    `extra` is handed to the model as its own `args`): `diffeqsolve` then
    differentiates with respect to `p` through `re`, with any solver and adjoint, at
    the cost of the same solve on the plain model. The model computes in `p.dtype`;
    time is handed to it in `p.dtype` too. The state `y` must have `p.dtype` (or the
    matching complex dtype): anything else is a `TypeError`, never a silent solve in
    another precision. `args=p` (or `(p, extra)`) also works and rebuilds the model
    at every evaluation, inside the solver's loop: 2-4x slower for `vmap`ped solves
    on CPU (see the docs).

    !!! Example

        ```python
        p, re = sciflat.destructure(model)  # model(t, y, args) -> dy/dt
        term = diffrax.ODETerm(sciflat.vector_field(re))
        sol = diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, args=re(p))
        ```

    **Arguments:**

    - `re`: the [`sciflat.Restructure`][] from `sciflat.destructure(model)`.
    - `signature`: how the model is called: `"y"` (`model(y)`), `"t,y"`
        (`model(t, y)`) or `"t,y,args"` (`model(t, y, extra)`, the Diffrax convention).

    **Returns:**

    A [`sciflat.VectorField`][], to wrap in `diffrax.ODETerm`.
    """
    if not isinstance(re, Restructure):
        raise TypeError(
            "`re` must be the `Restructure` returned by `sciflat.destructure(model)`, "
            f"got {type(re).__name__}."
        )
    if signature not in _SIGNATURES:
        raise ValueError(
            f"`signature` must be one of {_SIGNATURES}, got {signature!r}."
        )
    return VectorField(re, signature)
