"""`band`: the confidence (or prediction) band of any function of a fitted model.

The delta method with the exact Jacobian: Var f = J cov Jᵀ, J = ∂f(re(p))/∂p by JAX
through `re`, its transforms and ties, in float64. A public helper on top of
`FitResult`: it takes a result.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from .._dtypes import X64_FIX, x64_enabled
from .._transforms import has_transforms, unwrap
from .delta import derivative
from .result import FitResult
from .uncertainty import Uncertainty


# The probability of ±1σ of a normal distribution: lmfit's default `sigma=1`.
ONE_SIGMA = 0.6826894921370859


@dataclasses.dataclass(frozen=True)
class Band:
    """A confidence or prediction band: what [`sciflat.band`][] returns.

    **Fields:**

    - `value`: f at the fitted model (NumPy, the shape f returns).
    - `stderr`: the standard error of f (confidence band), or of a new observation
        (prediction band: `sqrt(stderr_f² + noise²)`), of `value`'s shape.
    - `lower`, `upper`: `value ∓ quantile · stderr`.
    - `level`: the probability the band covers (0.95: 95 %).
    - `quantile`: the multiplier of `stderr`: Student's t with `dof` degrees of
        freedom where the covariance is scaled by the residual variance, the normal
        quantile where it is not (known errors, a negative log-likelihood).
    - `dof`: the degrees of freedom m - n of that t (None for the normal).
    - `prediction`: True for the band of new observations.
    """

    value: npt.NDArray[np.float64]
    stderr: npt.NDArray[np.float64]
    lower: npt.NDArray[np.float64]
    upper: npt.NDArray[np.float64]
    level: float
    quantile: float
    dof: int | None
    prediction: bool


def band(
    result: FitResult[Any],
    f: Callable[..., Any],
    *,
    args: tuple[Any, ...] = (),
    level: float = 0.95,
    prediction: bool = False,
    noise: Any = None,
) -> Band:
    """The confidence band of `f(model, *args)` at `level`, or the prediction band of
    new observations, from the covariance of a fit.

    Var f = J cov Jᵀ (the delta method), with J = ∂f/∂p exact by JAX through the
    model's transforms and ties, and `cov` the fit's (scaled by the residual variance
    s², or unscaled after [`sciflat.FitResult.with_known_errors`][]). The band is
    `f ± q · stderr` with q from Student's t with m - n degrees of freedom for a
    scaled covariance (as lmfit's `eval_uncertainty`), from the normal distribution
    for an unscaled one (known errors, a negative log-likelihood). `f` may return any
    array: the curve at new x, an ODE trajectory, a derived quantity.

    !!! Example

        ```python
        result = sciflat.least_squares(residuals, model, args=(x, y))
        xs = jnp.linspace(0, 10, 200)
        b = sciflat.band(result, lambda m: curve(m, xs), level=0.95)
        plt.fill_between(xs, b.lower, b.upper)
        p = sciflat.band(result, lambda m: curve(m, xs), prediction=True)
        ```

    **Arguments:**

    - `result`: a [`sciflat.FitResult`][] with its uncertainty (`least_squares`, or
        [`sciflat.hessian_uncertainty`][] after `minimize`).
    - `f`: `f(model, *args) -> array`, JAX-traceable. It gets the model the residuals
        saw: each transform replaced by its constrained value (`sciflat.unwrap`).
    - `args`: more arguments of `f`.
    - `level`: the probability the band covers, in (0, 1) (lmfit's `sigma=1` is
        `level=0.6827`, `scipy.special.erf(1 / 2**0.5)`).
    - `prediction`: the band of a new observation, adding `noise²` to Var f.
    - `noise`: the standard deviation of a new observation, in f's units (a number or
        an array broadcasting to f's shape). Default: s = √(χ²/(m - n)), the
        residual standard deviation of a scaled fit (right for unweighted residuals
        `f - y`, as lmfit's `dely_predicted`); required for an unscaled covariance.

    **Returns:**

    A [`sciflat.Band`][]: `value`, `stderr`, `lower`, `upper`, `quantile`, ...
    """
    import scipy.stats

    unc = _uncertainty(result)
    if not 0.0 < level < 1.0:
        raise ValueError(f"`level` must be in (0, 1) (0.95 for 95 %), got {level!r}.")
    if not x64_enabled():
        raise TypeError(
            "`band` computes in float64, but JAX's 64-bit mode is off: "
            f"{X64_FIX} at the start of your program."
        )
    value, var = _variance(result, unc, f, args)
    if prediction:
        if noise is None:
            if unc.residual_variance is None:
                raise ValueError(
                    "`noise` is needed for a prediction band of a fit with known errors "
                    "(or a negative log-likelihood): give the standard deviation of a "
                    "new observation, in f's units."
                )
            noise = np.sqrt(unc.residual_variance)
        var = var + np.asarray(noise, np.float64) ** 2
    if unc.dof is not None:
        q = float(scipy.stats.t.ppf(0.5 + level / 2, unc.dof))
    else:
        q = float(scipy.stats.norm.ppf(0.5 + level / 2))
    stderr = np.sqrt(var)
    return Band(
        value,
        stderr,
        value - q * stderr,
        value + q * stderr,
        level,
        q,
        unc.dof,
        prediction,
    )


def _uncertainty(result: FitResult[Any]) -> Uncertainty:
    if not isinstance(result, FitResult):
        raise TypeError(
            f"`result` must be a `sciflat.FitResult`, got {type(result).__name__}."
        )
    return result._need_uncertainty()[0]


def _variance(
    result: FitResult[Any], unc: Uncertainty, f: Callable, args: tuple
) -> tuple[np.ndarray, np.ndarray]:
    """f at the fit and J cov Jᵀ's diagonal, in f's shape."""
    re = result.re
    assert re is not None  # _uncertainty checked
    x = jnp.asarray(result.p, jnp.float64)
    g = lambda x: jnp.asarray(f(unwrap(re(x)), *args), jnp.float64)
    shape = jax.eval_shape(g, x).shape
    flat = lambda x: jnp.ravel(g(x))
    jac = jax.jacfwd(flat) if len(x) <= int(np.prod(shape)) else jax.jacrev(flat)
    value, j = jax.jit(lambda x: (g(x), jac(x)))(x)
    j = np.asarray(j, np.float64).reshape(-1, len(x))
    if has_transforms(result.model):
        # `cov` is the constrained values' (D cov_p D): J_p cov_p J_pᵀ = J_c cov J_cᵀ
        # with J_c = J_p / d, a zero column where d is (a value that cannot move).
        d = np.asarray(derivative(re)(x), np.float64)
        j = np.divide(j, d, out=np.zeros_like(j), where=d != 0)
    cov = np.asarray(unc.covariance, np.float64)
    undetermined = ~np.isfinite(np.diag(cov))
    cov = np.where(undetermined[:, None] | undetermined[None, :], 0.0, cov)
    var = np.einsum("ij,jk,ik->i", j, cov, j)
    # Where f moves with a parameter the data do not determine, its band is unknown.
    var[(j[:, undetermined] != 0).any(1)] = np.nan
    var = np.maximum(var, 0.0)  # rounding of a positive semi-definite form
    return np.asarray(value).reshape(shape), var.reshape(shape)
