"""The cache key of a user's function: its identity, as `jax.jit` keys it.

A fit wraps the user's loss in small adapters of its own, made anew at every call
(unwrapping the transforms, say). Those are keyed by their code and the identity of
what they close over, so the same loss object reuses its compilation through them.
Nothing is keyed by value: a new `lambda` is a new function and compiles again, as
under `jax.jit`, so a reused compilation can never have read a stale value.
"""

import types
from collections.abc import Hashable


class Same:
    """Equal only to the same object (kept alive, so its `id` is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other) -> bool:
        return type(other) is Same and other.obj is self.obj


def identity_key(fn) -> Hashable:
    """Equal for the same object, as `jax.jit`'s key; and for sciflat's own adapter
    closures around the same objects (their cells are never rebound)."""
    if isinstance(fn, types.FunctionType) and fn.__closure__ and _ours(fn):
        try:
            cells = tuple(identity_key(c.cell_contents) for c in fn.__closure__)
        except ValueError:  # an empty cell
            return Same(fn)
        return (fn.__code__, cells)
    return Same(fn)


def _ours(fn: types.FunctionType) -> bool:
    # Where it was defined, not the name `ft.wraps` copied onto it.
    return (fn.__globals__.get("__name__") or "").partition(".")[0] == "sciflat"
