"""sciflat's kept jitted functions (the SciPy fits', `fit`'s step and final loss, the
transforms' derivative), reused across fits as `jax.jit` reuses them."""

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from .._flatten import Restructure
from . import start as _scipy_start
from .fn_key import Same, identity_key
from .problem import split_args


# One `jax.jit` per (kind, mode, loss, `re`, static part of `args`): the loss by
# identity, as `jax.jit` keys it, and `re` and the static part by structure (`re`
# compares its frozen arrays by identity). Shapes, dtypes, placement and JAX's
# configuration are keyed by `jax.jit` itself, which retraces when any of them change.
# So a fit reuses a compilation exactly where `jax.jit` of the same function would.
_CACHE: OrderedDict[Hashable, Any] = OrderedDict()
CACHE_SIZE = 64


class _Failed:
    """A gradient mode that failed to trace while another one worked."""


class _Entry:
    """One `jax.jit`, and the output shapes of each signature it was traced at."""

    def __init__(self, fn):
        self.fn = fn
        self.out_info: dict[Hashable, Any] = {}


def _signature(example) -> Hashable:
    def one(x):
        if type(x) is np.ndarray:  # what `jax.typeof` gives it, without the cost
            return (x.shape, x.dtype, False, None)
        aval = jax.typeof(x)
        return (aval.shape, aval.dtype, aval.weak_type, getattr(x, "sharding", None))

    return tuple(one(x) for x in jax.tree.leaves(example))


class Programs:
    """The jitted functions of one fit, looked up in (or added to) the cache."""

    def __init__(
        self,
        build: Callable,
        loss: Callable,
        re: Restructure,
        args: tuple,
        to_device: bool = True,
    ):
        self.leaves, rebuild = split_args(args, to_device)
        self._parts = (build, loss, re, rebuild)
        self._key = (build, identity_key(loss), structure_key(re), rebuild)
        self.out_info: dict[Hashable, Any] = {}  # of each kind got, as traced

    def get(self, kind: Hashable, mode: str, *example, where: Hashable = None) -> Any:
        """The jitted `kind` function, traced at `example` (its arguments but the
        data), so that an error in the trace is raised here. A signature traced
        before (`where`: shapes, dtypes, placement) is not traced again: only its
        output shapes are kept; the call itself goes through `jax.jit`, which keys
        it (on JAX's configuration too) and retraces where it would."""
        key = (kind, mode, *self._key)
        entry = _CACHE.get(key)
        if entry is None:
            build, loss, re, rebuild = self._parts
            entry = _Entry(jax.jit(build(kind, loss, re, rebuild, mode)))
        if where is None:
            where = _signature((*example, self.leaves))
        info = entry.out_info.get(where)
        if info is None:
            info = entry.fn.trace(*example, self.leaves).out_info
            entry.out_info[where] = info
        _remember(key, entry)
        self.out_info[kind] = info
        return entry.fn

    def first_working(
        self, kind: Hashable, modes: list[str], *example
    ) -> tuple[Any, str]:
        """Trace with the preferred mode; on a trace-time error (e.g. forward mode
        through `RecursiveCheckpointAdjoint`, reverse mode through `ForwardMode`) fall
        back to the other one. A mode that failed is remembered (not traced again)
        once another one worked. Returns (jitted function, mode used)."""
        where = _signature((*example, self.leaves))
        failed, errors = [], []
        for i, mode in enumerate(modes):
            failure = ("failed", kind, mode, where, *self._key)
            if failure in _CACHE and i < len(modes) - 1:
                continue  # the last mode is traced again, to raise its own error
            try:
                fn = self.get(kind, mode, *example, where=where)
            except (TypeError, ValueError) as e:
                failed.append(failure)
                errors.append(e)
                continue
            for key in failed:
                _remember(key, _Failed())
            return fn, mode
        raise errors[-1]


def structure_key(re: Restructure) -> Hashable:
    """`re` as a key: by structure, comparing its frozen arrays by identity (sound for
    JAX arrays, which cannot change; a NumPy one can change in place between fits,
    so an `re` holding one is equal only to itself)."""
    mutable = any(isinstance(x, np.ndarray) for x in jax.tree.leaves(re))
    return Same(re) if mutable else re


def shared(key: Hashable, make: Callable[[], Any]) -> Any:
    """What the cache keeps under `key`, made by `make()` where it keeps nothing: for
    `fit`'s step (one `jax.jit` per loss, optimiser, `re` and static `args`) and final
    loss, and the transforms' derivative (per `re`), keyed as `Programs` keys the
    SciPy fits' functions: by identity or structure, never by value of an array."""
    value = _CACHE.get(key)
    if value is None:
        value = make()
    _remember(key, value)
    return value


def _remember(key, value) -> None:
    _CACHE[key] = value
    _CACHE.move_to_end(key)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)


def clear_caches() -> None:
    """Forget every compiled function and flattened start model sciflat keeps.

    sciflat keeps the jitted functions of recent fits (reused by a later fit of the
    same loss object, `Restructure` and data structure, and for `fit` the same
    optimiser object, exactly where `jax.jit` would reuse them; the standard errors
    of transformed values, per `Restructure`) and the `Restructure` of recent start
    models. Call this to free their memory, or to time a first fit again; nothing
    else changes, since a hit never returns a stale result. (`jax.clear_caches()`
    clears JAX's own.)

    !!! Example

        ```python
        sciflat.clear_caches()
        ```
    """
    _CACHE.clear()
    _scipy_start.clear()
