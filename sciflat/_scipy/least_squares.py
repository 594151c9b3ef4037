"""`least_squares`, the front: it checks `method` and the options once, and hands one
engine its configuration: SciPy's `trf`, `dogbox` or `lm`, or MINPACK's `lmder`
(`engines.py`, on the host), Fides's trust region (`fides.py`, on the host), or the
device fit (`_device/least_squares.py`)."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PyTree

from .._device import least_squares as on_device
from .._fitting.delta import for_values
from .._fitting.gradients import Mode, choose_modes
from .._fitting.inputs import Inputs, checked_inputs
from .._fitting.problem import data_by_keyword, nonfinite_start_message, residual_fn
from .._fitting.programs import Programs
from .._fitting.result import FitResult
from .._fitting.uncertainty import from_jacobian
from .._solver.minpack import OPTIONS, minpack_options, with_defaults
from . import fides
from .bounds import flat_bounds
from .engines import Engine, Run, solve
from .host import BlasThreads, Tracker, blas_threads_limit


_M = TypeVar("_M")
_WHO = "least_squares"
_METHODS = ("auto", "trf", "dogbox", "lm", "fides", "device")
# What SciPy's `lm` takes besides MINPACK's options; anything else (a robust `loss`,
# `tr_solver`, `jac_sparsity`, ...) is a `trf` option.
_LM_OPTIONS = OPTIONS | {"diff_step", "verbose"}
_OURS = ("fun", "x0", "jac", "kwargs")


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
        `"fides"`: Fides's trust region (`pip install "sciflat[fides]"`; the
        optimiser pyPESTO runs with AMICI, made for ODE models), given the cost, its
        gradient `Jᵀr` and the Gauss–Newton matrix `JᵀJ` from one call of the
        residuals and their Jacobian together; bounds as for `"trf"`. Its options
        are Fides's (`maxiter`, `fatol`, `frtol`, `gatol`, ... at Fides's defaults)
        and `hessian_update` (default `fides.HybridFixed()`, as pyPESTO: the
        Gauss–Newton matrix, then BFGS where it stops helping).
        `"device"`: the same Levenberg–Marquardt (MINPACK's scaling and stopping
        rules) run whole on JAX's device as one compiled program, no bounds and no
        `callback`; see [Many fits at once](many_fits.md) and
        [`sciflat.least_squares_batch`][].
    - `callback`: `callback(step, cost, model)` after every iteration (every
        Jacobian); a true return value stops the fit, as in [`sciflat.minimize`][].
    - `**kwargs`: passed to `scipy.optimize.least_squares` (for `"fides"`: to
        Fides) (`ftol`, `x_scale`,
        `loss`, `max_nfev`, ...). Defaults differ from SciPy's: `ftol`, `xtol` and
        `gtol` are 1e-12 (not 1e-8) and `max_nfev` is `2000 * (n + 1)` (lmfit's; not
        `100 * n`), so that fits reach the digits NIST certifies.

    **Returns:**

    A [`sciflat.FitResult`][] whose `loss` is SciPy's `cost`; `raw` is SciPy's result;
    `stderr`, `covariance`, `chisqr`, ... and `print(result)` as in
    [Parameter estimation](parameter_estimation.md).
    """
    _check(method, bounds, callback, kwargs)
    device = method == "device"
    inputs = checked_inputs(residuals, model, args, x0, filter_spec, _WHO, device)
    if device:  # the whole fit as one compiled program
        options = minpack_options(kwargs, len(inputs.re), _WHO)
        return on_device.least_squares_on_device(inputs, options, mode)
    return _on_host(
        inputs, method, bounds, mode, callback, progress, blas_threads, kwargs
    )


def _check(method: str, bounds, callback, kwargs: dict) -> None:
    """What no engine takes, refused before anything is traced."""
    if clash := [k for k in _OURS if k in kwargs]:
        raise TypeError(f"`least_squares` handles {clash} itself; do not pass them.")
    if method not in _METHODS:
        raise ValueError(f"`method` must be one of {_METHODS}, got {method!r}.")
    if method == "lm" and bounds is not None:
        raise ValueError("`method='lm'` does not take bounds; use 'trf' or 'dogbox'.")
    if method == "fides":
        fides.check_options(kwargs, _WHO)
    if method != "device":
        return
    if bounds is not None:
        raise ValueError(
            "`method='device'` does not take bounds; use 'trf' or 'dogbox', or a "
            "`sciflat.Positive`/`Interval` transform of the parameter."
        )
    if callback is not None:
        raise TypeError(
            "`method='device'` runs the whole fit as one compiled program, so it "
            "cannot call `callback` between iterations: use `method='lm'`."
        )
    on_device.check_options(kwargs, _WHO)


def _engine(method: str, unbounded: bool, m: int, n: int, kwargs: dict) -> Engine:
    """The host's engine. `"auto"`, as `scipy.optimize.curve_fit` and lmfit: `lm`
    when there are no bounds, at least as many residuals as parameters and no option
    only `trf` takes; `trf` otherwise."""
    fallback = False
    if method == "fides":
        return Engine("fides", fides=tuple(kwargs.items()))
    if method == "auto":
        fallback = unbounded and m >= n and set(kwargs) <= _LM_OPTIONS
        method = "lm" if fallback else "trf"
    if method == "lm" and set(kwargs) <= OPTIONS:
        options = minpack_options(kwargs, n, _WHO)
        return Engine("minpack", minpack=options, fallback=fallback)
    scipy = tuple(with_defaults(kwargs, n).items())
    return Engine(method, scipy=scipy, fallback=fallback)  # pyright: ignore[reportArgumentType]


