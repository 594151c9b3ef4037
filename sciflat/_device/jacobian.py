"""The residuals of a device fit as one vector, and with their Jacobian in one pass."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._fitting.problem import check_float64, residual_vector


def residual_fn(residuals: Callable, re: Callable, rebuild: Callable) -> Callable:
    """`(x, leaves) -> residuals(re(x), *args)` as one vector in `x`'s dtype, or a
    clear error."""

    def r(x, leaves):
        return _checked(residual_vector(residuals(re(x), *rebuild(leaves))), x.dtype)

    return r


def _checked(out: jax.Array, dtype) -> jax.Array:
    if dtype == np.float64:
        check_float64(out, "The residuals")
    elif out.dtype != dtype:
        raise TypeError(
            f"The residuals have dtype {out.dtype.name}; the device fit computes in "
            f"`p`'s dtype, {np.dtype(dtype).name} here, so something in the residuals "
            "or their data casts (data in float64?). Give the data in "
            f"{np.dtype(dtype).name}, or find the cast with `sciflat.audit_dtypes`."
        )
    return out


def evaluation(residuals: Callable, re: Callable, rebuild: Callable, mode: str):
    """`(x, leaves) -> (r(x), J(x))`, the residuals (`residual_fn`) and their
    Jacobian in one pass (`with_jacobian`)."""
    r = residual_fn(residuals, re, rebuild)
    return lambda x, leaves: with_jacobian(lambda x: r(x, leaves), mode)(x)


def with_jacobian(r: Callable, mode: str) -> Callable:
    """`x -> (r(x), J(x))` in one pass: forward mode carries the residuals along."""
    if mode == "forward":

        def both(x):
            jac, f = jax.jacfwd(lambda x: (r(x), r(x)), has_aux=True)(x)
            return f, jac

        return both

    def both_reverse(x):
        f, vjp = jax.vjp(r, x)
        (jac,) = jax.vmap(vjp)(jnp.eye(f.shape[0], dtype=f.dtype))
        return f, jac

    return both_reverse
