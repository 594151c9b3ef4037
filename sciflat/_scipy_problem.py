"""What `minimize` and `least_squares` share: the float64 start, one compiled call per
SciPy call, bookkeeping of the best point, and stopping cleanly."""

import contextlib
import functools as ft
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.core  # `jax.core.Tracer`: imported explicitly so type checkers see it
import jax.numpy as jnp
import numpy as np

from ._calls import data_by_keyword as data_by_keyword
from ._dtypes import X64_FIX, x64_enabled
from ._flatten import Restructure, destructure
from ._layout import names as _names, nonfinite_paths
from ._progress import progress_bar
from ._scipy_fn_key import Same, function_key, identity_key
from ._validate import checked_flat_vector


Mode = Literal["auto", "forward", "reverse"]
BlasThreads = int | None | Literal["auto"]
# Forward mode costs one JVP per parameter; reverse mode one VJP plus storing (or
# recomputing) the forward pass, which through an ODE solve is several times a JVP.
FORWARD_MAX_PARAMS = 16


@ft.cache
def _blas_controller():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def blas_threads_limit(blas_threads: BlasThreads, size: int):
    """Limit the BLAS threads SciPy's own linear algebra uses during the fit.

    On small problems OpenBLAS's threads cost far more than they save: on a shared
    2-core machine one L-BFGS-B step (`setulb`, 4 parameters) took ~10 ms with the
    default threads and ~40 µs with one. The limit also reaches the loss where JAX
    calls LAPACK (jaxlib's CPU `jnp.linalg` kernels are SciPy's OpenBLAS; XLA's own
    kernels have their own pool): kept on purpose, see docs/scipy.md ("BLAS threads")
    for the measurement. `"auto"`: one thread while `size` <= 10**7.
    """
    if blas_threads == "auto":
        blas_threads = 1 if size <= 10**7 else None
    if blas_threads is None:
        return contextlib.nullcontext()
    if not isinstance(blas_threads, int) or blas_threads < 1:
        raise ValueError(
            f"`blas_threads` must be 'auto', None or an int >= 1, got {blas_threads!r}."
        )
    return _blas_controller().limit(limits=blas_threads, user_api="blas")


def start(model, x0, filter_spec, who: str) -> tuple[np.ndarray, Restructure]:
    """The float64 starting vector and `re`, or a clear error."""
    if not x64_enabled():
        raise TypeError(
            f"`{who}` runs SciPy, which works in float64, but JAX's 64-bit mode is off, "
            f"so JAX would round every iterate to float32: {X64_FIX} at the start of "
            "your program."
        )
    if isinstance(model, Restructure):
        re = model
        if x0 is None:
            raise TypeError(f"`{who}` got a `Restructure` as `model`: pass `x0=` too.")
        if re.dtype != np.float64:
            raise TypeError(
                f"`{who}` got a `Restructure` for {re.dtype.name}; SciPy works in float64: "
                "use `sciflat.destructure(model, dtype=jnp.float64)`."
            )
    else:
        p, re = _destructured(model, filter_spec)
        x0 = p if x0 is None else x0
    x0 = checked_flat_vector(x0, len(re), f"`{who}` (`x0`)")
    if len(re) == 0:
        raise ValueError(f"`{who}`: the model has no trainable floating leaves.")
    # An exact conversion: float32 and narrower fit in float64 without rounding.
    x0 = np.array(x0, dtype=np.float64)
    if not np.isfinite(x0).all():
        bad = ", ".join(f"`{q}`" for q in nonfinite_paths(x0, re))
        raise ValueError(f"`{who}`: the starting point is not finite in {bad}.")
    return x0, re


# The same start model fitted to many datasets is flattened once.
_MODELS: OrderedDict[Hashable, tuple[np.ndarray, Restructure]] = OrderedDict()


