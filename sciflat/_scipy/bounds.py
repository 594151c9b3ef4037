"""Bounds given in the model's own structure, turned into SciPy's flat `(lb, ub)`."""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .._flatten import Restructure
from .._layout import TRAINABLE, Leaf, names
from .._transforms import Transform, raw_path, raw_to_values


def _transforms_in(model) -> dict[str, Transform]:
    """The model's transform nodes by path (`['w']` for a `sciflat.Positive` at `w`)."""
    is_node = lambda x: isinstance(x, Transform)
    nodes = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_node)[0]
    return {jax.tree_util.keystr(k): x for k, x in nodes if is_node(x)}


def _transform_note(nodes: dict[str, Transform]) -> str:
    """Why a bound on a transformed leaf is refused, and what to do instead."""
    shown = list(nodes.items())[:4]
    which = ", ".join(f"`{p}` is a `sciflat.{type(x).__name__}`" for p, x in shown)
    raws = names(raw_path(p) for p, _ in shown)
    return (
        f"{which}: a transform constrains its value itself, and `p` holds the "
        f"unconstrained `raw`, so a bound on {raws} would bound the unconstrained "
        "`raw`, not the value. Drop the bound (the transform already keeps the value "
        "in its domain) or, for a value in (lower, upper), make the leaf "
        "`sciflat.Interval(value, lower, upper)`."
    )


def _bound_array(value, entry: Leaf, side: str, where: str) -> np.ndarray:
    """One side of one leaf's bound as float64 of the leaf's `size` in `p`."""
    default = -np.inf if side == "lower" else np.inf
    size = entry.slice.stop - entry.slice.start
    if value is None:
        return np.full(size, default)
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(
            f"`bounds` for `{where}` ({side}) must be None, a number or an array, got "
            f"{type(value).__name__}."
        ) from None
    shape = entry.shape
    complex_leaf = size != int(np.prod(shape, dtype=int))
    if arr.ndim == 0:
        return np.full(size, float(arr))
    if complex_leaf or arr.shape != shape:
        raise ValueError(
            f"`bounds` for `{where}` ({side}) must be a number or an array of the "
            f"leaf's shape {shape}, got shape {arr.shape}"
            + (" (a complex leaf takes scalar bounds only)." if complex_leaf else ".")
        )
    return arr.ravel()


def _from_mapping(
    bounds: Mapping, re: Restructure, entries: dict[str, Leaf], model
) -> dict[str, tuple]:
    out, given = {}, {}
    for where, pair in bounds.items():
        name = where if isinstance(where, str) else getattr(where, "__name__", "where")
        try:
            sl = re.slice(where)
        except (KeyError, ValueError) as e:
            raise _not_a_leaf(where, name, e, re, model) from None
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(
                f"`bounds[{name!r}]` must be a pair `(lower, upper)`, got {pair!r}."
            )
        entry = next(e for e in entries.values() if e.slice == sl)
        # Tied uses are one array in `p`: the same bounds twice are fine, others not.
        key = entry.path
        if key in out and not _same(out[key], pair):
            raise ValueError(
                f"`bounds` differ for `{name}` and `{given[key]}`, which are the same "
                f"(tied) array `{key}` in `p`. Give them the same bounds."
            )
        out[key] = pair
        given.setdefault(key, name)
    return out


def _not_a_leaf(where, name: str, error: Exception, re: Restructure, model):
    nodes = _transforms_in(model)
    if callable(where):
        picked = where(model)
        hit = {p: x for p, x in nodes.items() if x is picked}
    else:
        hit = {p: x for p, x in nodes.items() if p.lstrip(".") == where.lstrip(".")}
    if hit:
        return ValueError(f"`bounds` for `{name}`: {_transform_note(hit)}")
    why = error.args[0] if isinstance(error, KeyError) else str(error)
    if isinstance(error, KeyError):  # the trainable paths, quoted once
        shown = re.paths[:8]
        why = f"the trainable leaves are {names(shown)}" + (
            ", ..." if len(re.paths) > 8 else ""
        )
    note = f" {_transform_note(nodes)}" if nodes else ""
    return ValueError(
        f"`bounds` key `{name}` does not pick a trainable leaf: {why}.{note}"
    )


