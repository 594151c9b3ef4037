"""Several starts of one fit, as rows of flat vectors: one check for every fit that
takes them (`multistart`, `least_squares_batch`), so a wrong start reads the same
whichever got it."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from .._flatten import Restructure, destructure
from .._validate import checked_flat_vector
from .floats import promote_floats


def stacked_starts(
    starts: Any, re: Restructure, filter_spec: Any, who: str
) -> npt.NDArray[np.float64]:
    """`starts` as a float64 `(K, n)` array: given as an array of K flat vectors, or
    as K models of the structure `re` was made from (flattened by `filter_spec`). A
    start that is not finite is kept (each fit reports its own), but a start of
    another shape or structure is a ValueError naming it, and no start at all too."""
    n = len(re)
    if isinstance(starts, jax.Array | np.ndarray):
        if np.ndim(starts) != 2 or np.shape(starts)[1] != n:
            raise ValueError(
                f"`{who}`: `starts` as an array must have shape (K, {n}), one flat "
                f"vector per start in the order of `p` (see `re.paths`), got "
                f"{np.shape(starts)}."
            )
        if len(starts) == 0:
            raise _empty(who)
        # The rows' dtype as a vector given to a fit's: real floating, held exactly
        # by JAX. One row is checked: one transfer, not K (a batch has thousands).
        checked_flat_vector(starts[0], n, f"`{who}` (`starts`)")
        return np.asarray(starts, np.float64)
    rows = [_flattened(s, i, re, filter_spec, who) for i, s in enumerate(starts)]
    if not rows:
        raise _empty(who)
    return np.stack(rows)


def _empty(who: str) -> ValueError:
    return ValueError(f"`{who}`: `starts` is empty; give at least one start.")


def _flattened(start, i: int, re: Restructure, filter_spec, who: str) -> np.ndarray:
    q, r = destructure(promote_floats(start, who), filter_spec, dtype=jnp.float64)
    if r.paths != re.paths:
        raise ValueError(
            f"`{who}`: the starts differ in structure: `starts[{i}]` does not have "
            f"the model's trainable leaves: expected {list(re.paths)[:8]} ({len(re)} "
            f"numbers), got {list(r.paths)[:8]} ({len(r)}). Every start has the "
            "model's structure."
        )
    if len(r) != len(re):
        raise ValueError(_tie_mismatch(i, re, r, who))
    return np.asarray(q, np.float64)


def _ties(re: Restructure) -> dict[str, str]:
    return {e.path: e.tied_to for e in re.layout() if e.tied_to is not None}


def _tie_mismatch(i: int, re: Restructure, start: Restructure, who: str) -> str:
    """The same trainable paths but another length of `p`: the ties differ."""
    want, got = _ties(re), _ties(start)
    lost = [f"`{p}` is tied to `{q}`" for p, q in want.items() if got.get(p) != q]
    new = [f"`{p}` is tied to `{q}`" for p, q in got.items() if want.get(p) != q]
    parts = []
    if lost:
        parts.append(
            "in the model " + ", ".join(lost[:4]) + " (one array, one entry "
            "of `p`), in the start they are separate arrays"
        )
    if new:
        parts.append("in the start " + ", ".join(new[:4]) + ", in the model not")
    return (
        f"`{who}`: the starts differ in structure: `starts[{i}]` does not have the "
        "model's ties: " + "; ".join(parts) + ". Put one array object in every tied "
        "place of a start, as in the model (`w = jnp.asarray(...)`, then "
        "`{'a': w, 'b': w}`), or give `starts` as flat vectors: rows of length "
        f"{len(re)} in the order of `p`."
    )
