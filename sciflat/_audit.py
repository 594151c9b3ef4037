"""`audit_dtypes`: where a computation leaves `p.dtype`, read from its jaxpr."""

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, PyTree

from ._audit_report import (
    AllowEntry,
    DtypeReport,
    Finding,
    allow_rule,
    user_location,
)
from ._dtypes import check_representable, is_inexact, real_dtype


#
# Walking the jaxpr
#

# Primitives that only move values around: applied to data that entered the
# computation (an input or a constant), their result is still that data.
_MOVES = frozenset({
    "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose", "slice",
    "dynamic_slice", "concatenate", "copy", "copy_p", "gather", "rev", "pad",
    "device_put", "split", "select_n", "stop_gradient",
})  # fmt: skip

# (kind, primitive, source dtype | None, dtype, tracebacks from the op outwards)
_Key = tuple


def _sub_jaxprs(eqn) -> list[tuple[str, jex.Jaxpr]]:
    """Every jaxpr nested in `eqn`'s params, found generically: (param, jaxpr)."""
    found = []
    for name, value in eqn.params.items():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jex.ClosedJaxpr):
                found.append((name, v.jaxpr))
            elif isinstance(v, jex.Jaxpr):
                found.append((name, v))
    return found


def _inner_inputs(eqn, param: str, n: int) -> Sequence[Any]:
    """The outer values feeding a nested jaxpr's inputs, where the layout is known."""
    ins = list(eqn.invars)
    name = eqn.primitive.name
    if name == "while":
        cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        carry = ins[cn + bn :]
        ins = ins[:cn] + carry if param == "cond_jaxpr" else ins[cn : cn + bn] + carry
    elif name == "cond":
        ins = ins[1:]  # the branch index
    return ins if len(ins) == n else [None] * n


# Loops feed their outputs back in: an output that is data on the first iteration
# need not be on the next, so their outputs never count as data.
_LOOPS = frozenset({"while", "scan"})

_Walked = tuple[Counter, int, tuple[bool, ...]]  # findings, ops checked, outputs data


class _Walker:
    """Walks a jaxpr and every jaxpr nested in it, tracking which values are *data*:
    inputs and constants, and what only moves them around (never computed on)."""

    def __init__(self):
        self._memo: dict[tuple, tuple[jex.Jaxpr, _Walked]] = {}

    def walk(self, jaxpr: jex.Jaxpr, data_in: tuple[bool, ...]) -> _Walked:
        # The same jitted function is often called many times: walk it once.
        key = (id(jaxpr), data_in)
        if key not in self._memo:
            self._memo[key] = (jaxpr, self._walk(jaxpr, data_in))  # keeps `id` valid
        return self._memo[key][1]

    def _walk(self, jaxpr: jex.Jaxpr, data_in: tuple[bool, ...]) -> _Walked:
        counts: Counter[_Key] = Counter()
        checked = 0
        data = set(jaxpr.constvars)
        data.update(v for v, d in zip(jaxpr.invars, data_in, strict=True) if d)
        is_data = lambda v: isinstance(v, jex.Literal) or v in data
        for eqn in jaxpr.eqns:
            subs = _sub_jaxprs(eqn)
            if not subs:
                checked += _check(eqn, is_data, counts)
                if eqn.primitive.name in _MOVES and all(
                    is_data(v) for v in eqn.invars if _inexact_aval(v)
                ):
                    data.update(eqn.outvars)
                continue
            out_data = [eqn.primitive.name not in _LOOPS] * len(eqn.outvars)
            for param, inner in subs:
                outer = _inner_inputs(eqn, param, len(inner.invars))
                flags = tuple(x is not None and is_data(x) for x in outer)
                sub_counts, sub_checked, sub_out = self.walk(inner, flags)
                # A nested jaxpr may have been traced when the user's frames were no
                # longer on the stack: keep the enclosing op's frames as a fallback.
                tb = eqn.source_info.traceback
                for (*head, chain), n in sub_counts.items():
                    counts[(*head, (*chain, tb))] += n
                checked += sub_checked
                if len(sub_out) == len(out_data):  # a call, or a branch of a cond
                    out_data = [a and b for a, b in zip(out_data, sub_out, strict=True)]
                elif param != "cond_jaxpr":
                    out_data = [False] * len(out_data)
            data.update(v for v, d in zip(eqn.outvars, out_data, strict=True) if d)
        out = tuple(is_data(v) for v in jaxpr.outvars)
        return counts, checked, out


