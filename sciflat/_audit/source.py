"""The user's own source line for an op: the innermost frame of its traceback that is
outside JAX, the libraries built on it, sciflat and the standard library."""

import dataclasses
import functools as ft
import importlib.util
import os
import sysconfig
from collections.abc import Sequence
from typing import Any


_LIBRARIES = (
    "jax",
    "jaxlib",
    "equinox",
    "diffrax",
    "optax",
    "lineax",
    "optimistix",
    "jaxtyping",
    "typeguard",
    "sciflat",
)


@ft.cache
def _library_dirs() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    libraries = []
    for name in _LIBRARIES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            libraries += [os.path.join(d, "") for d in spec.submodule_search_locations]
    stdlib = {os.path.join(sysconfig.get_path(k), "") for k in ("stdlib", "platstdlib")}
    site = {os.path.join(sysconfig.get_path(k), "") for k in ("purelib", "platlib")}
    return tuple(libraries), tuple(stdlib), tuple(site)


@ft.cache
def _is_user_file(filename: str) -> bool:
    libraries, stdlib, site = _library_dirs()
    if filename.startswith(("<frozen ", *libraries)):
        return False
    # site-packages sits inside the standard library's folder and holds user code too.
    return filename.startswith(site) or not filename.startswith(stdlib)


@dataclasses.dataclass(frozen=True, order=True)
class Location:
    """A line of the user's code: `file:line (function)`."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        file = self.file
        if os.path.isabs(file):
            rel = os.path.relpath(file)
            file = rel if not rel.startswith("..") else file
        return f"{file}:{self.line} ({self.function})"


_UNKNOWN = Location("<unknown>", 0, "?")


def user_location(tracebacks: Sequence[Any]) -> Location:
    """The innermost frame in user code of the first of `tracebacks` (JAX source-info
    tracebacks, from an op outwards through the ops that enclose it) that has one."""
    for traceback in tracebacks:
        where = _user_frame(traceback)
        if where is not None:
            return where
    return _UNKNOWN


@ft.lru_cache(maxsize=4096)
def _user_frame(traceback) -> Location | None:
    if traceback is None:
        return None
    codes, lastis = traceback.raw_frames()
    for code, lasti in zip(codes, lastis, strict=True):
        if _is_user_file(code.co_filename):
            return Location(code.co_filename, _line(code, lasti), code.co_qualname)
    return None


@ft.lru_cache(maxsize=4096)
def _positions(code) -> tuple:
    return tuple(pos[0] for pos in code.co_positions())


def _line(code, lasti: int) -> int:
    lines = _positions(code)
    index = lasti // 2  # one position per 2-byte code unit
    line = lines[index] if 0 <= index < len(lines) else None
    return code.co_firstlineno if line is None else line
