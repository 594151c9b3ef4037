"""A PEtab problem (format version 1), its public face: what a fit takes (the start,
the bounds, the objectives on a flat vector), the simulation, the starts and the
uncertainty.

The pieces are read in `tables.py` (the tables, as index arrays), `sbml.py` (the model,
symbolic), `formulas.py` (SymPy to JAX) and `objective.py` (the solves and the noise
model); `petab_problem` puts them together.
"""

import os
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Scalar

from .._fitting.hessian import hessian_uncertainty
from .bdf import BDF
from .formulas import compile_formulas
from .hierarchical import HierarchicalProblem
from .objective import (
    Objective,
    ReactionODE as ReactionODE,
    StageChord as StageChord,
    unscale,
)
from .sbml import SbmlOde, read_sbml
from .strong import strongly_typed
from .tables import Scale, _to_scale, lint, read_files, read_tables


def _imports() -> tuple[Any, Any, Any, Any]:
    try:
        import diffrax
        import petab.v1
        import petab.v1.lint
        import sympy
        import yaml
    except ImportError as e:
        raise ImportError(
            f'`sciflat.petab_problem` needs {e.name}: pip install "sciflat[petab]" '
            "(petab, python-libsbml, sympy, pyyaml, diffrax)."
        ) from None
    return diffrax, sympy, yaml, petab


