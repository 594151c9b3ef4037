"""Per-leaf transforms: a parameter stored unconstrained, seen constrained.

`sciflat.Positive(2.0)` is a node of the model holding `raw = log(expm1(2.0))`; `p`
holds `raw`, and every fit hands the loss the model with each node replaced by its
constrained value (`sciflat.unwrap`). So an unbounded method (BFGS, Adam, `lm`)
respects the constraint, and standard errors are mapped to the constrained values by
the delta method (`_delta.py`).
"""

import abc
import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from ._flatten import Restructure
from ._layout import TRAINABLE


_M = TypeVar("_M")


class Transform(eqx.Module):
    """A parameter stored unconstrained (`raw`, in `p`) and used constrained (`value`).

    Subclasses say how: `forward(raw) -> value` and `inverse(value) -> raw`,
    elementwise. Build one from the constrained value: `sciflat.Positive(2.0)`.
    """

    raw: Float[Array, "..."]

    @abc.abstractmethod
    def forward(self, raw: Float[Array, "..."]) -> Float[Array, "..."]:
        """The constrained value of `raw`."""

    @property
    def value(self) -> Float[Array, "..."]:
        """The constrained value."""
        return self.forward(self.raw)


def _raw(
    value: ArrayLike, inverse: Callable[[np.ndarray], np.ndarray], what: str
) -> np.ndarray:
    given = np.asarray(value).dtype
    # A floating value keeps its dtype (bfloat16 and float16 too: the dtype rule);
    # anything else becomes floating as NumPy promotes it with float32.
    floating = jnp.issubdtype(given, jnp.floating)
    dtype = given if floating else np.result_type(given, np.float32)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`{what}` takes a real value, got dtype {given}.")
    # The inverse in float64 (NumPy has no bfloat16 logs), rounded once to `dtype`.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        raw = np.asarray(inverse(np.asarray(value, np.float64)), dtype)
    if not np.isfinite(raw).all():
        raise ValueError(f"`{what}` got {value!r}, outside its domain.")
    return raw


class Positive(Transform):
    """A positive parameter: `value = softplus(raw)` (about `raw` for large values,
    `exp(raw)` near zero).

    !!! Example

        ```python
        model = {"b1": sciflat.Positive(500.0), "b2": sciflat.Positive(1e-4)}
        result = sciflat.least_squares(residuals, model, args=(x, y))
        sciflat.unwrap(result.model)["b1"]      # the fitted value, > 0
        ```

    **Arguments:**

    - `value`: the starting value (> 0), a number or an array.
    """

    raw: Float[Array, "..."]

    def __init__(self, value: ArrayLike):
        self.raw = jnp.asarray(_raw(value, lambda v: np.log(np.expm1(v)), "Positive"))

    def forward(self, raw: Float[Array, "..."]) -> Float[Array, "..."]:
        return jax.nn.softplus(raw)


class Log(Transform):
    """A positive parameter fitted on a log scale: `value = exp(raw)`. For scales
    spanning decades (rates, concentrations).

    !!! Example

        ```python
        model = {"rate": sciflat.Log(1e-3)}     # p holds log(1e-3)
        ```

    **Arguments:**

    - `value`: the starting value (> 0), a number or an array.
    """

    raw: Float[Array, "..."]

    def __init__(self, value: ArrayLike):
        self.raw = jnp.asarray(_raw(value, np.log, "Log"))

    def forward(self, raw: Float[Array, "..."]) -> Float[Array, "..."]:
        return jnp.exp(raw)


class Interval(Transform):
    """A parameter in the open interval `(lower, upper)`:
    `value = lower + (upper - lower) * sigmoid(raw)`.

    !!! Example

        ```python
        model = {"fraction": sciflat.Interval(0.3, 0.0, 1.0)}
        ```

    **Arguments:**

    - `value`: the starting value, strictly inside the interval.
    - `lower`, `upper`: the bounds (numbers, `lower < upper`).
    """

    lower: float = eqx.field(static=True)
    upper: float = eqx.field(static=True)

    raw: Float[Array, "..."]

    def __init__(self, value: ArrayLike, lower: float, upper: float):
        if not float(lower) < float(upper):
            raise ValueError(f"`Interval` needs `lower < upper`, got {lower}, {upper}.")
        self.lower, self.upper = float(lower), float(upper)
        to_unit = lambda v: (v - self.lower) / (self.upper - self.lower)
        self.raw = jnp.asarray(
            _raw(
                value, lambda v: np.log(to_unit(v)) - np.log1p(-to_unit(v)), "Interval"
            )
        )

    def forward(self, raw: Float[Array, "..."]) -> Float[Array, "..."]:
        return self.lower + (self.upper - self.lower) * jax.nn.sigmoid(raw)


