"""MINPACK's Levenberg–Marquardt as sciflat offers it, whichever engine runs it
(`lmder` through SciPy on the host, or `lm.py` on the device): its options and
their defaults, what each `info` code means, and the `OptimizeResult` a fit returns
as `raw`, as `scipy.optimize.least_squares` returns it."""

import dataclasses
from typing import Any

import numpy as np

from .._fitting.result import Status
from .lm import NONFINITE_START


# SciPy's tolerances (1e-8) stop Chwirut1/2 a digit short of lmfit, and its evaluation
# limit (100 n) stops NIST Bennett5 at 1.9 digits: 1e-12 reaches >= 7 digits on all
# eight lower-difficulty StRD problems for one or two more evaluations, and lmfit's
# limit is 2000 (n + 1). (`docs/parameter_estimation.md` has the table.)
TOL = 1e-12
# What MINPACK takes besides the residuals and the Jacobian.
OPTIONS = frozenset({"ftol", "xtol", "gtol", "max_nfev", "x_scale"})


def default_max_nfev(n: int) -> int:
    return 2000 * (n + 1)


def with_defaults(kwargs: dict, n: int) -> dict:
    """`kwargs` (SciPy's options) with sciflat's defaults where not given."""
    tolerances = dict.fromkeys(("ftol", "xtol", "gtol"), TOL)
    return {**tolerances, "max_nfev": default_max_nfev(n), **kwargs}


@dataclasses.dataclass(frozen=True)
class Minpack:
    """MINPACK's options, checked: the tolerances, the evaluation limit, and the
    fixed column scales (`x_scale`, MINPACK's `diag = 1 / x_scale`), or `"jac"`:
    scaled by the Jacobian's columns, as MINPACK's default."""

    ftol: float
    xtol: float
    gtol: float
    max_nfev: int
    x_scale: str | tuple[float, ...] = "jac"

    @property
    def diag(self) -> np.ndarray | None:
        """MINPACK's `diag`, None for `"jac"`."""
        if isinstance(self.x_scale, str):
            return None
        return 1.0 / np.asarray(self.x_scale, np.float64)


def minpack_options(kwargs: dict, n: int, who: str) -> Minpack:
    """MINPACK's options from `kwargs` (names in `OPTIONS`), sciflat's defaults where
    not given (`max_nfev` None or 0 too), or a ValueError naming the wrong one."""
    tol = {k: float(kwargs.get(k, TOL)) for k in ("ftol", "xtol", "gtol")}
    if any(not v >= 0 for v in tol.values()):
        raise ValueError(f"`{who}`: `ftol`, `xtol`, `gtol` must be >= 0, got {tol}.")
    max_nfev = int(kwargs.get("max_nfev") or default_max_nfev(n))
    x_scale = kwargs.get("x_scale", "jac")
    if not (isinstance(x_scale, str) and x_scale == "jac"):
        scale = np.broadcast_to(np.asarray(x_scale, np.float64), (n,))
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"`{who}`: `x_scale` must be 'jac' or positive numbers.")
        x_scale = tuple(scale.tolist())
    return Minpack(**tol, max_nfev=max_nfev, x_scale=x_scale)


#
# What MINPACK's `info` codes mean
#

# MINPACK's codes, plus ours: `NONFINITE_START` (the device fit could not start).
MESSAGES: dict[int, tuple[Status, str]] = {
    NONFINITE_START: (
        "nonfinite",
        "The residuals or the Jacobian are non-finite at the start.",
    ),
    1: (
        "converged",
        "Converged: the sum of squares decreases by at most a fraction `ftol`.",
    ),
    2: (
        "converged",
        "Converged: the step is at most a fraction `xtol` of the parameters.",
    ),
    3: ("converged", "Converged: both the `ftol` and the `xtol` tests hold."),
    4: (
        "converged",
        "Converged: the residuals are orthogonal to the Jacobian to `gtol`.",
    ),
    5: ("max_steps", "Reached `max_nfev` residual evaluations."),
    6: (
        "converged",
        "Converged: `ftol` is too small, no further reduction is possible.",
    ),
    7: (
        "converged",
        "Converged: `xtol` is too small, the parameters cannot be improved.",
    ),
    8: (
        "converged",
        "Converged: `gtol` is too small, the gradient vanishes to precision.",
    ),
}
# `info` -> `scipy.optimize.least_squares`' `status` (-1 for any other code).
_SCIPY_STATUS = {1: 2, 2: 3, 3: 4, 4: 1, 5: 0, 6: 2, 7: 3, 8: 1}


def more_evaluations(max_nfev: int) -> str:
    """What to do when a fit reached its evaluation limit."""
    return f" Raise `max_nfev` (it was {max_nfev}) to go further, or start closer."


def describe(info: int) -> tuple[Status, str]:
    """The status and message of MINPACK's `info` code."""
    info = int(info)
    unknown = "MINPACK refused its input." if info == 0 else f"MINPACK's info {info}."
    return MESSAGES.get(info, ("failed", unknown))


def status_and_message(info: int, max_nfev: int) -> tuple[Status, str]:
    """`describe(info)`, and what to do at the evaluation limit."""
    status, message = describe(info)
    if status == "max_steps":
        message += more_evaluations(max_nfev)
    return status, message


def optimize_result(
    *, x, cost, f, jac, grad, optimality, nfev: int, njev: int, info: int, message
) -> Any:
    """A finished MINPACK fit as `scipy.optimize.least_squares` returns it."""
    import scipy.optimize  # here: the device fit does not load it until it is done

    status = _SCIPY_STATUS.get(int(info), -1)
    return scipy.optimize.OptimizeResult(
        x=x,
        cost=cost,
        fun=f,
        jac=jac,
        grad=grad,
        optimality=optimality,
        active_mask=np.zeros(len(x), int),
        nfev=int(nfev),
        njev=int(njev),
        status=status,
        message=message,
        success=status > 0,
    )
