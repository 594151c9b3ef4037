"""Reads any NIST StRD nonlinear-regression `.dat` file.

The Statistical Reference Datasets (https://www.itl.nist.gov/div898/strd/nls/) give
each problem as one text file: a description, the model formula (`y = b1*(1-exp[-b2*x])
+ e`), two starting points, the certified parameter values and standard deviations,
the certified residual sum of squares, and the data. The eight lower-difficulty files
are in `tests/data/nist_strd/`; drop any other StRD file there (or pass its path).

    problem = read("tests/data/nist_strd/Misra1a.dat")
    problem.residuals(problem.start(1), problem.x, problem.y)

Used by the tests (`tests/test_nist.py`) and `benchmarks/bench_nist.py`; not part of
sciflat's API.
"""

import dataclasses
import functools as ft
import math
import pathlib
import re
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np


DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "nist_strd"

# The functions StRD formulas use, under the names they use.
_NAMESPACE = {
    "exp": jnp.exp,
    "log": jnp.log,
    "sqrt": jnp.sqrt,
    "arctan": jnp.arctan,
    "cos": jnp.cos,
    "sin": jnp.sin,
    "pi": math.pi,
}
_NUMPY = {k: getattr(np, k) if k != "pi" else math.pi for k in _NAMESPACE}


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    formula: str  # as NIST writes it, without "y =" and "+ e"
    names: tuple[str, ...]  # b1, b2, ...
    starts: tuple[tuple[float, ...], tuple[float, ...]]
    certified: tuple[float, ...]
    certified_stderr: tuple[float, ...]
    certified_rss: float
    x: np.ndarray
    y: np.ndarray
    expression: str = dataclasses.field(repr=False)  # the formula in Python

    def f(self, params: dict, x, numpy: bool = False):
        """The model `y = f(x; b)` with `params` a dict `{"b1": ..., ...}`, in JAX
        (or in NumPy, `numpy=True`, for libraries that call it with NumPy arrays)."""
        namespace = _NUMPY if numpy else _NAMESPACE
        return eval(_code_of(self.expression), dict(namespace), {**params, "x": x})

    @property
    def residuals(self) -> Callable:
        """`residuals(params, x, y) = f(x; params) - y`, for `sciflat.least_squares`."""
        return _residuals_of(self.expression)

    def start(self, which: int) -> dict[str, float]:
        """NIST's Start 1 (far) or Start 2 (near) as `{"b1": 500.0, ...}`."""
        return dict(zip(self.names, self.starts[which - 1], strict=True))


@ft.cache
def _code_of(expression: str):
    # Compiled once: lmfit's NumPy residuals call it at every evaluation (compiling the
    # string each time cost 18 µs per call, a quarter of a Chwirut1 fit by lmfit).
    return compile(expression, "<StRD formula>", "eval")


@ft.cache
def _residuals_of(expression: str) -> Callable:
    # One function per formula, so that every fit of a problem reuses one compilation.
    code = _code_of(expression)

    def residuals(params, x, y):
        return eval(code, dict(_NAMESPACE), {**params, "x": x}) - y

    return residuals


def _to_python(formula: str) -> str:
    # NIST writes exp[-b2*x] with brackets for grouping; Python uses parentheses.
    return formula.replace("[", "(").replace("]", ")")


def read(path: str | pathlib.Path) -> Problem:
    """One StRD file: a path, or a name found in `tests/data/nist_strd/` ("Misra1a")."""
    path = pathlib.Path(path)
    if not path.suffix:
        path = DATA / f"{path}.dat"
    lines = path.read_text().splitlines()
    # The formula: from "y = ..." up to the blank line, without the error term.
    start = next(
        i
        for i, line in enumerate(lines)
        if re.match(r"\s*y\s*=", line) and "Response" not in line
    )
    parts = []
    for line in lines[start:]:
        if not line.strip():
            break
        parts.append(line.strip())
    formula = " ".join(parts).split("=", 1)[1]
    formula = re.sub(r"\+\s*e\s*$", "", formula.strip()).strip()
    # Parameter lines: "  b1 =   500   250   2.3894212918E+02  2.7070075241E+00".
    number = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
    rows = [
        (m.group(1), [float(v) for v in m.group(2).split()])
        for m in (
            re.match(rf"\s*(b\d+)\s*=\s*((?:{number}\s*){{4}})$", line)
            for line in lines
        )
        if m
    ]
    names = tuple(name for name, _ in rows)
    rss = next(line for line in lines if line.startswith("Residual Sum of Squares"))
    # The data: the rows after the second "Data:" line (the column header).
    header = [i for i, line in enumerate(lines) if line.startswith("Data:")][-1]
    data = np.array(
        [
            [float(v) for v in line.split()]
            for line in lines[header + 1 :]
            if line.strip()
        ]
    )
    return Problem(
        name=path.stem,
        formula=formula,
        names=names,
        starts=(
            tuple(v[0] for _, v in rows),
            tuple(v[1] for _, v in rows),
        ),
        certified=tuple(v[2] for _, v in rows),
        certified_stderr=tuple(v[3] for _, v in rows),
        certified_rss=float(rss.split()[-1]),
        x=data[:, 1],
        y=data[:, 0],
        expression=_to_python(formula),
    )


def problems() -> list[Problem]:
    """Every StRD file in `tests/data/nist_strd/`, by name."""
    return [read(p) for p in sorted(DATA.glob("*.dat"))]


def digits(estimate: float, certified: float) -> float:
    """Log relative error: correct significant digits (capped at 15; 0 if none)."""
    if estimate == certified:
        return 15.0
    rel = abs(estimate - certified) / abs(certified)
    return float(min(15.0, max(0.0, -math.log10(rel))))


def fit(problem: Problem, start: int, **kwargs):
    """`sciflat.least_squares` with its defaults on one problem from Start 1 or 2."""
    import sciflat

    data = (problem.x, problem.y)  # NumPy, as for lmfit
    return sciflat.least_squares(
        problem.residuals, problem.start(start), args=data, progress=False, **kwargs
    )