class PetabProblem:
    """A PEtab problem read by [`sciflat.petab_problem`][]: the start, the bounds and
    the negative log-likelihood of its parameters, and their simulation.

    The fitted model is a dict `{parameterId: value}` of the estimated parameters, each
    on its PEtab `parameterScale` (`lin`, `log` or `log10`), so `p` and the bounds are
    on that scale. The objective is the negative log-likelihood of the PEtab noise model
    (normal or Laplace, on the `observableTransformation` scale), the noise parameters
    estimated with the rest; each condition is solved by [`sciflat.BDF`][] by default
    (stiff, variable order, forward-mode derivatives).

    !!! Example

        ```python
        problem = sciflat.petab_problem("Boehm_JProteomeRes2014.yaml")
        problem.nll(problem.nominal)         # the published fit's -log L
        result = sciflat.least_squares(problem.residuals, problem.nominal,
                                       bounds=problem.bounds)
        ```

    **Attributes:**

    - `parameter_ids`: the estimated parameters, in the table's order.
    - `scales`: `{parameterId: "lin" | "log" | "log10"}`.
    - `nominal`: the table's `nominalValue`s on their scales (the published fit for a
        benchmark problem): a model to start from or to evaluate.
    - `bounds`: `(lower, upper)`, two dicts on the parameters' scales, for the fits'
        `bounds=`.
    - `conditions`: the simulation condition ids, in the order of first use.
    - `observable_ids`, `species`: the observables' and the state's ids.
    - `constant_ids`: the ids of the SBML parameters and compartments (what
        [`ReactionODE`][sciflat.ReactionODE]`.constants` holds).
    - `measurements`: the measurement table, rows as dicts.
    - `n_data`: the number of measurements.
    - `nll`: `nll(model) -> scalar`, the negative log-likelihood, plus the negative
        log-density of the objective priors if the table gives any (jit-compiled;
        for [`sciflat.minimize`][]).
    - `residuals`: `residuals(model) -> (2 n_data + n_priors,)` for
        [`sciflat.least_squares`][] (normal noise and normal priors only):
        `(y - h) / σ` on the observables' scales, then `sqrt(2 log σ + C)`, then
        `(v - mean) / σ` of each prior, so that half their sum of squares is `nll`
        up to a constant: the estimated σ enter as in Data2Dynamics' error model.
        `C` keeps the square root real for σ above the smallest positive lower bound
        of the parameter table.
    - `residual_offset`: `nll(m) == 0.5 * sum(residuals(m) ** 2) + residual_offset`.
    """

    def __init__(self, objective: Objective, ode: SbmlOde):
        if not isinstance(objective, Objective):
            raise TypeError(
                "`PetabProblem` is made by `sciflat.petab_problem(yaml_path)`; got "
                f"{type(objective).__name__}."
            )
        self._objective, self.ode = objective, ode
        tables = objective.tables
        par = tables.parameters
        self.table_ids: tuple[str, ...] = par.table_ids
        self.parameter_ids: tuple[str, ...] = par.ids
        self.scales: dict[str, Scale] = par.scales
        self.bounds: tuple[dict[str, float], dict[str, float]] = (par.lower, par.upper)
        self.nominal: dict[str, Array] = {
            k: jnp.asarray(
                _to_scale(par.nominal_lin[par.table_ids.index(k)], par.scales[k]),
                jnp.float64,
            )
            for k in par.ids
        }
        self.conditions: tuple[str, ...] = tables.conditions
        self.observable_ids: tuple[str, ...] = tables.observable_ids
        self.species: tuple[str, ...] = ode.species
        self.constant_ids: tuple[str, ...] = tuple(ode.constants)
        self.measurements: list[dict[str, str]] = tables.measurements
        self.n_data: int = tables.n_data
        # jit by identity: one compilation per problem, shared by every fit.
        self.nll = strongly_typed(jax.jit(self._nll))
        # The same, with forward mode where `nll`'s gradient is an adjoint (`BDF`'s
        # `adjoint`): for the Hessian of `uncertainty`.
        forward = lambda model: objective.nll(model, reverse=False)
        self._nll_forward = strongly_typed(jax.jit(forward))
        self.residuals = strongly_typed(jax.jit(self._residuals))
        self._neg_log_prior = strongly_typed(jax.jit(objective.neg_log_prior))
        # `check_tolerances`' program: the tolerances are its inputs, so that the
        # tighter solve runs the same compiled program as this problem's own.
        at = strongly_typed(jax.jit(jax.value_and_grad(self._nll_at)))
        self._value_and_grad_at = at

    def _nll(self, model: dict[str, Any]) -> Scalar:
        return self._objective.nll(model)

    def _nll_at(self, model: dict[str, Any], tolerances: Array) -> Scalar:
        """`nll` solved at `tolerances` = `(rtol, atol)`, traced values."""
        rtol, atol = tolerances
        return self._objective.with_tolerances(rtol, atol).nll(model)

    def _residuals(self, model: dict[str, Any]) -> Array:
        return self._objective.residuals(model)

    @property
    def residual_offset(self) -> float:
        return self._objective.residual_offset()

    def llh(self, model: dict[str, Any]) -> Scalar:
        """The data's log-likelihood, without the priors: `-nll(model) -
        log_prior(model)` (what the benchmark collection reports)."""
        if not len(self._objective.tables.parameters.priors.index):
            return -self.nll(model)
        return -self.nll(model) - self.log_prior(model)

    def log_prior(self, model: dict[str, Any]) -> Scalar:
        """The log-density of the objective priors at `model` (0 without priors).

        PEtab v1's `objectivePriorType`s: `uniform`, `normal`, `laplace`,
        `logNormal`, `logLaplace` are densities of the linear value;
        `parameterScaleUniform`, `parameterScaleNormal`, `parameterScaleLaplace` of the
        value on the parameter's scale; none is truncated at the bounds. `nll` is
        `-(llh + log_prior)`.
        """
        return -self._neg_log_prior(model)

    def hierarchical(self, noise: Sequence[str] | None = None) -> HierarchicalProblem:
        """This problem with its noise parameters computed in closed form for each
        trial of the others (hierarchical optimisation): a fit sees only the outer
        parameters.

        **Arguments:**

        - `noise`: the noise parameters to compute (default: every one that can be;
            see [`sciflat.HierarchicalProblem`][] for which can).

        **Returns:**

        A [`sciflat.HierarchicalProblem`][]: `nominal`, `bounds`, `nll`, `residuals`
        of the outer parameters, and `full(model)`, every parameter.
        """
        return HierarchicalProblem(self, noise)

    def unscale(self, model: dict[str, Any]) -> dict[str, Array]:
        """The estimated parameters on the linear scale.

        **Arguments:**

        - `model`: `{parameterId: value on its scale}` (e.g. `result.model`).

        **Returns:**

        `{parameterId: value}`, linear.
        """
        self._objective.check_model(model)
        return {
            k: unscale(jnp.asarray(model[k]), self.scales[k])
            for k in self.parameter_ids
        }

    def vector_field(
        self, model: dict[str, Any], condition: str | None = None
    ) -> ReactionODE:
        """The SBML model's vector field in one condition, as an Equinox module.

        **Arguments:**

        - `model`: the estimated parameters on their scales.
        - `condition`: a simulation condition id (default: the first).

        **Returns:**

        A [`sciflat.ReactionODE`][]: `ode(t, y, args) -> dy/dt`.
        """
        objective = self._objective
        c = objective.condition(condition)
        ext = objective.ext(model)
        constants = ext[objective.tables.constant_index[c]]
        return ReactionODE(constants, objective.formulas.rhs)

    def simulate(
        self, model: dict[str, Any], times: Any = None, condition: str | None = None
    ) -> dict[str, Array]:
        """Simulates one condition: the state and every observable over `times`.

        **Arguments:**

        - `model`: the estimated parameters on their scales.
        - `times`: increasing times >= 0 (default: 200 points up to the last
            measurement of the condition).
        - `condition`: a simulation condition id (default: the first).

        **Returns:**

        `{"time": (T,), "state": (T, n_species), observableId: (T,), ...}`. An
        observable with placeholders takes those of the condition's first measurement
        of it.
        """
        objective = self._objective
        c = objective.condition(condition)
        if times is None:
            tables = objective.tables
            mine = [
                t
                for t, r in zip(tables.times, self.measurements, strict=True)
                if r["simulationConditionId"] == self.conditions[c]
            ]
            times = np.linspace(0.0, max(mine), 200)
        ts = np.asarray(times, np.float64)
        if ts.ndim != 1 or not len(ts) or (np.diff(ts) < 0).any() or ts[0] < 0:
            raise ValueError("`times` must be a non-empty increasing 1-d array >= 0.")
        objective.check_model(model)
        out, ok = objective.simulate(model, c, tuple(float(t) for t in ts))
        if not bool(ok):
            raise ValueError(
                "The ODE solve failed at these parameters (stiff, or max_steps)."
            )
        return out

    def sample_starts(
        self, n: int, *, seed: int = 0, method: Literal["lhs", "uniform"] = "lhs"
    ) -> list[dict[str, Array]]:
        """`n` starting models drawn within the bounds, on the parameters' scales.

        **Arguments:**

        - `n`: how many.
        - `seed`: the random seed.
        - `method`: `"lhs"` (Latin hypercube, `scipy.stats.qmc`) or `"uniform"`.

        **Returns:**

        A list of `n` models (dicts), for [`sciflat.multistart`][].
        """
        if n < 1:
            raise ValueError(f"`n` must be at least 1, got {n}.")
        d = len(self.parameter_ids)
        if method == "lhs":
            from scipy.stats import qmc

            try:  # SciPy >= 1.15 takes `rng`; older ones `seed`
                sampler = qmc.LatinHypercube(d=d, rng=np.random.default_rng(seed))
            except TypeError:
                old: dict[str, Any] = {"seed": seed}
                sampler = qmc.LatinHypercube(d, **old)
            u = sampler.random(n)
        elif method == "uniform":
            u = np.random.default_rng(seed).uniform(size=(n, d))
        else:
            raise ValueError(f"`method` must be 'lhs' or 'uniform', got {method!r}.")
        lo = np.array([self.bounds[0][k] for k in self.parameter_ids])
        hi = np.array([self.bounds[1][k] for k in self.parameter_ids])
        x = lo + u * (hi - lo)
        return [
            {
                k: jnp.asarray(v, jnp.float64)
                for k, v in zip(self.parameter_ids, row, strict=True)
            }
            for row in x
        ]

    def check_tolerances(
        self,
        model: dict[str, Any],
        *,
        factor: float = 100.0,
        nll_rtol: float = 1e-6,
        grad_rtol: float = 1e-3,
    ) -> dict[str, Any]:
        """Whether `nll` and its gradient at `model` are converged in the ODE
        tolerances: both computed again with `rtol` and `atol` `factor` times
        tighter, compared, and a `UserWarning` if either moved by more than its
        tolerance here (or the tighter solve failed).

        A fit's end is where to call it: where the optimum is a knife edge (Crauste
        et al. 2017 at its published fit: a step of 1e-4 in log10 `rho_E` makes the
        solve fail), the gradient at the default tolerances can be 45 to 125 times
        off its converged value, and nothing in the value itself says so. Compiles
        one program of `nll` and its gradient, the tolerances among its inputs, at
        the first call (seconds; any `factor` reuses it), and solves twice with it.

        **Arguments:**

        - `model`: the estimated parameters on their scales (e.g. `result.model`).
        - `factor`: how much tighter the second pair of tolerances is.
        - `nll_rtol`, `grad_rtol`: the relative changes of `nll` and of the
            gradient (in norm) above which the result is reported as sensitive.

        **Returns:**

        `{"rtol": (rtol, rtol / factor), "atol": (...), "nll": (at this problem's
        tolerances, at the tighter ones), "nll_error": relative change,
        "grad_error": relative change of the gradient in norm, "sensitive": bool}`.
        """
        if not factor > 1:
            raise ValueError(f"`factor` must be > 1 (how much tighter), got {factor}.")
        objective = self._objective
        objective.check_model(model)
        tolerances = np.array([objective.rtol, objective.atol])
        here = self._value_and_grad_at(model, tolerances)
        there = self._value_and_grad_at(model, tolerances / factor)
        ids = self.parameter_ids
        (v0, g0), (v1, g1) = (
            (float(v), np.asarray([float(g[k]) for k in ids])) for v, g in (here, there)
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            nll_error = abs(v0 - v1) / abs(v1)
            grad_error = float(np.linalg.norm(g0 - g1) / np.linalg.norm(g1))
        finite = np.isfinite([v0, v1, nll_error, grad_error]).all()
        sensitive = bool(not finite or nll_error > nll_rtol or grad_error > grad_rtol)
        out = {
            "rtol": (objective.rtol, objective.rtol / factor),
            "atol": (objective.atol, objective.atol / factor),
            "nll": (v0, v1),
            "nll_error": float(nll_error),
            "grad_error": grad_error,
            "sensitive": sensitive,
        }
        if sensitive:
            warnings.warn(
                f"At these parameters the objective is not converged in the ODE "
                f"tolerances: with rtol={objective.rtol:g}, atol={objective.atol:g} "
                f"and {factor:g} times tighter, nll is {v0!r} and {v1!r} "
                f"(relative change {nll_error:.2g}) and the gradient changes by "
                f"{grad_error:.3g} of its norm. Read the gradient here as "
                "unreliable, or solve with tighter tolerances: "
                "`petab_problem(path, rtol=..., atol=...)`.",
                UserWarning,
                stacklevel=2,
            )
        return out

    def uncertainty(self, result: Any) -> Any:
        """`result` (of a fit of this problem) with its covariance from the Hessian of
        the negative log-likelihood, cov = H⁻¹ on the parameters' scales:
        [`sciflat.hessian_uncertainty`][]`(result, problem.nll)`.

        **Arguments:**

        - `result`: a [`sciflat.FitResult`][] of `least_squares(problem.residuals,
            ...)` or `minimize(problem.nll, ...)`.

        **Returns:**

        A copy with `uncertainty` set: `stderr`, `correlation`, `print(result)`.
        """
        if getattr(result, "re", None) is None:
            raise ValueError("`result` has no `re`: pass what a sciflat fit returned.")
        return hessian_uncertainty(result, self._nll_forward, scale="nll")


def petab_problem(
    yaml_path: str | os.PathLike[str],
    *,
    rtol: float = 1e-8,
    atol: float = 1e-10,
    solver: Any = None,
    max_steps: int = 100_000,
) -> PetabProblem:
    """Reads a PEtab problem (format version 1): the SBML model, and the parameter,
    condition, observable and measurement tables.

    The SBML model becomes a symbolic ODE (reactions with their kinetic laws, species
    in concentrations or amounts, compartments, parameters, initial assignments,
    assignment rules; function definitions expanded), compiled to JAX and solved in
    every simulation condition (by [`sciflat.BDF`][], or the Diffrax solver given).
    Events, delays, algebraic and rate rules, piecewise functions, pre-equilibration
    and steady-state measurements are refused with a `ValueError` naming them, never
    silently dropped. Needs the `petab` extra: `pip install "sciflat[petab]"`.

    !!! Example

        ```python
        problem = sciflat.petab_problem("Boehm_JProteomeRes2014.yaml")
        print(problem.llh(problem.nominal))                # -138.22199...
        runs = sciflat.multistart(sciflat.least_squares, problem.residuals,
                                  problem.nominal, problem.sample_starts(20),
                                  bounds=problem.bounds)
        ```

    **Arguments:**

    - `yaml_path`: the problem's YAML file.
    - `rtol`, `atol`: the tolerances of the solves, each step's error within
        `atol + rtol * |y|` (for a Diffrax solver, its `diffrax.PIDController`'s).
    - `solver`: [`sciflat.BDF`][] (sciflat's own; the default: variable order, its
        Jacobian and Newton matrix kept over many steps, what CVODES does), or a
        Diffrax solver, e.g. `diffrax.Kvaerno5(root_finder=sciflat.StageChord(
        rtol=rtol, atol=atol))`, an implicit Runge–Kutta method.
    - `max_steps`: of each solve; a solve that fails (at `max_steps`, or after 30
        rejected steps in a row, as CVODES gives up: a blow-up, rates that are not
        defined there) makes `nll` infinite and the
        `residuals` NaN (a fit then stops, rather than using a wrong value).

    **Returns:**

    A [`sciflat.PetabProblem`][]: `nominal`, `bounds`, `nll`, `llh`, `residuals`,
    `simulate`, `sample_starts`, `uncertainty`.
    """
    diffrax, sympy, yaml, petab = _imports()
    files = read_files(yaml_path, yaml, petab)
    ode = read_sbml(files.sbml)
    tables = read_tables(files, ode)
    formulas = compile_formulas(sympy, ode, tables)
    lint(files, petab, yaml_path)
    rtol, atol = float(rtol), float(atol)
    if solver is None:
        # The BDF method, its Jacobian and Newton matrix kept over many steps (1-3
        # evaluations of the vector field a step, against Kvaerno5's ~20 and its
        # Jacobian and inversion every step): on the collection's five largest
        # models 0.06-0.22 of Kvaerno5's time per llh; on the small ones 0.4-1.0
        # (Borghans, Boehm 1.0-1.3), gradients 0.6-0.9.
        solver = BDF()
    objective = Objective(tables, formulas, diffrax, solver, rtol, atol, max_steps)
    return PetabProblem(objective, ode)
