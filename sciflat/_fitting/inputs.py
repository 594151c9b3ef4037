"""What a float64 fit (SciPy's, the device's, the batch's) starts from, checked once
in one order, so that a wrong input reads the same whichever fit got it."""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from .._flatten import Restructure
from .._transforms import unwrapping
from .floats import promote_floats
from .problem import check_args
from .start import start as float64_start


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs:
    """A fit's checked inputs (`eq=False`: data, compared by identity)."""

    fn: Callable[..., Any]  # the loss or residuals, seeing the values of Transforms
    model: Any  # Python floats outside modules made float64 arrays
    start: np.ndarray  # float64 (a device fit's may be narrower), `re`'s length
    re: Restructure
    args: tuple


def checked_inputs(
    fn: Callable[..., Any],
    model: Any,
    args: Any,
    x0: Any,
    filter_spec: Any,
    who: str,
    device: bool = False,
) -> Inputs:
    """`args` a tuple, the model's Python floats parameters (`{"b1": 500.0}`: `b1` is
    fitted), `fn` unwrapping `sciflat.Transform`s, and the float64 start (`x0`, or
    the model's), or the first error of these, naming `who`. A `device` fit with
    JAX's 64-bit mode off starts in the model's dtype instead of float64."""
    args = check_args(args, who)
    model = promote_floats(model, who)
    start, re = float64_start(model, x0, filter_spec, who, device)
    return Inputs(unwrapping(fn), model, start, re, args)
