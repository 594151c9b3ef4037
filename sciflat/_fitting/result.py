"""What every fit returns: the fitted model first, then how the fit went."""

import dataclasses
import math
from typing import Any, Generic, Literal, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float

from .._flatten import Restructure
from .._layout import TRAINABLE
from .._transforms import node_path, raw_to_values
from .report import report as report_text
from .uncertainty import Uncertainty


_M = TypeVar("_M")

Status = Literal[
    "converged", "completed", "max_steps", "interrupted", "nonfinite", "failed"
]


@dataclasses.dataclass(frozen=True)
class FitResult(Generic[_M]):
    """The outcome of a fit by [`sciflat.minimize`][], [`sciflat.least_squares`][] or
    [`sciflat.fit`][].

    `print(result)` (or `result.report()`) shows the fitted values with their standard
    errors and correlations, χ², AIC/BIC, evaluations, status and message.

    !!! Example

        ```python
        result = sciflat.least_squares(residuals, {"b1": 500.0, "b2": 1e-4}, args=(x, y))
        print(result)                 # values ± standard errors, correlations, χ², ...
        result.stderr["b1"]           # standard errors in the model's own structure
        ```

    **Fields:**

    - `model`: the fitted model, rebuilt from `p` (so in `p.dtype`).
    - `p`: the flat parameter vector it was rebuilt from.
    - `loss`: the loss (or cost) at `p`.
    - `status`: `"converged"`, `"completed"` ([`sciflat.fit`][] ran the steps or
        batches it was given), `"max_steps"` (a SciPy fit used up its budget of
        evaluations or iterations), `"interrupted"` (Ctrl-C: `p` is the best point seen
        so far), `"nonfinite"` (a non-finite loss, gradient or `p`: `p` is the last
        finite point) or `"failed"`.
    - `message`: a sentence saying why the fit stopped (and, at `"max_steps"`, what to
        change to go further).
    - `history`: the loss at every step or call, as a NumPy array.
    - `n_steps`: steps (or solver iterations) taken.
    - `raw`: what the backend returned (SciPy's `OptimizeResult`, Optax's final state).
    - `re`: the [`sciflat.Restructure`][] that rebuilds `model` from `p`.
    - `uncertainty`: the [`sciflat.Uncertainty`][] of the parameters: computed by
        `least_squares`, by [`sciflat.hessian_uncertainty`][] for `minimize` and
        `fit`; else None.
    - `chisqr`: Σr², the sum of squared residuals (least squares only).
    - `n_data`: the number of residuals (least squares only).
    - `n_evaluations`: calls of the loss or residuals.
    """

    model: _M
    p: Float[Array, " n"]
    loss: float
    status: Status
    message: str
    history: npt.NDArray[np.float64]
    n_steps: int
    raw: Any = None
    re: Restructure[_M] | None = None
    uncertainty: Uncertainty | None = None
    chisqr: float | None = None
    n_data: int | None = None
    n_evaluations: int | None = None

    @property
    def success(self) -> bool:
        """True when the fit did what it was asked: `"converged"`, or `"completed"`
        (an Optax fit that ran all its steps without a non-finite stop). A SciPy fit
        stopped by its budget (`"max_steps"`) is no success, as SciPy's `success`."""
        return self.status in ("converged", "completed")

    @property
    def stderr(self) -> Any:
        """Standard errors in the model's own structure: each trainable leaf holds
        those of its entries (NaN where the data do not determine them), frozen and
        non-array leaves are None. Raises a ValueError if there is no uncertainty."""
        unc, re = self._need_uncertainty()
        return _model_shaped(re, unc.stderr)

    @property
    def covariance(self) -> npt.NDArray[np.float64]:
        """The `(n, n)` covariance of `p` (see [`sciflat.Uncertainty`][])."""
        return self._need_uncertainty()[0].covariance

    @property
    def correlation(self) -> npt.NDArray[np.float64]:
        """The `(n, n)` correlation matrix of `p`."""
        return self._need_uncertainty()[0].correlation

    @property
    def redchi(self) -> float | None:
        """χ² / (m - n), the reduced χ² (least squares only; None where m <= n:
        undefined without more residuals than parameters)."""
        dof = self._dof()
        # Undefined (None) without more residuals than parameters, as for m = n.
        if self.chisqr is None or dof is None or dof <= 0:
            return None
        return self.chisqr / dof

    @property
    def aic(self) -> float | None:
        """Akaike's information criterion, m log(χ²/m) + 2n, as lmfit."""
        return self._criterion(2.0)

    @property
    def bic(self) -> float | None:
        """The Bayesian information criterion, m log(χ²/m) + log(m) n, as lmfit."""
        return None if self.n_data is None else self._criterion(math.log(self.n_data))

    def with_known_errors(self) -> "FitResult[_M]":
        """This result with the unscaled covariance (JᵀJ)⁻¹: for residuals already
        divided by their known standard deviations σ, as SciPy's
        `curve_fit(..., sigma=σ, absolute_sigma=True)` and lmfit's
        `scale_covar=False`. Its `stderr`, `covariance`, `correlation`, report,
        [`sciflat.band`][] (normal quantiles) and [`sciflat.profile`][] (χ²₁
        thresholds) follow; the fit itself is unchanged.

        !!! Example

            ```python
            residuals = lambda m, x, y, sigma: (f(m, x) - y) / sigma
            result = sciflat.least_squares(residuals, model, args=(x, y, sigma))
            print(result.with_known_errors().stderr)   # curve_fit's absolute_sigma
            ```

        Raises a ValueError where the covariance is not scaled by a residual variance
        (a negative log-likelihood's, or known errors already)."""
        unc, _ = self._need_uncertainty()
        return dataclasses.replace(self, uncertainty=unc.with_known_errors())

    def report(self, *, min_correlation: float = 0.1) -> str:
        """The fit as text, in the manner of lmfit's `fit_report`: values, standard
        errors and relative errors, correlations above `min_correlation`, χ²,
        reduced χ², AIC/BIC, evaluations, status and message."""
        return report_text(self, min_correlation)

    def __str__(self) -> str:
        return self.report()

    def _dof(self) -> int | None:
        if self.n_data is None:
            return None
        return self.n_data - len(self.p)

    def _criterion(self, per_parameter: float) -> float | None:
        if self.chisqr is None or self.n_data is None or self.chisqr <= 0:
            return None
        m = self.n_data
        return m * math.log(self.chisqr / m) + per_parameter * len(self.p)

    def _need_uncertainty(self) -> tuple[Uncertainty, Restructure]:
        if self.uncertainty is None or self.re is None:
            raise ValueError(
                "This result has no uncertainty: `least_squares` computes it; for "
                "`minimize` call `sciflat.hessian_uncertainty(result, loss, args=..., "
                "scale=...)`."
            )
        return self.uncertainty, self.re


def _model_shaped(re: Restructure[Any], flat: npt.NDArray[np.float64]) -> Any:
    """`flat` (one value per entry of `p`) in the model's structure; leaves not in `p`
    are None."""
    # A transform node holds its value's numbers in `raw`: show them in its place.
    # float64 where JAX's 64-bit mode holds it (else a device fit's float32).
    wide = jax.dtypes.canonicalize_dtype(np.float64)
    model = raw_to_values(re(jnp.asarray(flat, wide)))
    trainable = {e.path for e in re.layout() if e.kind == TRAINABLE}
    trainable |= {node_path(p) for p in trainable}
    keep = lambda k, v: v if jax.tree_util.keystr(k) in trainable else None
    return jax.tree_util.tree_map_with_path(keep, model)
