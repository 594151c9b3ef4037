"""The PEtab tables (format version 1), read and checked, as one frozen record of index
arrays.

The `petab` library reads the files (and lints the whole problem at the end); these
checks come first, so that what sciflat cannot simulate is named as such.
Everything the tables name becomes an index into one vector
`ext = [every table parameter (linear scale), the numbers the tables hold]`, so a
condition's parameters, an observable's placeholders and a noise parameter are all
gathers from it. Nothing here knows SymPy or JAX: the formulas are compiled elsewhere
(`formulas.py`), the objective gathers from these arrays (`objective.py`).
"""

import contextlib
import dataclasses
import logging
import math
import os
import re as regex
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .sbml import SbmlOde


_SCALES = ("lin", "log", "log10")
_NOISE = ("normal", "laplace")
Scale = Literal["lin", "log", "log10"]
Row = dict[str, str]


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


#
# The files a problem's YAML names
#


@dataclasses.dataclass(frozen=True)
class Files:
    """The rows of every table of one problem (each cell as text, "" where empty),
    where its SBML model is, and the `petab` library's reading of it (to lint)."""

    sbml: str
    parameters: list[Row]
    conditions: list[Row]
    observables: list[Row]
    measurements: list[Row]
    petab_problem: Any


def _text(value: Any, isna: Any) -> str:
    """A cell of a table `petab` read (pandas), as the text our checks read."""
    if isinstance(value, bool | np.bool_):
        return "1" if value else "0"
    if isna(value):
        return ""
    if isinstance(value, float | np.floating):
        return repr(float(value))
    return str(value).strip()


def _rows(frame: Any) -> list[Row]:
    if frame is None:
        return []
    import pandas

    if frame.index.name is not None:
        frame = frame.reset_index()
    return [
        {str(k).strip(): _text(v, pandas.isna) for k, v in record.items()}
        for record in frame.to_dict("records")
    ]


@contextlib.contextmanager
def _quiet_petab():
    """`petab` 0.8 with pandas 3 warns of pandas' deprecations at every read, and
    logs its linter's findings: neither is the user's to act on (the findings are
    raised as a `ValueError`, by `lint`)."""
    logger = logging.getLogger("petab")
    propagate = logger.propagate
    logger.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.propagate = propagate


def read_files(yaml_path: str | os.PathLike[str], yaml: Any, petab: Any) -> Files:
    """The problem's YAML file and tables, read by the `petab` library."""
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
    try:
        with _quiet_petab():
            problem = petab.v1.Problem.from_yaml(path)
    except Exception as e:
        raise ValueError(
            f"{path}: the `petab` library cannot read this problem: {e}"
        ) from None
    return Files(
        sbml=os.path.join(folder, sbml[0]),
        parameters=_rows(problem.parameter_df),
        conditions=_rows(problem.condition_df),
        observables=_rows(problem.observable_df),
        measurements=_rows(problem.measurement_df),
        petab_problem=problem,
    )


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def lint(files: Files, petab: Any, path: str | os.PathLike[str]) -> None:
    """The `petab` library's linter over the whole problem; its findings (errors, not
    warnings) as one `ValueError`."""
    keep = _Keep()
    logger = logging.getLogger("petab")
    logger.addHandler(keep)
    try:
        with _quiet_petab():
            failed = petab.v1.lint.lint_problem(files.petab_problem)
    finally:
        logger.removeHandler(keep)
    if failed:
        found = [m for m in keep.messages if m.strip() != "Not OK"] or ["(no message)"]
        lines = "\n".join(f"- {m.strip()}" for m in found)
        raise ValueError(
            f"{os.fspath(path)} is not a valid PEtab problem; the PEtab linter "
            f"(the `petab` library) says:\n{lines}"
        )


_REQUIRED = {
    "parameter": (
        "parameterId",
        "parameterScale",
        "lowerBound",
        "upperBound",
        "nominalValue",
        "estimate",
    ),
    "condition": ("conditionId",),
    "observable": ("observableId", "observableFormula", "noiseFormula"),
    "measurement": ("observableId", "simulationConditionId", "measurement", "time"),
}