def _destructured(model, filter_spec) -> tuple[np.ndarray, Restructure]:
    """`destructure(model, filter_spec, dtype=jnp.float64)`, `p` on the host. `re` is
    reused for a model of the same structure when every leaf is a trainable real
    array (`_by_structure`); otherwise both are reused for the same model: the same
    structure and the very same leaf objects. A NumPy leaf (which may be changed in
    place) or a `filter_spec` other than a bool is never reused there."""
    leaves, treedef = jax.tree.flatten(model)
    if (
        filter_spec is True
        and (hit := _by_structure(model, leaves, treedef)) is not None
    ):
        return hit
    mutable = any(isinstance(x, np.ndarray | jax.core.Tracer) for x in leaves)
    if mutable or not isinstance(filter_spec, bool):
        p, re = destructure(model, filter_spec, dtype=jnp.float64)
        return np.asarray(p), re
    key = (treedef, filter_spec, tuple(Same(x) for x in leaves))
    try:
        hit = _MODELS.get(key)
    except TypeError:  # an unhashable static field
        p, re = destructure(model, filter_spec, dtype=jnp.float64)
        return np.asarray(p), re
    if hit is None:
        p, re = destructure(model, filter_spec, dtype=jnp.float64)
        hit = _MODELS[key] = (np.asarray(p), re)
        while len(_MODELS) > 8:
            _MODELS.popitem(last=False)
    return hit


_REAL = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_BY_STRUCTURE: OrderedDict[Hashable, Restructure] = OrderedDict()


def _by_structure(
    model, leaves: list, treedef
) -> tuple[np.ndarray, Restructure] | None:
    """When every leaf is a real floating array, all trainable (`{"b1": 500.0, ...}`
    after `promote_floats`, or a plain Equinox model), `re` depends on the structure
    alone: the tree, the shapes, and which leaves are the same array. A
    fit of new start values then reuses `re` (and so its compiled functions) and
    builds `p` with NumPy; `None` otherwise."""
    if not leaves or not all(
        isinstance(x, jax.Array | np.ndarray)
        and x.dtype in _REAL
        and not isinstance(x, jax.core.Tracer)
        for x in leaves
    ):
        return None
    first: dict[int, int] = {}  # ties are by identity, as in `destructure`
    ties = tuple(first.setdefault(id(x), i) for i, x in enumerate(leaves))
    key = (treedef, tuple(x.shape for x in leaves), ties)  # `p` is float64 anyway
    try:
        re = _BY_STRUCTURE.get(key)
    except TypeError:  # an unhashable static field
        return None
    if re is None:
        p, re = destructure(model, dtype=jnp.float64)
        _BY_STRUCTURE[key] = re
        while len(_BY_STRUCTURE) > 8:
            _BY_STRUCTURE.popitem(last=False)
        return np.asarray(p), re
    _BY_STRUCTURE.move_to_end(key)
    unique = [x for i, x in enumerate(leaves) if ties[i] == i]
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in unique]), re


def check_args(args, who: str) -> tuple:
    if not isinstance(args, tuple | list):
        raise TypeError(
            f"`{who}`: `args` must be a tuple of the further arguments of the loss, "
            f"e.g. `args=(x, y)` or `args=(x,)`; got {type(args).__name__}."
        )
    return tuple(args)


class NonFinite(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def split_args(args: tuple) -> tuple[list, Any]:
    """Array leaves of `args` (passed to the compiled call) and a hashable key that
    puts them back (so a second fit with new data reuses the compiled functions).
    NumPy data is put on the device once here, not at every call of the fit."""
    dynamic, static = eqx.partition(args, eqx.is_array)
    leaves, treedef = jax.tree.flatten(dynamic)
    leaves = [
        jnp.asarray(x) if isinstance(x, np.ndarray | np.generic) else x for x in leaves
    ]
    return leaves, _Rebuild(treedef, static)


class _Rebuild:
    def __init__(self, treedef, static):
        self.treedef, self.static = treedef, static
        flat, static_def = jax.tree.flatten(static)
        try:
            # With the type: 1, 1.0 and True are equal but trace differently.
            self._key = (treedef, static_def, tuple((type(x), x) for x in flat))
            self._hash = hash(self._key)
        except TypeError:  # an unhashable static argument: equal only to itself
            self._hash, self._key = id(self), (id(self),)

    def __call__(self, leaves):
        return eqx.combine(jax.tree.unflatten(self.treedef, leaves), self.static)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, _Rebuild) and self._key == other._key