def _on_host(
    inputs: Inputs, method, bounds, mode, callback, progress, blas_threads, kwargs
) -> FitResult:
    residuals, start, re = inputs.fn, inputs.start, inputs.re
    lb_ub = flat_bounds(bounds, re, start)
    programs = Programs(_build, residuals, re, inputs.args)
    leaves = programs.leaves
    if method == "fides":  # Fides takes both from one program: no other traced
        kind = "both"
        jac_fn, used = programs.first_working(kind, choose_modes(mode, True), start)
        m = programs.out_info[kind][0].shape[0]
        if mode == "auto" and len(re) > m:  # more parameters than residuals
            jac_fn, used = programs.first_working(kind, ["reverse", "forward"], start)

        def res_fn(x, leaves):  # only where a derivative failed
            return programs.get("residuals", "none", start)(x, leaves)

    else:
        kind = "jacobian"
        res_fn = programs.get("residuals", "none", start)
        m = programs.out_info["residuals"].shape[0]
        jac_fn, used = programs.first_working(
            kind, choose_modes(mode, len(re) <= m), start
        )
    limit = blas_threads_limit(blas_threads, len(re) * m)
    engine = _engine(method, lb_ub is None, m, len(re), kwargs)

    def attempt(engine: Engine) -> tuple[Tracker, Run]:
        tracker = Tracker(re, callback, progress, f"least_squares ({engine.method})")
        run = solve(engine, start, lb_ub, res_fn, jac_fn, leaves, re, tracker, limit)
        return tracker, run

    tracker, run = attempt(engine)
    n_calls = tracker.n_calls
    if run.status == "nonfinite" and tracker.best_x is None:  # at the start: say why
        r0 = np.asarray(res_fn(start, leaves))
        message = nonfinite_start_message("The residuals are", inputs.args, r0)
        run, n_calls = dataclasses.replace(run, message=message), 1
    # MINPACK rejects a trial step to non-finite residuals and shrinks it, as SciPy's
    # `lm` does; but a problem that overflows may have led it to a poorer minimum
    # (NIST BoxBOD from Start 1, where `curve_fit` ends at a constant): then `trf`
    # runs from the start too, and the lower cost wins. A stop (a non-finite
    # Jacobian) hands over to `trf` outright.
    elif engine.fallback and (run.status == "nonfinite" or run.rejected):
        trf = Engine("trf", scipy=tuple(with_defaults(kwargs, len(re)).items()))
        trf_tracker, trf_run = attempt(trf)
        n_calls += trf_tracker.n_calls
        run, lm_won = _better(run, trf_run)
        if not lm_won:
            tracker, engine = trf_tracker, trf
    # Standard errors from the Jacobian at the solution: SciPy's own (for the linear
    # loss, `raw.jac` is the Jacobian at `x`), or one more Jacobian call.
    jac = None
    if kwargs.get("loss", "linear") == "linear" and np.isfinite(run.cost):
        if run.raw is not None:
            jac = run.raw.jac
        else:  # stopped: one more call (Fides's program gives `(r, J)`)
            try:
                jac = jac_fn(run.x, leaves)
                jac = jac[1] if kind == "both" else jac
            except (ValueError, RuntimeError):  # it failed there: no errors given
                jac = None
    how = f"method: {engine.method}; Jacobian: {used} mode"
    return _fit_result(run, jac, tracker, re, m, n_calls, how)


def _better(lm: Run, trf: Run) -> tuple[Run, bool]:
    """Of `lm`, which met non-finite residuals, and `trf` from the same start, the
    one with the lower cost (`lm` where neither is lower), its message saying what
    the other did; and whether it is `lm`."""
    lm_won = lm.status != "nonfinite" and (
        trf.status == "nonfinite" or not float(trf.cost) < float(lm.cost)
    )
    if lm_won:
        why = (
            f" (`lm` rejected {lm.rejected} trial steps to non-finite residuals;"
            f" `trf`, run from the start too, ended at cost {float(trf.cost):.6g}.)"
        )
        return dataclasses.replace(lm, message=lm.message + why), True
    what = (
        "stopped at non-finite values"
        if lm.status == "nonfinite"
        else f"stepped to non-finite residuals and ended at cost {float(lm.cost):.6g}"
    )
    why = f" (`lm` {what}; `trf` ran from the start.)"
    return dataclasses.replace(trf, message=trf.message + why), False


def _fit_result(run: Run, jac, tracker: Tracker, re, m: int, n_calls: int, how: str):
    p = jnp.asarray(np.asarray(run.x, dtype=np.float64))
    fitted, cost = re(p), float(run.cost)
    unc = None
    if jac is not None:
        unc = from_jacobian(np.asarray(jac), cost, re)
        unc = for_values(unc, re, run.x, fitted)
    return FitResult(
        model=fitted,
        p=p,
        loss=cost,
        status=run.status,
        message=f"{run.message} ({how})",
        history=np.asarray(tracker.history),
        n_steps=len(tracker.history),
        raw=run.raw,
        re=re,
        uncertainty=unc,
        chisqr=2.0 * cost,
        n_data=m,
        n_evaluations=n_calls,
    )


def _build(kind: str, residuals, re, rebuild, mode: str) -> Callable:
    r = residual_fn(residuals, re, rebuild)
    if kind == "residuals":
        return r
    jacobian = jax.jacfwd if mode == "forward" else jax.jacrev
    if kind == "both":  # `(r, J)` from one pass: an ODE's sensitivities give both

        def both(x, leaves):
            jac, out = jacobian(lambda x: (r(x, leaves),) * 2, has_aux=True)(x)
            return out, jac

        return both
    return lambda x, leaves: jacobian(lambda x: r(x, leaves))(x)
