"""The formulas of a PEtab problem, from SymPy to JAX: the model's right-hand side and
initial state, and each observable's formula and noise formula.

Each becomes a function of `(t, x, constants, q, placeholders)`: the time, the state,
the SBML model's constants in one condition, the table parameters that are no SBML
constant, and the observable's or noise formula's placeholders of one measurement.
"""

import dataclasses
import functools as ft
from collections.abc import Sequence
from typing import Any

from .sbml import SbmlOde
from .tables import Row, Tables


@dataclasses.dataclass(frozen=True)
class Formulas:
    """Lambdified formulas: `rhs(t, x, k)`, `x0(k)`, and per observable (in
    `Tables.observable_ids`' order) `h[o]` and `sigma[o]`, each
    `(t, x, k, q, placeholders)`: the observable's placeholders for `h`, those and
    then the noise placeholders for `sigma`."""

    rhs: Any
    x0: Any
    h: tuple[Any, ...]
    sigma: tuple[Any, ...]


def parse(
    sympy: Any, ode: SbmlOde, table_ids: Sequence[str], text: str, where: str, extra
) -> Any:
    """A formula of the observable table, in SymPy, with the model's assignment rules
    substituted."""
    from sympy.core.function import AppliedUndef
    from sympy.parsing.sympy_parser import (
        convert_xor,
        parse_expr,
        standard_transformations,
    )

    names = {*ode.constants, *ode.species, *ode.expressions}
    names |= {*table_ids, *extra}
    local = {k: sympy.Symbol(k, real=True) for k in names}
    local.update(
        exp=sympy.exp,
        log=sympy.log,
        ln=sympy.log,
        sqrt=sympy.sqrt,
        abs=sympy.Abs,
        log10=lambda x: sympy.log(x, 10),
        log2=lambda x: sympy.log(x, 2),
        sin=sympy.sin,
        cos=sympy.cos,
        tan=sympy.tan,
        pow=lambda a, b: a**b,
        t=ode.time,
        time=ode.time,
    )
    try:
        expr = parse_expr(
            text,
            local_dict=local,
            transformations=(*standard_transformations, convert_xor),
        )
    except Exception as e:
        raise ValueError(f"{where}: cannot parse {text!r} ({e}).") from None
    if undefined := sorted(str(f.func) for f in expr.atoms(AppliedUndef)):
        raise ValueError(f"{where}: unsupported function(s) {undefined} in {text!r}.")
    unknown = sorted(
        str(s) for s in expr.free_symbols if str(s) not in names | {"t", "time"}
    )
    if unknown:
        raise ValueError(f"{where}: {text!r} names unknown {unknown}.")
    subs = {sympy.Symbol(k, real=True): v for k, v in ode.expressions.items()}
    return sympy.sympify(expr).xreplace(subs)


def compile_formulas(sympy: Any, ode: SbmlOde, tables: Tables) -> Formulas:
    sym = lambda k: sympy.Symbol(k, real=True)
    table_ids = tables.parameters.table_ids
    t = ode.time
    x = [sym(s) for s in ode.species]
    k = [sym(c) for c in ode.constants]
    q = [sym(table_ids[i]) for i in tables.q_only]
    lam = ft.partial(sympy.lambdify, modules="jax", cse=True)
    h, sigma = [], []
    for oid in tables.observable_ids:
        row: Row = tables.observables[oid]
        observable, noise = tables.placeholders[oid]
        for column, names, out in (
            ("observableFormula", observable, h),
            ("noiseFormula", [*observable, *noise], sigma),
        ):
            where = f"Observable {oid!r}, {column}"
            expr = parse(sympy, ode, table_ids, row[column], where, names)
            out.append(lam([t, x, k, q, [sym(nm) for nm in names]], expr))
    return Formulas(
        rhs=lam([t, x, k], list(ode.rhs)),
        x0=lam([k], list(ode.x0)),
        h=tuple(h),
        sigma=tuple(sigma),
    )
