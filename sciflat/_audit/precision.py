"""Products computed at DEFAULT precision: float32 matrix products and convolutions that
GPUs (TF32) and TPUs (bfloat16 passes) compute with fewer bits than float32 has."""

import jax
import jax.numpy as jnp
import numpy as np

from .._dtypes import real_dtype


# The primitives whose `precision` parameter selects the algorithm of the product.
PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})

FIX = (
    'wrap the computation in `with jax.default_matmul_precision("highest"):`\n'
    '(or pass `precision="highest"` to each product)'
)


def default_precision(eqn) -> np.dtype | None:
    """The dtype the product computes in, if `eqn` is a product computed in a 32-bit
    floating dtype at DEFAULT precision, else None.

    A product computes in its operands' common dtype: float32 data times a float64 `p`
    (which `jnp.matmul` hands `dot_general` as they are) is a float64 product, exact
    on every backend. `jax.default_matmul_precision` is applied when the product is
    traced, so the jaxpr's `precision` already holds the ambient setting: None means
    DEFAULT.
    """
    if eqn.primitive.name not in PRODUCTS:
        return None
    a, b = (v.aval.dtype for v in eqn.invars[:2])
    dtype = np.dtype(jnp.promote_types(a, b))
    # JAX's setting concerns 32-bit inputs: float64 products are float64 everywhere.
    if dtype.kind not in "fc" or real_dtype(dtype).itemsize != 4:
        return None
    return dtype if _is_default(eqn.params.get("precision")) else None


def _is_default(precision) -> bool:
    if precision is None:
        return True
    if isinstance(precision, tuple | list):
        # XLA computes at the higher of the two operands' precisions.
        return all(p == jax.lax.Precision.DEFAULT for p in precision)
    return precision == jax.lax.DotAlgorithmPreset.DEFAULT  # any other is explicit
