"""An SBML model as a symbolic ODE: species, compartments, parameters, rules, reactions.

Reads the subset of SBML (levels 2 and 3) that the PEtab benchmark models without events
use, with python-libsbml, into SymPy expressions: the right-hand side dx/dt(t, x, k), the
initial state x0(k) and every other quantity a formula may name. The state holds each
species as its formulas see it: a concentration (amount / compartment size) for
`hasOnlySubstanceUnits="false"`, an amount otherwise; reaction rates are amounts per
time, so d[S]/dt = sum(stoichiometry * rate) / size. Anything outside the subset is a
`ValueError` naming the element, never a silently different model.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any


try:
    import sympy
except ImportError:  # pragma: no cover (the `petab` extra installs it)
    raise ImportError(
        'sciflat\'s PEtab reader needs sympy: pip install "sciflat[petab]".'
    ) from None


def _libsbml() -> Any:
    try:
        import libsbml
    except ImportError:
        raise ImportError(
            'Reading SBML needs python-libsbml and sympy: pip install "sciflat[petab]".'
        ) from None
    return libsbml


Expr = Any  # a SymPy expression (SymPy's own annotations are too loose to check)
Read = Callable[[Any, str], Expr]  # libsbml's math, and where it is -> SymPy


@dataclasses.dataclass(frozen=True)
class SbmlOde:
    """The ODE of an SBML model, symbolic.

    **Fields:**

    - `species`: the state's ids, in order.
    - `rhs`: dx/dt, one expression per state, in `time`, the state's symbols and
        the `constants`' symbols (assignment rules substituted).
    - `x0`: the initial state, in the `constants`' symbols.
    - `constants`: every parameter and compartment a formula may name, with its
        value in the model (`{id: float}`).
    - `expressions`: what an observable formula may name besides the state and the
        constants: assignment-rule targets, as expressions of those.
    - `time`: the symbol of time.
    - `rates`: each reaction's rate (amount per time), in `time`, the state's
        symbols, the constants' and those of `expressions` (not substituted).
    - `stoichiometry`: `(state index, reaction index, signed stoichiometry)` of each
        reactant and product that is part of the state.
    - `sizes`: per state, what its rate of change is divided by: its compartment's
        symbol for a concentration, 1 for an amount.

    `rhs[i] == sum(n * rates[r] for i, r, n in stoichiometry) / sizes[i]`, with
    `expressions` substituted: the same right-hand side as a matrix times a vector of
    rates, which is how it is compiled (`formulas.py`).
    """

    species: tuple[str, ...]
    rhs: tuple[Expr, ...]
    x0: tuple[Expr, ...]
    constants: dict[str, float]
    expressions: dict[str, Expr]
    time: sympy.Symbol
    rates: tuple[Expr, ...] = ()
    stoichiometry: tuple[tuple[int, int, float], ...] = ()
    sizes: tuple[Expr, ...] = ()

    def symbol(self, name: str) -> sympy.Symbol:
        return sympy.Symbol(name, real=True)


_TIME = sympy.Symbol("t", real=True)


def _unsupported(what: str, fix: str = "") -> ValueError:
    return ValueError(
        f"The SBML model has {what}, which sciflat's PEtab reader does not support"
        f"{': ' + fix if fix else ''}. It reads reactions, compartments, parameters, "
        "initial assignments and assignment rules only (a different model would be "
        "silently wrong)."
    )


class _Math:
    """libsbml's ASTNode -> SymPy, for the functions SBML's MathML subset names."""

    def __init__(self, libsbml: Any, where: str):
        self.s = libsbml
        self.where = where
        L = libsbml
        self.n_ary = {
            L.AST_PLUS: sympy.Add,
            L.AST_TIMES: sympy.Mul,
        }
        self.unary = {
            L.AST_FUNCTION_EXP: sympy.exp,
            L.AST_FUNCTION_LN: sympy.log,
            L.AST_FUNCTION_ABS: sympy.Abs,
            L.AST_FUNCTION_SIN: sympy.sin,
            L.AST_FUNCTION_COS: sympy.cos,
            L.AST_FUNCTION_TAN: sympy.tan,
            L.AST_FUNCTION_TANH: sympy.tanh,
            L.AST_FUNCTION_SINH: sympy.sinh,
            L.AST_FUNCTION_COSH: sympy.cosh,
            L.AST_FUNCTION_FLOOR: sympy.floor,
            L.AST_FUNCTION_CEILING: sympy.ceiling,
        }

    def __call__(self, node: Any) -> Expr:
        L = self.s
        if node is None:
            raise ValueError(f"{self.where}: missing or unreadable math.")
        kind = node.getType()
        if kind == L.AST_FUNCTION_DELAY:
            raise _unsupported(f"a delay in {self.where}")
        if kind == L.AST_FUNCTION_PIECEWISE:
            raise _unsupported(f"a piecewise function in {self.where}")
        kids = [self(node.getChild(i)) for i in range(node.getNumChildren())]
        if kind == L.AST_NAME:
            return sympy.Symbol(node.getName(), real=True)
        if kind == L.AST_NAME_TIME:
            return _TIME
        if kind == L.AST_INTEGER:
            return sympy.Integer(node.getInteger())
        if kind in (L.AST_REAL, L.AST_REAL_E):
            return sympy.Float(node.getReal(), 17)
        if kind == L.AST_RATIONAL:
            return sympy.Rational(node.getNumerator(), node.getDenominator())
        if kind == L.AST_CONSTANT_PI:
            return sympy.pi
        if kind == L.AST_CONSTANT_E:
            return sympy.E
        if kind in self.n_ary:
            return (
                self.n_ary[kind](*kids)
                if kids
                else sympy.Integer(0 if kind == L.AST_PLUS else 1)
            )
        if kind == L.AST_MINUS:
            return -kids[0] if len(kids) == 1 else kids[0] - kids[1]
        if kind == L.AST_DIVIDE:
            return kids[0] / kids[1]
        if kind in (L.AST_POWER, L.AST_FUNCTION_POWER):
            return kids[0] ** kids[1]
        if kind == L.AST_FUNCTION_ROOT:
            degree = kids[0] if len(kids) == 2 else sympy.Integer(2)
            return kids[-1] ** (1 / degree)
        if kind == L.AST_FUNCTION_LOG:  # <log/> with an optional <logbase/>
            base = kids[0] if len(kids) == 2 else sympy.Integer(10)
            return sympy.log(kids[-1]) / sympy.log(base)
        if kind in self.unary:
            return self.unary[kind](kids[0])
        name = node.getName() or L.formulaToL3String(node)
        if kind == L.AST_FUNCTION:
            raise _unsupported(
                f"a call of function {name!r} in {self.where}",
                "function definitions are expanded first; this one could not be",
            )
        raise _unsupported(f"the MathML element {name!r} in {self.where}")


def read_sbml(path: str) -> SbmlOde:
    """The symbolic ODE of the SBML file at `path` (see the module's docstring)."""
    L = _libsbml()
    doc = L.readSBMLFromFile(str(path))
    if doc.getNumErrors(L.LIBSBML_SEV_ERROR) + doc.getNumErrors(L.LIBSBML_SEV_FATAL):
        raise ValueError(
            f"libsbml could not read {path}:\n{doc.getErrorLog().toString()}"
        )
    model = doc.getModel()
    if model is None:
        raise ValueError(f"{path} holds no SBML model.")
    if model.getNumFunctionDefinitions():
        props = L.ConversionProperties()
        props.addOption("expandFunctionDefinitions")
        if doc.convert(props) != L.LIBSBML_OPERATION_SUCCESS:
            raise _unsupported("function definitions that libsbml cannot expand")
        model = doc.getModel()
    return _ode(model, lambda node, where: _Math(L, where)(node))


#
# One kind of SBML element per function, each reading what the model holds of it.
#


def _sym(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, real=True)


def _refuse_unsupported(m: Any) -> None:
    if m.getNumEvents():
        ids = [m.getEvent(i).getId() or f"#{i}" for i in range(m.getNumEvents())]
        raise _unsupported(f"events ({', '.join(ids)})")
    if m.getNumConstraints():
        raise _unsupported("constraints")
    for i in range(m.getNumRules()):
        rule = m.getRule(i)
        if rule.isAlgebraic():
            raise _unsupported("an algebraic rule")
        if rule.isRate():
            raise _unsupported(f"a rate rule for {rule.getVariable()!r}")
    for i in range(m.getNumCompartments()):
        c = m.getCompartment(i)
        if not c.getConstant():
            raise _unsupported(f"compartment {c.getId()!r} of varying size")


def _constants(m: Any) -> dict[str, float]:
    """Compartment sizes (1 where unset) and parameter values (NaN where unset)."""
    constants: dict[str, float] = {}
    for i in range(m.getNumCompartments()):
        c = m.getCompartment(i)
        size = c.getSize() if c.isSetSize() else 1.0
        constants[c.getId()] = float(size) if not math.isnan(size) else 1.0
    for i in range(m.getNumParameters()):
        p = m.getParameter(i)
        constants[p.getId()] = float(p.getValue() if p.isSetValue() else math.nan)
    return constants


def _assignment_rules(m: Any, read: Read) -> dict[str, Expr]:
    rules: dict[str, Expr] = {}
    for i in range(m.getNumRules()):
        rule = m.getRule(i)  # assignment rules only, by now
        where = f"the assignment rule for {rule.getVariable()!r}"
        rules[rule.getVariable()] = read(rule.getMath(), where)
    return _resolve(rules, "assignment rules")


def _initial_assignments(m: Any, read: Read) -> dict[str, Expr]:
    initial: dict[str, Expr] = {}
    for i in range(m.getNumInitialAssignments()):
        a = m.getInitialAssignment(i)
        where = f"the initial assignment of {a.getSymbol()!r}"
        initial[a.getSymbol()] = read(a.getMath(), where)
    return initial


@dataclasses.dataclass
class _Species:
    """The species: the state (`ids`, `x0`), those no reaction changes (`fixed`), each
    one's compartment and whether it is held as an amount."""

    ids: list[str] = dataclasses.field(default_factory=list)
    x0: list[Expr] = dataclasses.field(default_factory=list)
    fixed: dict[str, Expr] = dataclasses.field(default_factory=dict)
    size_of: dict[str, Expr] = dataclasses.field(default_factory=dict)
    amounts: set[str] = dataclasses.field(default_factory=set)


def _initial_value(s: Any, amount: bool, initial: dict[str, Expr]) -> Expr:
    sid, size = s.getId(), _sym(s.getCompartment())
    if sid in initial:
        return initial[sid]
    if s.isSetInitialConcentration():
        value = sympy.Float(s.getInitialConcentration(), 17)
        return value * size if amount else value
    if s.isSetInitialAmount():
        value = sympy.Float(s.getInitialAmount(), 17)
        return value if amount else value / size
    raise ValueError(
        f"Species {sid!r} has no initial amount, concentration or assignment."
    )


def _species(m: Any, rules: dict[str, Expr], initial: dict[str, Expr]) -> _Species:
    out = _Species()
    for i in range(m.getNumSpecies()):
        s = m.getSpecies(i)
        sid = s.getId()
        out.size_of[sid] = _sym(s.getCompartment())
        if s.getHasOnlySubstanceUnits():
            out.amounts.add(sid)
        if sid in rules:
            continue  # an assignment rule gives it at every time
        value = _initial_value(s, sid in out.amounts, initial)
        if s.getConstant() or s.getBoundaryCondition():
            out.fixed[sid] = value  # no reaction changes it
        else:
            out.ids.append(sid)
            out.x0.append(value)
    return out


def _kinetic_law(reaction: Any, read: Read) -> Expr:
    """The rate of a reaction (amount per time), its local parameters substituted."""
    rid, law = reaction.getId(), reaction.getKineticLaw()
    if law is None or not law.isSetMath():
        raise ValueError(f"Reaction {rid!r} has no kinetic law.")
    rate = read(law.getMath(), f"the kinetic law of reaction {rid!r}")
    local = {}
    for j in range(law.getNumParameters()):
        q = law.getParameter(j)
        local[_sym(q.getId())] = sympy.Float(q.getValue(), 17)
    for j in range(law.getNumLocalParameters()):
        q = law.getLocalParameter(j)
        local[_sym(q.getId())] = sympy.Float(q.getValue(), 17)
    return rate.xreplace(local)


def _stoichiometry(ref: Any, rid: str, rules, initial) -> Expr:
    """A species reference's constant stoichiometry (1 where unset); refused where a
    rule or an initial assignment would set it."""
    sid, named = ref.getSpecies(), ref.getId() if ref.isSetId() else None
    if ref.isSetStoichiometryMath() or named in rules:
        raise _unsupported(f"a variable stoichiometry of {sid!r} in reaction {rid!r}")
    if named in initial:
        raise _unsupported(
            f"an initial assignment to the stoichiometry of {sid!r} in reaction {rid!r}"
        )
    stoich = ref.getStoichiometry() if ref.isSetStoichiometry() else 1.0
    return _number(1.0 if math.isnan(stoich) else stoich)


def _rates(m: Any, read: Read, species: _Species, rules, initial):
    """Each reaction's rate, and `(state index, reaction index, signed
    stoichiometry)` of each reactant and product in the state."""
    rates: list[Expr] = []
    entries: list[tuple[int, int, float]] = []
    index = {sid: i for i, sid in enumerate(species.ids)}
    for r in range(m.getNumReactions()):
        reaction = m.getReaction(r)
        rid = reaction.getId()
        rates.append(_kinetic_law(reaction, read))
        for sign, n, get in (
            (-1, reaction.getNumReactants(), reaction.getReactant),
            (1, reaction.getNumProducts(), reaction.getProduct),
        ):
            for j in range(n):
                ref = get(j)
                sid = ref.getSpecies()
                stoich = _stoichiometry(ref, rid, rules, initial)
                if sid not in index:
                    continue  # boundary or constant species, or a rule's target
                entries.append((index[sid], r, sign * float(stoich)))
    return rates, entries


def _sum_rates(n: int, rates: list[Expr], entries, sizes) -> list[Expr]:
    """dx/dt of the state: each reaction's rate times its stoichiometry, divided by
    the compartment's size for a species held as a concentration."""
    out: list[list[Expr]] = [[] for _ in range(n)]
    for i, r, stoich in entries:
        out[i].append(_number(stoich) * rates[r])
    return [sympy.Add(*terms) / size for terms, size in zip(out, sizes, strict=True)]


def _ode(m: Any, read: Read) -> SbmlOde:
    _refuse_unsupported(m)
    constants = _constants(m)
    rules = _assignment_rules(m, read)
    for name in rules:
        constants.pop(name, None)  # not a constant: its rule says what it is
    initial = _initial_assignments(m, read)
    species = _species(m, rules, initial)
    # Constant parameters given by an initial assignment: their expression.
    derived = {k: v for k, v in initial.items() if k in constants}
    for k in derived:
        constants.pop(k)
    rates, entries = _rates(m, read, species, rules, initial)
    sizes = [
        sympy.Integer(1) if sid in species.amounts else species.size_of[sid]
        for sid in species.ids
    ]
    # Everything but the state, time and the constants, substituted away.
    known = _resolve(
        {**species.fixed, **derived, **rules}, "initial assignments and rules"
    )
    subs = {_sym(k): v for k, v in known.items()}
    summed = _sum_rates(len(species.ids), rates, entries, sizes)
    rhs = tuple(sympy.sympify(e).xreplace(subs) for e in summed)
    x0 = _initial_state(species, subs)
    _check_model(species.ids, rhs, x0, constants)
    return SbmlOde(
        species=tuple(species.ids),
        rhs=rhs,
        x0=x0,
        constants=constants,
        expressions={k: sympy.sympify(v) for k, v in known.items()},
        time=_TIME,
        rates=tuple(rates),
        stoichiometry=tuple(entries),
        sizes=tuple(sizes),
    )


def _initial_state(species: _Species, subs: dict) -> tuple[Expr, ...]:
    """Initial values may name other species (their initial values) and rules."""
    pairs = list(zip(species.ids, species.x0, strict=True))
    init_subs = {**subs, **{_sym(s): v for s, v in pairs}}
    init = (_fixpoint(v, init_subs, f"the initial value of {s!r}") for s, v in pairs)
    return tuple(v.xreplace({_TIME: sympy.Integer(0)}) for v in init)


def _check_model(species, rhs, x0, constants: dict[str, float]) -> None:
    allowed = {_sym(k) for k in constants} | {_sym(s) for s in species} | {_TIME}
    for sid, e in zip(species, rhs, strict=True):
        _check_names(e, allowed, f"dx/dt of {sid!r}")
    for sid, e in zip(species, x0, strict=True):
        _check_names(e, allowed - {_TIME}, f"the initial value of {sid!r}")
    for k, v in constants.items():
        if math.isnan(v):
            raise ValueError(f"Parameter {k!r} has no value in the SBML model.")


def _number(x: float) -> Expr:
    return sympy.Integer(int(x)) if float(x).is_integer() else sympy.Float(x, 17)


def _fixpoint(expr: Expr, subs: dict, where: str) -> Expr:
    expr = sympy.sympify(expr)
    for _ in range(len(subs) + 1):
        new = expr.xreplace(subs)
        if new == expr:
            return expr
        expr = new
    raise ValueError(f"{where} refers to itself (a cycle of assignments).")


def _resolve(defs: dict[str, Expr], what: str) -> dict[str, Expr]:
    """Each definition with the others substituted into it (they may chain)."""
    subs = {sympy.Symbol(k, real=True): sympy.sympify(v) for k, v in defs.items()}
    return {k: _fixpoint(v, subs, f"the {what} of {k!r}") for k, v in defs.items()}


def _check_names(expr: Expr, allowed: set, where: str) -> None:
    unknown = sorted(str(s) for s in expr.free_symbols - allowed)
    if unknown:
        raise ValueError(
            f"{where} names {unknown}, which the SBML model does not define as a "
            "species, parameter or compartment."
        )
