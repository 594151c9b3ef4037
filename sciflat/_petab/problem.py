"""A PEtab problem (format version 1) as an objective on a flat vector: the tables, the
noise model, the simulation of every condition by Diffrax.

The model handed to the fits is a dict `{parameterId: value on its parameterScale}` of
the estimated parameters (so `p` is what pyPESTO and Data2Dynamics optimise: log10
rates, say, with bounds on that scale). Everything the tables name becomes an index into
one vector `ext = [every table parameter (linear scale), the numbers the tables hold]`,
so a condition's parameters, an observable's placeholders and a noise parameter are all
gathers from it, and the objective is one compiled function of `p`.
"""

import csv
import dataclasses
import functools as ft
import math
import os
import re as regex
from collections.abc import Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float, Scalar

from .sbml import SbmlOde, read_sbml


def _imports() -> tuple[Any, Any, Any]:
    try:
        import diffrax
        import sympy
        import yaml
    except ImportError as e:
        raise ImportError(
            f'`sciflat.petab_problem` needs {e.name}: pip install "sciflat[petab]" '
            "(python-libsbml, sympy, pyyaml, diffrax)."
        ) from None
    return diffrax, sympy, yaml


_SCALES = ("lin", "log", "log10")
_NOISE = ("normal", "laplace")
Scale = Literal["lin", "log", "log10"]


