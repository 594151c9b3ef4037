"""The host's engines of `least_squares`: SciPy's `trf`, `dogbox` and `lm`,
MINPACK's `lmder` called directly, and Fides; one run of the one that `Engine`
names."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import scipy.optimize

from .._fitting.result import Status
from .._solver.minpack import (
    Minpack,
    describe,
    more_evaluations,
    optimize_result,
)
from . import fides as _fides
from .host import NonFinite, Tracker, nonfinite_message, run


@dataclasses.dataclass(frozen=True)
class Engine:
    """Which engine runs a host fit, and its options: the front (`least_squares`)
    decides once. `"minpack"` is `lm` through MINPACK's `lmder` directly (as
    `scipy.optimize.leastsq`, whose iterates are `least_squares(method="lm")`'s
    exactly, without its per-call wrappers), when every option is MINPACK's."""

    name: Literal["trf", "dogbox", "lm", "minpack", "fides"]
    minpack: Minpack | None = None  # for "minpack"
    # For SciPy's methods: its options (sciflat's defaults filled in), as pairs.
    scipy: tuple[tuple[str, Any], ...] = ()
    # For Fides: its options (`hessian_update` included), as pairs.
    fides: tuple[tuple[str, Any], ...] = ()
    # `lm` chosen by `"auto"`: where it met non-finite residuals, `trf` runs too.
    fallback: bool = False

    @property
    def method(self) -> str:
        """The method, as a fit's message names it."""
        return "lm" if self.name == "minpack" else self.name

    @property
    def max_nfev(self) -> Any:
        if self.minpack is not None:
            return self.minpack.max_nfev
        if self.name == "fides":
            return dict(self.fides).get("maxiter")
        return dict(self.scipy)["max_nfev"]


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
    """One run of an engine: SciPy's result (None when stopped), the status, the
    message, the point and its cost, and how many trial points had non-finite
    residuals."""

    raw: Any
    status: Status
    message: str
    x: Any  # float64: the best point, or SciPy's
    cost: float
    rejected: int


def solve(engine: Engine, start, lb_ub, res_fn, jac_fn, leaves, re, tracker, limit):
    """One run of `engine` from `start` (`res_fn`, `jac_fn`: the compiled residuals
    and Jacobian, at `(x, leaves)`; for Fides, `jac_fn` gives both): a `Run`."""
    calls = _Calls(res_fn, jac_fn, leaves, re, tracker)

    def call():
        with limit, np.errstate(over="ignore"):  # SciPy's own cost may overflow too
            if engine.name == "fides":
                options = dict(engine.fides)
                return _fides.minimize(
                    calls.both, start, lb_ub, options, calls.seen, tracker.iteration
                )
            if engine.minpack is not None:
                return _minpack(calls.fun, calls.jac, start, engine.minpack)
            return scipy.optimize.least_squares(
                calls.fun,
                start,
                jac=calls.jac,  # pyright: ignore[reportArgumentType]
                method=engine.name,
                bounds=lb_ub if lb_ub is not None else (-np.inf, np.inf),
                **dict(engine.scipy),
            )

    res, status, message, x, value = run(call, tracker, start)
    if isinstance(res, _fides.Result):
        status, value = res.status, res.cost
    elif res is not None:
        status, value = _status(res), res.cost
        if status == "max_steps":
            message += more_evaluations(engine.max_nfev)
    return Run(res, status, message, x, value, calls.rejected)


