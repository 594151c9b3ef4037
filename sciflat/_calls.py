"""How the fits are called: the data of the loss go in `args=(...)`, by keyword."""

import functools as ft
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _positional(fit: Callable) -> tuple[str, ...]:
    """The names of the parameters `fit` takes positionally (before its `*`)."""
    try:
        params = inspect.signature(fit).parameters.values()
    except (TypeError, ValueError):
        return ("loss", "model")
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def data_by_keyword(fit: Callable[_P, _R]) -> Callable[_P, _R]:
    """Turn data passed after the positional parameters (the old `*args`) into a
    clear error that names the fix."""
    who = fit.__name__
    # The closure holds `fit` and its name only: the compile cache keys sciflat's own
    # wrappers by the identity of what they close over.
    n_positional = len(_positional(fit))

    @ft.wraps(fit)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if len(args) > n_positional:
            raise _data_after(who, _positional(fit), len(args) - n_positional)
        return fit(*args, **kwargs)

    return checked


def _data_after(who: str, names: tuple[str, ...], n: int) -> TypeError:
    written = ", ".join(["loss", *names[1:]])  # `residuals` is a loss, too
    return TypeError(
        f"`{who}` takes the data of the loss as `args=(...)`, a tuple (as "
        "`scipy.optimize.minimize` and every sciflat fit do), but got "
        f"{n} positional argument{'s' * (n > 1)} after `{names[-1]}`: write "
        f"`sciflat.{who}({written}, args=(x, y), ...)`."
    )