def _read_tsv(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return [{k.strip(): (v or "").strip() for k, v in row.items()} for row in rows]


def _unscale(x: Any, scale: str) -> Any:
    if scale == "log10":
        return 10.0**x
    if scale == "log":
        return jnp.exp(x) if isinstance(x, jax.Array) else np.exp(x)
    return x


def _to_scale(x: float, scale: str) -> float:
    with np.errstate(divide="ignore"):
        if scale == "log10":
            return float(np.log10(x))
        if scale == "log":
            return float(np.log(x))
    return float(x)


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class _Group:
    """The measurements of one observable in one condition, as index arrays."""

    condition: int
    observable: int
    rows: npt.NDArray[np.int64]  # positions in the measurement table
    time_index: npt.NDArray[np.int64]  # into the condition's sorted unique times
    times: npt.NDArray[np.float64]
    data: npt.NDArray[np.float64]
    observable_parameters: npt.NDArray[np.int64]  # (m, k) indices into `ext`
    noise_parameters: npt.NDArray[np.int64]


class ReactionODE(eqx.Module):
    """The vector field of a PEtab problem's SBML model in one condition: an Equinox
    model with Diffrax's signature `(t, y, args) -> dy/dt`.

    **Fields:**

    - `constants`: the values of the model's parameters and compartment sizes in this
        condition, in the order of `PetabProblem.constant_ids`.
    """

    constants: Float[Array, " k"]
    rhs: Any = eqx.field(static=True)

    def __call__(self, t: Scalar, y: Float[Array, " n"], args: Any) -> Array:
        out = self.rhs(t, y, self.constants)
        zero = jnp.zeros((), y.dtype)
        return jnp.stack([zero + e for e in out])


class PetabProblem:
    """A PEtab problem read by [`sciflat.petab_problem`][]: the start, the bounds and
    the negative log-likelihood of its parameters, and their simulation.

    The fitted model is a dict `{parameterId: value}` of the estimated parameters, each
    on its PEtab `parameterScale` (`lin`, `log` or `log10`), so `p` and the bounds are
    on that scale. The objective is the negative log-likelihood of the PEtab noise model
    (normal or Laplace, on the `observableTransformation` scale), the noise parameters
    estimated with the rest; each condition is solved by Diffrax (stiff solver, adaptive
    steps, forward-mode derivatives).

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
    - `nll`: `nll(model) -> scalar`, the negative log-likelihood (jit-compiled; for
        [`sciflat.minimize`][]).
    - `residuals`: `residuals(model) -> (2 n_data,)` for [`sciflat.least_squares`][]
        (normal noise only): `(y - h) / σ` on the observables' scales, then
        `sqrt(2 log σ + C)`, so that half their sum of squares is `nll` up to a
        constant: the estimated σ enter as in Data2Dynamics' error model. `C` keeps
        the square root real for σ above the smallest positive lower bound of the
        parameter table.
    - `residual_offset`: `nll(m) == 0.5 * sum(residuals(m) ** 2) + residual_offset`.
    """

    def __init__(
        self,
        yaml_path: str | os.PathLike[str],
        *,
        rtol: float = 1e-8,
        atol: float = 1e-10,
        solver: Any = None,
        max_steps: int = 100_000,
    ):
        diffrax, sympy, yaml = _imports()
        self._diffrax, self._sympy = diffrax, sympy
        path = os.fspath(yaml_path)
        folder = os.path.dirname(os.path.abspath(path))
        with open(path) as f:
            spec = yaml.safe_load(f)
        if str(spec.get("format_version", "1")).split(".")[0] != "1":
            raise ValueError(
                f"{path}: `format_version` is {spec.get('format_version')!r}; "
                "sciflat reads PEtab format version 1."
            )
        problems = spec.get("problems") or []
        if len(problems) != 1:
            raise ValueError(
                f"{path} lists {len(problems)} problems under `problems`; sciflat reads "
                "a file with exactly one."
            )
        (files,) = problems
        sbml = files.get("sbml_files") or []
        if len(sbml) != 1:
            raise ValueError(f"{path}: `sbml_files` must list one model, got {sbml}.")
        where = lambda name: os.path.join(folder, name)
        tables = lambda key, names=None: [
            row
            for name in (names or files.get(key) or [])
            for row in _read_tsv(where(name))
        ]
        self.ode: SbmlOde = read_sbml(where(sbml[0]))
        parameter_files = spec.get("parameter_file")
        if isinstance(parameter_files, str):
            parameter_files = [parameter_files]
        self._rtol, self._atol, self._max_steps = float(rtol), float(atol), max_steps
        if solver is None:
            # Newton's method, not Diffrax's default chord method: with the fast
            # modes of these models (rates of 1e5) the chord iteration fails and the
            # step is rejected again and again (Boehm: 900 steps, 460 rejected, against
            # 106 and 6 with Newton; the same solution).
            import optimistix

            solver = diffrax.Kvaerno5(
                root_finder=optimistix.Newton(rtol=self._rtol, atol=self._atol)
            )
        self._solver = solver
        self._read_parameters(tables("", parameter_files))
        self._read_conditions(tables("condition_files"))
        self._read_observables(tables("observable_files"))
        self.measurements: list[dict[str, str]] = tables("measurement_files")
        self._read_measurements()
        self._compile_formulas()
        # jit by identity: one compilation per problem, shared by every fit.
        self.nll = _strongly_typed(jax.jit(self._nll))
        self.residuals = _strongly_typed(jax.jit(self._residuals))
        self._value_and_hessian = jax.jit(self._nll_and_hessian)

    # -- the tables ---------------------------------------------------------------

    def _read_parameters(self, rows: list[dict[str, str]]) -> None:
        if not rows:
            raise ValueError("The PEtab problem has an empty parameter table.")
        for column in ("objectivePriorType", "objectivePriorParameters"):
            used = [r["parameterId"] for r in rows if r.get(column)]
            if used:
                raise ValueError(
                    f"The parameter table gives `{column}` for {used}: priors are not "
                    "supported by sciflat's PEtab reader (the objective would differ)."
                )
        self.table_ids: tuple[str, ...] = tuple(r["parameterId"] for r in rows)
        if len(set(self.table_ids)) != len(self.table_ids):
            raise ValueError("The parameter table lists a parameterId twice.")
        self.scales: dict[str, Scale] = {}
        self._nominal_lin = np.zeros(len(rows))
        estimated, lower, upper = [], {}, {}
        for i, r in enumerate(rows):
            pid, scale = r["parameterId"], r.get("parameterScale") or "lin"
            if scale not in _SCALES:
                raise ValueError(
                    f"Parameter {pid!r}: `parameterScale` must be one of {_SCALES}, "
                    f"got {scale!r}."
                )
            nominal = _float(r.get("nominalValue", ""))
            if nominal is None:
                raise ValueError(f"Parameter {pid!r} has no numeric `nominalValue`.")
            self._nominal_lin[i] = nominal
            if r.get("estimate", "1") not in ("0", "1"):
                raise ValueError(f"Parameter {pid!r}: `estimate` must be 0 or 1.")
            if r.get("estimate", "1") == "1":
                estimated.append(pid)
                self.scales[pid] = scale  # type: ignore[assignment]
                for side, store in (("lowerBound", lower), ("upperBound", upper)):
                    value = _float(r.get(side, ""))
                    if value is None:
                        raise ValueError(f"Estimated parameter {pid!r} has no {side}.")
                    store[pid] = _to_scale(value, scale)
                if not np.isfinite(lower[pid]) or not np.isfinite(upper[pid]):
                    raise ValueError(
                        f"Parameter {pid!r}: its bounds are not finite on its "
                        f"{scale} scale ({r.get('lowerBound')}, {r.get('upperBound')})."
                    )
        self.parameter_ids: tuple[str, ...] = tuple(estimated)
        self._estimated = np.array([self.table_ids.index(k) for k in estimated], int)
        self.bounds: tuple[dict[str, float], dict[str, float]] = (lower, upper)
        scale_of = lambda k: self.scales[k]
        self.nominal: dict[str, Array] = {
            k: jnp.asarray(
                _to_scale(self._nominal_lin[self.table_ids.index(k)], scale_of(k)),
                jnp.float64,
            )
            for k in estimated
        }
        positive = [
            float(r["lowerBound"])
            for r in rows
            if r.get("estimate") == "1" and (_float(r.get("lowerBound", "")) or 0) > 0
        ]
        self._sigma_floor = min(positive) if positive else 1e-8
        # `ext`: the table parameters, then the numbers the tables hold.
        self._numbers: list[float] = []

    def _ref(self, text: str, where: str) -> int:
        """The index in `ext` of a number or a table parameter."""
        value = _float(text)
        if value is not None:
            self._numbers.append(value)
            return len(self.table_ids) + len(self._numbers) - 1
        if text in self.table_ids:
            return self.table_ids.index(text)
        raise ValueError(
            f"{where}: {text!r} is neither a number nor a parameter of the parameter "
            "table."
        )

    def _read_conditions(self, rows: list[dict[str, str]]) -> None:
        self._condition_rows = {r["conditionId"]: r for r in rows}
        targets = {
            k for r in rows for k in r if k not in ("conditionId", "conditionName")
        }
        for k in sorted(targets):
            if k not in self.ode.constants and k not in self.ode.species:
                raise ValueError(
                    f"The condition table sets {k!r}, which is not a parameter, "
                    "compartment or species (a state) of the SBML model"
                    + (
                        " (it is given by a rule)."
                        if k in self.ode.expressions
                        else "."
                    )
                )

    def _read_observables(self, rows: list[dict[str, str]]) -> None:
        self.observable_ids: tuple[str, ...] = tuple(r["observableId"] for r in rows)
        self._observables = {r["observableId"]: r for r in rows}
        for r in rows:
            oid = r["observableId"]
            if (r.get("observableTransformation") or "lin") not in _SCALES:
                raise ValueError(
                    f"Observable {oid!r}: `observableTransformation` must be one of "
                    f"{_SCALES}, got {r['observableTransformation']!r}."
                )
            if (r.get("noiseDistribution") or "normal") not in _NOISE:
                raise ValueError(
                    f"Observable {oid!r}: `noiseDistribution` must be one of {_NOISE}, "
                    f"got {r['noiseDistribution']!r}."
                )

    def _read_measurements(self) -> None:
        rows = self.measurements
        if not rows:
            raise ValueError("The PEtab problem has no measurements.")
        self.conditions: tuple[str, ...] = tuple(
            dict.fromkeys(r["simulationConditionId"] for r in rows)
        )
        for i, r in enumerate(rows):
            if r.get("preequilibrationConditionId"):
                raise ValueError(
                    f"Measurement {i} has preequilibrationConditionId "
                    f"{r['preequilibrationConditionId']!r}: pre-equilibration is not "
                    "supported by sciflat's PEtab reader."
                )
            time = _float(r.get("time", ""))
            if time is None or not np.isfinite(time) or time < 0:
                raise ValueError(
                    f"Measurement {i} has time {r.get('time')!r}: sciflat simulates "
                    "finite times >= 0 (no steady-state measurements)."
                )
            if r["observableId"] not in self._observables:
                raise ValueError(
                    f"Measurement {i}: unknown observable {r['observableId']!r}."
                )
            if r["simulationConditionId"] not in self._condition_rows:
                raise ValueError(
                    f"Measurement {i}: unknown condition {r['simulationConditionId']!r}."
                )
            if _float(r.get("measurement", "")) is None:
                raise ValueError(f"Measurement {i} has no numeric `measurement`.")
        self.n_data = len(rows)
        self._data = np.array([float(r["measurement"]) for r in rows])
        self._times = np.array([float(r["time"]) for r in rows])

    # -- the formulas -------------------------------------------------------------

    def _parse(self, text: str, where: str, extra: Sequence[str]) -> Any:
        sympy = self._sympy
        from sympy.parsing.sympy_parser import (
            convert_xor,
            parse_expr,
            standard_transformations,
        )

        names = {*self.ode.constants, *self.ode.species, *self.ode.expressions}
        names |= {*self.table_ids, *extra}
        local = {k: sympy.Symbol(k, real=True) for k in names}
        local.update(
            exp=sympy.exp,
            log=sympy.log,
            ln=sympy.log,
            sqrt=sympy.sqrt,
            abs=sympy.Abs,
            log10=lambda x: sympy.log(x, 10),
            log2=lambda x: sympy.log(x, 2),
            sin=sympy.sin,
            cos=sympy.cos,
            tan=sympy.tan,
            pow=lambda a, b: a**b,
            t=self.ode.time,
            time=self.ode.time,
        )
        try:
            expr = parse_expr(
                text,
                local_dict=local,
                transformations=(*standard_transformations, convert_xor),
            )
        except Exception as e:
            raise ValueError(f"{where}: cannot parse {text!r} ({e}).") from None
        from sympy.core.function import AppliedUndef

        if undefined := sorted(str(f.func) for f in expr.atoms(AppliedUndef)):
            raise ValueError(
                f"{where}: unsupported function(s) {undefined} in {text!r}."
            )
        unknown = sorted(
            str(s) for s in expr.free_symbols if str(s) not in names | {"t", "time"}
        )
        if unknown:
            raise ValueError(f"{where}: {text!r} names unknown {unknown}.")
        subs = {sympy.Symbol(k, real=True): v for k, v in self.ode.expressions.items()}
        return sympy.sympify(expr).xreplace(subs)

    def _compile_formulas(self) -> None:
        sympy = self._sympy
        ode, sym = self.ode, (lambda k: sympy.Symbol(k, real=True))
        self.species: tuple[str, ...] = ode.species
        self.constant_ids: tuple[str, ...] = tuple(ode.constants)
        x = [sym(s) for s in ode.species]
        k = [sym(c) for c in self.constant_ids]
        q_only = [pid for pid in self.table_ids if pid not in ode.constants]
        q = [sym(pid) for pid in q_only]
        self._q_only = np.array([self.table_ids.index(p) for p in q_only], int)
        t = ode.time
        lam = ft.partial(sympy.lambdify, modules="jax", cse=True)
        self._rhs = lam([t, x, k], list(ode.rhs))
        self._x0 = lam([k], list(ode.x0))

        # Per condition: every constant and the overridden initial values, as `ext`
        # indices.
        self._constant_index, self._x0_override = [], []
        for cid in self.conditions:
            row = self._condition_rows[cid]
            index = []
            for c in self.constant_ids:
                text = row.get(c, "")
                if text and text.lower() != "nan":
                    index.append(self._ref(text, f"Condition {cid!r}, column {c!r}"))
                elif c in self.table_ids:
                    index.append(self.table_ids.index(c))
                else:
                    index.append(self._ref(repr(ode.constants[c]), "the SBML model"))
            self._constant_index.append(np.array(index, int))
            override = {}
            for i, s in enumerate(ode.species):
                text = row.get(s, "")
                if text and text.lower() != "nan":
                    override[i] = self._ref(text, f"Condition {cid!r}, column {s!r}")
            self._x0_override.append(override)

        # Per observable: h(t, x, k, q, observableParameters) and σ(..., noise...).
        self._h, self._sigma, self._n_placeholders = [], [], []
        for oid in self.observable_ids:
            row = self._observables[oid]
            fns, counts = [], []
            for column, kind in (
                ("observableFormula", "observable"),
                ("noiseFormula", "noise"),
            ):
                text = row.get(column, "")
                if not text:
                    raise ValueError(f"Observable {oid!r} has no `{column}`.")
                pattern = regex.compile(
                    rf"\b{kind}Parameter(\d+)_{regex.escape(oid)}\b"
                )
                n = max((int(m) for m in pattern.findall(text)), default=0)
                names = [f"{kind}Parameter{i + 1}_{oid}" for i in range(n)]
                expr = self._parse(text, f"Observable {oid!r}, {column}", names)
                fns.append(lam([t, x, k, q, [sym(nm) for nm in names]], expr))
                counts.append(n)
            self._h.append(fns[0])
            self._sigma.append(fns[1])
            self._n_placeholders.append(tuple(counts))

        # Every condition is solved at the union of the measurement times, so that
        # all conditions are one (vmapped) solve: compiled once, however many.
        union = np.array(sorted({float(r["time"]) for r in self.measurements}))
        self._condition_times = [union] * len(self.conditions)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(self.measurements):
            key = (
                self.conditions.index(r["simulationConditionId"]),
                self.observable_ids.index(r["observableId"]),
            )
            groups.setdefault(key, []).append(i)
        self._groups = []
        for (c, o), rows in groups.items():
            oid = self.observable_ids[o]
            refs = []
            for column, n in zip(
                ("observableParameters", "noiseParameters"),
                self._n_placeholders[o],
                strict=True,
            ):
                block = []
                for i in rows:
                    text = self.measurements[i].get(column, "")
                    parts = [s.strip() for s in text.split(";")] if text else []
                    if len(parts) != n:
                        raise ValueError(
                            f"Measurement {i} ({oid!r}) gives {len(parts)} "
                            f"{column} ({text!r}); its formula has {n} placeholders."
                        )
                    block.append(
                        [self._ref(s, f"Measurement {i}, {column}") for s in parts]
                    )
                refs.append(np.array(block, int).reshape(len(rows), n))
            rows_a = np.array(rows, int)
            self._groups.append(
                _Group(
                    condition=c,
                    observable=o,
                    rows=rows_a,
                    time_index=np.searchsorted(
                        self._condition_times[c], self._times[rows_a]
                    ),
                    times=self._times[rows_a],
                    data=self._data[rows_a],
                    observable_parameters=refs[0],
                    noise_parameters=refs[1],
                )
            )
        self._order = np.argsort(np.concatenate([g.rows for g in self._groups]))
        self._number_array = np.array(self._numbers, np.float64)
        lowest = float(np.min(self._data)) if len(self._data) else 1.0
        for g in self._groups:
            row = self._observables[self.observable_ids[g.observable]]
            if (row.get("observableTransformation") or "lin") != "lin" and (
                g.data <= 0
            ).any():
                raise ValueError(
                    f"Observable {self.observable_ids[g.observable]!r} is log-transformed "
                    f"but has measurements <= 0 (lowest {lowest})."
                )
        # The constant that keeps 2 log σ + C positive for σ above the floor.
        self._log_sigma_shift = 1.0 - 2.0 * math.log(self._sigma_floor)

    # -- the objective ------------------------------------------------------------

    def _check_model(self, model: Any) -> None:
        if not isinstance(model, dict) or set(model) != set(self.parameter_ids):
            got = sorted(model) if isinstance(model, dict) else type(model).__name__
            raise ValueError(
                "The model of a PEtab problem is a dict of its estimated parameters "
                f"{list(self.parameter_ids)}; got {got}. Start from `problem.nominal`."
            )

    def _ext(self, model: dict[str, Any]) -> Array:
        """Every table parameter on the linear scale, then the tables' numbers."""
        self._check_model(model)
        values = [
            _unscale(jnp.asarray(model[k]), self.scales[k]) for k in self.parameter_ids
        ]
        dtype = jnp.result_type(*values)
        q = (
            jnp.asarray(self._nominal_lin, dtype)
            .at[self._estimated]
            .set(jnp.stack(values))
        )
        return jnp.concatenate([q, jnp.asarray(self._number_array, dtype)])

    def unscale(self, model: dict[str, Any]) -> dict[str, Array]:
        """The estimated parameters on the linear scale.

        **Arguments:**

        - `model`: `{parameterId: value on its scale}` (e.g. `result.model`).

        **Returns:**

        `{parameterId: value}`, linear.
        """
        self._check_model(model)
        return {
            k: _unscale(jnp.asarray(model[k]), self.scales[k])
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
        c = self._condition(condition)
        ext = self._ext(model)
        return ReactionODE(ext[self._constant_index[c]], self._rhs)

    def _condition(self, condition: str | None) -> int:
        if condition is None:
            return 0
        if condition not in self.conditions:
            raise ValueError(
                f"`condition` must be one of {list(self.conditions)}, got {condition!r}."
            )
        return self.conditions.index(condition)

    def _initial(self, ext: Array, c: int) -> tuple[Array, Array]:
        constants = ext[self._constant_index[c]]
        x0 = jnp.stack([jnp.zeros((), ext.dtype) + e for e in self._x0(constants)])
        for i, j in self._x0_override[c].items():
            x0 = x0.at[i].set(ext[j])
        return constants, x0

    def _solve(
        self, ext: Array, c: int, ts: npt.NDArray[np.float64]
    ) -> tuple[Array, Array]:
        constants, x0 = self._initial(ext, c)
        return self._integrate(constants, x0, ts)

    def _solve_all(self, ext: Array) -> tuple[Array, Array]:
        """Every condition at the union of the measurement times: `(C, T, n)`."""
        ts = self._condition_times[0]
        if len(self.conditions) == 1:
            ys, ok = self._solve(ext, 0, ts)
            return ys[None], ok
        pairs = [self._initial(ext, c) for c in range(len(self.conditions))]
        constants = jnp.stack([k for k, _ in pairs])
        x0 = jnp.stack([x for _, x in pairs])
        ys, ok = jax.vmap(lambda k, x: self._integrate(k, x, ts))(constants, x0)
        return ys, jnp.all(ok)

    def _integrate(
        self, constants: Array, x0: Array, ts: npt.NDArray[np.float64]
    ) -> tuple[Array, Array]:
        diffrax = self._diffrax
        ts_j = jnp.asarray(ts, x0.dtype)
        if float(ts[-1]) == 0.0:
            return jnp.broadcast_to(x0, (len(ts), len(x0))), jnp.asarray(True)
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(ReactionODE(constants, self._rhs)),
            self._solver,
            t0=jnp.zeros((), x0.dtype),
            t1=ts_j[-1],
            dt0=None,
            y0=x0,
            saveat=diffrax.SaveAt(ts=ts_j),
            # Steps end at the measurement times: there the solution is the step's
            # own (5th order), not the solver's interpolation (3rd order Hermite for
            # Kvaerno5, 1e-7 off for Boehm at rtol 1e-8 against 6e-9 like this).
            stepsize_controller=diffrax.ClipStepSizeController(
                diffrax.PIDController(rtol=self._rtol, atol=self._atol),
                step_ts=jnp.asarray(ts[ts > 0], x0.dtype),
            ),
            adjoint=diffrax.ForwardMode(),
            max_steps=self._max_steps,
            throw=False,
        )
        ys = sol.ys
        assert ys is not None
        return ys, sol.result == diffrax.RESULTS.successful

    def _terms(self, model: dict[str, Any]) -> dict[str, Array]:
        """Per measurement (table order): the simulation, σ, the transformed
        residual, and the noise model's constants; and whether every solve succeeded."""
        ext = self._ext(model)
        all_ys, ok = self._solve_all(ext)
        parts: dict[str, list[Array]] = {"h": [], "sigma": []}
        for g in self._groups:
            ys = all_ys[g.condition]
            constants = ext[self._constant_index[g.condition]]
            q = ext[self._q_only]
            xs = ys[g.time_index]
            ts = jnp.asarray(g.times, ext.dtype)
            ops = ext[g.observable_parameters]
            nps = ext[g.noise_parameters]
            h = _rows(self._h[g.observable], ts, xs, constants, q, ops)
            s = _rows(self._sigma[g.observable], ts, xs, constants, q, nps)
            parts["h"].append(h)
            parts["sigma"].append(s)
        out = {k: jnp.concatenate(v)[self._order] for k, v in parts.items() if v}
        out["ok"] = ok
        return out

    def _transformed(self, h: Array) -> tuple[Array, Array, npt.NDArray[np.float64]]:
        """The simulation and the data on each observable's transformation scale, and
        the per-measurement constant of the density (the Jacobian of the transform)."""
        y = self._data
        kinds = self._transforms()
        ht = jnp.where(
            kinds == 1,
            jnp.log(jnp.where(kinds == 1, h, 1.0)),
            jnp.where(kinds == 2, jnp.log10(jnp.where(kinds == 2, h, 1.0)), h),
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            yt = np.where(kinds == 1, np.log(y), np.where(kinds == 2, np.log10(y), y))
            jac = np.where(
                kinds == 1, np.log(y), np.where(kinds == 2, np.log(y * np.log(10)), 0.0)
            )
        return ht, jnp.asarray(yt), jac

    @ft.cache  # noqa: B019 (one problem, a handful of calls)
    def _transforms(self) -> npt.NDArray[np.int64]:
        kinds = {"lin": 0, "log": 1, "log10": 2}
        return np.array(
            [
                kinds[
                    self._observables[r["observableId"]].get("observableTransformation")
                    or "lin"
                ]
                for r in self.measurements
            ]
        )

    @ft.cache  # noqa: B019
    def _laplace(self) -> npt.NDArray[np.bool_]:
        return np.array(
            [
                (
                    self._observables[r["observableId"]].get("noiseDistribution")
                    or "normal"
                )
                == "laplace"
                for r in self.measurements
            ]
        )

    def _nll(self, model: dict[str, Any]) -> Scalar:
        terms = self._terms(model)
        ht, yt, jac = self._transformed(terms["h"])
        sigma = terms["sigma"]
        r = (yt - ht) / sigma
        normal = 0.5 * jnp.log(2 * jnp.pi * sigma**2) + 0.5 * r**2
        laplace = jnp.log(2 * sigma) + jnp.abs(r)
        each = jnp.where(self._laplace(), laplace, normal) + jac
        return jnp.where(terms["ok"], jnp.sum(each), jnp.inf)

    def _residuals(self, model: dict[str, Any]) -> Array:
        if self._laplace().any():
            raise ValueError(
                "`residuals` exist for normal noise only; this problem has Laplace "
                "noise: fit `problem.nll` with `sciflat.minimize`."
            )
        terms = self._terms(model)
        ht, yt, _ = self._transformed(terms["h"])
        sigma = terms["sigma"]
        fit = (yt - ht) / sigma
        noise = jnp.sqrt(2 * jnp.log(sigma) + self._log_sigma_shift)
        out = jnp.concatenate([fit, noise])
        return jnp.where(terms["ok"], out, jnp.nan)

    @property
    def residual_offset(self) -> float:
        _, _, jac = self._transformed(jnp.ones(self.n_data))
        m = self.n_data
        return float(
            0.5 * m * math.log(2 * math.pi)
            + np.sum(jac)
            - 0.5 * m * self._log_sigma_shift
        )

    def llh(self, model: dict[str, Any]) -> Scalar:
        """The log-likelihood, `-nll(model)` (what the benchmark collection reports)."""
        return -self.nll(model)

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
        c = self._condition(condition)
        if times is None:
            mine = [
                t
                for t, r in zip(self._times, self.measurements, strict=True)
                if r["simulationConditionId"] == self.conditions[c]
            ]
            times = np.linspace(0.0, max(mine), 200)
        ts = np.asarray(times, np.float64)
        if ts.ndim != 1 or not len(ts) or (np.diff(ts) < 0).any() or ts[0] < 0:
            raise ValueError("`times` must be a non-empty increasing 1-d array >= 0.")
        self._check_model(model)
        out, ok = self._simulate(model, c, tuple(float(t) for t in ts))
        if not bool(ok):
            raise ValueError(
                "The ODE solve failed at these parameters (stiff, or max_steps)."
            )
        return out

    @ft.partial(jax.jit, static_argnums=(0, 2, 3))
    def _simulate(
        self, model: dict[str, Any], c: int, times: tuple[float, ...]
    ) -> tuple[dict[str, Array], Array]:
        ts = np.asarray(times, np.float64)
        ext = self._ext(model)
        ys, ok = self._solve(ext, c, ts)
        constants, q = ext[self._constant_index[c]], ext[self._q_only]
        out: dict[str, Array] = {"time": jnp.asarray(ts), "state": ys}
        for g in self._groups:
            if g.condition != c:
                continue
            o = g.observable
            ops = ext[g.observable_parameters[:1]]
            ops = jnp.broadcast_to(ops, (len(ts), ops.shape[1]))
            out[self.observable_ids[o]] = _rows(
                self._h[o], jnp.asarray(ts), ys, constants, q, ops
            )
        return out, ok

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

    def _nll_and_hessian(self, x: Array, re: Any) -> tuple[Array, Array]:
        """The value and the Hessian in one compiled program; `re` is an argument (a
        pytree), so every fit of the problem, which has an equal one, shares it."""
        f = lambda x: self._nll(re(x))
        return f(x), jax.jacfwd(jax.jacfwd(f))(x)

    def uncertainty(self, result: Any) -> Any:
        """`result` (of a fit of this problem) with its covariance from the Hessian of
        the negative log-likelihood, cov = H⁻¹ on the parameters' scales; the Hessian
        by forward over forward mode (the solves' derivatives are forward-mode).

        **Arguments:**

        - `result`: a [`sciflat.FitResult`][] of `least_squares(problem.residuals,
            ...)` or `minimize(problem.nll, ...)`.

        **Returns:**

        A copy with `uncertainty` set: `stderr`, `correlation`, `print(result)`.
        """
        from .._fitting.uncertainty import from_hessian

        re = result.re
        if re is None:
            raise ValueError("`result` has no `re`: pass what a sciflat fit returned.")
        x = jnp.asarray(result.p, jnp.float64)
        value, hess = self._value_and_hessian(x, re)
        unc = from_hessian(np.asarray(hess), float(value), re, "nll", None)
        return dataclasses.replace(result, uncertainty=unc)


def _rows(fn: Any, ts: Array, xs: Array, constants: Array, q: Array, params: Array):
    """A lambdified formula `fn(t, x, constants, q, params)` at every row."""
    zero = jnp.zeros((), xs.dtype)
    one = lambda t, x, par: zero + fn(t, x, constants, q, par)
    return jax.vmap(one)(ts, xs, params)


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
    assignment rules; function definitions expanded), compiled to JAX and solved by
    Diffrax in every simulation condition. Events, delays, algebraic and rate rules,
    piecewise functions, priors, pre-equilibration and steady-state measurements are
    refused with a `ValueError` naming them, never silently dropped. Needs the
    `petab` extra: `pip install "sciflat[petab]"`.

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
    - `rtol`, `atol`: the tolerances of the step-size controller
        (`diffrax.PIDController`).
    - `solver`: a Diffrax solver (default `diffrax.Kvaerno5` with
        `optimistix.Newton` as its root finder: stiff, 5th order).
    - `max_steps`: of each solve; a solve that fails makes `nll` infinite and the
        `residuals` NaN (a fit then stops, rather than using a wrong value).

    **Returns:**

    A [`sciflat.PetabProblem`][]: `nominal`, `bounds`, `nll`, `llh`, `residuals`,
    `simulate`, `sample_starts`, `uncertainty`.
    """
    return PetabProblem(
        yaml_path, rtol=rtol, atol=atol, solver=solver, max_steps=max_steps
    )


def _strongly_typed(fn):
    """`fn(model)`, each weakly typed value of `model` (a Python float,
    `jnp.asarray(0.7)`) first made a strongly typed array of the dtype the values
    compute in anyway (their `jnp.result_type`, as `_ext` takes it). `jax.jit` keys on
    weak types: `nll(problem.nominal)` and `nll({"k": jnp.asarray(-0.7), ...})` would
    compile twice (seconds each) for the same arithmetic."""

    @ft.wraps(fn)
    def call(model):
        return fn(_strong_values(model))

    return call


def _strong_values(model):
    if not isinstance(model, dict):
        return model  # `_check_model` says what was expected
    weak = [k for k, v in model.items() if _weak(v)]
    if not weak:
        return model
    try:
        dtype = jnp.result_type(*model.values())
    except TypeError:  # a value that is not a number: `_check_model` names it
        return model
    if not jnp.issubdtype(dtype, jnp.inexact):
        return model
    return {**model, **{k: jnp.asarray(model[k], dtype) for k in weak}}


def _weak(x) -> bool:
    try:
        return jax.typeof(x).weak_type
    except TypeError:
        return False
