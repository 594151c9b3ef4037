"""What the dtype auditor found: the findings, the table, and the allow list."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from .precision import FIX
from .source import Location


#
# Findings and the report
#

Kind = Literal["op", "narrow", "widen", "convert", "precision"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One group of operations that left the expected dtype.

    `kind` is `"op"` (an operation whose output has an unexpected floating dtype),
    `"narrow"` / `"widen"` (a `convert_element_type` to a smaller / larger floating
    dtype), `"convert"` (between floating dtypes of one size, e.g. float16 and
    bfloat16) or `"precision"` (a float32 product at DEFAULT precision, in
    `report.precision`: `dtype` is its operands'). `primitive` is the JAX primitive's
    name (`"dot_general"`, `"convert_element_type"`, ...); `source` is the dtype
    converted from (`None` for an `"op"`); `dtype` the dtype of the output; `where`
    the line of the user's code (`where.file`, `where.line`, `where.function`); `count`
    how many operations of the traced program (nested ones included) fall in this
    group.
    """

    kind: Kind
    primitive: str
    source: np.dtype | None
    dtype: np.dtype
    where: Location
    count: int

    @property
    def dtypes(self) -> str:
        if self.source is None:
            return self.dtype.name
        return f"{self.source.name} -> {self.dtype.name}"


@dataclasses.dataclass(frozen=True)
class DtypeReport:
    """The result of [`sciflat.audit_dtypes`][]: `print` it, or call `raise_if_any()`.

    `findings` holds what is not allowed, `allowed` what the `allow` list let through;
    both are grouped by (kind, primitive, dtypes, source line), most frequent first
    within a line. A finding's `count` is how many ops of the jaxpr are in its group:
    an op inside a loop body counts once, however many times the loop runs.
    `len(report)` is the number of groups found, so a clean report is falsy. `out`
    holds the `jax.ShapeDtypeStruct`s of what was traced: `fn(p, *args)`, or
    `(fn(p, *args), gradient)` for `grad=True`. `precision` holds, grouped the same
    way (kind `"precision"`), the float32 matrix products and convolutions at DEFAULT
    precision, which GPUs and TPUs compute with TF32 or bfloat16 passes; they are not
    findings (`raise_if_any(precision=...)` decides).

    !!! Example

        ```python
        report = sciflat.audit_dtypes(loss, p, x)
        print(report)  # op, dtypes, count, file:line
        for finding in report.findings:
            print(finding.primitive, finding.dtypes, finding.where.line)
        value, grad = report.out
        assert grad.dtype == p.dtype
        ```
    """

    name: str
    expected: np.dtype
    findings: tuple[Finding, ...]
    allowed: tuple[Finding, ...]
    n_checked: int
    out: Any = dataclasses.field(default=None, compare=False)
    precision: tuple[Finding, ...] = ()

    def __len__(self) -> int:
        return len(self.findings)

    def __str__(self) -> str:
        n_ops = sum(f.count for f in self.findings)
        head = (
            f"dtype audit of {self.name}: expected {self.expected.name}, "
            f"{self.n_checked} floating-point ops checked, "
        )
        if not self.findings:
            head += "nothing found"
        else:
            head += (
                f"{n_ops} ops in {len(self.findings)} groups left {self.expected.name}"
            )
        if self.allowed:
            head += f" ({sum(f.count for f in self.allowed)} allowed)"
        text = head + ("\n" + _table(self.findings) if self.findings else "")
        return text + (_precision_text(self.precision) if self.precision else "")

    __repr__ = __str__

    def raise_if_any(self, *, precision: bool | None = None) -> "DtypeReport":
        """Raises a `TypeError` holding the table if anything was found; else returns
        the report.

        `precision`: also raise for the products in `report.precision` (float32 at
        DEFAULT precision): `True` always, `False` never, `None` (default) only where
        they lose bits, i.e. when JAX's default backend is not the CPU.
        """
        if self.findings:
            raise TypeError(
                f"{self}\nEvery floating-point op should compute in "
                f"{self.expected.name}. If some of these are intended, list them in "
                '`allow`, e.g. `allow=[("dot_general", "bfloat16")]` or '
                '`allow=["float32"]`.'
            )
        if self.precision and _precision_matters(precision):
            raise TypeError(f"{self}\nTo compute them in float32, {FIX}.")
        return self


def _table(findings: Sequence[Finding]) -> str:
    rows = [("op", "dtypes", "count", "where")]
    rows += [(f.primitive, f.dtypes, str(f.count), str(f.where)) for f in findings]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [
        f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}"
        for a, b, c, d in rows
    ]
    return "\n".join(lines)


def _precision_text(products: Sequence[Finding]) -> str:
    n = sum(f.count for f in products)
    return (
        f"\n{n} float32 products in {len(products)} groups at DEFAULT precision: exact "
        "on CPU, but GPUs (TF32) and\nTPUs (bfloat16) round their inputs to 11 or 8 "
        f"significant bits of float32's 24. To keep\nfloat32, {FIX}.\n"
        + _table(products)
    )


def _precision_matters(precision: bool | None) -> bool:
    if precision is None:
        import jax

        return jax.default_backend() != "cpu"
    return precision


#
# The allow list
#

AllowEntry = Any  # a dtype, (primitive, dtype), or Callable[[Finding], bool]


def allow_rule(
    allow: Sequence[AllowEntry],
) -> Callable[[Finding, frozenset | None], bool]:
    """Turns the user's `allow` list into one predicate (finding, dtypes) -> allowed."""
    dtypes, pairs, predicates = set(), set(), []
    for entry in allow:
        if callable(entry) and not isinstance(entry, type):
            predicates.append(entry)
        elif isinstance(entry, tuple):
            if len(entry) != 2 or not isinstance(entry[0], str):
                raise TypeError(
                    "`allow` entries that are tuples must be (primitive name, dtype), "
                    f'e.g. ("dot_general", "bfloat16"); got {entry!r}.'
                )
            pairs.add((entry[0], _dtype(entry[1])))
        else:
            dtypes.add(_dtype(entry))

    def rule(finding: Finding, off: frozenset | None) -> bool:
        # `off`: the finding's dtypes that are not the expected ones (None: not a
        # dtype finding, which only a function can allow).
        if off is None:
            return any(pred(finding) for pred in predicates)
        if off <= dtypes:
            return True
        if any(finding.primitive == prim and off <= {dt} for prim, dt in pairs):
            return True
        return any(pred(finding) for pred in predicates)

    return rule


def _dtype(x) -> np.dtype:
    try:
        return np.dtype(x)
    except TypeError:
        raise TypeError(
            '`allow` entries must be dtypes (e.g. `jnp.float32` or "bfloat16"), '
            f"(primitive, dtype) pairs, or functions of a `Finding`; got {x!r}."
        ) from None
