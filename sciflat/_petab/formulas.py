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

import jax
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
                fn = sympy.lambdify(names, template, modules="jax", cse=True)
                groups[key] = (fn, [], [])
            groups[key][1].append(j)
            groups[key][2].append(args)
        self.n_symbols, self.size = len(symbols), len(exprs)
        self.numbers = np.asarray(numbers, np.float64)
        self.groups = tuple(
            (fn, np.asarray(rows, np.int64).reshape(len(rows), -1))
            for fn, _, rows in groups.values()
        )
        self.order = np.asarray(
            [j for _, rows, _ in groups.values() for j in rows], np.int64
        )  # the expression of each entry of the groups' outputs, concatenated
        self.inverse = np.argsort(self.order)

    def __call__(self, z: Any) -> Any:
        if not self.size:
            return jnp.zeros((0,), z.dtype)
        return self.grouped(z)[self.inverse]

    def grouped(self, z: Any) -> Any:
        """`self(z)` in the groups' order (`self(z)` is `grouped(z)[inverse]`)."""
        zz = jnp.concatenate([z, jnp.asarray(self.numbers, z.dtype)])
        parts = []
        for fn, idx in self.groups:
            cols = zz[idx]  # (rows, template arguments)
            out = fn(*(cols[:, i] for i in range(idx.shape[1])))
            parts.append(jnp.broadcast_to(jnp.asarray(out, z.dtype), (idx.shape[0],)))
        return jnp.concatenate(parts)

    def derivative(self, direct: dict[int, int], chained: dict[int, int], m: int):
        """The Jacobian `d self(z) / d x`, `x` a vector of `m` entries that some
        symbols are (`z[c]` is `x[direct[c]]`) and others depend on (`z[c]` has the
        derivative `chained_jac[chained[c]]`, a row given at the call): a
        [`_Derivative`][]."""
        return _Derivative(self, direct, chained, m)


def initial_states(sympy: Any, exprs: Sequence[Any], symbols: Sequence[Any]) -> Any:
    """The initial states' formulas as one function of the constants `z`. Where they
    share subexpressions (closed-form steady states, as Fiedler et al. 2016's six,
    each repeating one polynomial of the rates: 1,039 operations as templates, 208
    with the shared parts computed once), one lambdified function with SymPy's
    common-subexpression elimination over all of them; else a [`Vectorised`][]."""
    replacements, _ = sympy.cse([sympy.sympify(e) for e in exprs])
    if not replacements:
        return Vectorised(sympy, exprs, symbols)
    fn = sympy.lambdify(list(symbols), list(exprs), modules="jax", cse=True)

    def joint(z: Any) -> Any:
        values = fn(*(z[i] for i in range(len(symbols))))
        return jnp.stack([jnp.asarray(v, z.dtype) for v in values])

    return joint


