"""Hierarchical optimisation of a PEtab problem: the noise parameters computed in closed
form for each trial of the others (Loos et al. 2018; Schmiester et al. 2020), so that
an optimiser sees only the dynamic parameters.

A noise parameter σ that is the whole noise formula of the measurements that use it
(and used nowhere else) enters −log L only through `m log σ + S / (2 σ²)` (normal
noise; `S` the sum of squared residuals of those `m` measurements, on their
transformation scale) or `m log σ + A / σ` (Laplace; `A` the sum of absolute
residuals): both convex in `log σ`, minimal at `σ̂² = S / m` or `σ̂ = A / m`, so within
the bounds the minimum is `σ̂` clipped to them, on any monotone scale.
"""

import dataclasses
import re as regex
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Scalar

from .._fitting.hessian import hessian_uncertainty
from .objective import Objective, unscale
from .priors import neg_log_prior, prior_residuals
from .strong import strongly_typed
from .tables import Tables


@dataclasses.dataclass(frozen=True)
class Profiled:
    """One noise parameter computed in closed form: the measurements whose σ it is."""

    parameter: str
    scale: str
    lower: float  # on its scale
    upper: float
    rows: npt.NDArray[np.int64]  # positions in the measurement table
    laplace: bool


#
# Which noise parameters can be profiled
#


def _why_not(tables: Tables, pid: str) -> str | None:
    """Why the estimated parameter `pid` cannot be computed in closed form (None if
    it can)."""
    par = tables.parameters
    j = par.table_ids.index(pid)
    if pid in {*np.asarray(par.ids)[par.priors.index]}:
        return "it has an objective prior"
    if any(j in index for index in tables.constant_index) or any(
        j in o.values() for o in tables.x0_override
    ):
        return "it enters the model or the condition table"
    named = regex.compile(rf"\b{regex.escape(pid)}\b")
    for oid, row in tables.observables.items():
        if named.search(row["observableFormula"] + " " + row["noiseFormula"]):
            return f"the formulas of observable {oid!r} name it"
    used, laplace = False, set()
    for g in tables.groups:
        oid = tables.observable_ids[g.observable]
        if (g.observable_parameters == j).any():
            return f"it is an observable parameter of {oid!r}"
        if not (g.noise_parameters == j).any():
            continue
        used = True
        formula = tables.observables[oid]["noiseFormula"].strip()
        whole = regex.fullmatch(rf"noiseParameter(\d+)_{regex.escape(oid)}", formula)
        if whole is None:
            return f"the noise formula of {oid!r} ({formula!r}) is not σ alone"
        column = int(whole.group(1)) - 1
        if not (g.noise_parameters[:, column] == j).all():
            return f"some measurements of {oid!r} use it as no σ"
        laplace.add(bool(tables.laplace[g.rows[0]]))
    if not used:
        return "no measurement uses it as its σ"
    if len(laplace) > 1:
        return "it is the σ of both normal and Laplace noise"
    if par.scales[pid] == "lin" and par.lower[pid] < 0:
        return "its lower bound is negative (a σ is positive)"
    return None


def profiled_noise(tables: Tables) -> tuple[dict[str, Profiled], dict[str, str]]:
    """The estimated parameters that can be computed in closed form, and why each
    other estimated parameter cannot."""
    par = tables.parameters
    out, refused = {}, {}
    for pid in par.ids:
        why = _why_not(tables, pid)
        if why is not None:
            refused[pid] = why
            continue
        j = par.table_ids.index(pid)
        rows = np.sort(
            np.concatenate(
                [g.rows[(g.noise_parameters == j).any(axis=1)] for g in tables.groups]
            )
        )
        out[pid] = Profiled(
            parameter=pid,
            scale=par.scales[pid],
            lower=par.lower[pid],
            upper=par.upper[pid],
            rows=rows,
            laplace=bool(tables.laplace[rows[0]]),
        )
    return out, refused


def _to_scale(sigma_sq_or_abs: Array, p: Profiled) -> Array:
    """σ̂ (from `S / m`, or `A / m` for Laplace) on the parameter's scale, clipped."""
    x = sigma_sq_or_abs
    positive = x > 0
    safe = jnp.where(positive, x, 1.0)
    power = 1.0 if p.laplace else 0.5  # σ̂ = (S/m)^½ or A/m
    if p.scale == "log10":
        v = jnp.where(positive, power * jnp.log10(safe), -jnp.inf)
    elif p.scale == "log":
        v = jnp.where(positive, power * jnp.log(safe), -jnp.inf)
    else:
        v = jnp.where(positive, safe**power, 0.0)
    return jnp.clip(v, p.lower, p.upper)


#
# The outer problem
#


