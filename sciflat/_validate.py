"""Checking a flat vector handed to sciflat: never a silent cast."""

import jax
import jax.numpy as jnp
import numpy as np

from ._dtypes import check_representable


def as_flat_vector(p, size: int, who: str) -> jax.Array:
    """`p` as a 1-D real floating JAX array of length `size`, or a clear error.

    NumPy arrays and lists are accepted when JAX can hold them exactly: a float64 one
    while JAX's 64-bit mode is off is refused, since JAX would round it to float32.
    """
    p = checked_flat_vector(p, size, who)
    return p if isinstance(p, jax.Array) else jnp.asarray(p)


def checked_flat_vector(p, size: int, who: str):
    """`p` (a list as a NumPy array) if `as_flat_vector` accepts it, without a copy to
    a device: for SciPy, which works on the host."""
    if isinstance(p, list | tuple):
        p = np.asarray(p)
    if not hasattr(p, "dtype") or not hasattr(p, "shape"):
        raise TypeError(
            f"{who} expected a 1-D real floating array, got {type(p).__name__}."
        )
    dtype = np.dtype(p.dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"{who} expected a real floating vector, got dtype {dtype.name}. `p` is always "
            "real (complex leaves store their real and imaginary parts as separate "
            "entries), so real parameters never become complex."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{who} expected a real floating vector, got dtype {dtype.name}. Convert it "
            "explicitly, e.g. `p.astype(jnp.float32)`."
        )
    if isinstance(p, np.ndarray | np.generic):
        check_representable(dtype, f"`p` (a NumPy array given to {who})")
    shape: tuple[int, ...] = tuple(np.shape(p))
    if len(shape) != 1:
        raise ValueError(
            f"{who} expected a 1-D vector of length {size}, got shape {shape}."
        )
    if shape[0] != size:
        raise ValueError(f"{who} expected a vector of length {size}, got {shape[0]}.")
    return p
