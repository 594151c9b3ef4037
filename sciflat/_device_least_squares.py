"""`least_squares(method="device")`: the whole Levenberg–Marquardt fit as one
compiled program (`_lm.py`), on the problem layer the SciPy fits share."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _lm
from ._floats import promote_floats
from ._gradients import Mode, choose_modes
from ._problem import check_args, check_float64, residual_vector
from ._result import FitResult
from ._scipy_programs import Programs
from ._scipy_start import start as float64_start
from ._transforms import for_values, unwrapping
from ._uncertainty import from_jacobian


# What the device fit takes; defaults as the SciPy path's (`_scipy_least_squares`).
OPTIONS = {"ftol", "xtol", "gtol", "max_nfev", "x_scale"}
_TOL = 1e-12
# The history keeps the cost of at most this many accepted steps (it is part of the
# compiled program: one float per step).
_HISTORY_MAX = 10_000
# `least_squares`' `status` numbering of SciPy, for `raw.status`.
_SCIPY_STATUS = {-2: -1, 1: 2, 2: 3, 3: 4, 4: 1, 5: 0, 6: 2, 7: 3, 8: 1}


def options(kwargs: dict, n: int, who: str) -> tuple[_lm.Options, int]:
    """MINPACK's tolerances from `kwargs` (sciflat's defaults), and `max_nfev`."""
    if extra := sorted(set(kwargs) - OPTIONS):
        raise TypeError(
            f"`{who}` with the device fit takes {sorted(OPTIONS)} as options, got "
            f"{extra}: those are SciPy's (use `method='trf'` for a robust `loss`, ...)."
        )
    tol = {k: float(kwargs.get(k, _TOL)) for k in ("ftol", "xtol", "gtol")}
    if any(not v >= 0 for v in tol.values()):
        raise ValueError(f"`{who}`: `ftol`, `xtol`, `gtol` must be >= 0, got {tol}.")
    max_nfev = int(kwargs.get("max_nfev") or 2000 * (n + 1))
    x_scale = kwargs.get("x_scale", "jac")
    if isinstance(x_scale, str) and x_scale == "jac":
        diag = np.zeros(n)
    else:
        scale = np.broadcast_to(np.asarray(x_scale, np.float64), (n,))
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"`{who}`: `x_scale` must be 'jac' or positive numbers.")
        diag = 1.0 / scale  # as MINPACK's `diag` in `least_squares(method="lm")`
    f64 = lambda v: np.asarray(v, np.float64)
    opts = _lm.Options(
        f64(tol["ftol"]), f64(tol["xtol"]), f64(tol["gtol"]), f64(max_nfev), f64(diag)
    )
    return opts, max_nfev


def residual_fn(residuals, re, rebuild) -> Callable:
    def r(x, leaves):
        out = residual_vector(residuals(re(x), *rebuild(leaves)))
        check_float64(out, "The residuals")
        return out

    return r


def with_jacobian(r: Callable, mode: str) -> Callable:
    """`x -> (r(x), J(x))` in one pass: forward mode carries the residuals along."""
    if mode == "forward":

        def both(x):
            jac, f = jax.jacfwd(lambda x: (r(x), r(x)), has_aux=True)(x)
            return f, jac

        return both

    def both_reverse(x):
        f, vjp = jax.vjp(r, x)
        (jac,) = jax.vmap(vjp)(jnp.eye(f.shape[0], dtype=f.dtype))
        return f, jac

    return both_reverse


def _build(kind, residuals, re, rebuild, mode: str) -> Callable:
    """The compiled single fit: `(x0, options, leaves) -> final State`."""
    history = int(kind.removeprefix("device:"))
    r = residual_fn(residuals, re, rebuild)

    def fit(x0, opts, leaves):
        check_shape(
            jax.eval_shape(r, x0, leaves).shape[0], x0.shape[0], "least_squares"
        )
        both = with_jacobian(lambda x: r(x, leaves), mode)
        return _lm.solve(both, x0, opts, history)

    return fit


def check_shape(m: int, n: int, who: str) -> None:
    if m < n:
        raise ValueError(
            f"`{who}`: the device fit (Levenberg–Marquardt) needs at least as many "
            f"residuals as parameters, got {m} residuals for {n} parameters: use "
            "`method='trf'`."
        )


def status_and_message(info: int, max_nfev: int) -> tuple[Any, str]:
    status, message = _lm.MESSAGES.get(int(info), ("failed", f"info {int(info)}."))
    if status == "max_steps":
        message += (
            f" Raise `max_nfev` (it was {max_nfev}) to go further, or start closer."
        )
    return status, message


def least_squares_on_device(
    residuals: Callable,
    model: Any,
    *,
    args: tuple,
    bounds: Any,
    mode: Mode,
    x0: Any,
    filter_spec: Any,
    callback: Any,
    kwargs: dict,
) -> FitResult:
    """What `sciflat.least_squares(..., method="device")` runs."""
    who = "least_squares"
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
    model = promote_floats(model, who)
    residuals = unwrapping(residuals)
    start, re = float64_start(model, x0, filter_spec, who)
    args = check_args(args, who)
    opts, max_nfev = options(kwargs, len(re), who)
    programs = Programs(_build, residuals, re, args)
    kind = f"device:{min(max_nfev, _HISTORY_MAX) + 1}"  # the history's length
    # Forward mode first: the fit needs m >= n, where it is the cheaper one.
    fn, used = programs.first_working(kind, choose_modes(mode, True), start, opts)
    m = programs.out_info[kind].f.shape[0]
    state = jax.device_get(fn(start, opts, programs.leaves))
    return fit_result(state, re, m, start, max_nfev, f"Jacobian: {used} mode")


def fit_result(state, re, m: int, start, max_nfev: int, how: str) -> FitResult:
    """The `FitResult` of one finished `State` (NumPy arrays)."""
    import scipy.optimize

    info = int(state.info)
    status, message = status_and_message(info, max_nfev)
    ok = info != _lm.NONFINITE_START
    x = np.asarray(state.x if ok else start, np.float64)
    cost = 0.5 * float(state.fnorm) ** 2 if ok else np.nan
    p = jnp.asarray(x)
    fitted = re(p)
    unc = None
    if ok:
        unc = from_jacobian(np.asarray(state.jac), cost, re)
        unc = for_values(unc, re, p, fitted)
    njev = int(state.njev)
    history = np.asarray(state.history, np.float64)[: min(njev, len(state.history))]
    grad = np.asarray(state.jac).T @ np.asarray(state.f)
    raw = scipy.optimize.OptimizeResult(
        x=x,
        cost=cost,
        fun=np.asarray(state.f),
        jac=np.asarray(state.jac),
        grad=grad,
        optimality=float(np.max(np.abs(grad), initial=0.0)),
        active_mask=np.zeros(len(x), int),
        nfev=int(state.nfev),
        njev=njev,
        status=_SCIPY_STATUS.get(info, -1),
        message=message,
        success=status == "converged",
    )
    return FitResult(
        model=fitted,
        p=p,
        loss=cost,
        status=status,
        message=f"{message} (method: device; {how})",
        history=history,
        n_steps=len(history),
        raw=raw,
        re=re,
        uncertainty=unc,
        chisqr=2.0 * cost,
        n_data=m,
        n_evaluations=int(state.nfev),
    )
