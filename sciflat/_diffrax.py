"""Diffrax right-hand sides from a flat vector: `diffeqsolve(ODETerm(f), ..., args=p)`."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree, Shaped

from ._dtypes import complex_dtype, is_complex, is_inexact
from ._flatten import Restructure


Signature = Literal["y", "t,y", "t,y,args"]
_SIGNATURES = ("y", "t,y", "t,y,args")


class VectorField(eqx.Module):
    """An ODE right-hand side `f(t, y, args)` that rebuilds the model from `p`.

    Made by [`sciflat.vector_field`][]; see there. It is an `eqx.Module`, so an
    `ODETerm` holding it is a pytree with a fixed structure and `jit` never retraces
    for a new `VectorField` built from the same `re`.
    """

    # A pytree field: `re` may hold arrays (frozen and integer leaves), which Equinox
    # refuses in static fields. BacksolveAdjoint then carries an adjoint for the frozen
    # floating arrays too: correct, and discarded.
    re: Restructure
    signature: Signature = eqx.field(static=True)
    args: Literal["p", "model"] = eqx.field(static=True, default="p")

    def __call__(self, t, y: PyTree[Shaped[Array, "..."]], args) -> PyTree:
        if self.args == "model":
            model, extra = self._split_model(args)
            dtype = _model_dtype(model, y)
            _check_state(y, dtype, "`y`")
        else:
            p, extra = self._split_p(args)
            dtype = np.dtype(p.dtype)
            _check_state(y, dtype, "`y`")
            model = self.re(p)
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

    def _split_p(self, args):
        p, extra = (args[0], args[1]) if isinstance(args, tuple) else (args, None)
        if isinstance(args, tuple) and len(args) != 2:
            raise ValueError(
                "`args` of `diffeqsolve` must be `p` or `(p, extra)`, got a tuple of "
                f"length {len(args)}."
            )
        dtype = np.dtype(getattr(p, "dtype", object))
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                "`args` of `diffeqsolve` must be the flat vector `p` (or `(p, extra)`), "
                f"got {type(p).__name__} of dtype {dtype}."
            )
        return p, extra

    def _split_model(self, args):
        want = self.re._spec.treedef
        if jax.tree.structure(args) == want:
            return args, None
        if (
            isinstance(args, tuple)
            and len(args) == 2
            and jax.tree.structure(args[0]) == want
        ):
            return args
        raise TypeError(
            "`args` of `diffeqsolve` must be the model rebuilt by `re(p)` (or "
            f"`(re(p), extra)`), since `args='model'`; got {jax.tree.structure(args)}."
        )


def _model_dtype(model, y) -> np.dtype:
    """`p.dtype` of a model rebuilt by `re(p)`: every floating leaf has it."""
    for leaf in jax.tree.leaves(model):
        if eqx.is_inexact_array(leaf):
            return np.dtype(jnp.finfo(leaf.dtype).dtype)
    return np.dtype(jnp.result_type(jax.tree.leaves(y)[0]))


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


def vector_field(
    re: Restructure,
    signature: Signature = "t,y,args",
    *,
    args: Literal["p", "model"] = "p",
) -> VectorField:
    """An ODE right-hand side for Diffrax whose parameters are the flat vector `p`.

    Pass `p` as Diffrax's `args` (or `(p, extra)`, where `extra` is handed to the model
    as its own `args`): then `diffeqsolve` differentiates with respect to `p`, with any
    solver and adjoint. The model is rebuilt by `re(p)` at every evaluation, so it
    computes in `p.dtype`; time is handed to it in `p.dtype` too. The state `y` must
    have `p.dtype` (or the matching complex dtype): anything else is a `TypeError`,
    never a silent solve in another precision. A universal differential equation is
    just a model holding both the known rates and the network.

    !!! Example

        ```python
        p, re = sciflat.destructure(model)  # model(t, y, args) -> dy/dt
        term = diffrax.ODETerm(sciflat.vector_field(re))
        sol = diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, args=p)
        ```

    **Arguments:**

    - `re`: the [`sciflat.Restructure`][] from `sciflat.destructure(model)`.
    - `signature`: how the model is called: `"y"` (`model(y)`), `"t,y"`
        (`model(t, y)`) or `"t,y,args"` (`model(t, y, extra)`, the Diffrax convention).
    - `args`: what is passed as Diffrax's `args`: `"p"` (the flat vector: the model
        is rebuilt at every evaluation) or `"model"` (`re(p)`, rebuilt once outside
        the solve: the gradient still flows to `p`, through `re`). `"model"` is
        faster for batched (`vmap`ped) solves on CPU: see the benchmark in the docs.

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
    if args not in ("p", "model"):
        raise ValueError(f"`args` must be 'p' or 'model', got {args!r}.")
    return VectorField(re, signature, args)
