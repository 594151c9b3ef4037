"""PEtab v1's objective priors: their −log densities at the estimated parameters, and
the normal ones as residuals for least squares.

The types are listed in `tables.PRIORS`; the first five are densities of the linear
value, the `parameterScale` ones of the value on the parameter's scale; none is
truncated at the bounds (as PEtab v1 and pyPESTO define them).
"""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Scalar

from .tables import PRIORS, Priors


def _uniform(v, a, b):
    return jnp.where((v >= a) & (v <= b), jnp.log(b - a), jnp.inf)


def _normal(v, a, b):
    return 0.5 * jnp.log(2 * jnp.pi * b**2) + 0.5 * ((v - a) / b) ** 2


def _laplace(v, a, b):
    return jnp.log(2 * b) + jnp.abs(v - a) / b


# −log density of each type at `v`, with its parameters `a;b`.
_NEG_LOG = {
    "uniform": _uniform,
    "normal": _normal,
    "laplace": _laplace,
    "logNormal": lambda v, a, b: jnp.log(v) + _normal(jnp.log(v), a, b),
    "logLaplace": lambda v, a, b: jnp.log(v) + _laplace(jnp.log(v), a, b),
    "parameterScaleUniform": _uniform,
    "parameterScaleNormal": _normal,
    "parameterScaleLaplace": _laplace,
}
_SQUARES = ("normal", "parameterScaleNormal")  # the priors that are residuals


def _by_kind(priors: Priors, scaled: Array, linear: Array):
    """Per prior type present: its name, the values it is a density of, `a`, `b`."""
    for kind in np.unique(priors.kind):
        name, chosen = PRIORS[kind], priors.kind == kind
        on_scale = scaled if name.startswith("parameterScale") else linear
        yield name, on_scale[priors.index[chosen]], priors.a[chosen], priors.b[chosen]


def neg_log_prior(
    priors: Priors, scaled: Float[Array, " n"], linear: Float[Array, " n"]
) -> Scalar:
    """−log of the priors' densities; `scaled` and `linear` are the estimated
    parameters on their scales and linear."""
    total = jnp.zeros((), scaled.dtype)
    for name, v, a, b in _by_kind(priors, scaled, linear):
        total = total + jnp.sum(_NEG_LOG[name](v, a, b))
    return total


def prior_residuals(
    priors: Priors, scaled: Float[Array, " n"], linear: Float[Array, " n"]
) -> Array:
    """(v − mean) / σ of each normal prior: half their sum of squares is the priors'
    −log density, up to `prior_offset`."""
    others = sorted({PRIORS[k] for k in priors.kind} - set(_SQUARES))
    if others:
        raise ValueError(
            f"`residuals` exist for normal priors only; this problem has {others} "
            "priors: fit `problem.nll` with `sciflat.minimize`."
        )
    out = [(v - a) / b for _, v, a, b in _by_kind(priors, scaled, linear)]
    return jnp.concatenate(out) if out else jnp.zeros(0, scaled.dtype)


def prior_offset(priors: Priors) -> float:
    """The constant of the normal priors' −log density beside their squares."""
    normal = np.isin([PRIORS[k] for k in priors.kind], _SQUARES)
    return float(np.sum(0.5 * np.log(2 * np.pi * priors.b[normal] ** 2)))