class Hierarchical:
    """The outer objective: −log L of the dynamic parameters with the profiled σ at
    their closed form, and its residuals."""

    def __init__(self, objective: Objective, profiled: dict[str, Profiled]):
        self.objective, self.profiled = objective, profiled
        ids = objective.tables.parameters.ids
        self.outer = tuple(k for k in ids if k not in profiled)

    def check_model(self, model: Any) -> None:
        if not isinstance(model, dict) or set(model) != set(self.outer):
            got = sorted(model) if isinstance(model, dict) else type(model).__name__
            raise ValueError(
                "The model of a hierarchical PEtab problem is a dict of its outer "
                f"parameters {list(self.outer)} (the noise parameters "
                f"{list(self.profiled)} are computed); got {got}. Start from "
                "`hierarchical.nominal`, or drop them with `hierarchical.outer(model)`."
            )

    def _placeholder(self, model: dict[str, Any]) -> dict[str, Any]:
        """`model` with every profiled parameter at its lower bound: the solves do not
        read them, and their σ is replaced."""
        self.check_model(model)
        dtype = jnp.result_type(*model.values()) if model else jnp.float64
        return {
            **model,
            **{k: jnp.asarray(p.lower, dtype) for k, p in self.profiled.items()},
        }

    def parts(self, model: dict[str, Any]) -> dict[str, Any]:
        """The residuals on the transformation scales, σ with the closed form in, the
        full model, and the rest of the noise model's terms."""
        objective = self.objective
        full = self._placeholder(model)
        terms = objective.terms(full)
        ht, yt, jac = objective.transformed(terms["h"])
        r = yt - ht
        sigma, scaled = terms["sigma"], {}
        for k, p in self.profiled.items():
            rows = r[p.rows]
            mean = jnp.mean(jnp.abs(rows)) if p.laplace else jnp.mean(rows**2)
            scaled[k] = _to_scale(mean, p)
            sigma = sigma.at[p.rows].set(unscale(scaled[k], p.scale))
        return dict(r=r, sigma=sigma, jac=jac, ok=terms["ok"], full={**full, **scaled})

    def _prior_values(self, full: dict[str, Any]) -> tuple[Array, Array]:
        objective = self.objective
        ids = objective.tables.parameters.ids
        return jnp.stack([jnp.asarray(full[k]) for k in ids]), objective.linear(full)

    def nll(self, model: dict[str, Any]) -> Scalar:
        parts = self.parts(model)
        r, sigma = parts["r"], parts["sigma"]
        normal = 0.5 * jnp.log(2 * jnp.pi * sigma**2) + 0.5 * (r / sigma) ** 2
        laplace = jnp.log(2 * sigma) + jnp.abs(r) / sigma
        each = jnp.where(self.objective.tables.laplace, laplace, normal) + parts["jac"]
        priors = self.objective.tables.parameters.priors
        prior = neg_log_prior(priors, *self._prior_values(parts["full"]))
        return jnp.where(parts["ok"], jnp.sum(each), jnp.inf) + prior

    def residuals(self, model: dict[str, Any]) -> Array:
        tables = self.objective.tables
        if tables.laplace.any():
            raise ValueError(
                "`residuals` exist for normal noise only; this problem has Laplace "
                "noise: fit `hierarchical.nll` with `sciflat.minimize`."
            )
        parts = self.parts(model)
        # The closed-form σ is held constant in the Jacobian: Jᵀr is still the
        # gradient of the profiled −log L (the envelope theorem: ∂nll/∂σ = 0 at σ̂,
        # and a clipped σ̂ does not move), and JᵀJ is the Gauss–Newton matrix of the
        # dynamic parameters at σ = σ̂, the Fisher information the field's
        # optimisers use.
        sigma = parts["sigma"]
        fixed = np.zeros(tables.n_data, bool)
        for p in self.profiled.values():
            fixed[p.rows] = True
        sigma = jnp.where(fixed, jax.lax.stop_gradient(sigma), sigma)
        fit = parts["r"] / sigma
        noise = jnp.sqrt(2 * jnp.log(sigma) + tables.log_sigma_shift)
        priors = tables.parameters.priors
        prior = prior_residuals(priors, *self._prior_values(parts["full"]))
        out = jnp.concatenate([fit, noise, prior.astype(fit.dtype)])
        return jnp.where(parts["ok"], out, jnp.nan)


#
# The public face
#