class _Derivative:
    """`d v(z) / d x` of a [`Vectorised`][] `v`, computed a template at a time: for
    each argument of a template that is (or depends on) an entry of `x`, the
    template's partial derivative in that argument at every row (one forward-mode
    derivative of the vectorised template, elementwise, so JAX's own rules at every
    point: no symbolic derivative that is 0/0 where JAX's is defined), times a
    constant one-hot matrix of which entry of `x` it is (or the given Jacobian of
    what it depends on). `jax.jacfwd` of the vectorised function instead carries `m`
    tangents through every gather and concatenation of it."""

    def __init__(self, vec: Vectorised, direct: dict, chained: dict, m: int):
        self.vec, self.m = vec, m
        self.terms: list[list[tuple[int, Any, Any]]] = []
        for _, idx in vec.groups:
            group = []
            for i in range(idx.shape[1]):
                cols = [int(c) for c in idx[:, i]]
                onehot = None
                if any(c in direct for c in cols):
                    onehot = np.zeros((len(cols), m), np.float64)
                    for r, c in enumerate(cols):
                        if c in direct:
                            onehot[r, direct[c]] = 1.0
                rows = None
                if any(c in chained for c in cols):  # -1: a zero row at the end
                    rows = np.asarray([chained.get(c, -1) for c in cols], np.int64)
                if onehot is not None or rows is not None:
                    group.append((i, onehot, rows))
            self.terms.append(group)

    def partials(self, z: Any, chained_jac: Any = None) -> list[list[tuple]]:
        """Per group, per argument that is (or depends on) an entry of `x`: the
        template's partial derivative in it at every row, its one-hot matrix (or
        None) and the rows of `chained_jac` it depends on (or None)."""
        vec, dtype = self.vec, z.dtype
        zz = jnp.concatenate([z, jnp.asarray(vec.numbers, dtype)])
        if chained_jac is not None:
            chained_jac = jnp.concatenate([chained_jac, jnp.zeros((1, self.m), dtype)])
        out = []
        for (fn, idx), group in zip(vec.groups, self.terms, strict=True):
            cols = zz[idx]
            args = [cols[:, i] for i in range(idx.shape[1])]
            pieces = []
            for i, onehot, rows in group:
                partial = _partial(fn, args, i)
                partial = jnp.broadcast_to(jnp.asarray(partial, dtype), (idx.shape[0],))
                rows_jac = None
                if rows is not None:
                    assert chained_jac is not None  # `chained` named its rows
                    rows_jac = chained_jac[rows]
                pieces.append((partial, onehot, rows_jac))
            out.append(pieces)
        return out

    def __call__(self, z: Any, chained_jac: Any = None) -> Any:
        vec, dtype = self.vec, z.dtype
        if not vec.size:
            return jnp.zeros((0, self.m), dtype)
        parts = []
        for (_, idx), pieces in zip(
            vec.groups, self.partials(z, chained_jac), strict=True
        ):
            out = jnp.zeros((idx.shape[0], self.m), dtype)
            for partial, onehot, rows_jac in pieces:
                if onehot is not None:
                    out = out + partial[:, None] * jnp.asarray(onehot, dtype)
                if rows_jac is not None:
                    out = out + partial[:, None] * rows_jac
            parts.append(out)
        return jnp.concatenate(parts)[vec.inverse]


def _partial(fn: Any, args: list, i: int) -> Any:
    """The partial derivative of an elementwise `fn(*args)` in its `i`-th argument,
    at every row: one forward-mode derivative with a tangent of ones."""
    one = lambda a: fn(*args[:i], a, *args[i + 1 :])
    return jax.jvp(one, (args[i],), (jnp.ones_like(args[i]),))[1]