class _Calls:
    """What SciPy (or MINPACK) calls: the residuals and the Jacobian at `x`, each one
    compiled call, seen by `tracker`. A non-finite start or Jacobian stops the run
    (`NonFinite`, naming the parameters)."""

    def __init__(self, res_fn, jac_fn, leaves, re, tracker: Tracker):
        self.res_fn, self.jac_fn, self.leaves = res_fn, jac_fn, leaves
        self.re, self.tracker = re, tracker
        self.rejected = 0  # trial points with non-finite residuals

    def fun(self, x):
        tracker = self.tracker
        out = np.array(self.res_fn(x, self.leaves))
        # Finite residuals whose sum of squares overflows are not an error: SciPy's
        # cost is then inf and it shrinks the step (NIST BoxBOD from Start 1). Nor
        # are non-finite residuals at a trial point: both `trf` (it checks) and
        # MINPACK (NaN or inf fails its reduction test) reject the step and shrink
        # it, as in SciPy. Only at the start is there no step to reject.
        cost = _cost(out)
        nonfinite = not math.isfinite(cost) and not np.isfinite(out).all()
        if nonfinite and tracker.n_calls == 0:
            try:  # to name the parameters whose Jacobian columns are non-finite
                jac = np.asarray(self.jac_fn(x, self.leaves))
            except (ValueError, RuntimeError):  # it raised there too
                jac = None
            where = f"call {tracker.n_calls + 1} (iteration {len(tracker.history)})"
            n_bad = int((~np.isfinite(out)).sum())
            what = f"The residuals are non-finite ({n_bad} entries)"
            raise NonFinite(self._message(what, where, x, jac))
        self.rejected += nonfinite
        tracker.seen(x, cost)
        return out

    def both(self, x):
        """For Fides: the residuals and their Jacobian from one call. Fides asks for
        both at every trial point, where the residuals may be non-finite (an ODE
        solve that failed), and a derivative can raise there (Lineax refuses a
        non-finite linear solve in an implicit derivative). Then the residuals alone
        decide: non-finite, the point is rejected as any such trial point; finite,
        the run stops as at a non-finite Jacobian, with the error in its message."""
        try:
            r, jac = self.jac_fn(x, self.leaves)
        except (ValueError, RuntimeError) as e:
            r = np.array(self.res_fn(x, self.leaves))
            if np.isfinite(r).all():
                what = f"The Jacobian could not be computed ({_error_line(e)})"
                where = f"call {self.tracker.n_calls + 1}"
                raise NonFinite(self._message(what, where, x, None)) from e
            return r, np.full((r.size, np.size(x)), np.nan)
        return np.array(r), np.array(jac)

    def seen(self, x, cost: float, r: np.ndarray, jac: np.ndarray) -> None:
        """For Fides: one evaluation seen. Non-finite residuals stop the run at the
        start only (at a trial point Fides rejects the step); a non-finite Jacobian
        at finite residuals stops it, naming the parameters, as in `jac`."""
        tracker = self.tracker
        if not np.isfinite(r).all():
            if tracker.n_calls == 0:
                where = "call 1 (iteration 0)"
                n_bad = int((~np.isfinite(r)).sum())
                what = f"The residuals are non-finite ({n_bad} entries)"
                raise NonFinite(self._message(what, where, x, jac))
            self.rejected += 1
        elif not np.isfinite(jac).all():
            where = f"iteration {len(tracker.history) + 1}"
            raise NonFinite(self._message("The Jacobian is non-finite", where, x, jac))
        tracker.seen(x, cost)

    def jac(self, x, *_):
        where = f"iteration {len(self.tracker.history) + 1}"
        try:
            out = np.array(self.jac_fn(x, self.leaves))
        except (ValueError, RuntimeError) as e:  # e.g. Equinox's runtime checks
            what = f"The Jacobian could not be computed ({_error_line(e)})"
            raise NonFinite(self._message(what, where, x, None)) from e
        if not np.isfinite(out).all():
            raise NonFinite(self._message("The Jacobian is non-finite", where, x, out))
        # SciPy asks for the Jacobian once per iteration, at the accepted point.
        cost = self.tracker.cost_at(x)
        self.tracker.iteration(x, _cost(self.fun(x)) if cost is None else cost)
        return out

    def _message(self, what: str, where: str, x, jac: np.ndarray | None) -> str:
        # The parameters whose Jacobian column is non-finite are named.
        if jac is None:
            return nonfinite_message(what, where, x, None, self.re, "Jacobian")
        columns = np.where(np.isfinite(jac), 0.0, np.nan).sum(0)
        return nonfinite_message(what, where, x, columns, self.re, "Jacobian")


def _status(res) -> Status:
    if res.status > 0:
        return "converged"
    return "max_steps" if res.status == 0 else "failed"


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


def _error_line(e: Exception) -> str:
    """The line of an error from a compiled call that says what went wrong: a host
    callback's (Equinox's runtime checks) is inside JAX's own message."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    said = [ln for ln in lines if "Error: " in ln and "CpuCallback" not in ln]
    return said[-1].lstrip("_") if said else f"{type(e).__name__}: {lines[:1]}"
