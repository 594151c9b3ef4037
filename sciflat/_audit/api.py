"""`audit_dtypes`: where a computation leaves `p.dtype`, read from its jaxpr."""

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, PyTree

from .._dtypes import check_representable, is_inexact, real_dtype
from .report import AllowEntry, DtypeReport, Finding, allow_rule
from .source import user_location
from .walk import Walker


def _expected_dtype(p, expect) -> np.dtype:
    if expect is not None:
        dtype = np.dtype(expect)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"`expect` must be a real floating dtype, got {dtype.name}."
            )
        check_representable(dtype, "`expect`")
        return dtype
    dtypes = {
        real_dtype(x.dtype)
        for x in jax.tree.leaves(p)
        if hasattr(x, "dtype") and is_inexact(x.dtype)
    }
    if len(dtypes) != 1:
        got = sorted(d.name for d in dtypes) or "no floating arrays"
        raise TypeError(
            "`p` must be a floating array (or a pytree of arrays of one floating "
            f"dtype) to say which dtype to expect, got {got}. Pass `expect=` instead."
        )
    dtype = dtypes.pop()
    check_representable(dtype, "`p`")  # else JAX would trace it in 32 bits
    return dtype


def _traced(fn: Callable, grad: bool) -> Callable:
    if not grad:
        return fn

    def value_and_grad(p, *args):
        # filter_vjp: `p` may be a whole model, functions and integer leaves included.
        out, vjp = eqx.filter_vjp(lambda p: fn(p, *args), p)
        (grad,) = vjp(jax.tree.map(jnp.ones_like, out))
        return out, grad

    return value_and_grad


def _group(counts: Counter, expected: np.dtype, allow) -> tuple:
    ok = {expected}
    if expected.itemsize in (4, 8):
        ok.add(np.dtype(jnp.complex64 if expected.itemsize == 4 else jnp.complex128))
    merged: Counter = Counter()
    for (kind, prim, src, dtype, chain), n in counts.items():
        if kind == "widen-data":
            if dtype in ok:
                continue  # data (an input or constant) brought up to the expected dtype
            kind = "widen"
        if kind == "op" and dtype in ok:
            continue
        merged[(kind, prim, src, dtype, user_location(chain))] += n
    findings, allowed, products = [], [], []
    for (kind, prim, src, dtype, where), n in merged.items():
        finding = Finding(kind, prim, src, dtype, where, n)
        if kind == "precision":
            # Not a dtype: only a function in `allow` can say it is intended.
            (allowed if allow(finding, None) else products).append(finding)
            continue
        off = frozenset({src, dtype} - ok - {None})
        (allowed if allow(finding, off) else findings).append(finding)
    order = lambda f: (f.where, -f.count, f.primitive, f.dtypes)
    return tuple(sorted(x, key=order) for x in (findings, allowed, products))


def audit_dtypes(
    fn: Callable[..., Any],
    p: PyTree[ArrayLike | jax.ShapeDtypeStruct],
    *args: Any,
    grad: bool = True,
    expect: Any = None,
    allow: Sequence[AllowEntry] = (),
) -> DtypeReport:
    """Finds every floating-point operation of `fn(p, *args)` (and, by default, of its
    gradient with respect to `p`) that does not compute in `p.dtype`.

    `fn` is traced with `jax.make_jaxpr`, never run, so this is cheap and inputs may be
    `jax.ShapeDtypeStruct`s. Every nested jaxpr is read (`jit`, `scan`, `while`,
    `cond`, `custom_jvp`/`custom_vjp`, `checkpoint`, Diffrax's and Equinox's
    internals). Reported: ops whose output has another floating dtype (the complex
    counterpart of `p.dtype` is fine), and `convert_element_type`s that narrow
    (float64 -> float32) or widen a computed value. Not reported: Python scalars (weak
    types), integer and boolean arithmetic, and inputs or constants converted up to the
    expected dtype. Findings are grouped by op, dtypes and line of your code.

    Separately, `report.precision` lists the float32 matrix products and convolutions
    at DEFAULT precision (as traced: `jax.default_matmul_precision` applies), which
    GPUs and TPUs compute with TF32 or bfloat16 passes; they are exact on CPU.

    !!! Example

        ```python
        report = sciflat.audit_dtypes(loss, p, x, y)
        print(report)          # op, dtypes, count, file:line
        report.raise_if_any()  # TypeError with the table if anything was found
        ```

    **Arguments:**

    - `fn`: the function, called as `fn(p, *args)`; for `grad=True` its outputs must
        be floating (the gradient traced is that of the sum of each output).
    - `p`: the parameters, usually the flat vector of [`sciflat.destructure`][]; any
        pytree works (a whole model: the gradient is then with respect to its
        floating arrays, and `expect` is needed if they have several dtypes).
    - `*args`: the other arguments: arrays, `jax.ShapeDtypeStruct`s or any pytree
        (non-array leaves are static).
    - `grad`: also trace the gradient with respect to `p`.
    - `expect`: the dtype every op should compute in. Default: `p.dtype`.
    - `allow`: what is intended: dtypes (`["float32"]` allows everything float32,
        e.g. an ODE state kept in float32), `(primitive, dtype)` pairs
        (`[("dot_general", "bfloat16")]`), or functions `Finding -> bool`.

    **Returns:**

    A [`sciflat.DtypeReport`][]: `print` it, check `report.findings`, or call
    `report.raise_if_any()`.
    """
    expected = _expected_dtype(p, expect)
    rule = allow_rule(allow)
    closed, out_dynamic, out_static = eqx.filter_make_jaxpr(_traced(fn, grad))(p, *args)
    walker = Walker()
    counts, n_checked, _ = walker.walk(closed.jaxpr, (True,) * len(closed.jaxpr.invars))
    findings, allowed, products = _group(counts, expected, rule)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    out = eqx.combine(out_dynamic, out_static)
    return DtypeReport(
        name, expected, tuple(findings), tuple(allowed), n_checked, out, tuple(products)
    )


def assert_dtypes(
    fn: Callable[..., Any],
    p: PyTree[ArrayLike | jax.ShapeDtypeStruct],
    *args: Any,
    grad: bool = True,
    expect: Any = None,
    allow: Sequence[AllowEntry] = (),
    precision: bool | None = None,
) -> DtypeReport:
    """[`sciflat.audit_dtypes`][] for tests: raises an `AssertionError` with the table
    if any op leaves the expected dtype (and, on GPU/TPU, if a float32 product runs at
    DEFAULT precision).

    !!! Example

        ```python
        def test_loss_stays_float64():
            sciflat.assert_dtypes(loss, p, x, y)
        ```

    **Arguments:** as for [`sciflat.audit_dtypes`][], and

    - `precision`: also raise for float32 products at DEFAULT precision
        (`report.precision`): `True` always, `False` never, `None` (default) when JAX's
        default backend is not the CPU, where they would lose bits.

    **Returns:** the (clean) [`sciflat.DtypeReport`][].
    """
    report = audit_dtypes(fn, p, *args, grad=grad, expect=expect, allow=allow)
    try:
        report.raise_if_any(precision=precision)
    except TypeError:
        raise AssertionError(str(report)) from None
    return report
