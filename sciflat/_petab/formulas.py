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

import jax.numpy as jnp
import numpy as np

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


class Vectorised:
    """Many SymPy expressions over the entries of one vector `z`, evaluated a few
    vector operations at a time: the expressions that differ only in which symbols
    and numbers they hold (`k1 * A * B` and `k7 * C * D`) share one template, computed
    once over the gathered columns of all of them. A model of 600 reactions of 6 kinds
    is then 6 vectorised products for XLA, not 600 scalar ones (and so is every
    Jacobian of it): tracing and compiling cost what the kinds of rate laws cost, not
    the size of the model.

    `Vectorised(sympy, exprs, symbols)(z)` is `[e(z) for e in exprs]`, with
    `symbols[i]` standing for `z[i]`."""

    def __init__(self, sympy: Any, exprs: Sequence[Any], symbols: Sequence[Any]):
        where = {s: i for i, s in enumerate(symbols)}
        numbers: list[float] = []
        groups: dict[str, tuple[Any, list[int], list[list[int]]]] = {}
        for j, e in enumerate(exprs):
            args: list[int] = []
            template = _template(sympy, sympy.sympify(e), where, numbers, args)
            key = sympy.srepr(template)
            if key not in groups:
                names = [sympy.Symbol(f"_a{i}", real=True) for i in range(len(args))]
                fn = sympy.lambdify(names, template, modules="jax")
                groups[key] = (fn, [], [])
            groups[key][1].append(j)
            groups[key][2].append(args)
        self.n_symbols, self.size = len(symbols), len(exprs)
        self.numbers = np.asarray(numbers, np.float64)
        self.groups = tuple(
            (fn, np.asarray(rows, np.int64).reshape(len(rows), -1))
            for fn, _, rows in groups.values()
        )
        order = [j for _, rows, _ in groups.values() for j in rows]
        self.inverse = np.argsort(np.asarray(order, np.int64))

    def __call__(self, z: Any) -> Any:
        if not self.size:
            return jnp.zeros((0,), z.dtype)
        zz = jnp.concatenate([z, jnp.asarray(self.numbers, z.dtype)])
        parts = []
        for fn, idx in self.groups:
            cols = zz[idx]  # (rows, template arguments)
            out = fn(*(cols[:, i] for i in range(idx.shape[1])))
            parts.append(jnp.broadcast_to(jnp.asarray(out, z.dtype), (idx.shape[0],)))
        return jnp.concatenate(parts)[self.inverse]


def _template(sympy: Any, e: Any, where: dict, numbers: list, args: list) -> Any:
    """`e` with each symbol and each number (other than an integer exponent, -1 or
    1) a placeholder `_a{n}`, in order of appearance; `args` gets their indices into
    `[z, numbers]`."""

    def arg(index: int) -> Any:
        args.append(index)
        return sympy.Symbol(f"_a{len(args) - 1}", real=True)

    def walk(e: Any) -> Any:
        if isinstance(e, sympy.Symbol):
            return arg(where[e])
        if isinstance(e, sympy.Number):
            if e in (sympy.Integer(1), sympy.Integer(-1)) or not e.is_finite:
                return e
            numbers.append(float(e))
            return arg(len(where) + len(numbers) - 1)
        if isinstance(e, sympy.Pow) and isinstance(e.exp, sympy.Integer):
            return sympy.Pow(walk(e.base), e.exp, evaluate=False)
        if not e.args:
            return e  # pi, E: constants of their own
        return e.func(*(walk(a) for a in e.args), evaluate=False)

    return walk(e)


class RateLaws:
    """The right-hand side `rhs(t, x, k)` of an SBML model as `N @ v / sizes`: the
    stoichiometry matrix `N` (sparse, NumPy constants), the vector `v` of the reactions'
    rates and the compartment sizes, both [`Vectorised`][]; the assignment rules,
    fixed species and derived constants the rates name are computed first, once."""

    def __init__(self, sympy: Any, ode: SbmlOde):
        sym = lambda k: sympy.Symbol(k, real=True)
        base = [ode.time, *(sym(s) for s in ode.species)]
        base += [sym(c) for c in ode.constants]
        named = set().union(*(sympy.sympify(r).free_symbols for r in ode.rates))
        named |= set().union(*(sympy.sympify(v).free_symbols for v in ode.sizes))
        known = [k for k in ode.expressions if sym(k) in named]
        self.known = Vectorised(sympy, [ode.expressions[k] for k in known], base)
        symbols = [*base, *(sym(k) for k in known)]
        self.rates = Vectorised(sympy, ode.rates, symbols)
        self.sizes = Vectorised(sympy, ode.sizes, symbols)
        # N, sparse, as each species' reactions and stoichiometries, padded to the
        # longest row with reaction 0 and stoichiometry 0.
        rows: list[list[tuple[int, float]]] = [[] for _ in ode.species]
        for i, r, stoich in ode.stoichiometry:
            rows[i].append((r, stoich))
        width = max([len(row) for row in rows] + [1])
        self.reactions = np.zeros((len(rows), width), np.int64)
        self.stoichiometry = np.zeros((len(rows), width), np.float64)
        for i, row in enumerate(rows):
            for j, (r, stoich) in enumerate(row):
                self.reactions[i, j], self.stoichiometry[i, j] = r, stoich

    def __call__(self, t: Any, x: Any, k: Any) -> Any:
        dtype = jnp.result_type(x, k)
        z = jnp.concatenate([jnp.reshape(t, (1,)).astype(dtype), x, k]).astype(dtype)
        z = jnp.concatenate([z, self.known(z)])
        v = self.rates(z)
        # N @ v, N sparse: a gather and a sum. A dense product costs n x reactions
        # per call and n times that in each Jacobian (75 x 618 x 75 for
        # SalazarCavazos: 2.3 ms), `segment_sum` a scatter as slow on CPU.
        if not v.shape[0]:
            return jnp.zeros_like(x)
        dx = jnp.sum(jnp.asarray(self.stoichiometry, dtype) * v[self.reactions], axis=1)
        return dx / self.sizes(z)


class _Formula:
    """One formula as `fn(t, x, k, q, placeholders)`, lambdified in the symbols it
    names only: those are gathered from `[t, x, k, q, placeholders]` at once. (A
    function of every state and constant unpacks them all, one operation each, for
    each formula: Lang et al. 2024's 30 formulas of a 124-species model with 600
    constants were 19,000 of its 40,000 traced operations.)"""

    def __init__(self, lam: Any, expr: Any, layout: Sequence[Any]):
        where = {s: i for i, s in enumerate(layout)}
        used = sorted(expr.free_symbols, key=str)
        self.index = np.asarray([where[s] for s in used], np.int64)
        self.fn = lam(used, expr)

    def __call__(self, t: Any, x: Any, k: Any, q: Any, placeholders: Any) -> Any:
        if not len(self.index):
            return self.fn()
        z = jnp.concatenate([jnp.reshape(t, (1,)), x, k, q, placeholders])
        cols = z[self.index]
        return self.fn(*(cols[i] for i in range(len(self.index))))


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
            layout = [t, *x, *k, *q, *(sym(nm) for nm in names)]
            out.append(_Formula(lam, expr, layout))
    x0 = Vectorised(sympy, ode.x0, k)
    return Formulas(
        rhs=RateLaws(sympy, ode),
        x0=lambda constants: x0(constants),
        h=tuple(h),
        sigma=tuple(sigma),
    )
