"""The text of `print(result)`, in the manner of lmfit's `fit_report`.

Below `FitResult` (whose `report()` and `__str__` call it): it reads a result's
fields and imports nothing of it.
"""

import re as _re
from typing import Any

import numpy as np

from .._transforms import constrained
from .delta import value_names


def pretty(name: str) -> str:
    """`['b1']` -> `b1`, `.layers[0].weight[1, 2]` -> `layers[0].weight[1, 2]`."""
    dotted = _re.sub(r"\['([^']*)'\]", r".\1", name)
    return _re.sub(r"(^|\s)\.", r"\1", dotted)


def _number(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.6g}"


def _redchi(result: Any) -> str:
    if result.redchi is None and result.n_data is not None:
        m, n = result.n_data, len(result.p)
        return f"undefined ({m} residuals, {n} parameters: no degree of freedom left)"
    return _number(result.redchi)


def report(result: Any, min_correlation: float) -> str:
    lines = ["[[Fit Statistics]]"]
    stats = [
        (
            "status",
            f"{result.status} ({'success' if result.success else 'no success'})",
        ),
        ("function evals", _number(result.n_evaluations)),
        ("iterations", str(result.n_steps)),
        ("data points", _number(result.n_data)),
        ("variables", str(len(result.p))),
        ("loss", _number(result.loss)),
    ]
    if result.chisqr is not None:
        stats += [
            ("chi-square", _number(result.chisqr)),
            ("reduced chi-square", _redchi(result)),
            ("Akaike info crit", _number(result.aic)),
            ("Bayesian info crit", _number(result.bic)),
        ]
    lines += [f"    {k + ':':21s}{v}" for k, v in stats]
    lines.append(f"    {'message:':21s}{result.message}")
    unc, re = result.uncertainty, result.re
    if re is None:
        return "\n".join(lines)
    names = [pretty(n) for n in value_names(re)]
    values = np.asarray(constrained(re, result.p), np.float64)
    lines.append("[[Variables]]")
    width = max(len(n) for n in names)
    stderr = None if unc is None else unc.stderr
    for i, name in enumerate(names):
        text = f"    {name + ':':{width + 1}s}  {values[i]: .8g}"
        if stderr is not None:
            rel = abs(stderr[i] / values[i]) if values[i] != 0 else np.nan
            text += f" +/- {stderr[i]:.4g} ({rel:.2%})"
        lines.append(text)
    if unc is None:
        return "\n".join(lines)
    lines.append(f"    (covariance: {pretty(unc.scale)})")
    for direction in unc.unidentifiable:
        lines.append(f"    not determined by the data: {pretty(direction)}")
    corr = unc.correlation
    pairs = [
        (abs(corr[i, j]), i, j)
        for i in range(len(names))
        for j in range(i + 1, len(names))
        if np.isfinite(corr[i, j]) and abs(corr[i, j]) >= min_correlation
    ]
    if pairs:
        lines.append(
            f"[[Correlations]] (unreported correlations are < {min_correlation:.3f})"
        )
        for _, i, j in sorted(pairs, reverse=True):
            pair = f"C({names[i]}, {names[j]})"
            lines.append(f"    {pair:{2 * width + 6}s} = {corr[i, j]:+.4f}")
    return "\n".join(lines)
