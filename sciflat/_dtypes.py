"""The dtype vocabulary of the dtype rule: which real dtype goes with which complex one,
and when JAX would silently round a 64-bit value down to 32 bits."""

import jax
import jax.numpy as jnp
import numpy as np


X64_FIX = 'enable it with `jax.config.update("jax_enable_x64", True)`'

# The only complex dtypes that exist; there is no complex counterpart of (b)float16.
_COMPLEX_OF = {
    np.dtype(np.float32): np.dtype(np.complex64),
    np.dtype(np.float64): np.dtype(np.complex128),
}


def x64_enabled() -> bool:
    return bool(jax.config.read("jax_enable_x64"))


def is_inexact(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def is_complex(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.complexfloating)


def real_dtype(dtype) -> np.dtype:
    """float32 for complex64, float64 for complex128, itself for a real dtype."""
    dtype = np.dtype(dtype)
    return np.finfo(dtype).dtype if is_complex(dtype) else dtype


def complex_dtype(real: np.dtype, what: str) -> np.dtype:
    try:
        return _COMPLEX_OF[np.dtype(real)]
    except KeyError:
        raise TypeError(
            f"{what} is complex, but `p` has dtype {np.dtype(real).name}, which has no "
            "complex counterpart (only float32 -> complex64 and float64 -> complex128 "
            "exist). Use a float32 or float64 `p`, or freeze that leaf."
        ) from None


def check_representable(dtype: np.dtype, what: str) -> None:
    """A 64-bit dtype with x64 off would be rounded to 32 bits by JAX: refuse it."""
    if np.dtype(dtype).itemsize >= 8 and not x64_enabled() and is_inexact(dtype):
        raise TypeError(
            f"{what} has dtype {np.dtype(dtype).name}, but JAX's 64-bit mode is off, so "
            f"JAX would silently round it to 32 bits. To compute in 64 bits, {X64_FIX} "
            "at the start of your program; to compute in 32 bits, convert it "
            "explicitly (e.g. `.astype(np.float32)`, or `dtype=jnp.float32`)."
        )