def _require(rows: list[Row], table: str) -> None:
    if rows and (missing := [c for c in _REQUIRED[table] if c not in rows[0]]):
        raise ValueError(
            f"The {table} table has no column {missing}: PEtab requires "
            f"{list(_REQUIRED[table])}."
        )


#
# The parameter table
#


# PEtab v1's objective priors. The first five are densities of the linear value, the
# `parameterScale` ones of the value on the parameter's scale; each is untruncated (the
# bounds do not renormalise it), as PEtab v1 and pyPESTO define them.
PRIORS = (
    "uniform",
    "normal",
    "laplace",
    "logNormal",
    "logLaplace",
    "parameterScaleUniform",
    "parameterScaleNormal",
    "parameterScaleLaplace",
)


@dataclasses.dataclass(frozen=True)
class Priors:
    """The objective priors of the estimated parameters: for each prior, the position
    of its parameter among the estimated ones, its type (an index into `PRIORS`) and
    its two parameters."""

    index: npt.NDArray[np.int64]
    kind: npt.NDArray[np.int64]
    a: npt.NDArray[np.float64]
    b: npt.NDArray[np.float64]


def _prior(r: Row, pid: str, scale: str) -> tuple[int, float, float] | None:
    kind = r.get("objectivePriorType", "")
    text = r.get("objectivePriorParameters", "")
    if not kind:
        if text:
            raise ValueError(
                f"Parameter {pid!r} gives `objectivePriorParameters` ({text!r}) but no "
                "`objectivePriorType`."
            )
        return None
    if kind not in PRIORS:
        raise ValueError(
            f"Parameter {pid!r}: `objectivePriorType` must be one of {list(PRIORS)}, "
            f"got {kind!r}."
        )
    if not text and kind == "parameterScaleUniform":  # PEtab: the bounds
        text = ";".join(
            repr(_to_scale(float(r[s]), scale)) for s in ("lowerBound", "upperBound")
        )
    values = [_float(s.strip()) for s in text.split(";")] if text else []
    if len(values) != 2 or None in values:
        raise ValueError(
            f"Parameter {pid!r}: a {kind} prior takes two numbers in "
            f"`objectivePriorParameters` (`a;b`), got {text!r}."
        )
    a, b = values
    assert a is not None and b is not None
    if b <= a if kind.endswith(("uniform", "Uniform")) else b <= 0:
        raise ValueError(
            f"Parameter {pid!r}: the {kind} prior's parameters {text!r} are not a "
            "valid distribution (a uniform prior needs a < b, the others a positive "
            "scale)."
        )
    return PRIORS.index(kind), a, b


def _priors(rows: list[Row], estimated: list[str], scales: Mapping[str, str]) -> Priors:
    index, kind, a, b = [], [], [], []
    for r in rows:
        pid = r["parameterId"]
        if pid in estimated and (got := _prior(r, pid, scales[pid])) is not None:
            index.append(estimated.index(pid))
            kind.append(got[0])
            a.append(got[1])
            b.append(got[2])
    return Priors(
        index=np.array(index, int),
        kind=np.array(kind, int),
        a=np.array(a, np.float64),
        b=np.array(b, np.float64),
    )


@dataclasses.dataclass(frozen=True)
class Parameters:
    """The parameter table: every parameter's nominal value (linear), the estimated
    ones' scales and bounds (on their scales)."""

    table_ids: tuple[str, ...]
    ids: tuple[str, ...]  # the estimated ones, in the table's order
    scales: dict[str, Scale]
    nominal_lin: npt.NDArray[np.float64]  # every table parameter
    estimated: npt.NDArray[np.int64]  # positions of `ids` in `table_ids`
    lower: dict[str, float]
    upper: dict[str, float]
    sigma_floor: float  # the smallest positive lower bound of an estimated one
    priors: Priors


def _bounds(r: Row, pid: str, scale: str) -> tuple[float, float]:
    out = []
    for side in ("lowerBound", "upperBound"):
        value = _float(r.get(side, ""))
        if value is None:
            raise ValueError(f"Estimated parameter {pid!r} has no {side}.")
        out.append(_to_scale(value, scale))
    if not np.isfinite(out[0]) or not np.isfinite(out[1]):
        raise ValueError(
            f"Parameter {pid!r}: its bounds are not finite on its "
            f"{scale} scale ({r.get('lowerBound')}, {r.get('upperBound')})."
        )
    return out[0], out[1]


