"""`scipy.optimize.minimize` on a model: one compiled value-and-gradient call per step."""

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
from jaxtyping import Array, Float, PyTree, Scalar

from .._fitting.gradients import (
    FORWARD_MAX_PARAMS,
    Mode,
    choose_modes,
    gradient,
    value_and_grad_flat,
)
from .._fitting.inputs import checked_inputs
from .._fitting.problem import (
    check_float64,
    data_by_keyword,
    nonfinite_start_message,
)
from .._fitting.programs import Programs
from .._fitting.result import FitResult, Status
from .bounds import flat_bounds
from .host import (
    BlasThreads,
    NonFinite,
    Tracker,
    blas_threads_limit,
    nonfinite_message,
    run,
)


_M = TypeVar("_M")

_GRADIENT_FREE = {"nelder-mead", "powell", "cobyla", "cobyqa"}
_HESSP = {"newton-cg", "trust-ncg", "trust-krylov", "trust-constr"}
_HESS = {"dogleg", "trust-exact"}
_BOUNDED = {
    "nelder-mead",
    "powell",
    "l-bfgs-b",
    "tnc",
    "slsqp",
    "trust-constr",
    "cobyla",
    "cobyqa",
}
_METHODS = _GRADIENT_FREE | _HESSP | _HESS | _BOUNDED | {"cg", "bfgs"}
_OURS = ("fun", "x0", "jac", "hess", "hessp")


def _check_method(method: str, bounds) -> str:
    name = method.lower() if isinstance(method, str) else method
    if name not in _METHODS:
        raise ValueError(f"`method` must be one of {sorted(_METHODS)}, got {method!r}.")
    if bounds is not None and name not in _BOUNDED:
        raise ValueError(
            f"`method={method!r}` does not take bounds; use one of {sorted(_BOUNDED)}."
        )
    return name


def _status(res) -> Status:
    if res.success:
        return "converged"
    if "maxim" in str(res.message).lower() or "max" in str(res.message).lower().split():
        return "max_steps"
    return "failed"


@data_by_keyword
def minimize(
    loss: Callable[..., Scalar],
    model: _M,
    *,
    args: tuple = (),
    method: str = "L-BFGS-B",
    bounds: Mapping | tuple | None = None,
    mode: Mode = "auto",
    x0: Float[Array, " n"] | None = None,
    filter_spec: PyTree = True,
    callback: Callable[[int, float, _M], Any] | None = None,
    progress: bool = True,
    blas_threads: BlasThreads = "auto",
    tol: float | None = None,
    options: dict | None = None,
    **kwargs: Any,
) -> FitResult[_M]:
    """Minimises `loss(model, *args)` over the model's parameters with SciPy.

    The model is flattened with `sciflat.destructure(model, dtype=jnp.float64)` (SciPy
    works in float64, so JAX's 64-bit mode must be on). SciPy receives the value and
    gradient from ONE jit-compiled call, compiled once, as float64 NumPy arrays; the
    gradient is by forward mode (`jax.jacfwd`) for at most 16 parameters and by
    reverse mode otherwise (`mode`), falling back to the other mode if the loss
    cannot be differentiated that way (e.g. a Diffrax solve: forward mode needs
    `adjoint=diffrax.ForwardMode()`, reverse mode any other adjoint).
    Newton-CG, trust-ncg, trust-krylov and trust-constr get a Hessian-vector product
    (forward over the gradient); dogleg and trust-exact the Hessian. Ctrl-C returns
    the best point so far (status `"interrupted"`); a non-finite loss or gradient
    stops with the best finite point and names the leaves (status `"nonfinite"`).

    !!! Example

        ```python
        result = sciflat.minimize(lambda m, x, y: jnp.mean((m(x) - y) ** 2), model,
                                  args=(x, y), bounds={(lambda m: m.rates): (0.0, None)})
        result.model, result.loss, result.raw  # fitted model, loss, SciPy's result
        ```

    **Arguments:**

    - `loss`: `loss(model, *args) -> scalar`.
    - `model`: the starting model (or a float64 `Restructure`, with `x0`).
    - `args`: a tuple of the further arguments of `loss` (the data), as in
        `scipy.optimize.minimize` and [`sciflat.fit`][]; array leaves are arguments of
        the compiled call (new data of the same shapes compiles nothing), the rest is
        static.
    - `method`: any method of `scipy.optimize.minimize`.
    - `bounds`: per leaf: a dict `{where: (lower, upper)}` (`where` a path as in
        `re.paths` or `lambda m: m.leaf`; each side None, a number or an array of the
        leaf's shape), or a pair `(lower, upper)` of model-shaped pytrees.
    - `mode`: `"auto"`, `"forward"` or `"reverse"`: how the gradient is computed.
    - `x0`: start from this flat vector instead of the model's parameters.
    - `filter_spec`: which leaves are trainable, as in `sciflat.destructure`.
    - `callback`: `callback(step, loss, model)` after every iteration; a true return
        value stops the fit (status `"converged"`, `result.model` that iterate).
    - `progress`: show a progress bar with the iteration and loss.
    - `blas_threads`: OpenBLAS threads during the fit (SciPy's own linear algebra,
        and `jnp.linalg` in the loss, which runs on SciPy's LAPACK); `"auto"` uses one
        below 10**7 parameters (threads slow small problems down many times over),
        `None` leaves them alone, an int sets them.
    - `tol`, `options`, `**kwargs`: passed to `scipy.optimize.minimize`.

    **Returns:**

    A [`sciflat.FitResult`][]; `raw` is SciPy's `OptimizeResult` (None when stopped).
    """
    if clash := [k for k in _OURS if k in kwargs]:
        raise TypeError(f"`minimize` computes {clash} itself; do not pass them.")
    name = _check_method(method, bounds)
    inputs = checked_inputs(loss, model, args, x0, filter_spec, "minimize")
    loss, start, re, args = inputs.fn, inputs.start, inputs.re, inputs.args
    scipy_bounds = flat_bounds(bounds, re, start)
    programs = Programs(_build, loss, re, args)
    limit = blas_threads_limit(blas_threads, len(re))
    tracker = Tracker(re, callback, progress, f"minimize ({method})")
    fun, used, extra = _objective(programs, re, name, mode, start, tracker)

    def call():
        with limit:
            return scipy.optimize.minimize(
                fun,
                start,
                method=method,
                bounds=_as_scipy(scipy_bounds),
                tol=tol,
                options=options,
                callback=_scipy_callback(fun, tracker),
                **extra,
                **kwargs,
            )

    res, status, message, x, value = run(call, tracker, start)
    n, n_calls = len(tracker.history), tracker.n_calls
    if status == "nonfinite" and tracker.best_x is None:  # at the start: say why
        message, n_calls = nonfinite_start_message("The loss is", args), 1
    if res is not None:
        status, value, n = _status(res), float(res.fun), int(res.get("nit", n))
    p = jnp.asarray(np.asarray(x, dtype=np.float64))
    return FitResult(
        model=re(p),
        p=p,
        loss=float(value),
        status=status,
        message=f"{message} (gradient: {used})",
        history=np.asarray(tracker.history),
        n_steps=n,
        raw=res,
        re=re,
        n_evaluations=n_calls,
    )


