"""Which derivative a SciPy fit takes, and how: forward or reverse mode."""

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp


Mode = Literal["auto", "forward", "reverse"]
# Forward mode costs one JVP per parameter; reverse mode one VJP plus storing (or
# recomputing) the forward pass, which through an ODE solve is several times a JVP.
FORWARD_MAX_PARAMS = 16


def _with_aux(f):
    def f_and_value(x):
        value = f(x)
        return value, value

    return f_and_value


def choose_modes(mode: Mode, forward_first: bool) -> list[str]:
    if mode not in ("auto", "forward", "reverse"):
        raise ValueError(
            f"`mode` must be 'auto', 'forward' or 'reverse', got {mode!r}."
        )
    if mode != "auto":
        return [mode]
    return ["forward", "reverse"] if forward_first else ["reverse", "forward"]


def gradient(f: Callable, mode: str) -> Callable:
    """`x -> grad f(x)` by forward (`jacfwd`) or reverse mode."""
    return jax.jacfwd(f) if mode == "forward" else jax.grad(f)


def value_and_grad_flat(f: Callable, mode: str) -> Callable:
    """`x -> [f(x), *grad f(x)]`: one array, so one device-to-host transfer."""

    def both(x):
        if mode == "forward":
            g, value = jax.jacfwd(_with_aux(f), has_aux=True)(x)
        else:
            value, g = jax.value_and_grad(f)(x)
        return jnp.concatenate([value[None], g])

    return both
