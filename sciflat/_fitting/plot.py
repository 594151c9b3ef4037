"""`plot_fit`: data, fit and residuals of a finished fit (matplotlib, an extra).

A public helper on top of `FitResult`: it takes a result.
"""

from collections.abc import Callable
from typing import Any

import numpy as np

from .._transforms import unwrap
from .result import FitResult


def plot_fit(
    result: FitResult[Any],
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