def read_parameters(rows: list[Row]) -> Parameters:
    if not rows:
        raise ValueError("The PEtab problem has an empty parameter table.")
    table_ids = tuple(r["parameterId"] for r in rows)
    if len(set(table_ids)) != len(table_ids):
        raise ValueError("The parameter table lists a parameterId twice.")
    scales: dict[str, Scale] = {}
    nominal_lin = np.zeros(len(rows))
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
        nominal_lin[i] = nominal
        if r.get("estimate", "1") not in ("0", "1"):
            raise ValueError(f"Parameter {pid!r}: `estimate` must be 0 or 1.")
        if r.get("estimate", "1") == "1":
            estimated.append(pid)
            scales[pid] = scale  # type: ignore[assignment]
            lower[pid], upper[pid] = _bounds(r, pid, scale)
    positive = [
        float(r["lowerBound"])
        for r in rows
        if r.get("estimate") == "1" and (_float(r.get("lowerBound", "")) or 0) > 0
    ]
    return Parameters(
        table_ids=table_ids,
        ids=tuple(estimated),
        scales=scales,
        nominal_lin=nominal_lin,
        estimated=np.array([table_ids.index(k) for k in estimated], int),
        lower=lower,
        upper=upper,
        sigma_floor=min(positive) if positive else 1e-8,
        priors=_priors(rows, estimated, scales),
    )


#
# The condition, observable and measurement tables
#


def check_conditions(rows: list[Row], ode: SbmlOde) -> dict[str, Row]:
    targets = {k for r in rows for k in r if k not in ("conditionId", "conditionName")}
    for k in sorted(targets):
        if k not in ode.constants and k not in ode.species:
            raise ValueError(
                f"The condition table sets {k!r}, which is not a parameter, "
                "compartment or species (a state) of the SBML model"
                + (" (it is given by a rule)." if k in ode.expressions else ".")
            )
    return {r["conditionId"]: r for r in rows}


def check_observables(rows: list[Row]) -> dict[str, Row]:
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
    return {r["observableId"]: r for r in rows}


def _check_measurement(
    i: int, r: Row, observables: dict[str, Row], conditions: dict[str, Row]
) -> None:
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
    if r["observableId"] not in observables:
        raise ValueError(f"Measurement {i}: unknown observable {r['observableId']!r}.")
    if r["simulationConditionId"] not in conditions:
        raise ValueError(
            f"Measurement {i}: unknown condition {r['simulationConditionId']!r}."
        )
    if _float(r.get("measurement", "")) is None:
        raise ValueError(f"Measurement {i} has no numeric `measurement`.")


def check_measurements(
    rows: list[Row], observables: dict[str, Row], conditions: dict[str, Row]
) -> None:
    if not rows:
        raise ValueError("The PEtab problem has no measurements.")
    for i, r in enumerate(rows):
        _check_measurement(i, r, observables, conditions)


#
# The record of index arrays
#


@dataclasses.dataclass(frozen=True)
class Group:
    """The measurements of one observable in one condition, as index arrays."""

    condition: int
    observable: int
    rows: npt.NDArray[np.int64]  # positions in the measurement table
    time_index: npt.NDArray[np.int64]  # into the sorted unique measurement times
    times: npt.NDArray[np.float64]
    data: npt.NDArray[np.float64]
    observable_parameters: npt.NDArray[np.int64]  # (m, k) indices into `ext`
    noise_parameters: npt.NDArray[np.int64]