def _from_pytrees(bounds: tuple, model, entries: dict[str, Leaf]) -> dict[str, tuple]:
    is_none = lambda x: x is None
    want = jax.tree.structure(model, is_leaf=is_none)
    nodes = _transforms_in(model)
    # The model's structure with each transform node as one leaf: how a user writes
    # bounds for `{"w": sciflat.Positive(1.0)}` (`{"w": ...}`); unbounded there is fine.
    values_form = jax.tree.structure(raw_to_values(model), is_leaf=is_none)
    sides = []
    for side, tree in zip(("lower", "upper"), bounds, strict=True):
        got = jax.tree.structure(tree, is_leaf=is_none)
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none)[0]
        by_path = {jax.tree_util.keystr(k): v for k, v in leaves}
        if got != want and nodes and got == values_form:
            bounded = {k: nodes[k] for k in nodes if not _unbounded(by_path[k])}
            if bounded:
                raise ValueError(f"`bounds` ({side}): {_transform_note(bounded)}")
            sides.append(
                {raw_path(k) if k in nodes else k: v for k, v in by_path.items()}
            )
            continue
        if got != want:
            raise ValueError(
                f"`bounds` as `(lower, upper)` must be pytrees with the model's structure; "
                f"the {side} one differs.\nexpected: {want}\ngot:      {got}\nOr give a "
                "dict `{where: (lower, upper)}` for just the bounded leaves."
            )
        sides.append(by_path)
    out = {}
    for path in sides[0]:
        lo, hi = sides[0][path], sides[1][path]
        if path in entries:
            key = entries[path].path
            if key in out and not _same(out[key], (lo, hi)):
                raise ValueError(
                    f"`bounds` differ for `{path}` and `{key}`, which are the same (tied) "
                    "array in `p`. Give them the same bounds."
                )
            out[key] = (lo, hi)
        elif not all(_unbounded(v) for v in (lo, hi)):
            raise ValueError(
                f"`bounds` gives a finite bound for `{path}`, which is not in `p`."
            )
    return out


def _unbounded(v) -> bool:
    if v is None or callable(v) or isinstance(v, str | bool):
        return True
    try:
        return bool(np.all(np.isinf(np.asarray(v, dtype=np.float64))))
    except (TypeError, ValueError):
        return True  # a non-numeric leaf of the model (an activation name...)


def flat_bounds(
    bounds: Mapping[str | Callable[[Any], Any], tuple] | tuple | None,
    re: Restructure,
    x0: np.ndarray,
) -> tuple[np.ndarray, np.ndarray] | None:
    """SciPy's `(lb, ub)` for `bounds` given per leaf, checked against `x0`."""
    if bounds is None:
        return None
    layout = re.layout()
    # Every position in `p` (tied uses too) maps to the slot of its first path.
    first = {e.path: e for e in layout.slots}
    entries = {
        e.path: first[e.tied_to or e.path] for e in layout if e.kind == TRAINABLE
    }
    if isinstance(bounds, Mapping):
        per_leaf = _from_mapping(bounds, re, entries, re(jax.numpy.asarray(x0)))
    elif isinstance(bounds, tuple) and len(bounds) == 2:
        per_leaf = _from_pytrees(bounds, re(jax.numpy.asarray(x0)), entries)
    else:
        raise TypeError(
            "`bounds` must be a dict `{where: (lower, upper)}` (where: a leaf path or "
            "`lambda m: m.leaf`) or a pair `(lower, upper)` of model-shaped pytrees, got "
            f"{type(bounds).__name__}."
        )
    lb, ub = np.full(len(re), -np.inf), np.full(len(re), np.inf)
    for path, (lo, hi) in per_leaf.items():
        e = first[path]
        sl = e.slice
        lb[sl] = _bound_array(lo, e, "lower", path)
        ub[sl] = _bound_array(hi, e, "upper", path)
    _check(lb, ub, x0, first)
    return lb, ub


def _same(a: tuple, b: tuple) -> bool:
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None):
            return False
        if x is not None and not np.array_equal(np.asarray(x), np.asarray(y)):
            return False
    return True


def _check(lb, ub, x0, first: dict[str, Leaf]) -> None:
    for path, e in first.items():
        sl = e.slice
        if np.isnan(lb[sl]).any() or np.isnan(ub[sl]).any():
            raise ValueError(f"`bounds` for `{path}` contain NaN.")
        if (lb[sl] > ub[sl]).any():
            raise ValueError(f"`bounds` for `{path}`: lower > upper at some entries.")
        outside = (x0[sl] < lb[sl]) | (x0[sl] > ub[sl])
        if outside.any():
            i = int(np.argmax(outside))
            raise ValueError(
                f"The starting point is outside `bounds` at `{path}` (entry {i}: "
                f"{x0[sl][i]} not in [{lb[sl][i]}, {ub[sl][i]}]). Start inside the bounds."
            )