class HierarchicalProblem:
    """A PEtab problem fitted hierarchically: its noise parameters computed in closed
    form for each trial of the others, so that a fit sees only the outer (dynamic)
    parameters. Made by [`PetabProblem.hierarchical`][sciflat.PetabProblem.hierarchical].

    A noise parameter is computed in closed form where it is the whole noise formula
    (`noiseFormula` is `noiseParameter{n}_{observableId}`) of every measurement that
    names it, and nowhere else (not in the model, the conditions, an observable
    formula or an observable parameter), has no objective prior, and is the σ of
    normal noise only or of Laplace noise only: then −log L is minimal in it at
    `σ̂² = mean((y − h)²)` (normal) or `σ̂ = mean(|y − h|)` (Laplace) over those
    measurements, on the observables' transformation scales, taken to the parameter's
    scale (`lin`, `log`, `log10`) and clipped to its bounds: the exact minimum within
    them, since −log L is convex in `log σ`. Every other parameter stays outer.

    !!! Example

        ```python
        problem = sciflat.petab_problem(sciflat.petab_benchmark("Boehm_JProteomeRes2014"))
        hier = problem.hierarchical()          # the 3 σ in closed form: 6 outer
        result = sciflat.least_squares(hier.residuals, hier.nominal,
                                       bounds=hier.bounds, method="dogbox")
        full = hier.full(result.model)         # all 9, for `problem.nll`, `simulate`
        ```

    **Attributes:**

    - `problem`: the [`sciflat.PetabProblem`][].
    - `parameter_ids`: the outer parameters, in the table's order.
    - `profiled`: the parameters computed in closed form.
    - `refused`: `{parameterId: why}` for the estimated parameters left outer.
    - `nominal`, `bounds`, `scales`: those of the problem, for the outer parameters.
    - `nll`: `nll(model) -> scalar`, the problem's `nll` at the outer `model` and the
        closed-form noise parameters: the profiled negative log-likelihood. Its
        derivatives (any order, either mode) are those of the profile.
    - `residuals`: `residuals(model)`, the problem's residuals at the outer `model` and
        the closed-form noise parameters (half their sum of squares is `nll` up to
        `problem.residual_offset`). Their Jacobian holds the closed-form σ constant:
        `Jᵀr` is the gradient of `nll` (at σ̂ its derivative in σ is zero), `JᵀJ` the
        Gauss–Newton matrix at σ = σ̂.
    """

    def __init__(self, problem: Any, noise: Any = None):
        objective = problem._objective
        possible, refused = profiled_noise(objective.tables)
        if noise is None:
            noise = tuple(possible)
        elif isinstance(noise, str) or not all(isinstance(k, str) for k in noise):
            raise TypeError(
                f"`noise` must be a sequence of parameter ids, got {noise!r}."
            )
        for k in noise:
            if k not in possible:
                why = refused.get(k, "it is not an estimated parameter")
                raise ValueError(
                    f"`noise`: {k!r} cannot be computed in closed form: {why}. "
                    f"These can: {list(possible)}."
                )
        if not noise:
            raise ValueError(
                "No noise parameter of this problem can be computed in closed form "
                f"({refused}); fit `problem` itself."
            )
        chosen = {k: possible[k] for k in problem.parameter_ids if k in noise}
        self.problem = problem
        self._inner = Hierarchical(objective, chosen)
        self.profiled: tuple[str, ...] = tuple(chosen)
        self.refused: dict[str, str] = {
            k: refused.get(k, "not asked for")
            for k in problem.parameter_ids
            if k not in chosen
        }
        self.parameter_ids: tuple[str, ...] = self._inner.outer
        self.scales = {k: problem.scales[k] for k in self.parameter_ids}
        self.nominal = self.outer(problem.nominal)
        self.bounds = (self.outer(problem.bounds[0]), self.outer(problem.bounds[1]))
        self.nll = strongly_typed(jax.jit(self._inner.nll))
        self.residuals = strongly_typed(jax.jit(self._inner.residuals))
        self._full = strongly_typed(jax.jit(lambda m: self._inner.parts(m)["full"]))

    def __repr__(self) -> str:
        return (
            f"HierarchicalProblem(outer={list(self.parameter_ids)}, "
            f"closed_form={list(self.profiled)})"
        )

    def outer(self, model: dict[str, Any]) -> dict[str, Any]:
        """The outer parameters of a model of all the problem's parameters.

        **Arguments:**

        - `model`: `{parameterId: value}` of the problem's estimated parameters.

        **Returns:**

        The same dict without the parameters computed in closed form.
        """
        self.problem._objective.check_model(model)
        return {k: model[k] for k in self.parameter_ids}

    def full(self, model: dict[str, Any]) -> dict[str, Array]:
        """Every estimated parameter: the outer `model` and the closed-form ones.

        **Arguments:**

        - `model`: the outer parameters on their scales (e.g. `result.model`).

        **Returns:**

        A model of the [`sciflat.PetabProblem`][], for its `nll`, `llh`, `simulate`:
        `problem.nll(hierarchical.full(m)) == hierarchical.nll(m)`.
        """
        return dict(self._full(model))

    def llh(self, model: dict[str, Any]) -> Scalar:
        """The data's log-likelihood at the outer `model` and the closed-form noise
        parameters (without the priors, as `PetabProblem.llh`)."""
        return self.problem.llh(self.full(model))

    def sample_starts(self, n: int, *, seed: int = 0, method: Any = "lhs") -> list:
        """The outer parameters of `problem.sample_starts(n, seed=seed,
        method=method)`: the same starts as the whole problem's, for comparisons.

        **Returns:**

        A list of `n` outer models.
        """
        starts = self.problem.sample_starts(n, seed=seed, method=method)
        return [self.outer(s) for s in starts]

    def uncertainty(self, result: Any) -> Any:
        """`result` with its covariance from the Hessian of the profiled `nll`,
        cov = H⁻¹ on the outer parameters' scales (the noise parameters' uncertainty
        is propagated: the Hessian of a profile is the Schur complement of the full
        one). [`sciflat.hessian_uncertainty`][]`(result, hierarchical.nll)`."""
        if getattr(result, "re", None) is None:
            raise ValueError("`result` has no `re`: pass what a sciflat fit returned.")
        return hessian_uncertainty(result, self.nll, scale="nll")
