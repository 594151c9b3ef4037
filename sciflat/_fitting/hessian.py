"""`hessian_uncertainty`: the covariance of a finished fit from the Hessian of its loss.

A public helper on top of `FitResult`: it takes a result, and returns one.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .._dtypes import X64_FIX, x64_enabled
from .._transforms import unwrap
from .delta import for_values
from .programs import Programs
from .result import FitResult
from .uncertainty import from_hessian


_M = TypeVar("_M")


def hessian_uncertainty(
    result: FitResult[_M],
    loss: Callable[..., Any],
    *,
    args: tuple[Any, ...] = (),
    scale: Literal["nll", "chi2", "sse", "mse"] = "nll",
    n_data: int | None = None,
) -> FitResult[_M]:
    """The result of [`sciflat.minimize`][] or [`sciflat.fit`][] with its covariance,
    from the Hessian.

    The Hessian H of `loss(model, *args)` with respect to `p`, at `result.p`, by JAX
    (forward over reverse mode; compiled once per loss, `Restructure` and data
    structure), inverted as in [`sciflat.Uncertainty`][]. What the covariance means
    depends on what the loss is, so say it with `scale`:

    - `"nll"`: a negative log-likelihood: cov = H⁻¹.
    - `"chi2"`: χ² = Σ(r/σ)², residuals divided by their known standard deviations
        σ: cov = 2 H⁻¹, unscaled (as SciPy's `curve_fit(absolute_sigma=True)`).
    - `"sse"`: a sum of squared residuals Σr² over `n_data` residuals:
        cov = 2 s² H⁻¹ with s² = Σr² / (n_data - n).
    - `"mse"`: their mean Σr² / n_data: cov = 2 s² H⁻¹ / n_data.

    !!! Example

        ```python
        sse = lambda m, x, y: jnp.sum((f(m, x) - y) ** 2)
        result = sciflat.minimize(sse, model, args=(x, y))
        result = sciflat.hessian_uncertainty(result, sse, args=(x, y), scale="sse",
                                             n_data=len(y))
        print(result)                 # values ± standard errors, correlations
        ```

    **Arguments:**

    - `result`: what `minimize` or `fit` returned (it carries `re`). The Hessian is
        computed in float64, whatever `p.dtype` the fit ran in (JAX's 64-bit mode must
        be on).
    - `loss`, `args`: the loss the fit minimised and its data (or, for a
        `least_squares` result, a loss of its residuals, e.g. their Σr² with
        `scale="sse"`): `scale` reads the value of this loss at `result.p`.
    - `scale`: `"nll"`, `"chi2"`, `"sse"` or `"mse"`, as above.
    - `n_data`: the number of residuals (for `"sse"` and `"mse"`; optional for
        `"chi2"`, where it fills `n_data` of the result).

    **Returns:**

    A copy of `result` with `uncertainty` set (and `chisqr`, `n_data` for sums of
    squares). A Hessian that is not symmetric (beyond 1e-6 of its diagonal's scale:
    its derivatives are not exact) gives a `UserWarning`, and its symmetric part is
    used.
    """
    if result.re is None:
        raise ValueError(
            "`result` has no `re`: pass what `sciflat.minimize` or `sciflat.fit` "
            "returned."
        )
    if not x64_enabled():
        raise TypeError(
            "`hessian_uncertainty` computes the Hessian in float64, but JAX's 64-bit "
            f"mode is off, so JAX would round it to float32: {X64_FIX} at the start of "
            "your program."
        )
    re = result.re
    x = jnp.asarray(result.p, jnp.float64)
    # Kept in the compile cache: a second call with the same loss, `re` and data
    # structure reuses the program (a Hessian through ODE solves compiles for
    # seconds).
    programs = Programs(_build, loss, re, args)
    both = programs.get("value_and_hessian", "forward over reverse", x)
    # The scale reads the value of *this* loss, not `result.loss`: that of a
    # `least_squares` result is SciPy's cost, ½Σr², not Σr² (a factor √2 in stderr).
    value, hess = both(x, programs.leaves)
    value = float(value)
    unc = from_hessian(np.asarray(hess), value, re, scale, n_data)
    unc = for_values(unc, re, x, result.model)
    if scale == "nll":
        return dataclasses.replace(result, uncertainty=unc)
    if scale == "chi2":
        return dataclasses.replace(result, uncertainty=unc, chisqr=value, n_data=n_data)
    assert n_data is not None  # from_hessian checked
    chisqr = value if scale == "sse" else value * n_data
    return dataclasses.replace(result, uncertainty=unc, chisqr=chisqr, n_data=n_data)


def _build(kind: str, loss, re, rebuild, mode: str) -> Callable:
    f = lambda x, leaves: loss(unwrap(re(x)), *rebuild(leaves))
    return lambda x, leaves: (f(x, leaves), jax.hessian(f)(x, leaves))
