"""What `minimize` and `least_squares` share: the float64 start, one compiled call per
SciPy call, bookkeeping of the best point, and stopping cleanly."""

import contextlib
import functools as ft
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._dtypes import X64_FIX, x64_enabled
from ._flatten import Restructure, destructure
from ._layout import names as _names, nonfinite_paths
from ._progress import progress_bar
from ._validate import as_flat_vector


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
    default threads and ~40 µs with one. JAX's computations are not affected (XLA has
    its own thread pool). `"auto"`: one thread while `size` <= 10**7.
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
        p, re = destructure(model, filter_spec, dtype=jnp.float64)
        x0 = p if x0 is None else x0
    x0 = as_flat_vector(x0, len(re), f"`{who}` (`x0`)")
    if len(re) == 0:
        raise ValueError(f"`{who}`: the model has no trainable floating leaves.")
    # An exact conversion: float32 and narrower fit in float64 without rounding.
    x0 = np.array(x0, dtype=np.float64)
    if not np.isfinite(x0).all():
        bad = ", ".join(f"`{q}`" for q in nonfinite_paths(x0, re))
        raise ValueError(f"`{who}`: the starting point is not finite in {bad}.")
    return x0, re


class NonFinite(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def split_args(args: tuple) -> tuple[list, Any]:
    """Array leaves of `args` (passed to the compiled call) and a hashable key that
    puts them back (so a second fit with new data reuses the compiled functions)."""
    dynamic, static = eqx.partition(args, eqx.is_array)
    leaves, treedef = jax.tree.flatten(dynamic)
    return leaves, _Rebuild(treedef, static)


class _Rebuild:
    def __init__(self, treedef, static):
        self.treedef, self.static = treedef, static
        flat, static_def = jax.tree.flatten(static)
        try:
            self._hash = hash((treedef, static_def, tuple(flat)))
            self._key = (treedef, static_def, tuple(flat))
        except TypeError:  # an unhashable static argument: equal only to itself
            self._hash, self._key = id(self), (id(self),)

    def __call__(self, leaves):
        return eqx.combine(jax.tree.unflatten(self.treedef, leaves), self.static)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, _Rebuild) and self._key == other._key


# Compiled functions per (what, loss, re, args structure, mode): a second fit of the
# same problem (new data, new start) compiles nothing.
def _with_aux(f):
    def f_and_value(x):
        value = f(x)
        return value, value

    return f_and_value


@ft.lru_cache(maxsize=64)
def jitted(
    kind: str, build: Callable, user_fn: Callable, re, rebuild: _Rebuild, mode: str
):
    return jax.jit(build(kind, user_fn, re, rebuild, mode))


def check_float64(out, what: str) -> None:
    dtype = jnp.result_type(out)
    if dtype != jnp.float64:
        raise TypeError(
            f"{what} has dtype {jnp.dtype(dtype).name}; the model computes in float64 "
            "here, so something in it casts. Find it with `sciflat.audit_dtypes`."
        )


def compile_first_working(
    modes: list[str], get: Callable[[str], Any], example
) -> tuple:
    """Compile with the preferred mode; on a trace-time error (e.g. forward mode
    through `RecursiveCheckpointAdjoint`, reverse mode through `ForwardMode`) fall
    back to the other one. Returns (jitted function, mode used)."""
    errors = []
    for mode in modes:
        fn = get(mode)
        try:
            fn.lower(*example)  # traces now: a retrace never happens later
        except (TypeError, ValueError) as e:
            errors.append(e)
            continue
        return fn, mode
    raise errors[-1]


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


class Tracker:
    """The best point seen so far (for Ctrl-C) and the loss history per iteration."""

    def __init__(self, re: Restructure, callback, progress, desc: str):
        self.re, self.callback = re, callback
        self.best_x, self.best_f = None, np.inf
        self.last_x, self.last_f = None, np.nan
        self.n_calls, self.history = 0, []
        self.bar = progress_bar(enabled=progress, desc=desc, unit="it", leave=False)

    def seen(self, x: np.ndarray, f: float) -> None:
        self.n_calls += 1
        self.last_x, self.last_f = x.copy(), f
        if f < self.best_f:
            self.best_x, self.best_f = self.last_x, f

    def iteration(self, x: np.ndarray, f: float) -> None:
        self.history.append(f)
        self.bar.set_postfix(loss=f"{f:.6g}", refresh=False)
        self.bar.update(1)
        if self.callback is not None:
            self.callback(self.re(jnp.asarray(x)), f)

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
    finally:
        tracker.close()
    return res, None, str(res.message), res.x, None