def _template(sympy: Any, e: Any, where: dict, numbers: list, args: list) -> Any:
    """`e` with each symbol and each number (other than an integer exponent, -1 or
    1) a placeholder `_a{n}`, numbered in order of first appearance: a symbol or
    number that appears again is the same placeholder, so that SymPy's common
    subexpressions are still common (Fiedler et al. 2016's initial states repeat one
    square root of a polynomial in the parameters in each of six formulas). `args`
    gets their indices into `[z, numbers]`."""
    seen: dict[Any, Any] = {}

    def arg(key: Any, index: Any) -> Any:
        if key not in seen:
            args.append(index() if callable(index) else index)
            seen[key] = sympy.Symbol(f"_a{len(args) - 1}", real=True)
        return seen[key]

    def number(value: float) -> int:
        numbers.append(value)
        return len(where) + len(numbers) - 1

    def walk(e: Any) -> Any:
        if isinstance(e, sympy.Symbol):
            return arg(("symbol", e), where[e])
        if isinstance(e, sympy.Number):
            if e in (sympy.Integer(1), sympy.Integer(-1)) or not e.is_finite:
                return e
            value = float(e)
            return arg(("number", value), lambda: number(value))
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
    fixed species and derived constants the rates name are computed first, once.

    Its derivative in `x` is the Jacobian `N @ dv/dx / sizes` (`jacobian`), `dv/dx`
    computed a template at a time ([`_Derivative`][]), the assignment rules' own
    derivatives chained in: a custom JVP, so the implicit solvers' Jacobians
    (`jax.jacfwd`, Lineax's `JacobianLinearOperator`) compute it once and multiply,
    rather than push `len(x)` tangents through every rate law. Where the sizes depend
    on the state, JAX's own derivative is kept.

    `batched`: whether it is evaluated over a batch of conditions (`jax.vmap`).
    Where `N @ v` is summed over `N`'s nonzeros, a batch sums them by XLA's
    scatter (`segment_sum`), one condition by two padded gathers and sums
    (`_short_rows`): XLA:CPU's batched gathers are the slower (SalazarCavazos et
    al. 2020, four conditions: 21.8 µs against 8.7), its gathers alone the faster
    (Lang et al. 2024, one condition: 3.0 against 5.6; its `nll` 343 ms against
    390)."""

    def __init__(
        self,
        sympy: Any,
        ode: SbmlOde,
        sparse: bool | None = None,
        batched: bool = True,
    ):
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
        # The Jacobian's plan: which symbols are states (z[1 + i] is x[i]), which
        # assignment rules depend on them.
        n = len(ode.species)
        species = {sym(s) for s in ode.species}
        direct = {1 + i: i for i in range(n)}
        on_x = [
            j
            for j, k in enumerate(known)
            if sympy.sympify(ode.expressions[k]).free_symbols & species
        ]
        chained = {len(base) + j: row for row, j in enumerate(on_x)}
        self._on_x = np.asarray(on_x, np.int64)
        self._d_known = self.known.derivative(direct, {}, n)
        self._d_rates = self.rates.derivative(direct, chained, n)
        self._plan_sparse(n, direct, sparse)
        self._gathers = self.sparse_rates and not batched
        if self._gathers:
            self._nz_rows = _short_rows(
                self._nz_species, self._nz_grouped, self._nz_coef, n, self.rates.size
            )
        sizes_on_x = any(
            sympy.sympify(v).free_symbols & (species | {sym(known[j]) for j in on_x})
            for v in ode.sizes
        )
        self.analytic = not sizes_on_x
        rhs = jax.custom_jvp(self.evaluate)
        rhs.defjvp(self._jvp, symbolic_zeros=True)
        self._rhs = rhs
        together = jax.custom_jvp(self._evaluate_batched)
        together.defjvp(self._batched_jvp)
        self._batched = together
        matvec = jax.custom_jvp(self._jacobian_times)
        matvec.defjvp(self._jacobian_times_jvp, symbolic_zeros=True)
        self._matvec = matvec

    def __call__(self, t: Any, x: Any, k: Any) -> Any:
        return self._rhs(t, x, k) if self.analytic else self.evaluate(t, x, k)

    def batched(self, t: Any, x: Any, k: Any) -> Any:
        """`jax.vmap(self)` over a batch of conditions, `t` `(C,)`, `x` `(C, n)`, `k`
        `(C, k)`. Where `N @ v` is a scatter over `N`'s nonzeros, the batch's is one
        scatter with the conditions last, each nonzero moving the `C` conditions'
        terms at once, where `jax.vmap` scatters them one condition at a time
        (SalazarCavazos et al. 2020's 2,016 nonzeros, four conditions, alone in a
        loop: 5.4-7.7 µs against 9.3-9.9), and each nonzero's rate is gathered
        from the templates' outputs directly (one gather less). Its derivatives
        are those of `jax.vmap(self)`."""
        if self.analytic and self.sparse_rates and not self._gathers:
            return self._batched(t, x, k)
        return jax.vmap(self)(t, x, k)

    def _evaluate_batched(self, t: Any, x: Any, k: Any) -> Any:
        z = jax.vmap(self._z)(t, x, k)
        if not self.rates.size:
            return jnp.zeros_like(x)
        # The rates in the templates' order, each nonzero's gathered from there.
        v = jax.vmap(self.rates.grouped)(z).T  # (R, C)
        terms = jnp.asarray(self._nz_coef, v.dtype)[:, None] * v[self._nz_grouped]
        dx = jax.ops.segment_sum(
            terms, self._nz_species, num_segments=x.shape[1], indices_are_sorted=True
        )
        return dx.T / jax.vmap(self.sizes)(z)

    def _batched_jvp(self, primals: Any, tangents: Any) -> Any:
        return jax.jvp(jax.vmap(self._rhs), primals, tangents)

    def _z(self, t: Any, x: Any, k: Any) -> Any:
        dtype = jnp.result_type(x, k)
        z = jnp.concatenate([jnp.reshape(t, (1,)).astype(dtype), x, k]).astype(dtype)
        return jnp.concatenate([z, self.known(z)])

    def evaluate(self, t: Any, x: Any, k: Any) -> Any:
        """`dx/dt`, differentiated by JAX's own rules."""
        z = self._z(t, x, k)
        if not self.rates.size:
            return jnp.zeros_like(x)
        # The rates in the templates' order: the indices below point there.
        v = self.rates.grouped(z)
        if self._gathers:
            # N's nonzeros in short rows (a gather and a sum each), then each
            # species' rows: the padding reads the zero after `v`, after `part`.
            reaction, coef, rows = self._nz_rows
            zero = jnp.zeros((1,), v.dtype)
            v = jnp.concatenate([v, zero])
            part = jnp.sum(jnp.asarray(coef, v.dtype) * v[reaction], axis=1)
            dx = jnp.sum(jnp.concatenate([part, zero])[rows], axis=1)
        elif self.sparse_rates:
            dx = jax.ops.segment_sum(
                jnp.asarray(self._nz_coef, v.dtype) * v[self._nz_grouped],
                self._nz_species,
                num_segments=x.shape[0],
                indices_are_sorted=True,
            )
        else:
            dx = jnp.sum(
                jnp.asarray(self.stoichiometry, v.dtype) * v[self._grouped], axis=1
            )
        return dx / self.sizes(z)

    def jacobian(self, t: Any, x: Any, k: Any) -> Any:
        """`d rhs / d x` at `(t, x, k)`, `(n, n)`: analytic where the compartment
        sizes do not depend on the state (`self.analytic`), else `jax.jacfwd`."""
        if not self.analytic:
            return jax.jacfwd(self.evaluate, argnums=1)(t, x, k)
        z = self._z(t, x, k)
        n = x.shape[0]
        if not self.rates.size:
            return jnp.zeros((n, n), z.dtype)
        d_known = self._d_known(z[: z.shape[0] - self.known.size])
        chained = d_known[self._on_x]
        if self.sparse_jacobian:
            jac = self._sparse_jacobian(z, chained, n)
        else:
            dv = self._d_rates(z, chained)
            stoich = jnp.asarray(self.stoichiometry, z.dtype)
            jac = jnp.sum(stoich[:, :, None] * dv[self.reactions], axis=1)
        return jac / self.sizes(z)[:, None]

    def _plan_sparse(self, n: int, direct: dict[int, int], sparse: bool | None):
        """How `N @ v` and the Jacobian `N @ dv/dx` are summed. Each species' row
        of `N` padded to the longest (a gather and a sum over a dense block) is
        fastest while the rows are about as long; where a few species take part in
        far more reactions than the others (Lang et al. 2024: one in 200 of 669
        reactions, 124 species, 2,288 nonzeros; the Jacobian's padded block is
        124 x 200 x 124), the sums run over the nonzeros only (`segment_sum`):
        `N`'s for `N @ v`, and for the Jacobian the products `N[i, r] dv_r/dx_s`
        of every reaction `r`, argument `s` of its rate law that is a state, and
        species `i` it changes. `sparse=None` chooses each by the sizes; True or
        False forces both."""
        nz_species, slot = np.nonzero(self.stoichiometry)  # sorted by species
        self._nz_species = nz_species
        self._nz_reaction = self.reactions[nz_species, slot]
        self._nz_coef = self.stoichiometry[nz_species, slot]
        # ... and where `rates.grouped` puts each nonzero's (each padded entry's)
        # reaction: one gather from the templates' outputs, not two.
        # (A model without reactions pads with reaction 0.)
        where = self.rates.inverse if self.rates.size else np.zeros(1, np.int64)
        self._nz_grouped = where[self._nz_reaction]
        self._grouped = where[self.reactions]
        by_reaction: list[list[tuple[int, float]]] = [
            [] for _ in range(self.rates.size)
        ]
        for i, r, c in zip(nz_species, self._nz_reaction, self._nz_coef, strict=True):
            by_reaction[int(r)].append((int(i), float(c)))
        # The Jacobian's products: targets (entries of J, flat), coefficients
        # (N[i, r]) and sources (entries of the direct partials, concatenated); for
        # arguments that depend on the state through an assignment rule, rows of
        # the chained partials (each a row of J's).
        direct_plan: list[tuple[int, float, int]] = []
        chained_plan: list[tuple[int, float, int]] = []
        start = n_direct = n_chained = 0
        for (_, idx), group in zip(self.rates.groups, self._d_rates.terms, strict=True):
            for i, onehot, rows in group:
                for local in range(idx.shape[0]):
                    r = int(self.rates.order[start + local])
                    column = direct.get(int(idx[local, i]))
                    if onehot is not None and column is not None:
                        for sp, c in by_reaction[r]:
                            direct_plan.append((sp * n + column, c, n_direct + local))
                    if rows is not None and rows[local] >= 0:
                        for sp, c in by_reaction[r]:
                            chained_plan.append((sp, c, n_chained + local))
                n_direct += idx.shape[0] if onehot is not None else 0
                n_chained += idx.shape[0] if rows is not None else 0
            start += idx.shape[0]
        direct_plan.sort(key=lambda e: e[0])  # stable: a fixed order of the sums
        chained_plan.sort(key=lambda e: e[0])
        self._jac_plan = tuple(_columns(plan) for plan in (direct_plan, chained_plan))
        # Timed inside a loop (`N @ v` / the Jacobian, µs): Lang 150 / 2,746 padded
        # against 16 / 29 summed over the nonzeros, SalazarCavazos 16 / 134 against
        # 12 / 16, Laske 3.3 / 25 against 1.3 / 5.5; Boehm 0.38 / 0.46 against
        # 0.39 / 0.43, Borghans (3 species) 0.20 / 0.56 against 0.23 / 0.65.
        padded = n * self.reactions.shape[1]
        length = len(direct_plan) + n * len(chained_plan)
        if sparse is None:
            self.sparse_rates = padded >= 3 * len(nz_species) or len(nz_species) >= 1000
            self.sparse_jacobian = padded * n > 2 * length
        else:
            self.sparse_rates = self.sparse_jacobian = bool(sparse)

    def _sparse_jacobian(self, z: Any, chained: Any, n: int) -> Any:
        dtype = z.dtype
        direct, onto = [], []
        for pieces in self._d_rates.partials(z, chained):
            for partial, onehot, rows_jac in pieces:
                if onehot is not None:
                    direct.append(partial)
                if rows_jac is not None:
                    onto.append(partial[:, None] * rows_jac)
        jac = jnp.zeros((n * n,), dtype)
        if self._jac_plan[0] is not None:
            targets, coef, sources = self._jac_plan[0]
            values = jnp.asarray(coef, dtype) * jnp.concatenate(direct)[sources]
            jac = jac + jax.ops.segment_sum(
                values, targets, num_segments=n * n, indices_are_sorted=True
            )
        jac = jnp.reshape(jac, (n, n))
        if self._jac_plan[1] is not None:
            targets, coef, sources = self._jac_plan[1]
            values = jnp.asarray(coef, dtype)[:, None] * jnp.concatenate(onto)[sources]
            jac = jac + jax.ops.segment_sum(
                values, targets, num_segments=n, indices_are_sorted=True
            )
        return jac

    def _jvp(self, primals: Any, tangents: Any) -> Any:
        t, x, k = primals
        dt, dx, dk = tangents
        out = self.evaluate(t, x, k)
        dout = jnp.zeros_like(out)
        if not _zero(dx):
            dout = dout + self._matvec(t, x, k, dx)
        if not (_zero(dt) and _zero(dk)):
            dt = jnp.zeros_like(t) if _zero(dt) else dt
            dk = jnp.zeros_like(k) if _zero(dk) else dk
            fn = lambda t, k: self.evaluate(t, x, k)
            dout = dout + jax.jvp(fn, (t, k), (dt, dk))[1]
        return out, dout

    def _jacobian_times(self, t: Any, x: Any, k: Any, v: Any) -> Any:
        return self.jacobian(t, x, k) @ v

    def _jacobian_times_jvp(self, primals: Any, tangents: Any) -> Any:
        """The derivative of `J(t, x, k) v`: in `v`, `J dv`; in `(t, x, k)`, the
        directional second derivative of `evaluate` (JAX's forward over forward,
        what it cost before: not the derivative of the whole matrix `J`)."""
        t, x, k, v = primals
        dt, dx, dk, dv = tangents
        out = self._matvec(t, x, k, v)
        dout = jnp.zeros_like(out)
        if not (_zero(dt) and _zero(dx) and _zero(dk)):
            along = [
                jnp.zeros_like(a) if _zero(d) else d
                for a, d in ((t, dt), (x, dx), (k, dk))
            ]

            def jv(t: Any, x: Any, k: Any) -> Any:
                return jax.jvp(lambda y: self.evaluate(t, y, k), (x,), (v,))[1]

            dout = dout + jax.jvp(jv, (t, x, k), tuple(along))[1]
        if not _zero(dv):
            dout = dout + self._matvec(t, x, k, dv)
        return out, dout


