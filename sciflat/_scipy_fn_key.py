"""A cache key for a user's loss function that survives `lambda` re-creation.

`jax.jit` keys on the function object, so `minimize(lambda m, x: ..., ...)` in a loop
would compile every call. Two functions with equal code whose closure cells, defaults
and the globals they name hold equal values do the same thing when traced, so they may
share a compilation. A wrong hit is a silent wrong answer, so the key is strict: every
value reached is keyed by content when it can change (NumPy arrays, lists, dicts,
pytrees), by identity only when it cannot (JAX arrays) or is library code, and anything
else makes the whole function "unkeyable": it is then keyed by identity, as `jax.jit`
does.
"""

import builtins
import functools as ft
import types
from collections.abc import Hashable

import jax
import jax.core  # `jax.core.Tracer`: imported explicitly so type checkers see it
import numpy as np


# Code from these packages is not edited between two fits: keyed by identity.
_LIBRARIES = frozenset(
    "jax jaxlib numpy equinox diffrax optax lineax optimistix scipy sciflat jaxtyping "
    "builtins math cmath operator functools typing collections abc".split()
)
_MAX_NODES = 10_000  # values visited per key
_MAX_BYTES = 2**23  # NumPy data copied into keys


class _Unkeyable(Exception):
    pass


class Same:
    """Equal only to the same object (kept alive, so its `id` is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other) -> bool:
        return type(other) is Same and other.obj is self.obj


def function_key(fn) -> Hashable:
    """A hashable key: equal keys mean the functions trace to the same computation.

    Falls back to the function's identity when something it reaches cannot be keyed
    soundly (a mutable object, a tracer, too much data)."""
    try:
        return _Keyer().key(fn, ())
    except _Unkeyable:
        return Same(fn)


def identity_key(fn) -> Hashable:
    """Equal for the same object, as `jax.jit`'s key; and for sciflat's (or another
    library's) wrapper closures around the same objects, which a fit may create anew
    each call (`ft.wraps`-style adapters)."""
    if isinstance(fn, types.FunctionType) and fn.__closure__ and _library(fn):
        try:
            cells = tuple(identity_key(c.cell_contents) for c in fn.__closure__)
        except ValueError:  # an empty cell
            return Same(fn)
        return (fn.__code__, cells)
    return Same(fn)


def _library(obj) -> bool:
    if isinstance(obj, types.FunctionType):  # where it was defined (not `ft.wraps`'s)
        module = obj.__globals__.get("__name__") or ""
    else:
        module = getattr(obj, "__module__", None) or type(obj).__module__ or ""
    return module.partition(".")[0] in _LIBRARIES


class _Keyer:
    def __init__(self):
        self.nodes, self.bytes = 0, 0
        self.active: set[int] = set()  # functions being keyed (recursion)

    def key(self, obj, names: tuple[str, ...]) -> Hashable:
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            raise _Unkeyable
        if obj is None or isinstance(obj, bool | str | bytes):
            return (type(obj), obj)
        if isinstance(obj, np.generic):
            return (type(obj), obj.dtype.str, obj.tobytes())
        # By type and bits: 1, 1.0 and True trace differently; -0.0 is not 0.0.
        if isinstance(obj, int):
            return (type(obj), obj)
        if isinstance(obj, float):
            return (type(obj), obj.hex())
        if isinstance(obj, complex):
            return (type(obj), obj.real.hex(), obj.imag.hex())
        if isinstance(obj, jax.core.Tracer):
            raise _Unkeyable
        if isinstance(obj, jax.Array):
            return Same(obj)  # immutable
        if isinstance(obj, np.ndarray):
            self.bytes += obj.nbytes
            if obj.dtype.hasobject or self.bytes > _MAX_BYTES:
                raise _Unkeyable
            return (np.ndarray, obj.shape, obj.dtype.str, obj.tobytes())
        if isinstance(obj, types.FunctionType):
            # Library code without a closure never changes; a closure made at run
            # time (an adapter around the user's loss) is keyed by what it holds.
            library = _library(obj) and not obj.__closure__
            return Same(obj) if library else self.function(obj)
        if isinstance(obj, types.ModuleType):
            return self.module(obj, names)
        if isinstance(obj, type):
            return Same(obj)
        if isinstance(obj, ft.partial):
            parts = (obj.func, obj.args, tuple(sorted(obj.keywords.items())))
            return (ft.partial, *(self.key(x, names) for x in parts))
        if isinstance(obj, types.MethodType):
            parts = (obj.__func__, obj.__self__)
            return (types.MethodType, *(self.key(x, names) for x in parts))
        try:
            leaves, treedef = jax.tree.flatten(obj)
            hash(treedef)  # static fields must be hashable to be compared
        except Exception:
            raise _Unkeyable from None
        if not (
            len(leaves) == 1 and leaves[0] is obj
        ):  # a pytree: by structure and content
            return (treedef, tuple(self.key(leaf, names) for leaf in leaves))
        if _library(obj):  # jnp.tanh, jax.nn.relu, ...
            return Same(obj)
        raise _Unkeyable  # an object that may change without our seeing it

    def function(self, fn: types.FunctionType) -> Hashable:
        if id(fn) in self.active:  # recursion: keyed by identity, as by `jax.jit`
            raise _Unkeyable
        self.active.add(id(fn))
        code = fn.__code__
        names = _global_names(code)
        try:
            cells = tuple(
                self.key(c.cell_contents, names) for c in fn.__closure__ or ()
            )
        except ValueError:  # an empty cell
            raise _Unkeyable from None
        g = fn.__globals__
        found = tuple(
            (n, self.key(g[n], names) if n in g else ("missing", n in vars(builtins)))
            for n in sorted(names)
            if n in g or n in vars(builtins)
        )
        kwdefaults = sorted((fn.__kwdefaults__ or {}).items())
        self.active.discard(id(fn))
        defaults = self.key((fn.__defaults__, tuple(kwdefaults)), names)
        return (types.FunctionType, code, cells, found, defaults)

    def module(self, module: types.ModuleType, names: tuple[str, ...]) -> Hashable:
        if module.__name__.partition(".")[0] in _LIBRARIES:
            return Same(module)
        # A user's module: the attributes the code may read from it, by value.
        attrs = tuple(
            (n, self.key(getattr(module, n), names))
            for n in names
            if hasattr(module, n)
        )
        return (Same(module), attrs)


@ft.lru_cache(maxsize=256)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Every name the code (and the functions defined in it) may look up globally or
    as an attribute: a superset of the globals it reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    return tuple(sorted(names))
