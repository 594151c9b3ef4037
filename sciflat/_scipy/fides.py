"""`least_squares(method="fides")`: Fides's trust region on the residuals.

Fides (Fröhlich & Sorger, PLoS Comput. Biol. 18:e1010322, 2022) is the trust-region
optimiser the systems-biology field fits ODE models with (pyPESTO's default with
AMICI): an interior-reflective trust region in two-dimensional subspaces, the bounds
handled by affine scaling and reflection. Here it is given, at each point, the cost
`½‖r‖²`, its gradient `Jᵀr` and the Gauss–Newton matrix `JᵀJ`, all from one call of
the residuals and their Jacobian together (one forward-sensitivity solve for an ODE
model, where the residuals alone would be a solve too); by default
`fides.HybridFixed()`, as pyPESTO does: the Gauss–Newton matrix first, BFGS once it
stops helping."""

import copy
import dataclasses
import logging
from typing import Any

import numpy as np

from .._fitting.result import Status


# Fides's options by their names in `fides.Options`, and the Hessian approximation.
OPTIONS = frozenset(
    {
        "maxiter",
        "maxtime",
        "fatol",
        "frtol",
        "xtol",
        "gatol",
        "grtol",
        "subspace_solver",
        "stepback_strategy",
        "theta_max",
        "delta_init",
        "mu",
        "eta",
        "gamma1",
        "gamma2",
    }
)


def imported() -> Any:
    try:
        import fides
    except ImportError:
        raise ImportError(
            '`method="fides"` runs Fides\'s trust region: pip install "sciflat[fides]" '
            "(or pip install fides)."
        ) from None
    return fides


def check_options(kwargs: dict, who: str) -> None:
    """Only Fides's options (and `hessian_update`) are taken, refused before tracing."""
    unknown = sorted(set(kwargs) - OPTIONS - {"hessian_update"})
    if unknown:
        raise TypeError(
            f'`{who}(method="fides")` takes Fides\'s options {sorted(OPTIONS)} and '
            f"`hessian_update` (a `fides.HessianApproximation`); got {unknown}."
        )
    fides = imported()
    update = kwargs.get("hessian_update")
    if update is not None and not isinstance(
        update, fides.hessian_approximation.HessianApproximation
    ):
        raise TypeError(
            "`hessian_update` must be a `fides.HessianApproximation` (e.g. "
            f"`fides.HybridFixed()`, `fides.BFGS()`), got {type(update).__name__}."
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Result:
    """What the front reads from a run (as SciPy's `OptimizeResult`): the point and
    its cost, residuals and Jacobian (for the standard errors), and counts."""

    x: np.ndarray
    cost: float
    fun: np.ndarray
    jac: np.ndarray
    grad: np.ndarray
    nfev: int
    njev: int
    nit: int
    status: Status
    message: str
    exitflag: Any


class _Best:
    """The lowest cost seen, with its residuals and Jacobian (Fides returns the
    lowest point it evaluated, `x_min`)."""

    def __init__(self):
        self.cost = np.inf
        self.x: Any = None
        self.r: Any = None
        self.jac: Any = None


def minimize(both, start: np.ndarray, lb_ub, kwargs: dict, seen, iteration) -> Result:
    """Fides from `start`. `both(x) -> (r, J)` (NumPy, float64); `seen(x, cost, r, J)`
    for every evaluation (it raises to stop: a non-finite start, Ctrl-C, a callback);
    `iteration(x, cost)` once for each accepted step, before the next evaluation."""
    fides = imported()
    options = {k: v for k, v in kwargs.items() if k != "hessian_update"}
    update = kwargs.get("hessian_update")
    # Its matrix is state: each run starts its own.
    update = fides.HybridFixed() if update is None else copy.deepcopy(update)
    n = len(start)
    lb, ub = (np.full(n, -np.inf), np.full(n, np.inf)) if lb_ub is None else lb_ub
    best, counts = _Best(), {"nfev": 0, "last_x": np.array(start, dtype=np.float64)}
    optimizer: Any = None

    def fun(x):
        x = np.array(x, dtype=np.float64)
        if counts["nfev"] and not np.array_equal(optimizer.x, counts["last_x"]):
            counts["last_x"] = optimizer.x.copy()  # the step before was accepted
            iteration(counts["last_x"], float(optimizer.fval))
        counts["nfev"] += 1
        r, jac = both(x)
        cost = 0.5 * float(r @ r) if np.isfinite(r).all() else np.inf
        seen(x, cost, r, jac)
        if not np.isfinite(cost):  # a trial point: Fides rejects the step
            r, jac = np.full_like(r, np.nan), np.full_like(jac, np.nan)
        elif cost < best.cost:
            best.cost, best.x, best.r, best.jac = cost, x, r, jac
        if update.requires_resfun:  # the residuals' own schemes (e.g. `fides.SSM`)
            return r, jac
        if not update.requires_hess:  # e.g. `fides.BFGS()`
            return cost, jac.T @ r
        return cost, jac.T @ r, jac.T @ jac

    optimizer = fides.Optimizer(
        fun,
        ub=np.asarray(ub, dtype=np.float64),
        lb=np.asarray(lb, dtype=np.float64),
        verbose=logging.WARNING,
        options=options,
        hessian_update=update,
        resfun=update.requires_resfun,
    )
    try:
        optimizer.minimize(np.array(start, dtype=np.float64))
        message = _MESSAGES.get(optimizer.exitflag.name, str(optimizer.exitflag))
    except RuntimeError as e:  # Fides's own stop: a non-finite gradient
        message = f"Fides stopped: {e}"
    if not np.array_equal(optimizer.x, counts["last_x"]):  # the last step accepted
        iteration(optimizer.x.copy(), float(optimizer.fval))
    flag = optimizer.exitflag
    status: Status = (
        "converged"
        if flag.value > 0
        else "max_steps"
        if flag.name in ("MAXITER", "MAXTIME")
        else "failed"
    )
    return Result(
        x=best.x,
        cost=best.cost,
        fun=best.r,
        jac=best.jac,
        grad=best.jac.T @ best.r,
        nfev=counts["nfev"],
        njev=counts["nfev"],
        nit=int(optimizer.iteration),
        status=status,
        message=message,
        exitflag=flag,
    )


_MESSAGES = {
    "FTOL": "Fides: converged, the change of the cost within `fatol`/`frtol`.",
    "XTOL": "Fides: converged, the step within `xtol`.",
    "GTOL": "Fides: converged, the gradient within `gatol`/`grtol`.",
    "MAXITER": "Fides: stopped at `maxiter` iterations; raise `maxiter`.",
    "MAXTIME": "Fides: stopped at `maxtime` seconds; raise `maxtime`.",
    "DELTA_TOO_SMALL": "Fides: the trust region shrank below its floor.",
    "EXCEEDED_BOUNDARY": "Fides: a step left the bounds.",
    "NOT_FINITE": "Fides: a non-finite cost or gradient.",
}
