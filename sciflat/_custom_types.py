"""Annotation types that jaxtyping reads at runtime and static checkers read too.

jaxtyping's `PyTree` is opaque to static checkers on purpose, which makes every
parameter annotated with it "unknown" to `pyright --verifytypes` and to users' IDEs.
As Diffrax does, checkers see a plain alias here and the runtime keeps jaxtyping's.
"""

import os
import typing
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar


_T = TypeVar("_T")

if typing.TYPE_CHECKING:
    # A pytree whose leaves are `_T`: to a checker, `_T` or any container of them.
    PyTree: TypeAlias = _T | Any
else:
    from jaxtyping import PyTree as PyTree

# Which leaves are trainable: a bool or callable, or a pytree prefix of them.
FilterSpec: TypeAlias = PyTree[bool | Callable[[Any], bool]]
# A file name, as `open` takes it.
FilePath: TypeAlias = str | os.PathLike[str]