@dataclasses.dataclass(frozen=True)
class Tables:
    """A problem's tables as index arrays into `ext` (see the module's docstring)."""

    parameters: Parameters
    conditions: tuple[str, ...]  # simulation condition ids, in the order of first use
    observable_ids: tuple[str, ...]
    observables: dict[str, Row]
    measurements: list[Row]
    data: npt.NDArray[np.float64]
    times: npt.NDArray[np.float64]
    numbers: npt.NDArray[np.float64]  # the tail of `ext`
    q_only: npt.NDArray[np.int64]  # table parameters that are no SBML constant
    constant_index: tuple[npt.NDArray[np.int64], ...]  # per condition, into `ext`
    x0_override: tuple[dict[int, int], ...]  # per condition: state -> `ext`
    # Per observable: its observable and noise placeholders; the noise formula takes
    # both, in that order.
    placeholders: dict[str, tuple[list[str], list[str]]]
    union_times: npt.NDArray[np.float64]  # every condition is solved at these
    groups: tuple[Group, ...]
    order: npt.NDArray[np.int64]  # the groups' rows, back to the table's order
    transforms: npt.NDArray[np.int64]  # per measurement: 0 lin, 1 log, 2 log10
    laplace: npt.NDArray[np.bool_]  # per measurement
    log_sigma_shift: float  # keeps 2 log σ + C positive for σ above the floor

    @property
    def n_data(self) -> int:
        return len(self.measurements)


class _Refs:
    """`ext`'s tail, collected: the numbers the tables hold."""

    def __init__(self, table_ids: tuple[str, ...]):
        self.table_ids = table_ids
        self.numbers: list[float] = []
        self._at: dict[bytes, int] = {}  # a number's bits -> its index in `ext`

    def __call__(self, text: str, where: str) -> int:
        """The index in `ext` of a number or a table parameter. A number the tables
        hold more than once has one place (the same bits: `-0.0` is not `0.0`), so
        that two conditions that set the same numbers read the same entries of
        `ext` (and are one simulation: `objective.simulations`)."""
        value = _float(text)
        if value is not None:
            bits = np.float64(value).tobytes()
            if bits not in self._at:
                self.numbers.append(value)
                self._at[bits] = len(self.table_ids) + len(self.numbers) - 1
            return self._at[bits]
        if text in self.table_ids:
            return self.table_ids.index(text)
        raise ValueError(
            f"{where}: {text!r} is neither a number nor a parameter of the parameter "
            "table."
        )


def _set(text: str) -> bool:
    return bool(text) and text.lower() != "nan"


def _condition_index(
    cid: str, row: Row, ode: SbmlOde, refs: _Refs
) -> tuple[npt.NDArray[np.int64], dict[int, int]]:
    """Every constant and the overridden initial values of one condition, as `ext`
    indices."""
    index = []
    for c in ode.constants:
        text = row.get(c, "")
        if _set(text):
            index.append(refs(text, f"Condition {cid!r}, column {c!r}"))
        elif c in refs.table_ids:
            index.append(refs.table_ids.index(c))
        else:
            index.append(refs(repr(ode.constants[c]), "the SBML model"))
    override = {}
    for i, s in enumerate(ode.species):
        text = row.get(s, "")
        if _set(text):
            override[i] = refs(text, f"Condition {cid!r}, column {s!r}")
    return np.array(index, int), override


def _placeholders(oid: str, row: Row) -> tuple[list[str], list[str]]:
    """The `observableParameter{n}_` and `noiseParameter{n}_` names of an observable.
    The noise formula may name the observable parameters too (PEtab v1): their count
    is the highest either formula names."""
    for column in ("observableFormula", "noiseFormula"):
        if not row.get(column, ""):
            raise ValueError(f"Observable {oid!r} has no `{column}`.")
    both = row["observableFormula"] + " " + row["noiseFormula"]
    out = []
    for kind, text in (("observable", both), ("noise", row["noiseFormula"])):
        pattern = regex.compile(rf"\b{kind}Parameter(\d+)_{regex.escape(oid)}\b")
        n = max((int(m) for m in pattern.findall(text)), default=0)
        out.append([f"{kind}Parameter{i + 1}_{oid}" for i in range(n)])
    return out[0], out[1]


