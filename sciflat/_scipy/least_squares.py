"""`scipy.optimize.least_squares` on a model: residuals and Jacobian by JAX."""

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
from jaxtyping import Array, Float, PyTree

from .._fitting.delta import for_values
from .._fitting.gradients import Mode, choose_modes
from .._fitting.inputs import checked_inputs
from .._fitting.problem import (
    data_by_keyword,
    nonfinite_start_message,
    residual_fn,
)
from .._fitting.programs import Programs
from .._fitting.result import FitResult, Status
from .._fitting.uncertainty import from_jacobian
from .._solver.minpack import (
    OPTIONS,
    Minpack,
    describe,
    minpack_options,
    more_evaluations,
    optimize_result,
    with_defaults,
)
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
_METHODS = ("auto", "trf", "dogbox", "lm", "device")
# What MINPACK's `lm` takes besides what sciflat passes; anything else (a robust
# `loss`, `tr_solver`, `jac_sparsity`, ...) is a `trf` option.
_LM_OPTIONS = OPTIONS | {"diff_step", "verbose"}
_OURS = ("fun", "x0", "jac", "kwargs")


def _status(res) -> Status:
    if res.status > 0:
        return "converged"
    return "max_steps" if res.status == 0 else "failed"


@data_by_keyword
def least_squares(
    residuals: Callable[..., Float[Array, "..."]],
    model: _M,
    *,
    args: tuple = (),
    method: str = "auto",
    bounds: Mapping | tuple | None = None,
    mode: Mode = "auto",
    x0: Float[Array, " n"] | None = None,
    filter_spec: PyTree = True,
    callback: Callable[[int, float, _M], Any] | None = None,
    progress: bool = True,
    blas_threads: BlasThreads = "auto",
    **kwargs: Any,
) -> FitResult[_M]:
    """Minimises `0.5 * sum(residuals(model, *args) ** 2)` with SciPy's `least_squares`.

    As [`sciflat.minimize`][]: float64 (JAX's 64-bit mode on), residuals and Jacobian
    each one compiled call, bounds per leaf, progress, Ctrl-C and non-finite stops.
    The Jacobian is by forward mode (`jax.jacfwd`) when there are at most as many
    parameters as residuals and by reverse mode (`jax.jacrev`) otherwise (`mode`
    overrides), falling back to the other mode if the residuals cannot be
    differentiated that way (see [`sciflat.minimize`][] on Diffrax adjoints).

    !!! Example

        ```python
        result = sciflat.least_squares(lambda m, t, y: m(t) - y, model, args=(t, y),
                                       bounds={"rates": (0.0, None)})
        ```

    **Arguments:**

    - `residuals`: `residuals(model, *args) -> array` (any shape; flattened).
    - `model`, `args`, `bounds`, `mode`, `x0`, `filter_spec`, `progress`,
        `blas_threads` (here: one thread below 10**7 Jacobian entries): as in
        [`sciflat.minimize`][].
    - `method`: `"auto"` (default), `"trf"`, `"dogbox"` or `"lm"` (no bounds). `"auto"`,
        as `scipy.optimize.curve_fit` and lmfit: MINPACK's Levenberg–Marquardt
        (`"lm"`) when there are no bounds, at least as many residuals as parameters and
        no option only `"trf"` takes (a robust `loss`, ...); `"trf"` otherwise. Every
        method rejects a trial step to non-finite residuals and shrinks it, as in
        SciPy. If `"lm"` met such a step, `"trf"` runs from the start too and the fit
        with the lower cost is returned (an overflowing problem can lead either to a
        poorer minimum); if `"lm"` stopped at a non-finite Jacobian, `"trf"` is run
        instead.
        `"device"`: the same Levenberg–Marquardt (MINPACK's scaling and stopping
        rules) run whole on JAX's device as one compiled program, no bounds and no
        `callback`; see [Many fits at once](many_fits.md) and
        [`sciflat.least_squares_batch`][].
    - `callback`: `callback(step, cost, model)` after every iteration (every
        Jacobian); a true return value stops the fit, as in [`sciflat.minimize`][].
    - `**kwargs`: passed to `scipy.optimize.least_squares` (`ftol`, `x_scale`,
        `loss`, `max_nfev`, ...). Defaults differ from SciPy's: `ftol`, `xtol` and
        `gtol` are 1e-12 (not 1e-8) and `max_nfev` is `2000 * (n + 1)` (lmfit's; not
        `100 * n`), so that fits reach the digits NIST certifies.

    **Returns:**

    A [`sciflat.FitResult`][] whose `loss` is SciPy's `cost`; `raw` is SciPy's result;
    `stderr`, `covariance`, `chisqr`, ... and `print(result)` as in
    [Parameter estimation](parameter_estimation.md).
    """
    if clash := [k for k in _OURS if k in kwargs]:
        raise TypeError(f"`least_squares` handles {clash} itself; do not pass them.")
    if method not in _METHODS:
        raise ValueError(f"`method` must be one of {_METHODS}, got {method!r}.")
    if method == "lm" and bounds is not None:
        raise ValueError("`method='lm'` does not take bounds; use 'trf' or 'dogbox'.")
    if method == "device":  # the whole fit as one compiled program
        from .._device.least_squares import least_squares_on_device

        return least_squares_on_device(
            residuals,
            model,
            args=args,
            bounds=bounds,
            mode=mode,
            x0=x0,
            filter_spec=filter_spec,
            callback=callback,
            kwargs=kwargs,
        )
    inputs = checked_inputs(residuals, model, args, x0, filter_spec, "least_squares")
    residuals, start, re, args = inputs.fn, inputs.start, inputs.re, inputs.args
    lb_ub = flat_bounds(bounds, re, start)
    programs = Programs(_build, residuals, re, args)
    leaves = programs.leaves
    res_fn = programs.get("residuals", "none", start)
    m = programs.out_info["residuals"].shape[0]
    modes = choose_modes(mode, len(re) <= m)
    jac_fn, used = programs.first_working("jacobian", modes, start)
    limit = blas_threads_limit(blas_threads, len(re) * m)
    kwargs = with_defaults(kwargs, len(re))
    if method == "auto":
        lm_fits = lb_ub is None and m >= len(re) and set(kwargs) <= _LM_OPTIONS
        method = "lm" if lm_fits else "trf"
        fallback = lm_fits
    else:
        fallback = False

    def attempt(method):
        tracker = Tracker(re, callback, progress, f"least_squares ({method})")
        solved = _solve(
            method, start, lb_ub, res_fn, jac_fn, leaves, re, tracker, limit, kwargs
        )
        return tracker, *solved

    tracker, res, status, message, x, value, n_rejected = attempt(method)
    n_calls = tracker.n_calls
    if status == "nonfinite" and tracker.best_x is None:  # at the start: say why
        r0 = np.asarray(res_fn(start, leaves))
        message, n_calls = nonfinite_start_message("The residuals are", args, r0), 1
    # MINPACK rejects a trial step to non-finite residuals and shrinks it, as SciPy's
    # `lm` does; but a problem that overflows may have led it to a poorer minimum
    # (NIST BoxBOD from Start 1, where `curve_fit` ends at a constant): then `trf`
    # runs from the start too, and the lower cost wins. A stop (a non-finite
    # Jacobian) hands over to `trf` outright.
    elif fallback and (status == "nonfinite" or n_rejected):
        lm = (tracker, res, status, message, x, value)
        trf = attempt("trf")[:6]
        n_calls += trf[0].n_calls
        lm_better = status != "nonfinite" and (
            trf[2] == "nonfinite" or not float(trf[5]) < float(value)
        )
        tracker, res, status, message, x, value = lm if lm_better else trf
        if lm_better:
            message += (
                f" (`lm` rejected {n_rejected} trial steps to non-finite residuals;"
                f" `trf`, run from the start too, ended at cost {float(trf[5]):.6g}.)"
            )
        else:
            method = "trf"
            why = (
                "stopped at non-finite values"
                if lm[2] == "nonfinite"
                else f"stepped to non-finite residuals and ended at cost {float(lm[5]):.6g}"
            )
            message += f" (`lm` {why}; `trf` ran from the start.)"
    p = jnp.asarray(np.asarray(x, dtype=np.float64))
    # Standard errors from the Jacobian at the solution: SciPy's own (for the linear
    # loss, `res.jac` is the Jacobian at `res.x`), or one more Jacobian call.
    unc, fitted = None, re(p)
    if kwargs.get("loss", "linear") == "linear" and np.isfinite(value):
        jac_x = res.jac if res is not None else jac_fn(x, leaves)
        unc = for_values(
            from_jacobian(np.asarray(jac_x), float(value), re), re, x, fitted
        )
    return FitResult(
        model=fitted,
        p=p,
        loss=float(value),
        status=status,
        message=f"{message} (method: {method}; Jacobian: {used} mode)",
        history=np.asarray(tracker.history),
        n_steps=len(tracker.history),
        raw=res,
        re=re,
        uncertainty=unc,
        chisqr=2.0 * float(value),
        n_data=m,
        n_evaluations=n_calls,
    )


