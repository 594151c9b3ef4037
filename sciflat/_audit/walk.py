"""Reading a jaxpr for the dtype auditor: every nested jaxpr, every floating-point op
that is not in the expected dtype, and which values are data (never computed on)."""

from collections import Counter
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jex
import numpy as np

from .._dtypes import is_inexact, real_dtype
from .precision import default_precision


# Primitives that only move values around: applied to data that entered the
# computation (an input or a constant), their result is still that data.
_MOVES = frozenset(
    {
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "transpose",
        "slice",
        "dynamic_slice",
        "concatenate",
        "copy",
        "copy_p",
        "gather",
        "rev",
        "pad",
        "device_put",
        "split",
        "select_n",
        "stop_gradient",
    }
)

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


class Walker:
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
    if (dtype := default_precision(eqn)) is not None:
        counts[("precision", name, None, dtype, (tb,))] += 1
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
