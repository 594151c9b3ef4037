"""`plot_fit`: data, fit and residuals of a finished fit (matplotlib, an extra).

A public helper on top of `FitResult`: it takes a result.
"""

from collections.abc import Callable
from typing import Any

import numpy as np

from .._transforms import unwrap
from .band import band
from .result import FitResult


def plot_fit(
    result: FitResult[Any],
    predict: Callable[..., Any],
    x: Any,
    y: Any,
    *,
    ax: Any = None,
    level: float | None = None,
    prediction: bool = False,
) -> Any:
    """Plots data and fit (top) and residuals (bottom); returns the matplotlib figure.

    With `level`, the fit's confidence band at that level ([`sciflat.band`][]) is
    shaded around the curve, and with `prediction=True` the prediction band of new
    observations too.

    !!! Example

        ```python
        fig = sciflat.plot_fit(result, lambda m, x: f(m, x), x, y, level=0.95)
        fig.savefig("fit.png")
        ```

    **Arguments:**

    - `result`: a [`sciflat.FitResult`][].
    - `predict`: `predict(model, x) -> y`, the model's prediction at `x`. It gets the
        model the residuals saw: `sciflat.unwrap(result.model)`, each transform
        (`sciflat.Positive`, ...) replaced by its constrained value.
    - `x`, `y`: the data (1-d).
    - `ax`: a pair of matplotlib axes to draw into (default: a new figure).
    - `level`: draw the confidence band at this level (0.95: 95 %); default none.
    - `prediction`: with `level`, draw the prediction band too (its default noise:
        see [`sciflat.band`][]).

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
    if level is not None:
        xs = x[order]
        bands = [(False, 0.35, "confidence")] + [
            (True, 0.15, "prediction")
        ] * prediction
        for pred, alpha, what in bands:
            b = band(result, predict, args=(xs,), level=level, prediction=pred)
            label = f"{level:.0%} {what} band"
            ax[0].fill_between(
                xs, b.lower, b.upper, alpha=alpha, color="C1", label=label
            )
    ax[0].legend()
    ax[1].plot(x, fitted - y, "o", ms=3)
    ax[1].axhline(0.0, c="gray", lw=0.8)
    ax[1].set(xlabel="x", ylabel="fit - data")
    return fig
