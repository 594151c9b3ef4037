"""Covariance, standard errors and correlations of fitted parameters.

From the Jacobian J of the residuals (`least_squares`): cov = s² (JᵀJ)⁻¹ with the
residual variance s² = Σr² / (m - n), as NIST certifies its standard deviations. From
the Hessian H of the loss (`minimize`, on request): cov = H⁻¹ for a negative
log-likelihood, or scaled for a sum or mean of squares. Both through an SVD of the
column-scaled matrix, so that an ill-conditioned JᵀJ gives finite errors where the
data determine the parameters and names the directions they do not determine.

With known measurement errors (residuals already divided by their standard
deviations: `with_known_errors()`), the covariance is (JᵀJ)⁻¹ unscaled, as SciPy's
`curve_fit(absolute_sigma=True)` and lmfit's `scale_covar=False`.
"""

import dataclasses
import functools as ft
import warnings
from typing import Any

import numpy as np
import numpy.typing as npt

from .._flatten import Restructure


# A direction is unidentifiable when its singular value, relative to the largest, is
# below what float64 can resolve for a matrix of this size (as `np.linalg.pinv`).
def _rank_cutoff(shape: tuple[int, ...]) -> float:
    return max(shape) * float(np.finfo(np.float64).eps)


@dataclasses.dataclass(frozen=True)
class Uncertainty:
    """The covariance of the fitted parameters, in `p` order, and how it was scaled.

    **Fields:**

    - `covariance`: `(n, n)` NumPy array; rows and columns of parameters in an
        unidentifiable direction are NaN, and all of it where the Jacobian (or
        Hessian) at `p` is non-finite (`scale` then says where).
    - `re`: the [`sciflat.Restructure`][] of `p`; `names` gives one name per entry
        of `p` (`"['b1']"`, `".weight[0, 1]"`), a tied array once, under its first path.
    - `scale`: a sentence saying how the covariance was scaled.
    - `unidentifiable`: each direction of `p` the data do not determine, as a
        combination of parameter names (`"0.71 ['a'] + 0.71 ['b']"`).
    - `residual_variance`: s², the factor the covariance was scaled by (a least-squares
        fit, or `hessian_uncertainty` of a sum of squares), or None where it is not
        scaled (a negative log-likelihood, or known errors).
    - `dof`: the degrees of freedom m - n of `residual_variance` (None with it): the
        Student t of [`sciflat.band`][] and the F of [`sciflat.profile`][].

    `with_known_errors()` gives the unscaled covariance, for residuals that are
    already in units of their known standard deviations.
    """

    covariance: npt.NDArray[np.float64]
    re: Restructure[Any] = dataclasses.field(repr=False)
    scale: str
    unidentifiable: tuple[str, ...] = ()
    residual_variance: float | None = None
    dof: int | None = None

    def with_known_errors(self) -> "Uncertainty":
        """This covariance unscaled, (JᵀJ)⁻¹ (or 2 H⁻¹ of a sum of squares): for
        residuals already divided by known standard deviations, as SciPy's
        `curve_fit(..., absolute_sigma=True)` and lmfit's `scale_covar=False`.

        Raises a ValueError where the covariance is not scaled (a negative
        log-likelihood's, or known errors already) or where s² is undefined (no more
        residuals than parameters)."""
        s2 = self.residual_variance
        if s2 is None:
            raise ValueError(
                f"This covariance is not scaled by a residual variance ({self.scale}), "
                "so there is nothing to unscale: it already assumes known errors."
            )
        if not (np.isfinite(s2) and s2 > 0):
            raise ValueError(
                f"The residual variance of this fit is {s2}, so the unscaled "
                "covariance cannot be recovered from the scaled one: it needs more "
                "residuals than parameters and a non-zero χ²."
            )
        delta = self.scale.endswith(DELTA)
        return dataclasses.replace(
            self,
            covariance=self.covariance / s2,
            scale=KNOWN + (DELTA if delta else ""),
            residual_variance=None,
            dof=None,
        )

    @ft.cached_property
    def names(self) -> tuple[str, ...]:
        """One name per entry of `p` (computed when first asked for)."""
        return entry_names(self.re)

    @property
    def stderr(self) -> npt.NDArray[np.float64]:
        """Standard errors in `p` order (NaN where unidentifiable)."""
        return np.sqrt(np.diag(self.covariance))

    @property
    def correlation(self) -> npt.NDArray[np.float64]:
        """The correlation matrix in `p` order."""
        s = self.stderr
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.covariance / np.outer(s, s)


# How the covariance was scaled, in the words `scale` uses.
KNOWN = (
    "(JᵀJ)⁻¹ unscaled: the residuals are in units of their known standard deviations "
    "(`with_known_errors()`, as SciPy's `curve_fit(absolute_sigma=True)`)"
)
DELTA = "; for the constrained values by the delta method"