# `N @ v` over the nonzeros sums each species' in rows of at most this many.
_ROW = 8


def _short_rows(species: Any, reaction: Any, coef: Any, n: int, m: int) -> tuple:
    """`N`'s nonzeros (sorted by species) as rows of at most `_ROW`, each species'
    in turn: `(reaction, coef)` `(R, _ROW)`, padded with reaction `m` (the number of
    reactions: the caller appends a zero rate) and coefficient 0, and each species' rows
    `(n, M)`, padded with row `R` (a zero appended). Two padded gathers and sums
    in place of a scatter over the nonzeros (`segment_sum`): Lang et al. 2024's
    `N @ v` (2,288 nonzeros, one species in 200 of 669 reactions) 3.0 µs against
    5.6, SalazarCavazos et al. 2020's 1.7 against 5.1 (alone in a loop); a
    species' row padded to the longest took 45 µs on Lang."""
    reactions, coefs, owner = [], [], []
    for i in range(n):
        mine = np.flatnonzero(species == i)
        for start in range(0, len(mine), _ROW):
            at = mine[start : start + _ROW]
            pad = _ROW - len(at)
            reactions.append(np.concatenate([reaction[at], np.full(pad, m)]))
            coefs.append(np.concatenate([coef[at], np.zeros(pad)]))
            owner.append(i)
    r = len(owner)
    counts = np.bincount(np.asarray(owner, np.int64), minlength=n)
    rows = np.full((n, max(int(counts.max(initial=0)), 1)), r, np.int64)
    at = 0
    for i in range(n):
        rows[i, : counts[i]] = np.arange(at, at + counts[i])
        at += counts[i]
    shape = (r, _ROW)
    return (
        np.asarray(reactions, np.int64).reshape(shape),
        np.asarray(coefs, np.float64).reshape(shape),
        rows,
    )