#
# Compiled functions, cached across fits
#

# Keyed by everything that can change what a trace produces (the loss by
# `function_key`, `re`, the static part and the shapes/dtypes of the data, JAX's
# trace-time configuration), so a second fit of the same problem (new data of the same
# shapes, new start, new `lambda` with the same code and closure) traces nothing.
# Ahead-of-time compiled: a call with other shapes is an error, never a retrace of a
# stale function.
_CACHE: OrderedDict[Hashable, Any] = OrderedDict()
CACHE_SIZE = 64


class _Failed:
    """A gradient mode that failed to trace while another one worked."""


def _config_key() -> Hashable:
    # x64 and the matmul precision explicitly (documented); JAX's own jit key for the rest.
    try:
        from jax._src.config import trace_context

        rest = trace_context()
    except Exception:  # a JAX without it: the two that matter most
        rest = ()
    # Context-manager flags are read as attributes (`jax.config.read` refuses them).
    flags = ("jax_enable_x64", "jax_default_matmul_precision")
    return (*(getattr(jax.config, f) for f in flags), rest)


def _signature(example) -> Hashable:
    def one(x):
        aval = jax.typeof(x)
        return (aval.shape, aval.dtype, aval.weak_type, getattr(x, "sharding", None))

    return tuple(one(x) for x in jax.tree.leaves(example))


class Programs:
    """The compiled functions of one fit, looked up in (or added to) the cache.

    The loss is looked up first by identity (the same function object is reused, as
    by `jax.jit`), then by `function_key` (a new `lambda` with the same code and
    equal closure and globals)."""

    def __init__(self, build: Callable, loss: Callable, re: Restructure, args: tuple):
        self.leaves, rebuild = split_args(args)
        self._parts = (build, loss, re, rebuild)
        self._rest = (build, re, rebuild, _config_key())
        self._by_value: Hashable | None = None

    def _lookup(self, kind: str, mode: str, example) -> tuple[Any, list]:
        """The cached entry (or None) and the keys to store a new one under."""
        loss = self._parts[1]
        where = (kind, mode, _signature((*example, self.leaves)), self._rest)
        keys: list[Hashable] = [(*where, identity_key(loss))]
        hit = _CACHE.get(keys[0])
        if hit is None:
            if self._by_value is None:
                self._by_value = function_key(loss)
            if self._by_value != Same(loss):  # keyable by value
                keys.append((*where, self._by_value))
                hit = _CACHE.get(keys[-1])
        if hit is not None:
            _CACHE.move_to_end(keys[-1])
        return hit, keys

    def get(self, kind: str, mode: str, *example) -> Any:
        """The compiled `kind` function; `example`: its arguments but the data."""
        hit, keys = self._lookup(kind, mode, example)
        if hit is None or isinstance(hit, _Failed):
            build, loss, re, rebuild = self._parts
            fn = jax.jit(build(kind, loss, re, rebuild, mode))
            hit = fn.lower(*example, self.leaves).compile()
            for key in keys:
                _remember(key, hit)
        return hit

    def first_working(self, kind: str, modes: list[str], *example) -> tuple[Any, str]:
        """Compile with the preferred mode; on a trace-time error (e.g. forward mode
        through `RecursiveCheckpointAdjoint`, reverse mode through `ForwardMode`) fall
        back to the other one. A mode that failed is remembered (not traced again)
        once another one worked. Returns (compiled function, mode used)."""
        failed, errors = [], []
        for i, mode in enumerate(modes):
            hit, keys = self._lookup(kind, mode, example)
            if isinstance(hit, _Failed) and i < len(modes) - 1:
                continue  # the last mode is traced again, to raise its own error
            try:
                usable = hit is not None and not isinstance(hit, _Failed)
                fn = hit if usable else self.get(kind, mode, *example)
            except (TypeError, ValueError) as e:
                failed += keys
                errors.append(e)
                continue
            for key in failed:
                _remember(key, _Failed())
            return fn, mode
        raise errors[-1]


