"""What sits where in `p`: one typed record per array leaf, and the leaves' names.

The one vocabulary of leaf kinds, shared by the core (`_flatten.py`), the file format
(`_io.py`) and the fits, which ask `Layout.slots` rather than filtering themselves.
"""

import dataclasses
from collections.abc import Iterable
from typing import Any, Final, Literal, Protocol

import numpy as np


Kind = Literal["trainable", "frozen", "other"]

TRAINABLE: Final = "trainable"  # in `p`
FROZEN: Final = "frozen"  # floating, not in `p`: rebuilt in `p.dtype`
OTHER: Final = "other"  # integer, bool or key arrays: passed through
STATIC: Final = "static"  # not an array (never in a layout)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array leaf of a model, as [`sciflat.Restructure.layout`][] describes it.

    `kind` is `"trainable"` (in `p`; `dtype` is the one `re` rebuilds it in, and
    `offset`/`size` say where it sits in `p`), `"frozen"` (floating but not in `p`;
    `dtype` as given) or `"other"` (integer, bool or key arrays, passed through).
    `tied_to` is the first path of the same array, or `None`.
    """

    path: str
    kind: Kind
    shape: tuple[int, ...]
    dtype: str
    tied_to: str | None = None
    offset: int | None = None
    size: int | None = None

    @property
    def slice(self) -> slice:
        """Where a trainable leaf sits in `p`."""
        if self.offset is None or self.size is None:
            raise ValueError(f"The leaf `{self.path}` is {self.kind}, not in `p`.")
        return slice(self.offset, self.offset + self.size)

    def to_json(self) -> dict[str, Any]:
        """A plain dict (what a saved file's header holds)."""
        out = dataclasses.asdict(self)
        out["shape"] = list(self.shape)
        if self.kind != TRAINABLE:
            del out["offset"], out["size"]
        return out

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> "Leaf":
        fields = {**entry, "shape": tuple(entry["shape"])}
        return cls(**fields)


class Layout(tuple[Leaf, ...]):
    """Every array leaf of a model, in leaf order; returned by `Restructure.layout()`."""

    @property
    def slots(self) -> tuple[Leaf, ...]:
        """The leaves that own a slot of `p` (trainable, not tied to an earlier use),
        in `p` order: their `size`s add up to `len(p)`."""
        return tuple(x for x in self if x.kind == TRAINABLE and x.tied_to is None)

    def to_json(self) -> list[dict[str, Any]]:
        return [x.to_json() for x in self]


class HasLayout(Protocol):
    """What the helpers below need of a `Restructure` (which imports this module)."""

    def layout(self) -> "Layout": ...


def nonfinite_paths(flat, re: HasLayout) -> list[str]:
    """Paths of the slots of `p` with a NaN or infinite entry in `flat`."""
    # `astype` (not a view): bfloat16 & co. convert to float64 exactly, NaN included.
    bad = ~np.isfinite(np.asarray(flat).astype(np.float64))
    return [x.path for x in re.layout().slots if bad[x.slice].any()]


def names(paths: Iterable[str]) -> str:
    """Leaf paths as an error message lists them: `` `.a`, `.b` ``."""
    return ", ".join(f"`{p}`" for p in paths)