def _as_scipy(bounds):
    return None if bounds is None else scipy.optimize.Bounds(*bounds)


def _build(kind: str, loss, re, rebuild, mode: str) -> Callable:
    def f(x, leaves):
        out = loss(re(x), *rebuild(leaves))
        if jnp.shape(out) != ():
            raise ValueError(
                f"`loss` must return a scalar, got shape {jnp.shape(out)}."
            )
        check_float64(out, "The loss")
        return out

    grad = lambda x, leaves: gradient(lambda x: f(x, leaves), mode)(x)
    if kind == "value":
        return f
    if kind == "value_and_grad":
        return lambda x, leaves: value_and_grad_flat(lambda x: f(x, leaves), mode)(x)
    if kind == "hessp":
        return lambda x, v, leaves: jax.jvp(lambda x: grad(x, leaves), (x,), (v,))[1]
    return lambda x, leaves: jax.jacfwd(lambda x: grad(x, leaves))(x)


def _objective(programs: Programs, re, name: str, mode, x0, tracker: Tracker):
    """SciPy's `fun` (and `hess`/`hessp`), compiled once, and the gradient mode."""
    leaves = programs.leaves
    if name in _GRADIENT_FREE:
        value = programs.get("value", "none", x0)
        return _value_only(value, leaves, tracker, re), "none, gradient-free method", {}

    modes = choose_modes(mode, len(re) <= FORWARD_MAX_PARAMS)
    both, used = programs.first_working("value_and_grad", modes, x0)

    def fun(x):
        out = np.asarray(both(x, leaves))
        value, grad = out[0], out[1:]
        if not np.isfinite(out).all():
            where = f"call {tracker.n_calls + 1} (iteration {len(tracker.history)})"
            what = (
                f"The loss is {value}"
                if not np.isfinite(value)
                else "The gradient is non-finite"
            )
            raise NonFinite(nonfinite_message(what, where, x, grad, re))
        tracker.seen(x, value)
        return value, grad

    extra: dict[str, Any] = {"jac": True}
    if name in _HESSP:
        hvp = programs.get("hessp", used, x0, x0)
        # trust-constr may hand over an integer `v`; ints are exact in float64.
        extra["hessp"] = lambda x, v: np.asarray(
            hvp(x, np.asarray(v, np.float64), leaves)
        )
    elif name in _HESS:
        hess = programs.get("hess", used, x0)
        extra["hess"] = lambda x: np.asarray(hess(x, leaves))
    return fun, f"{used} mode", extra


def _value_only(value, leaves, tracker: Tracker, re):
    def fun(x):
        v = np.asarray(value(x, leaves))
        if not np.isfinite(v):
            where = f"call {tracker.n_calls + 1} (iteration {len(tracker.history)})"
            raise NonFinite(nonfinite_message(f"The loss is {v}", where, x, None, re))
        tracker.seen(x, float(v))
        return v

    return fun


def _scipy_callback(fun, tracker: Tracker):
    # One parameter named `intermediate_result`: SciPy then passes an OptimizeResult
    # (with `fun`) for every method that can; TNC, COBYLA and COBYQA pass `x`.
    def callback(intermediate_result):
        if isinstance(intermediate_result, scipy.optimize.OptimizeResult):
            x, value = intermediate_result.x, intermediate_result.get("fun")
        else:
            x, value = intermediate_result, None
        x = np.asarray(x, dtype=np.float64)
        if value is None:
            value = tracker.cost_at(x)
        if value is None:
            out = fun(x)
            value = out[0] if isinstance(out, tuple) else out
        tracker.iteration(x, float(value))

    return callback