def _remember(key, value) -> None:
    _CACHE[key] = value
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)


def _with_aux(f):
    def f_and_value(x):
        value = f(x)
        return value, value

    return f_and_value


_REAL_FIX = {
    "The residuals": "to fit a complex model to complex data, return "
    "`jnp.concatenate([r.real, r.imag])` (both parts), or `jnp.abs(r)`",
    "The loss": "return a real number, e.g. `jnp.sum(jnp.abs(r) ** 2)` for complex "
    "residuals `r`",
}


def check_float64(out, what: str) -> None:
    dtype = jnp.dtype(jnp.result_type(out))
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"{what} must be real: expected float64, got {dtype.name}. SciPy fits "
            f"real numbers; {_REAL_FIX.get(what, 'return a real array')}."
        )
    if dtype != jnp.float64:
        raise TypeError(
            f"{what} has dtype {dtype.name}; the model computes in float64 "
            "here, so something in it casts. Find it with `sciflat.audit_dtypes`."
        )


def residual_vector(out) -> jax.Array:
    """The residuals as one flat vector, or an error that says what is expected."""
    if not isinstance(out, jax.Array | np.ndarray | np.generic | float | int | complex):
        raise TypeError(
            "`residuals` must return an array (any shape: it is flattened) or a "
            f"number, got {type(out).__name__} of structure {jax.tree.structure(out)}. "
            "Join the parts yourself: `jnp.concatenate([jnp.ravel(r) for r in "
            "jax.tree.leaves(out)])` or `jax.flatten_util.ravel_pytree(out)[0]` (not "
            "done for you: a returned `(residuals, aux)` would be fitted as residuals)."
        )
    return jnp.ravel(out)  # pyright: ignore[reportArgumentType]


def _indices(bad: np.ndarray) -> str:
    """`[1, 3]`, or `[(0, 1), (2, 0)]` for a 2-d array, at most 10 shown."""
    shown = [int(i[0]) if len(i) == 1 else tuple(int(j) for j in i) for i in bad[:10]]
    more = f" ... ({len(bad)} in all)" if len(bad) > 10 else ""
    return str(shown)[:-1] + more + "]" if more else str(shown)


def _nonfinite_args(args: tuple) -> list[str]:
    """`` `args[1]` is non-finite at [2] `` for each floating leaf of `args` with a NaN
    or infinity."""
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        if not (eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)):
            continue
        arr = np.asarray(leaf)
        wide = (
            np.complex128
            if jnp.issubdtype(arr.dtype, jnp.complexfloating)
            else np.float64
        )
        bad = np.argwhere(~np.isfinite(np.atleast_1d(arr.astype(wide))))
        if len(bad):
            found.append(
                f"`args{jax.tree_util.keystr(path)}` is non-finite at {_indices(bad)}"
            )
    return found


def nonfinite_start_message(what: str, args: tuple, residuals=None) -> str:
    """Why a fit stopped at its first evaluation: what is non-finite, where, and
    whether the data (`args`) are the cause."""
    text = f"{what} non-finite at the start"
    if residuals is not None:
        bad = np.argwhere(~np.isfinite(np.atleast_1d(np.asarray(residuals))))
        text += f", at residuals {_indices(bad)} ({len(bad)} of {np.size(residuals)})"
    data = _nonfinite_args(args)
    if data:
        text += (
            "; in the data, " + "; ".join(data) + ". Drop those points (e.g. keep "
            "`np.isfinite(y)`) or fill them"
        )
    else:
        text += (
            "; the data in `args` are finite, so the model is not defined at the "
            "starting point: start where it is (or constrain the parameter with "
            "`sciflat.Positive` & co.)"
        )
    return text + ". Nothing was fitted; `p` is the start."


def choose_modes(mode: Mode, forward_first: bool) -> list[str]:
    if mode not in ("auto", "forward", "reverse"):
        raise ValueError(
            f"`mode` must be 'auto', 'forward' or 'reverse', got {mode!r}."
        )
    if mode != "auto":
        return [mode]
    return ["forward", "reverse"] if forward_first else ["reverse", "forward"]


