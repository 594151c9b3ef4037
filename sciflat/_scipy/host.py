"""A SciPy fit's host loop: BLAS threads, the best point seen, stopping cleanly."""

import contextlib
import functools as ft
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from .._fitting.progress import progress_bar
from .._flatten import Restructure
from .._layout import names as _names, nonfinite_paths


BlasThreads = int | None | Literal["auto"]


@ft.cache
def _blas_controller():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def blas_threads_limit(blas_threads: BlasThreads, size: int):
    """Limit the BLAS threads SciPy's own linear algebra uses during the fit.

    Rule (`"auto"`): one thread while `size` <= 10**7, where OpenBLAS's threads cost
    more than they save; it also reaches jaxlib's CPU `jnp.linalg` kernels in the loss
    (SciPy's OpenBLAS), on purpose. docs/scipy.md ("BLAS threads") has the figures.
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


class NonFinite(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


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