def _solve(method, start, lb_ub, res_fn, jac_fn, leaves, re, tracker, limit, kwargs):
    """One run of SciPy's `least_squares`: `(raw, status, message, x, cost,
    rejected)`, `rejected` the number of trial points with non-finite residuals."""
    rejected = [0]

    def fun(x):
        out = np.array(res_fn(x, leaves))
        # Finite residuals whose sum of squares overflows are not an error: SciPy's
        # cost is then inf and it shrinks the step (NIST BoxBOD from Start 1). Nor
        # are non-finite residuals at a trial point: both `trf` (it checks) and
        # MINPACK (NaN or inf fails its reduction test) reject the step and shrink
        # it, as in SciPy. Only at the start is there no step to reject.
        cost = _cost(out)
        start = tracker.n_calls == 0
        if start and not math.isfinite(cost) and not np.isfinite(out).all():
            jac = np.asarray(jac_fn(x, leaves))
            where = f"call {tracker.n_calls + 1} (iteration {len(tracker.history)})"
            raise NonFinite(
                nonfinite_message(
                    f"The residuals are non-finite ({int((~np.isfinite(out)).sum())} entries)",
                    where,
                    x,
                    np.where(np.isfinite(jac), 0.0, np.nan).sum(0),
                    re,
                    "Jacobian",
                )
            )
        if not math.isfinite(cost) and not np.isfinite(out).all():
            rejected[0] += 1
        tracker.seen(x, cost)
        return out

    def jac(x, *_):
        out = np.array(jac_fn(x, leaves))
        if not np.isfinite(out).all():
            where = f"iteration {len(tracker.history) + 1}"
            raise NonFinite(
                nonfinite_message(
                    "The Jacobian is non-finite",
                    where,
                    x,
                    np.where(np.isfinite(out), 0.0, np.nan).sum(0),
                    re,
                    "Jacobian",
                )
            )
        # SciPy asks for the Jacobian once per iteration, at the accepted point.
        cost = tracker.cost_at(x)
        tracker.iteration(x, _cost(fun(x)) if cost is None else cost)
        return out

    def call():
        with limit, np.errstate(over="ignore"):  # SciPy's own cost may overflow too
            # Rule: `lm` calls MINPACK's `lmder` through `scipy.optimize.leastsq`,
            # whose iterates are `least_squares(method="lm")`'s exactly (tested),
            # without its per-call wrappers (docs/parameter_estimation.md has what
            # they cost a small fit).
            if method == "lm" and set(kwargs) <= OPTIONS:
                options = minpack_options(kwargs, len(start), "least_squares")
                return _minpack(fun, jac, start, options)
            return scipy.optimize.least_squares(
                fun,
                start,
                jac=jac,  # pyright: ignore[reportArgumentType]
                method=method,
                bounds=lb_ub if lb_ub is not None else (-np.inf, np.inf),
                **kwargs,
            )

    res, status, message, x, value = run(call, tracker, start)
    if res is not None:
        status, value = _status(res), res.cost
        if status == "max_steps":
            message += more_evaluations(kwargs["max_nfev"])
    return res, status, message, x, value, rejected[0]