def gradient(f: Callable, mode: str) -> Callable:
    """`x -> grad f(x)` by forward (`jacfwd`) or reverse mode."""
    return jax.jacfwd(f) if mode == "forward" else jax.grad(f)


def value_and_grad_flat(f: Callable, mode: str) -> Callable:
    """`x -> [f(x), *grad f(x)]`: one array, so one device-to-host transfer."""

    def both(x):
        if mode == "forward":
            g, value = jax.jacfwd(_with_aux(f), has_aux=True)(x)
        else:
            value, g = jax.value_and_grad(f)(x)
        return jnp.concatenate([value[None], g])

    return both


def nonfinite_message(
    what: str, where: str, x, grad, re: Restructure, grad_name: str = "gradient"
) -> str:
    names = nonfinite_paths(grad, re) if grad is not None else []
    in_x = nonfinite_paths(x, re)
    parts = [f"{what} at {where}"]
    if in_x:
        parts.append("SciPy proposed non-finite parameters in " + _names(in_x))
    if names:
        parts.append(f"the {grad_name} is non-finite in " + _names(names))
    elif grad is not None:
        parts.append(f"the {grad_name} is finite")
    return "; ".join(parts) + ". Stopped; `p` is the best finite point seen."


class _Stop(Exception):
    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


class Tracker:
    """The best point seen so far (for Ctrl-C) and the loss history per iteration."""

    def __init__(self, re: Restructure, callback, progress, desc: str):
        self.re, self.callback = re, callback
        self.stopped_at: tuple[np.ndarray, float] = (np.empty(0), np.nan)
        self.best_x, self.best_f = None, np.inf
        # The last few points evaluated: MINPACK's `lm` asks for the Jacobian at the
        # accepted point after trying another, whose cost we then need not recompute.
        self.recent: deque[tuple[np.ndarray, float]] = deque(maxlen=4)
        self.n_calls, self.history = 0, []
        self.bar = progress_bar(enabled=progress, desc=desc, unit="it", leave=False)

    def seen(self, x: np.ndarray, f: float) -> None:
        self.n_calls += 1
        x = x.copy()  # SciPy may reuse its array
        self.recent.append((x, f))
        if f < self.best_f:
            self.best_x, self.best_f = x, f

    def cost_at(self, x: np.ndarray) -> float | None:
        """The loss at `x` if it is one of the last few points evaluated."""
        for seen_x, f in reversed(self.recent):
            if np.array_equal(x, seen_x):
                return f
        return None

    def iteration(self, x: np.ndarray, f: float) -> None:
        self.history.append(f)
        self.bar.set_postfix(loss=f"{f:.6g}", refresh=False)
        self.bar.update(1)
        step = len(self.history)
        if self.callback is not None and self.callback(
            step, f, self.re(jnp.asarray(x))
        ):
            self.stopped_at = (x.copy(), f)
            raise _Stop(step)

    def best(self, x0: np.ndarray) -> tuple[np.ndarray, float]:
        return (x0, np.inf) if self.best_x is None else (self.best_x, self.best_f)

    def close(self) -> None:
        self.bar.close()


def run(call: Callable[[], Any], tracker: Tracker, x0: np.ndarray) -> tuple:
    """SciPy's result, or a clean stop: `(raw or None, status or None, message, x, loss)`.

    `status` is None when SciPy returned (the caller reads SciPy's own status)."""
    try:
        res = call()
    except KeyboardInterrupt:
        message = "Interrupted (Ctrl-C); `p` is the best point seen."
        return None, "interrupted", message, *tracker.best(x0)
    except NonFinite as e:
        return None, "nonfinite", e.message, *tracker.best(x0)
    except _Stop as e:
        message = f"`callback` asked to stop after iteration {e.step}."
        return None, "converged", message, *tracker.stopped_at
    finally:
        tracker.close()
    return res, None, str(res.message), res.x, None