def _group(
    c: int,
    o: int,
    rows: list[int],
    oid: str,
    counts: tuple[int, int],
    measurements: list[Row],
    union: npt.NDArray[np.float64],
    times: npt.NDArray[np.float64],
    data: npt.NDArray[np.float64],
    refs: _Refs,
) -> Group:
    blocks = []
    for column, n in zip(
        ("observableParameters", "noiseParameters"), counts, strict=True
    ):
        block = []
        for i in rows:
            text = measurements[i].get(column, "")
            parts = [s.strip() for s in text.split(";")] if text else []
            if len(parts) != n:
                raise ValueError(
                    f"Measurement {i} ({oid!r}) gives {len(parts)} "
                    f"{column} ({text!r}); its formula has {n} placeholders."
                )
            block.append([refs(s, f"Measurement {i}, {column}") for s in parts])
        blocks.append(np.array(block, int).reshape(len(rows), n))
    rows_a = np.array(rows, int)
    return Group(
        condition=c,
        observable=o,
        rows=rows_a,
        time_index=np.searchsorted(union, times[rows_a]),
        times=times[rows_a],
        data=data[rows_a],
        observable_parameters=blocks[0],
        noise_parameters=blocks[1],
    )


def _check_positive(groups, observables, observable_ids, data) -> None:
    lowest = float(np.min(data)) if len(data) else 1.0
    for g in groups:
        row = observables[observable_ids[g.observable]]
        if (row.get("observableTransformation") or "lin") != "lin" and (
            g.data <= 0
        ).any():
            raise ValueError(
                f"Observable {observable_ids[g.observable]!r} is log-transformed "
                f"but has measurements <= 0 (lowest {lowest})."
            )


def read_tables(files: Files, ode: SbmlOde) -> Tables:
    """Checks the tables against each other and the model; indexes them."""
    for table in _REQUIRED:
        _require(getattr(files, f"{table}s"), table)
    parameters = read_parameters(files.parameters)
    condition_rows = check_conditions(files.conditions, ode)
    observables = check_observables(files.observables)
    observable_ids = tuple(r["observableId"] for r in files.observables)
    measurements = files.measurements
    check_measurements(measurements, observables, condition_rows)
    conditions = tuple(dict.fromkeys(r["simulationConditionId"] for r in measurements))
    data = np.array([float(r["measurement"]) for r in measurements])
    times = np.array([float(r["time"]) for r in measurements])
    table_ids = parameters.table_ids
    refs = _Refs(table_ids)
    per_condition = [
        _condition_index(cid, condition_rows[cid], ode, refs) for cid in conditions
    ]
    placeholders = {oid: _placeholders(oid, observables[oid]) for oid in observable_ids}
    # Every condition is solved at the union of the measurement times, so that all
    # conditions are one (vmapped) solve: compiled once, however many.
    union = np.array(sorted({float(r["time"]) for r in measurements}))
    by_key: dict[tuple[int, int], list[int]] = {}
    for i, r in enumerate(measurements):
        key = (
            conditions.index(r["simulationConditionId"]),
            observable_ids.index(r["observableId"]),
        )
        by_key.setdefault(key, []).append(i)
    groups = []
    for (c, o), rows in by_key.items():
        oid = observable_ids[o]
        counts = (len(placeholders[oid][0]), len(placeholders[oid][1]))
        groups.append(
            _group(c, o, rows, oid, counts, measurements, union, times, data, refs)
        )
    _check_positive(groups, observables, observable_ids, data)
    kinds = {"lin": 0, "log": 1, "log10": 2}
    of = lambda r, column: observables[r["observableId"]].get(column)
    return Tables(
        parameters=parameters,
        conditions=conditions,
        observable_ids=observable_ids,
        observables=observables,
        measurements=measurements,
        data=data,
        times=times,
        numbers=np.array(refs.numbers, np.float64),
        q_only=np.array(
            [table_ids.index(p) for p in table_ids if p not in ode.constants], int
        ),
        constant_index=tuple(index for index, _ in per_condition),
        x0_override=tuple(override for _, override in per_condition),
        placeholders=placeholders,
        union_times=union,
        groups=tuple(groups),
        order=np.argsort(np.concatenate([g.rows for g in groups])),
        transforms=np.array(
            [kinds[of(r, "observableTransformation") or "lin"] for r in measurements]
        ),
        laplace=np.array(
            [
                (of(r, "noiseDistribution") or "normal") == "laplace"
                for r in measurements
            ]
        ),
        log_sigma_shift=1.0 - 2.0 * math.log(parameters.sigma_floor),
    )