def _minpack(fun, jac, x0, options: Minpack):
    """Levenberg–Marquardt by MINPACK, returned as `least_squares` returns it."""
    # `leastsq` first calls both at `x0` to check their shapes, and MINPACK calls them
    # there again: served once, as `least_squares` serves them (nothing is counted or
    # recorded twice). MINPACK copies what they return.
    fun, jac = _last_one(fun), _last_one(jac)
    out: tuple = scipy.optimize.leastsq(  # pyright: ignore[reportAssignmentType]
        fun,
        x0,
        Dfun=jac,
        full_output=True,
        ftol=options.ftol,
        xtol=options.xtol,
        gtol=options.gtol,
        maxfev=options.max_nfev,
        diag=options.diag,  # pyright: ignore[reportArgumentType]
    )
    x, info, code = out[0], out[2], out[4]  # with `full_output`, five things
    message = describe(code)[1]  # what to do at `max_nfev`: in the fit's message
    f, J = info["fvec"], jac(x)  # `least_squares` too asks for the final Jacobian
    grad = J.T @ f
    return optimize_result(
        x=x,
        cost=_cost(f),
        f=f,
        jac=J,
        grad=grad,
        optimality=np.max(np.abs(grad), initial=0.0),
        nfev=info["nfev"],
        njev=info["njev"],
        info=code,
        message=message,
    )


def _last_one(f: Callable[[np.ndarray], np.ndarray]) -> Callable:
    """`f`, called again only when `x` differs from the last call's."""
    last: list = [None, None]

    def f_once(x, *_):
        if last[0] is None or not np.array_equal(x, last[0]):
            last[:] = [np.array(x), f(x)]
        return last[1]

    return f_once


def _cost(residuals: np.ndarray) -> float:
    return 0.5 * float(residuals @ residuals)  # overflow: `call` ignores it


def _build(kind: str, residuals, re, rebuild, mode: str) -> Callable:
    r = residual_fn(residuals, re, rebuild)
    if kind == "residuals":
        return r
    jacobian = jax.jacfwd if mode == "forward" else jax.jacrev
    return lambda x, leaves: jacobian(lambda x: r(x, leaves))(x)
