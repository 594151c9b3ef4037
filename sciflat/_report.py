"""The text of `print(result)`, in the manner of lmfit's `fit_report`, and a plot."""

import re as _re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._transforms import constrained, unwrap, value_names


if TYPE_CHECKING:
    from ._result import FitResult


def pretty(name: str) -> str:
    """`['b1']` -> `b1`, `.layers[0].weight[1, 2]` -> `layers[0].weight[1, 2]`."""
    dotted = _re.sub(r"\['([^']*)'\]", r".\1", name)
    return _re.sub(r"(^|\s)\.", r"\1", dotted)


def _number(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.6g}"


def _redchi(result: "FitResult[Any]") -> str:
    if result.redchi is None and result.n_data is not None:
        m, n = result.n_data, len(result.p)
        return f"undefined ({m} residuals, {n} parameters: no degree of freedom left)"
    return _number(result.redchi)


def report(result: "FitResult[Any]", min_correlation: float) -> str:
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


def plot_fit(
    result: "FitResult[Any]",
    predict: Callable[..., Any],
    x: Any,
    y: Any,
    *,
    ax: Any = None,
) -> Any:
    """Plots data and fit (top) and residuals (bottom); returns the matplotlib figure.

    !!! Example

        ```python
        fig = sciflat.plot_fit(result, lambda m, x: f(m, x), x, y)
        fig.savefig("fit.png")
        ```

    **Arguments:**

    - `result`: a [`sciflat.FitResult`][].
    - `predict`: `predict(model, x) -> y`, the model's prediction at `x`. It gets the
        model the residuals saw: `sciflat.unwrap(result.model)`, each transform
        (`sciflat.Positive`, ...) replaced by its constrained value.
    - `x`, `y`: the data (1-d).
    - `ax`: a pair of matplotlib axes to draw into (default: a new figure).

    **Returns:**

    The matplotlib `Figure`.

    matplotlib is not a dependency of sciflat: `pip install 'sciflat[plot]'`.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "`sciflat.plot_fit` draws with matplotlib, which is not installed (it is "
            "not a dependency of sciflat): `pip install 'sciflat[plot]'` (or "
            "`pip install matplotlib`)."
        ) from e

    x, y = np.asarray(x), np.asarray(y)
    if ax is None:
        fig, ax = plt.subplots(
            2, 1, sharex=True, figsize=(6, 5), gridspec_kw={"height_ratios": [3, 1]}
        )
    else:
        fig = ax[0].figure
    order = np.argsort(x)
    fitted = np.asarray(predict(unwrap(result.model), x))
    ax[0].plot(x, y, "o", ms=3, label="data")
    ax[0].plot(x[order], fitted[order], label="fit")
    ax[0].legend()
    ax[1].plot(x, fitted - y, "o", ms=3)
    ax[1].axhline(0.0, c="gray", lw=0.8)
    ax[1].set(xlabel="x", ylabel="fit - data")
    return fig