def entry_names(re: Restructure, rename: Any = None) -> tuple[str, ...]:
    """A name for every entry of `p`: the leaf's path, with the index for arrays
    (each path first mapped by `rename`, a dict, where it has one)."""
    names = []
    for entry in re.layout().slots:
        shape = entry.shape
        path = entry.path if rename is None else rename.get(entry.path, entry.path)
        parts = ("",) if entry.size == int(np.prod(shape)) else (".real", ".imag")
        for part in parts:
            if shape == ():
                names.append(path + part)
                continue
            for index in np.ndindex(*shape):
                names.append(f"{path}{part}[{', '.join(map(str, index))}]")
    return tuple(names)


def _scales(a: npt.NDArray[np.float64], squared: bool) -> npt.NDArray[np.float64]:
    """Each parameter's scale: its column's norm in J (`squared`), or `sqrt|H[i, i]|`
    in H; 1 where that is 0."""
    d = np.linalg.norm(a, axis=0) if squared else np.sqrt(np.abs(np.diag(a)))
    return np.where(d > 0, d, 1.0)


def _inverse(
    a: npt.NDArray[np.float64], re: Restructure, squared: bool
) -> tuple[np.ndarray, tuple[str, ...]]:
    """(JᵀJ)⁺ from J (`squared`) or H⁺ from a symmetric H, column-scaled, with the
    parameters of every dropped direction set to NaN."""
    a = np.asarray(a, np.float64)
    d = _scales(a, squared)
    scaled = a / d if squared else a / np.outer(d, d)
    if squared:
        # Every direction of `p`: with fewer residuals than parameters (m < n) the
        # thin SVD has m of the n, and the rest (undetermined) would pass unseen.
        _, s, vt = np.linalg.svd(scaled, full_matrices=scaled.shape[0] < len(d))
        values = np.zeros(len(d))
        values[: len(s)] = s**2
        vectors = vt.T
    else:
        values, vectors = np.linalg.eigh((scaled + scaled.T) / 2)
    top = np.max(np.abs(values), initial=0.0)
    # σ of J is known to eps σ_max, so σ² to eps² σ²_max; an AD Hessian to eps |H|.
    cutoff = _rank_cutoff(a.shape) ** (2 if squared else 1) * top
    keep = values > max(cutoff, np.finfo(np.float64).tiny)
    if keep.all():  # every direction determined (the usual case)
        return (vectors / values) @ vectors.T / np.outer(d, d), ()
    inner = (vectors[:, keep] / values[keep]) @ vectors[:, keep].T
    cov = inner / np.outer(d, d)
    dropped = []
    bad = np.zeros(len(d), bool)
    names = entry_names(re)
    for v in vectors[:, ~keep].T:
        weights = v / d  # back in the parameters' own units
        weights = weights / np.max(np.abs(weights))
        involved = np.abs(weights) > 1e-3
        bad |= involved
        terms = [f"{w:+.2g} {names[i]}" for i, w in enumerate(weights) if involved[i]]
        dropped.append(" ".join(terms).lstrip("+"))
    cov[bad, :] = np.nan
    cov[:, bad] = np.nan
    return cov, tuple(dropped)


def undefined(re: Restructure, what: str, matrix: np.ndarray) -> Uncertainty | None:
    """A NaN covariance saying why, when `matrix` (the Jacobian or Hessian at `p`) is
    not finite: the fit's outcome stands, its standard errors are undefined."""
    bad = ~np.isfinite(matrix)
    if not bad.any():
        return None
    names = entry_names(re)
    columns = [names[j] for j in np.flatnonzero(bad.any(0))]
    where = ", ".join(columns[:8]) + (", ..." if len(columns) > 8 else "")
    rows = np.flatnonzero(bad.any(1))
    text = (
        f"undefined: the {what} at `p` is non-finite ({int(bad.sum())} entries, in the "
        f"columns of {where}"
    )
    if what == "Jacobian":
        shown = ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")
        text += f"; residuals {shown}"
    text += "), so the standard errors cannot be computed"
    n = len(re)
    return Uncertainty(np.full((n, n), np.nan), re, text)


def from_jacobian(jac, cost: float, re: Restructure) -> Uncertainty:
    """cov = s² (JᵀJ)⁻¹, s² = 2 cost / (m - n): the least-squares covariance."""
    jac = np.asarray(jac, np.float64)
    m, n = jac.shape
    if (nan := undefined(re, "Jacobian", jac)) is not None:
        return nan
    inner, dropped = _inverse(jac, re, squared=True)
    # An undetermined direction is no degree of freedom used by the fit.
    rank = n - len(dropped)
    dof = m - rank
    s2 = 2.0 * cost / dof if dof > 0 else np.nan
    scale = jacobian_scale(cost, m, rank)
    return Uncertainty(s2 * inner, re, scale, dropped, s2, dof)


