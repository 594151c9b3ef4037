"""Products computed at DEFAULT precision: float32 matrix products and convolutions that
GPUs (TF32) and TPUs (bfloat16 passes) compute with fewer bits than float32 has."""

import jax
import numpy as np

from ._dtypes import real_dtype


# The primitives whose `precision` parameter selects the algorithm of the product.
PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})

FIX = (
    'wrap the computation in `with jax.default_matmul_precision("highest"):`\n'
    '(or pass `precision="highest"` to each product)'
)


def default_precision(eqn) -> np.dtype | None:
    """The operands' dtype if `eqn` is a product of 32-bit floating operands at DEFAULT
    precision, else None.

    `jax.default_matmul_precision` is applied when the product is traced, so the jaxpr's
    `precision` already holds the ambient setting: None means DEFAULT.
    """
    if eqn.primitive.name not in PRODUCTS:
        return None
    dtypes = {np.dtype(v.aval.dtype) for v in eqn.invars[:2]}
    # JAX's setting concerns 32-bit inputs: float64 products are float64 everywhere.
    bits32 = [d for d in dtypes if d.kind in "fc" and real_dtype(d).itemsize == 4]
    if not bits32 or not _is_default(eqn.params.get("precision")):
        return None
    return bits32[0]


def _is_default(precision) -> bool:
    if precision is None:
        return True
    if isinstance(precision, tuple | list):
        # XLA computes at the higher of the two operands' precisions.
        return all(p == jax.lax.Precision.DEFAULT for p in precision)
    return precision == jax.lax.DotAlgorithmPreset.DEFAULT  # any other is explicit
