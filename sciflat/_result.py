"""What every fit returns: the fitted model first, then how the fit went."""

import dataclasses
from typing import Any, Generic, Literal, TypeVar

import numpy as np
from jaxtyping import Array, Float


_M = TypeVar("_M")

Status = Literal["converged", "max_steps", "interrupted", "nonfinite", "failed"]


@dataclasses.dataclass(frozen=True)
class FitResult(Generic[_M]):
    """The outcome of a fit by [`sciflat.minimize`][], [`sciflat.least_squares`][] or
    [`sciflat.fit`][].

    **Fields:**

    - `model`: the fitted model, rebuilt from `p` (so in `p.dtype`).
    - `p`: the flat parameter vector it was rebuilt from.
    - `loss`: the loss (or cost) at `p`.
    - `status`: `"converged"`, `"max_steps"`, `"interrupted"` (Ctrl-C: `p` is the best
        point seen so far), `"nonfinite"` (a non-finite loss or gradient: `p` is the last
        finite point) or `"failed"`.
    - `message`: a sentence saying why the fit stopped.
    - `history`: the loss at every step or call, as a NumPy array.
    - `n_steps`: steps (or solver iterations) taken.
    - `raw`: what the backend returned (SciPy's `OptimizeResult`, Optax's final state).
    """

    model: _M
    p: Float[Array, " n"]
    loss: float
    status: Status
    message: str
    history: np.ndarray
    n_steps: int
    raw: Any = None

    @property
    def success(self) -> bool:
        return self.status in ("converged", "max_steps")