def member_uncertainty(
    cov,
    re: Restructure,
    cost: float,
    m: int,
    dropped: tuple[str, ...],
    scale: str | None,
) -> Uncertainty:
    """The `Uncertainty` of a least-squares fit whose covariance `cov` (scaled by s²)
    was computed elsewhere (on the device, or by a batch): with its s² and dof."""
    dof = m - (len(re) - len(dropped))
    s2 = 2.0 * cost / dof if dof > 0 else np.nan
    text = scale or jacobian_scale(cost, m, len(re) - len(dropped))
    return Uncertainty(cov, re, text, dropped, s2, dof)


def residual_variances(
    cost: npt.NDArray[np.float64], m: int, n: int, dropped: tuple[tuple[str, ...], ...]
) -> npt.NDArray[np.float64]:
    """s² = 2 cost / (m - rank) of each of K least-squares fits (NaN without a dof)."""
    rank = n - np.array([len(d) for d in dropped] if dropped else [0] * len(cost))
    dof = m - rank
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(dof > 0, 2.0 * np.asarray(cost) / np.maximum(dof, 1), np.nan)


def jacobian_scale(cost: float, m: int, rank: int) -> str:
    """How `from_jacobian` scaled its covariance, in words."""
    dof = m - rank
    s2 = 2.0 * cost / dof if dof > 0 else np.nan
    scale = (
        f"s² (JᵀJ)⁻¹ with the residual variance s² = Σr² / (m - n) = {s2:.6g} "
        f"(m = {m} residuals, n = {rank} determined parameters)"
    )
    if dof <= 0:
        scale += ": undefined, there are no more residuals than parameters"
    return scale


# Exact second derivatives are symmetric to rounding (1e-12 of the diagonal's scale on
# the problems tried); a derivative rule exact to first order only (one that held a
# matrix constant in the second derivative) made a Hessian 0.09 off.
SYMMETRIC_TO = 1e-6


def asymmetry(hess: npt.NDArray[np.float64]) -> float:
    """The largest `|H[i, j] - H[j, i]|`, each on the scale `sqrt(|H[i, i] H[j, j]|)`."""
    d = _scales(hess, squared=False)
    scaled = hess / np.outer(d, d)
    return float(np.max(np.abs(scaled - scaled.T), initial=0.0))


def from_hessian(
    hess, loss: float, re: Restructure, scale: str, n_data: int | None
) -> Uncertainty:
    """The covariance from the Hessian of the loss at its minimum, scaled by `scale`."""
    hess = np.asarray(hess, np.float64)
    n = len(re)
    if (nan := undefined(re, "Hessian", hess)) is not None:
        return nan
    if (off := asymmetry(hess)) > SYMMETRIC_TO:
        warnings.warn(
            f"The Hessian is not symmetric: H[i, j] and H[j, i] differ by up to {off:.1e} "
            "of their diagonal's scale, where exact second derivatives agree to "
            "rounding. Its derivatives are not exact (a derivative rule that holds "
            "something constant, a continuous adjoint's reverse pass); the covariance "
            "is computed from its symmetric part.",
            UserWarning,
            stacklevel=3,
        )
    inner, dropped = _inverse(hess, re, squared=False)
    if scale == "nll":
        return Uncertainty(
            inner, re, "H⁻¹: the loss is a negative log-likelihood", dropped
        )
    if scale == "chi2":
        text = (
            "2 H⁻¹: the loss is χ² = Σ(r/σ)² with known standard deviations σ "
            "(as SciPy's `curve_fit(absolute_sigma=True)`)"
        )
        return Uncertainty(2.0 * inner, re, text, dropped)
    if scale not in ("sse", "mse"):
        raise ValueError(
            f"`scale` must be 'nll', 'chi2', 'sse' or 'mse', got {scale!r}."
        )
    if n_data is None:
        raise TypeError(f"`scale={scale!r}` needs `n_data=`: the number of residuals.")
    dof = n_data - n
    sse = loss if scale == "sse" else loss * n_data
    s2 = sse / dof if dof > 0 else np.nan
    # loss = Σr² has Hessian 2 JᵀJ; loss = Σr² / m has Hessian 2 JᵀJ / m.
    factor = 2.0 * s2 if scale == "sse" else 2.0 * s2 / n_data
    what = "Σr²" if scale == "sse" else "Σr² / m"
    text = (
        f"2 s² H⁻¹{'' if scale == 'sse' else ' / m'}: the loss is {what} with the "
        f"residual variance s² = Σr² / (m - n) = {s2:.6g} (m = {n_data}, n = {n})"
    )
    return Uncertainty(factor * inner, re, text, dropped, s2, dof)