def _is_transform(x: Any) -> bool:
    return isinstance(x, Transform)


def unwrap(model: _M) -> _M:
    """The model with every [`sciflat.Transform`][] replaced by its constrained value.

    The fits do this before calling the loss; call it on `result.model` to read the
    fitted values.

    !!! Example

        ```python
        model = {"k": sciflat.Positive(2.0), "c": jnp.asarray(1.0)}
        sciflat.unwrap(model)                   # {"k": Array(2.), "c": Array(1.)}
        ```

    **Arguments:**

    - `model`: any pytree.

    **Returns:**

    The same pytree, each transform node replaced by its `value`.
    """
    leaf = lambda x: x.value if _is_transform(x) else x
    return jax.tree.map(leaf, model, is_leaf=_is_transform)


@ft.lru_cache(maxsize=256)
def unwrapping(loss: Callable[..., Any]) -> Callable[..., Any]:
    """`loss` called on the unwrapped model; one wrapper per loss, so that caches
    keyed by the loss still hit."""

    @ft.wraps(loss)
    def on_values(model: Any, *args: Any) -> Any:
        return loss(unwrap(model), *args)

    return on_values


def has_transforms(model: Any) -> bool:
    leaves = jax.tree.leaves(model, is_leaf=_is_transform)
    return any(_is_transform(x) for x in leaves)


# A transform node keeps its value's numbers in the leaf `raw`: `['a']` -> `['a'].raw`.
_RAW = jax.tree_util.keystr((jax.tree_util.GetAttrKey("raw"),))


def raw_path(node_path: str) -> str:
    """The path of the `raw` leaf of the transform node at `node_path`."""
    return node_path + _RAW


def node_path(path: str) -> str:
    """The path of the transform node whose `raw` leaf is at `path` (else `path`)."""
    return path.removesuffix(_RAW)


def nodes(re: Restructure) -> list[tuple[str, Transform]]:
    """Every transform node of the model `re` rebuilds, by path (each path of a tie)."""
    model = re(jnp.zeros(len(re), re.dtype))
    nodes = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_transform)[0]
    return [(jax.tree_util.keystr(k), x) for k, x in nodes if _is_transform(x)]


def describe(node: Transform) -> str:
    """`Positive()`, `Interval(lower=0.0, upper=1.0)`: the transform without its value."""
    fields = [f.name for f in dataclasses.fields(node) if f.name != "raw"]
    inside = ", ".join(f"{name}={getattr(node, name)!r}" for name in fields)
    return f"{type(node).__qualname__}({inside})"


def transforms_by_path(re: Restructure) -> dict[str, str]:
    """The transform at each leaf that is a transform's `raw` (`"['a'].raw"`), described:
    what a saved file records, so that it loads into the same transforms only."""
    return {raw_path(path): describe(node) for path, node in nodes(re)}


def constrained(re: Restructure, x: Float[Array, " n"]) -> Float[Array, " n"]:
    """`x` with every entry that is a transform's `raw` mapped to its value."""
    x = jnp.asarray(x)
    with jax.ensure_compile_time_eval():  # concrete also inside `jit`
        positions = re(jnp.arange(len(re), dtype=x.dtype))  # each leaf: its indices
    trainable = {e.path for e in re.layout() if e.kind == TRAINABLE}
    nodes = jax.tree_util.tree_flatten_with_path(positions, is_leaf=_is_transform)[0]
    out = x
    for path, node in nodes:
        if _is_transform(node) and raw_path(jax.tree_util.keystr(path)) in trainable:
            index = np.asarray(node.raw).astype(int).ravel()
            # From `x`, not from `out`: a tied node is met once per path, and its
            # entries are mapped once (not softplus of softplus).
            out = out.at[index].set(node.forward(x[index]))
    return out


def raw_to_values(model: Any) -> Any:
    """A model-shaped pytree of per-entry numbers, each transform node replaced by the
    numbers in its `raw` (for standard errors of the constrained values)."""
    leaf = lambda x: x.raw if _is_transform(x) else x
    return jax.tree.map(leaf, model, is_leaf=_is_transform)