def _inexact_aval(v) -> bool:
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    return dtype is not None and is_inexact(dtype)


def _check(eqn, is_data, counts: Counter) -> int:
    """Records what `eqn` does outside the expected dtype (decided later); returns 1 if
    it is a floating-point op."""
    outs = [v.aval for v in eqn.outvars if _inexact_aval(v)]
    if not outs:
        return 0
    tb = eqn.source_info.traceback
    name = eqn.primitive.name
    if name in _MOVES and all(is_data(v) for v in eqn.invars if _inexact_aval(v)):
        return 1  # moving an input or constant around computes nothing
    if name == "convert_element_type":
        src, out = eqn.invars[0].aval, outs[0]
        if out.weak_type or src.weak_type:
            return 1  # a Python scalar taking the dtype of what it meets
        if is_inexact(src.dtype) and np.dtype(src.dtype) == np.dtype(out.dtype):
            return 1
        if is_inexact(src.dtype):
            kind = _convert_kind(src.dtype, out.dtype)
            if kind == "widen" and is_data(eqn.invars[0]):
                kind = "widen-data"  # lossless, and nothing was computed in the source
            counts[(kind, name, np.dtype(src.dtype), np.dtype(out.dtype), (tb,))] += 1
            return 1
    for dtype in {np.dtype(a.dtype) for a in outs if not a.weak_type}:
        counts[("op", name, None, dtype, (tb,))] += 1
    return 1


def _convert_kind(src, out) -> str:
    a, b = real_dtype(src).itemsize, real_dtype(out).itemsize
    return "narrow" if b < a else "widen" if b > a else "convert"


#
# The public API
#


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
        out, vjp = jax.vjp(lambda p: fn(p, *args), p)
        (g,) = vjp(jax.tree.map(jnp.ones_like, out))
        return out, g

    return value_and_grad


def _group(counts: Counter, expected: np.dtype, allow) -> tuple[list, list]:
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
    findings, allowed = [], []
    for (kind, prim, src, dtype, where), n in merged.items():
        finding = Finding(kind, prim, src, dtype, where, n)
        off = frozenset({src, dtype} - ok - {None})
        (allowed if allow(finding, off) else findings).append(finding)
    order = lambda f: (f.where, -f.count, f.primitive, f.dtypes)
    return sorted(findings, key=order), sorted(allowed, key=order)


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

    !!! Example

        ```python
        report = sciflat.audit_dtypes(loss, p, x, y)
        print(report)          # op, dtypes, count, file:line
        report.raise_if_any()  # TypeError with the table if anything was found
        ```

    **Arguments:**

    - `fn`: the function, called as `fn(p, *args)`; for `grad=True` its outputs must
        be floating (the gradient traced is that of the sum of each output).
    - `p`: the parameters, usually the flat vector of [`sciflat.destructure`][].
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
    walker = _Walker()
    counts, n_checked, _ = walker.walk(closed.jaxpr, (True,) * len(closed.jaxpr.invars))
    findings, allowed = _group(counts, expected, rule)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    out = eqx.combine(out_dynamic, out_static)
    return DtypeReport(name, expected, tuple(findings), tuple(allowed), n_checked, out)


def assert_dtypes(
    fn: Callable[..., Any],
    p: PyTree[ArrayLike | jax.ShapeDtypeStruct],
    *args: Any,
    grad: bool = True,
    expect: Any = None,
    allow: Sequence[AllowEntry] = (),
) -> DtypeReport:
    """[`sciflat.audit_dtypes`][] for tests: raises an `AssertionError` with the table
    if any op leaves the expected dtype.

    !!! Example

        ```python
        def test_loss_stays_float64():
            sciflat.assert_dtypes(loss, p, x, y)
        ```

    **Arguments:** as for [`sciflat.audit_dtypes`][].

    **Returns:** the (clean) [`sciflat.DtypeReport`][].
    """
    report = audit_dtypes(fn, p, *args, grad=grad, expect=expect, allow=allow)
    if report.findings:
        raise AssertionError(str(report))
    return report