def _columns(plan: list[tuple[int, float, int]]) -> tuple | None:
    """A plan of sums (target, coefficient, source) as three arrays; None if empty."""
    if not plan:
        return None
    targets, coef, sources = zip(*plan, strict=True)
    return (
        np.asarray(targets, np.int64),
        np.asarray(coef, np.float64),
        np.asarray(sources, np.int64),
    )


def _zero(tangent: Any) -> bool:
    return isinstance(tangent, jax.custom_derivatives.SymbolicZero)


class _Formula:
    """One formula as `fn(t, x, k, q, placeholders)`, lambdified in the symbols it
    names only: those are gathered from `[t, x, k, q, placeholders]` at once. (A
    function of every state and constant unpacks them all, one operation each, for
    each formula: Lang et al. 2024's 30 formulas of a 124-species model with 600
    constants were 19,000 of its 40,000 traced operations.)

    `named(t, x, k[constants], q, placeholders)` is the same value from the model
    constants it names only (`constants`, indices into `k`): what a batch of rows
    from several conditions gathers per row, instead of every constant."""

    def __init__(self, lam: Any, expr: Any, layout: Sequence[Any], n_x: int, n_k: int):
        where = {s: i for i, s in enumerate(layout)}
        used = sorted(expr.free_symbols, key=str)
        self.index = np.asarray([where[s] for s in used], np.int64)
        lo, hi = 1 + n_x, 1 + n_x + n_k
        in_k = (self.index >= lo) & (self.index < hi)
        self.constants = np.unique(self.index[in_k] - lo)
        named = np.where(self.index >= hi, self.index - n_k + len(self.constants), 0)
        named = np.where(self.index < lo, self.index, named)
        where_k = np.searchsorted(self.constants, self.index[in_k] - lo)
        named[in_k] = lo + where_k
        self.named_index = named
        self.fn = lam(used, expr)

    def __call__(self, t: Any, x: Any, k: Any, q: Any, placeholders: Any) -> Any:
        return self.named(t, x, k[self.constants], q, placeholders)

    def named(self, t: Any, x: Any, k: Any, q: Any, placeholders: Any) -> Any:
        if not len(self.index):
            return self.fn()
        z = jnp.concatenate([jnp.reshape(t, (1,)), x, k, q, placeholders])
        cols = z[self.named_index]
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
    # Formulas that are the same but for their placeholders' names (one formula
    # under several observable ids, as Lucarelli et al. 2018's 65 observables have 37
    # observable and 16 noise formulas) are one `_Formula`: traced once for all of
    # their rows (the objective groups them).
    seen: dict[str, _Formula] = {}
    for oid in tables.observable_ids:
        row: Row = tables.observables[oid]
        observable, noise = tables.placeholders[oid]
        for column, names, out in (
            ("observableFormula", observable, h),
            ("noiseFormula", [*observable, *noise], sigma),
        ):
            where = f"Observable {oid!r}, {column}"
            expr = parse(sympy, ode, table_ids, row[column], where, names)
            slots = [sym(f"_placeholder{i}") for i in range(len(names))]
            expr = expr.xreplace(dict(zip(map(sym, names), slots, strict=True)))
            key = f"{len(names)}:{sympy.srepr(expr)}"
            if key not in seen:
                layout = [t, *x, *k, *q, *slots]
                seen[key] = _Formula(lam, expr, layout, len(x), len(k))
            out.append(seen[key])
    x0 = initial_states(sympy, ode.x0, k)
    return Formulas(
        # One condition: the right-hand side is never batched (a batch of one).
        rhs=RateLaws(sympy, ode, batched=len(tables.conditions) > 1),
        x0=lambda constants: x0(constants),
        h=tuple(h),
        sigma=tuple(sigma),
    )
