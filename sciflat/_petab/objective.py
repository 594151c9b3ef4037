"""The objective of a PEtab problem and its simulation: every condition solved by
Diffrax, the observables and noise formulas at the measurements, the noise model's
negative log-likelihood and the residuals of least squares.

The model is a dict `{parameterId: value on its parameterScale}` of the estimated
parameters; `ext` (see `tables.py`) is computed from it once per call, and everything
else is a gather from `ext`.
"""

import dataclasses
import functools as ft
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float, Scalar

from .formulas import Formulas
from .priors import neg_log_prior, prior_offset, prior_residuals
from .tables import Tables


try:
    import diffrax
    import lineax as lx
    import optimistix as optx
except ImportError:  # pragma: no cover (the `petab` extra installs them)
    raise ImportError(
        'sciflat\'s PEtab reader needs diffrax: pip install "sciflat[petab]".'
    ) from None

from .bdf import ADJOINT_TIGHTER, BDF, bdf_adjoint, bdf_solve
from .controller import RejectionLimit
from .explicit import EXPLICIT_BELOW_STATES, explicit_budget, explicit_solve


# From this many species on, `BDF` solves the conditions in turn (`nll`'s a few at a
# time: `BDF_CHUNK`).
BDF_IN_TURN_FROM_STATES = 20
# `nll`'s solves in turn take up to this many simulations together (one batch, one
# loop over their steps), in chunks of equal size: the loop's kernels, which cost a
# large model's step more than its arithmetic, are then shared, and a chunk runs
# until its longest simulation ends. Bachmann et al. 2011's 12 simulations: 33.8
# ms one at a time, 26.2 two, 22.0 four, 38.8 all at once; Lucarelli et al. 2018's
# 12: 27.7 / 45.5 / 26.0 / 31.4 (one process, each chunk size a problem of its
# own).
BDF_CHUNK = 4
# Below this many species, those chunks hold 1, 2 or 4 simulations (three padded
# to four with a copy of the last): there a batch of three cost XLA:CPU about as
# much as one of four, or more (one simulation repeated in a batch, 2 cores, ms
# for 2 / 3 / 4 lanes: Laske et al. 2019, 34 species, 14.8 / 30.4 / 21.0;
# Lucarelli et al. 2018, 33: 5.8 / 8.5 / 8.6; Bachmann et al. 2011, 25: 6.5 / 8.2
# / 8.8), while at 75 species a lane's arithmetic is the cost (SalazarCavazos et
# al. 2020: 34.1 / 41.6 / 61.1); between the two, not measured. Laske's three
# simulations: `nll` 29.6 ms in a chunk of three, 21.3 padded to four.
BDF_WHOLE_CHUNKS_BELOW_STATES = 50
# A model of at most this many species and this many simulations solves them one
# at a time for `nll`: one simulation's arrays (its Newton matrix, its differences)
# are then at most 512 bytes, and XLA:CPU runs a loop body whose buffers all are
# kernel after kernel on the calling thread; a batch of a few crosses that size and
# its kernels go through XLA's pool, which a few lanes do not pay back (Fiedler et
# al. 2016, 3 simulations of 6 species: `nll` 0.84-0.85 times as long one at a
# time, Bertozzi et al. 2020, 2 of 3: 0.87; with 7 or 8 the batch is faster: Zhao
# et al. 2020's 7 simulations of 4 species 1.97 ms as one batch, 2.45 one at a
# time).
ONE_AT_A_TIME_UP_TO_STATES = 8
ONE_AT_A_TIME_UP_TO_SIMULATIONS = 4
# The adjoint's solves (with their record) and its backward runs take conditions
# together, as many as keep their Newton matrices within this many entries
# (conditions times species squared): the backward's work for each attempt is the
# whole batch's, which costs a larger model more than the loop's kernels it
# shares (four times the entries: Lucarelli's gradient 283 against 228 ms, Laske's
# 213 against 167, Bachmann's and SalazarCavazos's the same). Before the
# simulations were solved once each and their matrices rebuilt only where needed,
# gradients, ms, one condition at a time / two / four: Bachmann et al. 2011
# (36 conditions, 25 species) 933 / 788 / 700, Lucarelli et al. 2018 (16, 33) 295 /
# 290 / 354, Laske et al. 2019 (3, 34) 192 / 172 / 205, SalazarCavazos et al. 2020
# (4, 75) 409 / 508 / 528; four at a time / all: Schwen et al. 2014 (19, 11) 173 /
# 137, Sneyd et al. 2002 (9, 6) 44.2 / 40.4, Zhao et al. 2020 (7, 4) 26.4 / 20.8.
ADJOINT_CHUNK_ENTRIES = 2500


class ReactionODE(eqx.Module):
    """The vector field of a PEtab problem's SBML model in one condition: an Equinox
    model with Diffrax's signature `(t, y, args) -> dy/dt`.

    **Fields:**

    - `constants`: the values of the model's parameters and compartment sizes in this
        condition, in the order of `PetabProblem.constant_ids`.
    """

    constants: Float[Array, " k"]
    rhs: Any = eqx.field(static=True)

    def __call__(self, t: Scalar, y: Float[Array, " n"], args: Any) -> Array:
        return self.rhs(t, y, self.constants)


def _stage_step(args: Any) -> tuple[Any, Any]:
    """From the arguments Diffrax gives the root finder of an implicit stage: the
    state before the stage's own increment, and the map from the unknown (the vector
    field's value, or the increment itself) to the change of the state."""
    if isinstance(args, tuple) and len(args) == 8:  # solved for f: (..., control)
        _, diagonal, _, prod, _, y_partial, _, control = args
        return y_partial, lambda v: diagonal * prod(v, control)
    if isinstance(args, tuple) and len(args) == 7:  # solved for k = f * dt
        _, diagonal, _, _, y_partial, _, _ = args
        return y_partial, lambda v: diagonal * v
    raise TypeError(
        "sciflat's stage root finders solve the implicit stages of a Diffrax "
        f"Runge-Kutta solver (e.g. `diffrax.Kvaerno5`); called with {type(args)}."
    )


def _stage_terminate(finder: Any, y: Any, args: Any, state: Any, rate: Any):
    """Converged when the last correction, as a change of the state, is below
    `kappa` times `atol + rtol * |y|`; failed when the linear solve failed, the
    correction is not finite, or it grew by more than 2 (`rate`)."""
    y_partial, step = _stage_step(args)
    with jax.numpy_dtype_promotion("standard"):
        scale = finder.atol + finder.rtol * jnp.abs(y_partial + step(y))
        size = jnp.max(jnp.abs(step(state.diff)) / scale)
    started = state.step >= 1
    failed = state.result != optx.RESULTS.successful
    bad = started & (failed | ~jnp.isfinite(size) | (rate > 2))
    result = optx.RESULTS.where(
        failed,
        state.result,
        optx.RESULTS.where(
            bad, optx.RESULTS.nonlinear_divergence, optx.RESULTS.successful
        ),
    )
    return (started & (size < finder.kappa)) | bad, result


class InverseSolver(lx.AbstractLinearSolver):
    """A Lineax solver for the small square systems of the chord iterations: the
    matrix inverted once (LU, then its triangular solves on the identity, together),
    each solve then one matrix–vector product. On the host, each triangular solve of
    a vector is a call of its own that costs microseconds whatever the size (more
    than the whole vector field of a small model), and the chord method makes one per
    iteration of each stage; a product fuses with what is around it. The iteration's
    fixed point is the stage's equation whatever the solve's rounding: only how fast
    it contracts depends on it. For one 1-d array (a `ReactionODE`'s state)."""

    def init(self, operator: Any, options: dict[str, Any]) -> Any:
        del options
        if operator.in_size() != operator.out_size() or not isinstance(
            operator.in_structure(), jax.ShapeDtypeStruct
        ):
            raise ValueError(
                "`InverseSolver` solves square systems in one 1-d array; got "
                f"{operator.in_structure()} -> {operator.out_structure()}."
            )
        return jnp.linalg.inv(operator.as_matrix())

    def compute(self, state: Any, vector: Any, options: dict[str, Any]) -> Any:
        del options
        return state @ vector, lx.RESULTS.successful, {}

    def transpose(self, state: Any, options: dict[str, Any]) -> Any:
        del options
        return state.T, {}

    def conj(self, state: Any, options: dict[str, Any]) -> Any:
        del options
        return state.conj(), {}

    def assume_full_rank(self) -> bool:
        return True


class StageChord(diffrax.VeryChord):
    """Diffrax's chord method for the implicit stages of its Runge–Kutta solvers
    (one Jacobian and one LU factorisation per step, shared by the stages),
    converged when its last correction, as a change of the state, is below `kappa`
    times the step-size controller's tolerance `atol + rtol * |y|`.

    Diffrax's own tests (`VeryChord`, and `optimistix.Newton`) measure the stage's
    unknown, the vector field's value, against `atol + rtol * |f|` (and Newton its
    residual against `atol` alone). Where the vector field is the small difference
    of large rates, its rounding error is above that however many iterations are
    done: the steps are rejected again and again (Laske's influenza model at t =
    2.66, states of 1e8 and rates of 1e12: 100,000 steps and llh -inf; Boehm's: half
    its steps). What the step's error budget is made of is a change of the state.

    Its linear solves are products with the inverse of the stage's matrix, by
    default. Give it the problem's tolerances: `petab_problem(path,
    solver=diffrax.Kvaerno5(root_finder=sciflat.StageChord(rtol=1e-8, atol=1e-10)))`
    for the default `rtol=1e-8, atol=1e-10`."""

    linear_solver: lx.AbstractLinearSolver = InverseSolver()

    def terminate(self, fn, y, args, options, state, tags):
        del fn, options, tags
        rate = jnp.where(
            state.step >= 2, state.diffsize / state.diffsize_prev, jnp.zeros(())
        )
        return _stage_terminate(self, y, args, state, rate)


def unscale(x: Any, scale: str) -> Any:
    if scale == "log10":
        return 10.0**x
    if scale == "log":
        return jnp.exp(x) if isinstance(x, jax.Array) else np.exp(x)
    return x


def _rows(fn: Any, ts: Array, xs: Array, constants: Array, q: Array, params: Array):
    """A lambdified formula `fn(t, x, constants, q, params)` at every row."""
    zero = jnp.zeros((), xs.dtype)
    one = lambda t, x, par: zero + fn(t, x, constants, q, par)
    return jax.vmap(one)(ts, xs, params)


@dataclasses.dataclass(frozen=True)
class Rows:
    """The measurements one formula is evaluated at, as index arrays: those of every
    observable that has it (one formula under several observable ids) in every
    condition, so that it is traced once for all of them, not once per observable
    and condition (Lucarelli et al. 2018: 65 observables with 37 observable and 16
    noise formulas, in 197 pairs of a condition and an observable)."""

    rows: npt.NDArray[np.int64]  # positions in the measurement table
    conditions: npt.NDArray[np.int64] | None  # per row; None: all in `condition`
    condition: int
    time_index: npt.NDArray[np.int64]
    times: npt.NDArray[np.float64]
    parameters: npt.NDArray[np.int64]  # (m, k): the placeholders', into `ext`


def _by_formula(
    tables: Tables, fns: tuple[Any, ...], noise: bool
) -> tuple[tuple[Any, Rows], ...]:
    """Each of the formulas `fns` (per observable; one object for the observables
    that share a formula) with the rows it is evaluated at, observable after
    observable; the placeholders those of the observable formula, and with `noise`
    those of the noise formula after them."""
    by: dict[int, list[Any]] = {}
    for g in sorted(tables.groups, key=lambda g: g.observable):
        by.setdefault(id(fns[g.observable]), []).append(g)
    out = []
    for groups in by.values():
        cat = lambda f, groups=groups: np.concatenate([f(g) for g in groups])
        conditions = cat(lambda g: np.full(len(g.rows), g.condition, np.int64))
        one = bool((conditions == conditions[0]).all())
        parameters = cat(
            lambda g: (
                np.concatenate([g.observable_parameters, g.noise_parameters], axis=1)
                if noise
                else g.observable_parameters
            )
        )
        rows = Rows(
            rows=cat(lambda g: g.rows),
            conditions=None if one else conditions,
            condition=int(conditions[0]),
            time_index=cat(lambda g: g.time_index),
            times=cat(lambda g: g.times),
            parameters=parameters,
        )
        out.append((fns[groups[0].observable], rows))
    return tuple(out)


def _formula_rows(
    fn: Any, b: Rows, ext: Array, all_ys: Array, cidx: Any, q: Array, params: Array
) -> Array:
    """`fn` at every row of `b`: with the constants of the rows' own conditions,
    only those the formula names gathered per row."""
    ts = jnp.asarray(b.times, ext.dtype)
    zero = jnp.zeros((), ext.dtype)
    if b.conditions is None:
        xs = all_ys[b.condition][b.time_index]
        constants = ext[cidx[b.condition]]
        one = lambda t, x, par: zero + fn(t, x, constants, q, par)
        return jax.vmap(one)(ts, xs, params)
    xs = all_ys[b.conditions, b.time_index]
    named = ext[cidx[b.conditions][:, fn.constants]]
    many = lambda t, x, k, par: zero + fn.named(t, x, k, q, par)
    return jax.vmap(many)(ts, xs, named, params)


def forward_sensitivities(
    solve: Callable,
    sensitivities: Callable | None = None,
    dynamic: npt.NDArray[np.int64] | None = None,
    value: Callable | None = None,
) -> Callable:
    """`solve(x) -> (ys, ok)` whose derivative is its forward sensitivities: any
    JVP computes the whole Jacobian dys/dx (one tangent per parameter, through the
    solves' `diffrax.ForwardMode`) and applies it. So reverse mode works too, as the
    transpose of that product (Diffrax's forward mode alone is a `while_loop` that
    JAX cannot transpose), and costs what forward mode costs: for `jax.grad` of a
    scalar, as much as `jax.jacfwd`; for one `jax.jvp`, `len(x)` tangents, not one.
    `dynamic`: the entries of `x` that `solve` depends on at all (the others'
    columns are zeros, not computed); `sensitivities(x) -> (ys, ok, dys/dx)`, if
    given, computes the solution and its Jacobian together (its solves' steps may
    differ from `solve`'s). `value(x) -> (ys, ok)`, if given, is the function's
    value where it is not differentiated (another solve of the same problem)."""
    fn = jax.custom_jvp(solve if value is None else value)

    @fn.defjvp
    def jvp(primals, tangents):
        (x,), (dx,) = primals, tangents
        if sensitivities is not None:
            ys, ok, jac = sensitivities(x)
        else:
            index = np.arange(len(x)) if dynamic is None else dynamic

            def ys_and_all(sub):
                ys, ok = solve(x.at[index].set(sub))
                return ys, (ys, ok)

            sub_jac, (ys, ok) = jax.jacfwd(ys_and_all, has_aux=True)(x[index])
            jac = columns(sub_jac, index, len(x))
        dys = jnp.tensordot(jac, dx, axes=1)
        return (ys, ok), (dys, np.zeros(jnp.shape(ok), jax.dtypes.float0))

    return fn


def _run_now(fn: Callable, *args: Any) -> Any:
    """`fn(*args)`, compiled and run now, even where it is called inside a trace (a
    compiled executable's call is not staged into it); `args` concrete."""
    return jax.jit(fn).lower(*args).compile()(*args)


def columns(sub: Array, index: npt.NDArray[np.int64], size: int) -> Array:
    """A Jacobian of `size` columns (the last axis) from those at `index`, zeros
    elsewhere."""
    if len(index) == size:
        return sub
    full = jnp.zeros((*sub.shape[:-1], size), sub.dtype)
    return full.at[..., index].set(sub)


def dynamic_parameters(tables: Tables) -> npt.NDArray[np.int64]:
    """The estimated parameters (their positions in `linear`) that the solves
    depend on: those a condition's constants or initial states read. The others
    (noise, observable parameters) leave the simulation as it is."""
    read = set(np.concatenate(tables.constant_index).tolist())
    for override in tables.x0_override:
        read |= set(override.values())
    where = tables.parameters.estimated
    return np.array([i for i, q in enumerate(where) if int(q) in read], np.int64)


class Simulations(NamedTuple):
    """The conditions' distinct simulations (`simulations`): the first condition of
    each `(S,)`, each condition's simulation `(C,)`, and how many of the union's
    measurement times each simulation is solved to `(S,)`."""

    first: npt.NDArray[np.int64]
    of: npt.NDArray[np.int64]
    need: npt.NDArray[np.int64]

    @property
    def distinct(self) -> bool:
        """Whether each condition is its own simulation, in the conditions' order."""
        return np.array_equal(self.first, np.arange(len(self.of)))


def simulations(tables: Tables) -> Simulations:
    """The conditions' distinct simulations. Two conditions are one simulation when
    they read the same entries of `ext` for every constant and every initial state
    they set: their solves are then the same function of the parameters (Schwen et
    al. 2014: 19 conditions, 7 simulations; Bachmann et al. 2011: 36, 12), and each
    is solved once, up to the last time any of its conditions is measured at
    (Bachmann's end at 7 to 360 minutes). They are ordered by that time, the
    longest first, so that the solves a few at a time take together those of a
    similar length, and a last chunk padded with copies pads the shortest."""
    keys: dict[tuple, int] = {}
    first, of = [], []
    for c, (index, override) in enumerate(
        zip(tables.constant_index, tables.x0_override, strict=True)
    ):
        key = (tuple(np.asarray(index).tolist()), tuple(sorted(override.items())))
        if key not in keys:
            keys[key] = len(first)
            first.append(c)
        of.append(keys[key])
    need = np.zeros(len(first), np.int64)
    for g in tables.groups:
        s = of[g.condition]
        need[s] = max(need[s], int(np.max(g.time_index, initial=-1)) + 1)
    order = np.lexsort((np.array(first), -need))  # `need` down, then condition
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return Simulations(np.array(first, np.int64)[order], rank[of], need[order])


class Objective:
    """The simulation and the noise model of one problem (tables, formulas, solver)."""

    def __init__(
        self,
        tables: Tables,
        formulas: Formulas,
        diffrax: Any,
        solver: Any,
        rtol: float,
        atol: float,
        max_steps: int,
    ):
        self.tables, self.formulas = tables, formulas
        self._diffrax, self._solver = diffrax, solver
        self.rtol, self.atol, self._max_steps = rtol, atol, max_steps
        # Each formula with its rows (`terms`), the observable formulas' and the noise
        # formulas'; and each measurement's place among the rows as they come out.
        self._by_formula = (
            _by_formula(tables, formulas.h, noise=False),
            _by_formula(tables, formulas.sigma, noise=True),
        )
        self._order = tuple(
            np.argsort(
                np.concatenate([b.rows for _, b in by] or [np.zeros(0, np.int64)])
            )
            for by in self._by_formula
        )
        self._constant_index = np.stack(tables.constant_index)
        # The initial states set by the condition table: conditions, states, and
        # their entries of `ext`.
        triples = [
            (c, i, j)
            for c, override in enumerate(tables.x0_override)
            for i, j in override.items()
        ]
        self._x0_overrides = tuple(
            np.array([t[a] for t in triples], np.int64) for a in range(3)
        )
        # `BDF`'s conditions in turn or as one batch; None: by the model's size.
        self._bdf_in_turn: bool | None = None
        self._dynamic = dynamic_parameters(tables)
        stepping = (
            isinstance(solver, BDF)
            and len(self._dynamic) > 0
            and float(tables.union_times[-1]) > 0  # else no steps to choose
        )
        controlled = stepping and solver.controls(len(self._dynamic))
        self._stepping = stepping
        self._sims = simulations(tables)
        # The value's solve (tried first by an explicit method where `BDF`'s
        # `explicit_first` says so: `_explicit_budget`) and `BDF`'s alone, which
        # the derivatives are.
        solve = lambda linear: self.solve_simulations(self.ext_of(linear))
        bdf = lambda linear: self.solve_simulations(self.ext_of(linear), False)
        sensitivities = forward_sensitivities(
            bdf,
            self._bdf_sensitivities if controlled else None,
            self._dynamic,
            value=solve,
        )
        # `nll`'s solve: in reverse mode the adjoint of the steps (`BDF.adjoint`),
        # at tighter tolerances where it stands in for the sensitivities' control.
        reverse = sensitivities
        if stepping:
            k = jax.ShapeDtypeStruct((self._constant_index.shape[1],), jnp.float32)
            n_states = jax.eval_shape(formulas.x0, k).shape[0]
            if solver.reverse(len(self._dynamic), n_states):
                tighter = ADJOINT_TIGHTER if controlled else 1.0
                reverse = self._with_adjoint(solve, tighter)
        self.solve_with_sensitivities = self._per_condition(sensitivities)
        self._solve_reverse = self._per_condition(reverse)

    def with_tolerances(self, rtol: float, atol: float) -> "Objective":
        """The same problem solved at other tolerances: the step-size controller's,
        and the root finder's where it is sciflat's `StageChord`."""
        solver = self._solver
        finder = getattr(solver, "root_finder", None)
        if isinstance(finder, StageChord):  # its other options kept
            finder = eqx.tree_at(lambda f: (f.rtol, f.atol), finder, (rtol, atol))
            solver = eqx.tree_at(lambda s: s.root_finder, solver, finder)
        return Objective(
            self.tables,
            self.formulas,
            self._diffrax,
            solver,
            rtol,
            atol,
            self._max_steps,
        )

    # -- from the model to `ext` --------------------------------------------------

    def check_model(self, model: Any) -> None:
        ids = self.tables.parameters.ids
        if not isinstance(model, dict) or set(model) != set(ids):
            got = sorted(model) if isinstance(model, dict) else type(model).__name__
            raise ValueError(
                "The model of a PEtab problem is a dict of its estimated parameters "
                f"{list(ids)}; got {got}. Start from `problem.nominal`."
            )

    def linear(self, model: dict[str, Any]) -> Array:
        """The estimated parameters on the linear scale, as one vector."""
        self.check_model(model)
        par = self.tables.parameters
        values = [unscale(jnp.asarray(model[k]), par.scales[k]) for k in par.ids]
        return jnp.stack(values).astype(jnp.result_type(*values))

    def ext_of(self, linear: Array) -> Array:
        """Every table parameter on the linear scale, then the tables' numbers."""
        par, dtype = self.tables.parameters, linear.dtype
        q = jnp.asarray(par.nominal_lin, dtype).at[par.estimated].set(linear)
        return jnp.concatenate([q, jnp.asarray(self.tables.numbers, dtype)])

    def ext(self, model: dict[str, Any]) -> Array:
        return self.ext_of(self.linear(model))

    def condition(self, condition: str | None) -> int:
        conditions = self.tables.conditions
        if condition is None:
            return 0
        if condition not in conditions:
            raise ValueError(
                f"`condition` must be one of {list(conditions)}, got {condition!r}."
            )
        return conditions.index(condition)

    # -- the simulation -------------------------------------------------------------

    def solve(
        self, ext: Array, c: int, ts: npt.NDArray[np.float64]
    ) -> tuple[Array, Array]:
        constants, x0 = self.initial_all(ext)
        return self.integrate(constants[c], x0[c], ts)

    def initial_all(self, ext: Array) -> tuple[Array, Array]:
        """Every condition's constants and initial states: `(C, k)`, `(C, n)`, the
        initial states' formulas traced once for all the conditions."""
        constants = ext[self._constant_index]
        x0 = jax.vmap(self.formulas.x0)(constants)
        rows, states, sources = self._x0_overrides
        return constants, x0.at[rows, states].set(ext[sources])

    def initial(self, ext: Array) -> tuple[Array, Array]:
        """Every simulation's constants and initial states: `(S, k)`, `(S, n)`
        (`simulations`: conditions that are the same simulation appear once)."""
        constants, x0 = self.initial_all(ext)
        if self._sims.distinct:
            return constants, x0
        return constants[self._sims.first], x0[self._sims.first]

    def _per_condition(self, solve: Callable) -> Callable:
        """`solve(a) -> (ys, ok)` of the simulations `(S, T, n)` as that of the
        conditions `(C, T, n)` (a gather; its reverse mode sums the conditions'
        cotangents into their simulation's)."""
        if self._sims.distinct:
            return solve

        def per_condition(a: Array) -> tuple[Array, Array]:
            ys, ok = solve(a)
            return ys[self._sims.of], ok

        return per_condition

    def solve_all(self, ext: Array, explicit: bool = True) -> tuple[Array, Array]:
        """Every condition at the union of the measurement times: `(C, T, n)`
        (`explicit`: `solve_simulations`'s)."""
        solve = lambda e: self.solve_simulations(e, explicit)
        return self._per_condition(solve)(ext)

    def solve_simulations(
        self, ext: Array, explicit: bool = True
    ) -> tuple[Array, Array]:
        """Every simulation at the union of the measurement times: `(S, T, n)`.
        `explicit`: tried first by `explicit_solve` where `_explicit_budget` says
        so (`False`: `BDF` alone)."""
        ts = self.tables.union_times
        if len(self._sims.first) == 1 and not isinstance(self._solver, BDF):
            ys, ok = self.solve(ext, int(self._sims.first[0]), ts)
            return ys[None], ok
        constants, x0 = self.initial(ext)
        budget = self._explicit_budget if explicit else None
        if budget is not None:
            ys, ok = self._explicit_first(constants, x0, budget)
        elif isinstance(self._solver, BDF):
            ys, ok = self._bdf(constants, x0, ts, self._sims.need)
        else:
            ys, ok = jax.vmap(lambda k, x: self.integrate(k, x, ts))(constants, x0)
        return ys, jnp.all(ok)

    def integrate(
        self, constants: Array, x0: Array, ts: npt.NDArray[np.float64]
    ) -> tuple[Array, Array]:
        if float(ts[-1]) == 0.0:
            return jnp.broadcast_to(x0, (len(ts), len(x0))), jnp.asarray(True)
        if isinstance(self._solver, BDF):
            ys, ok = self._bdf(constants[None], x0[None], ts)
            return ys[0], ok[0]
        ys, ok, _ = self._diffrax_solve(
            self._solver, constants, x0, ts, self._max_steps
        )
        return ys, ok

    @ft.cached_property
    def _explicit_budget(self) -> int | None:
        """The explicit solve's most steps a simulation where the value's solves are
        tried by `explicit_solve` first (`BDF`'s `explicit_first`), None where
        `BDF` solves them alone. Chosen once, at the first solve (`explicit_first=
        None`): by a solve with each method at the nominal parameters
        (`explicit_budget`), computed then even inside a trace."""
        choice = self._solver.explicit_first if self._stepping else False
        most = getattr(self._solver, "explicit_max_steps", 0)
        if choice is None:
            return self._probe_explicit(most)
        return most if choice else None

    def _probe_explicit(self, most: int) -> int | None:
        """`explicit_budget` at the nominal parameters, in float64."""
        par = self.tables.parameters
        nominal = np.asarray(par.nominal_lin[par.estimated], np.float64)
        ts, need = self.tables.union_times, self._sims.need
        initial = lambda linear: self.initial(self.ext_of(linear))
        if jax.eval_shape(initial, nominal)[1].shape[1] >= EXPLICIT_BELOW_STATES:
            return None

        def explicit(linear: Array) -> tuple[Array, Array]:
            return self._explicit_all(*initial(linear), most)[1:]

        ok, steps = _run_now(explicit, nominal)
        if not np.asarray(ok).all():
            return None

        def attempts(linear: Array) -> Array:
            m = jnp.asarray(need, jnp.int32)
            stats = self._bdf_solve(*initial(linear), ts, with_stats=True, need=m)
            return stats[2][:, 0] + stats[2][:, 1]  # accepted, rejected

        tried = _run_now(attempts, nominal)
        return explicit_budget(np.asarray(steps), np.asarray(tried), most)

    def _explicit_first(
        self, constants: Array, x0: Array, budget: int
    ) -> tuple[Array, Array]:
        """The simulations `(S, k)`, `(S, n)` by `explicit_solve` with `budget`
        steps each, or all by `BDF` where one of them does not finish (`lax.cond`:
        `BDF`'s results to the bit there). Under `jax.vmap` (a batch of parameter
        sets: `sciflat.fit`'s or `least_squares(method="device")`'s starts) by
        `BDF` alone: a batched condition would be a select, both methods run for
        every member of the batch."""
        ts, need = self.tables.union_times, self._sims.need
        bdf = lambda k, x: self._bdf(k, x, ts, need)

        @jax.custom_batching.custom_vmap
        def first(k: Array, x: Array) -> tuple[Array, Array]:
            ys, ok, _ = self._explicit_all(k, x, budget)
            return jax.lax.cond(jnp.all(ok), lambda: (ys, ok), lambda: bdf(k, x))

        @first.def_vmap
        def batched(size: int, in_batched: list, k: Array, x: Array) -> Any:
            axes = tuple(0 if b else None for b in in_batched)
            return jax.vmap(bdf, in_axes=axes)(k, x), (True, True)

        return first(constants, x0)

    def _explicit_all(
        self, constants: Array, x0: Array, most: int
    ) -> tuple[Array, Array, Array]:
        """The simulations `(S, k)`, `(S, n)` by `explicit_solve`, at most `most`
        steps each, each to its last measurement: `(S, T, n)` at the measurement
        times, `(S,)` whether each finished (not stopped by the stiffness test, not
        failed), and `(S,)` its steps (accepted and rejected)."""
        ts, rhs = self.tables.union_times, self.formulas.rhs
        one = lambda k, x, m: explicit_solve(
            rhs, k, x, ts, self.rtol, self.atol, most, m
        )
        need = jnp.asarray(self._sims.need, jnp.int32)
        if len(x0) == 1:  # not vmapped: a vmapped loop's conditionals are selects
            ys, ok, steps = one(constants[0], x0[0], need[0])
            return ys[None], ok[None], steps[None]
        return jax.vmap(one)(constants, x0, need)

    def _diffrax_solve(
        self,
        solver: Any,
        constants: Array,
        x0: Array,
        ts: npt.NDArray[np.float64],
        max_steps: int,
    ) -> tuple[Array, Array, Array]:
        """One condition by a Diffrax solver, at `ts` (its last time above 0): the
        solution there, whether the solve succeeded, its steps (accepted and
        rejected)."""
        diffrax = self._diffrax
        ts_j = jnp.asarray(ts, x0.dtype)
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(ReactionODE(constants, self.formulas.rhs)),
            solver,
            t0=jnp.zeros((), x0.dtype),
            t1=ts_j[-1],
            dt0=None,
            y0=x0,
            saveat=diffrax.SaveAt(ts=ts_j),
            # Steps end at the measurement times: there the solution is the step's
            # own (5th order), not the solver's interpolation (3rd order Hermite for
            # Kvaerno5, 1e-7 off for Boehm at rtol 1e-8 against 6e-9 like this).
            # A solve that rejects 30 steps in a row has failed (a blow-up, NaN
            # rates): it stops there, as CVODES does, not at `max_steps`.
            stepsize_controller=RejectionLimit(
                diffrax.ClipStepSizeController(
                    diffrax.PIDController(rtol=self.rtol, atol=self.atol),
                    step_ts=jnp.asarray(ts[ts > 0], x0.dtype),
                )
            ),
            adjoint=diffrax.ForwardMode(),
            max_steps=max_steps,
            throw=False,
        )
        ys = sol.ys
        assert ys is not None
        return ys, sol.result == diffrax.RESULTS.successful, sol.stats["num_steps"]

    def _in_turn(self, n_states: int, derivatives: bool = False) -> bool:
        """Whether `BDF` solves the conditions one after the other, a few at a
        time (large models: a batch runs until its longest condition ends, and
        each attempt's arithmetic is the whole batch's; Bachmann's 12 simulations
        22.0 ms four at a time, 38.8 as one batch) or as one batch (small models:
        their arithmetic costs less than the loop's kernels, which one batch
        shares; Schwen's 7 simulations 8.6 ms as one batch, 9.2 four at a time).
        With `derivatives` (the solves with their sensitivities) always in turn: an
        attempt's work for the directions, and its Jacobian and inversion for
        them, is most of its cost then, and one batch pays it for every condition
        until the last has finished (Schwen et al. 2014's 19 conditions: 262 ms in
        turn, 405 ms as one batch; Zhao's 7: 30 and 39 ms). (`nll`'s solves in
        turn go `BDF_CHUNK` conditions at a time.)"""
        if self._bdf_in_turn is not None:
            return self._bdf_in_turn
        return derivatives or n_states >= BDF_IN_TURN_FROM_STATES

    def _nll_batches(self, n_sims: int, n_states: int) -> tuple[int, bool]:
        """How `nll`'s `BDF` solves take the simulations (`_in_chunks`): at most how
        many together, and whether in batches of a power of two. A small model's
        few simulations one at a time (`ONE_AT_A_TIME_UP_TO_STATES`, unless the
        problem was told: `_bdf_in_turn`), a small model's others as one batch, a
        large model's `BDF_CHUNK` at a time (`_in_turn`), in batches of 1, 2 or 4
        below `BDF_WHOLE_CHUNKS_BELOW_STATES` species."""
        if (
            self._bdf_in_turn is None
            and n_states <= ONE_AT_A_TIME_UP_TO_STATES
            and n_sims <= ONE_AT_A_TIME_UP_TO_SIMULATIONS
        ):
            return 1, False
        if not self._in_turn(n_states):
            return n_sims, False
        return BDF_CHUNK, n_states < BDF_WHOLE_CHUNKS_BELOW_STATES

    def _bdf_solve(
        self,
        constants: Array,
        x0: Array,
        ts: npt.NDArray[np.float64],
        rtol: Any = None,
        atol: Any = None,
        **kw: Any,
    ) -> Any:
        """`bdf_solve` of a batch of conditions with this problem's settings (or
        other tolerances)."""
        rhs = self.formulas.rhs
        return bdf_solve(
            rhs,
            rhs.jacobian,
            constants,
            x0,
            ts,
            self.rtol if rtol is None else rtol,
            self.atol if atol is None else atol,
            self._max_steps,
            self._solver.max_order,
            **kw,
        )

    def _bdf(
        self,
        constants: Array,
        x0: Array,
        ts: npt.NDArray[np.float64],
        need: npt.NDArray[np.int64] | None = None,
    ) -> tuple[Array, Array]:
        """Conditions `(C, k)`, `(C, n)` solved by `bdf_solve` (each to `need` of
        `ts`, by default all): `(C, T, n)`, `(C,)`."""
        if float(ts[-1]) == 0.0:
            shape = (x0.shape[0], len(ts), x0.shape[1])
            return jnp.broadcast_to(x0[:, None], shape), jnp.ones(x0.shape[0], bool)
        need = np.full(x0.shape[0], len(ts)) if need is None else need
        solve = lambda k, x, m: self._bdf_solve(k, x, ts, need=m)
        need_j = jnp.asarray(need, jnp.int32)
        most, whole = self._nll_batches(*x0.shape)
        return _in_chunks(solve, (constants, x0, need_j), most, whole)

    def _bdf_sensitivities(self, linear: Array) -> tuple[Array, Array, Array]:
        """Every simulation's solution `(S, T, n)`, whether all succeeded, and the
        solution's derivatives in `linear` `(S, T, n, P)`, by `bdf_solve` with the
        sensitivities' errors controlled with the state's (as AMICI's CVODES
        does): each along a parameter scaled by its size (by 1 where it is 0), so
        that its error weights are the state's, as for a log-scale parameter."""
        ts, index = self.tables.union_times, self._dynamic

        def pairs(sub: Array) -> tuple[Array, Array]:
            return self.initial(self.ext_of(linear.at[index].set(sub)))

        (constants, x0), directions = jax.linearize(pairs, linear[index])
        size = jax.lax.stop_gradient(jnp.abs(linear[index]))
        size = jnp.where(size > 0, size, 1)
        # (P, S, k), (P, S, n): the dynamic parameters' directions, scaled
        dk, dx0 = jax.vmap(directions)(jnp.diag(size))

        need = jnp.asarray(self._sims.need, jnp.int32)

        def solve(k, x, dk, dx, m):
            return self._bdf_solve(k, x, ts, tangents=(dk, dx), need=m)

        if len(x0) == 1 or not self._in_turn(x0.shape[1], derivatives=True):
            ys, dys, ok = solve(constants, x0, dk, dx0, need)
        else:

            def one(a: tuple[Array, ...]) -> tuple[Array, Array, Array]:
                k, x, dk, dx, m = a  # one simulation's; its P directions
                ys, dys, ok = solve(k[None], x[None], dk[:, None], dx[:, None], m[None])
                return ys[0], dys[:, 0], ok[0]

            dk, dx0 = jnp.moveaxis(dk, 1, 0), jnp.moveaxis(dx0, 1, 0)
            ys, dys, ok = jax.lax.map(
                one, (constants, x0, dk, dx0, need)
            )  # (S, T, n), (S, P, T, n), (S,)
            dys = jnp.moveaxis(dys, 1, 0)
        jac = jnp.moveaxis(dys, 0, -1) / size  # (S, T, n, P)
        return ys, jnp.all(ok), columns(jac, index, len(linear))

    def _with_adjoint(self, solve: Callable, tighter: float) -> Callable:
        """`solve(linear) -> (ys, ok)` whose reverse mode is the discrete adjoint of
        `BDF`'s steps (`bdf_adjoint`: one transposed solve an accepted step, however
        many parameters; Lang et al. 2024's gradient 1.4 s, 28 s by forward mode
        along the same steps), the solve it differentiates at tolerances `tighter`
        times the problem's. A `jax.custom_vjp`: no forward mode (`jax.jvp`,
        `jax.hessian`), which `residuals` keep. The solves with a derivative take
        the conditions a few at a time (`_adjoint_chunk`), each batch keeping the
        record of its attempts that the adjoint reads (the last segment of them,
        and the state at the start of each: `bdf._SEGMENT`)."""
        index, ts = self._dynamic, self.tables.union_times
        tolerances = {"rtol": self.rtol / tighter, "atol": self.atol / tighter}

        need = jnp.asarray(self._sims.need, jnp.int32)

        def kept_solve(a: tuple[Array, Array, Array]) -> Any:
            k, x, m = a
            return self._bdf_solve(k, x, ts, record=True, need=m, **tolerances)

        def forward(linear: Array) -> Any:
            constants, x0 = self.initial(self.ext_of(linear))
            chunks = _Chunks.of(x0.shape[0], _adjoint_chunk(x0.shape[1]))
            ys, ok, kept = jax.lax.map(
                kept_solve, tuple(chunks.split(a) for a in (constants, x0, need))
            )
            ys, ok = chunks.joined(ys), chunks.joined(ok)
            return (ys, jnp.all(ok)), (linear, constants, x0, kept)

        def backward(res: tuple, cotangents: tuple) -> tuple[Array]:
            linear, constants, x0, kept = res
            ys_bar = cotangents[0]
            # The forward's chunks, as its record has them: (number, rows, size, ...)
            number, _, size = kept["rows"].shape[:3]
            chunks = _Chunks(x0.shape[0], number, size)
            split = tuple(chunks.split(a) for a in (constants, x0, need))

            def adjoint(a: tuple) -> tuple[Array, Array]:
                k, x, m, kept, bar = a

                def replay(point: dict) -> Array:  # a segment of the solve's record
                    return self._bdf_solve(k, x, ts, resume=point, need=m, **tolerances)

                return self._bdf_adjoint(k, x, kept, bar, replay)

            bars = jax.lax.map(adjoint, (*split, kept, chunks.split(ys_bar, pad=0.0)))
            bars = tuple(chunks.joined(b) for b in bars)
            pairs = lambda sub: self.initial(self.ext_of(linear.at[index].set(sub)))
            _, pull = jax.vjp(pairs, linear[index])
            (sub_bar,) = pull(bars)
            return (jnp.zeros_like(linear).at[index].set(sub_bar),)

        fn = jax.custom_vjp(solve)
        fn.defvjp(forward, backward)
        return fn

    def _bdf_adjoint(
        self,
        constants: Array,
        x0: Array,
        kept: dict,
        ys_bar: Array,
        replay: Callable[[dict], Array],
    ) -> tuple[Array, Array]:
        rhs = self.formulas.rhs
        ts = self.tables.union_times
        return bdf_adjoint(rhs, rhs.jacobian, constants, x0, ts, kept, ys_bar, replay)

    # -- the noise model ----------------------------------------------------------

    def terms(self, model: dict[str, Any], reverse: bool = False) -> dict[str, Array]:
        """Per measurement (table order): the simulation, σ, the transformed
        residual, and the noise model's constants; and whether every solve succeeded.
        `reverse`: the solve for `nll`, differentiated in reverse mode by the adjoint
        where `BDF.adjoint` says so."""
        tables = self.tables
        linear = self.linear(model)
        ext = self.ext_of(linear)
        solve = self._solve_reverse if reverse else self.solve_with_sensitivities
        all_ys, ok = solve(linear)
        q = ext[tables.q_only]
        h, sigma = [], []
        cidx = self._constant_index
        for by, out in zip(self._by_formula, (h, sigma), strict=True):
            for fn, b in by:
                params = ext[b.parameters]
                out.append(_formula_rows(fn, b, ext, all_ys, cidx, q, params))
        return {
            "h": jnp.concatenate(h)[self._order[0]],
            "sigma": jnp.concatenate(sigma)[self._order[1]],
            "ok": ok,
        }

    def transformed(self, h: Array) -> tuple[Array, Array, npt.NDArray[np.float64]]:
        """The simulation and the data on each observable's transformation scale, and
        the per-measurement constant of the density (the Jacobian of the transform)."""
        y = self.tables.data
        kinds = self.tables.transforms
        ht = jnp.where(
            kinds == 1,
            jnp.log(jnp.where(kinds == 1, h, 1.0)),
            jnp.where(kinds == 2, jnp.log10(jnp.where(kinds == 2, h, 1.0)), h),
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            yt = np.where(kinds == 1, np.log(y), np.where(kinds == 2, np.log10(y), y))
            jac = np.where(
                kinds == 1, np.log(y), np.where(kinds == 2, np.log(y * np.log(10)), 0.0)
            )
        return ht, jnp.asarray(yt), jac

    def nll(self, model: dict[str, Any], reverse: bool = True) -> Scalar:
        """−log L and −log prior; `reverse=False`: its solve differentiated in forward
        mode too (for a Hessian), not by the adjoint."""
        return self.data_nll(model, reverse) + self.neg_log_prior(model)

    def _values(self, model: dict[str, Any]) -> tuple[Array, Array]:
        """The estimated parameters on their scales and linear."""
        self.check_model(model)
        scaled = jnp.stack([jnp.asarray(model[k]) for k in self.tables.parameters.ids])
        return scaled, self.linear(model)

    def neg_log_prior(self, model: dict[str, Any]) -> Scalar:
        """−log of the objective priors' densities (PEtab v1; 0 without priors)."""
        return neg_log_prior(self.tables.parameters.priors, *self._values(model))

    def data_nll(self, model: dict[str, Any], reverse: bool = True) -> Scalar:
        terms = self.terms(model, reverse)
        ht, yt, jac = self.transformed(terms["h"])
        sigma = terms["sigma"]
        r = (yt - ht) / sigma
        normal = 0.5 * jnp.log(2 * jnp.pi * sigma**2) + 0.5 * r**2
        laplace = jnp.log(2 * sigma) + jnp.abs(r)
        each = jnp.where(self.tables.laplace, laplace, normal) + jac
        return jnp.where(terms["ok"], jnp.sum(each), jnp.inf)

    def residuals(self, model: dict[str, Any]) -> Array:
        if self.tables.laplace.any():
            raise ValueError(
                "`residuals` exist for normal noise only; this problem has Laplace "
                "noise: fit `problem.nll` with `sciflat.minimize`."
            )
        terms = self.terms(model)
        ht, yt, _ = self.transformed(terms["h"])
        sigma = terms["sigma"]
        fit = (yt - ht) / sigma
        noise = jnp.sqrt(2 * jnp.log(sigma) + self.tables.log_sigma_shift)
        priors = self.tables.parameters.priors
        prior = prior_residuals(priors, *self._values(model)).astype(fit.dtype)
        out = jnp.concatenate([fit, noise, prior])
        return jnp.where(terms["ok"], out, jnp.nan)

    def residual_offset(self) -> float:
        m = self.tables.n_data
        _, _, jac = self.transformed(jnp.ones(m))
        return float(
            0.5 * m * math.log(2 * math.pi)
            + np.sum(jac)
            - 0.5 * m * self.tables.log_sigma_shift
            + prior_offset(self.tables.parameters.priors)
        )

    @ft.partial(jax.jit, static_argnums=(0, 2, 3))
    def simulate(
        self, model: dict[str, Any], c: int, times: tuple[float, ...]
    ) -> tuple[dict[str, Array], Array]:
        tables = self.tables
        ts = np.asarray(times, np.float64)
        ext = self.ext(model)
        ys, ok = self.solve(ext, c, ts)
        constants, q = ext[tables.constant_index[c]], ext[tables.q_only]
        out: dict[str, Array] = {"time": jnp.asarray(ts), "state": ys}
        for g in tables.groups:
            if g.condition != c:
                continue
            o = g.observable
            ops = ext[g.observable_parameters[:1]]
            ops = jnp.broadcast_to(ops, (len(ts), ops.shape[1]))
            out[tables.observable_ids[o]] = _rows(
                self.formulas.h[o], jnp.asarray(ts), ys, constants, q, ops
            )
        return out, ok


def _adjoint_chunk(n_states: int) -> int:
    """The most conditions the adjoint takes together (`ADJOINT_CHUNK_ENTRIES`)."""
    return max(1, ADJOINT_CHUNK_ENTRIES // n_states**2)


def _in_chunks(
    solve: Callable, arrays: tuple[Array, ...], most: int, whole: bool = False
) -> Any:
    """`solve(*arrays)` of `C` conditions (each array `(C, ...)`) as `lax.map` over
    chunks of at most `most` of them (`_Chunks`; `whole`: of a power of two of
    them): `(C, T, n)`, `(C,)`."""
    chunks = _Chunks.of(arrays[0].shape[0], most, whole)
    if chunks.size == chunks.n_cond:  # one chunk, unpadded
        return solve(*arrays)
    ys, ok = jax.lax.map(lambda a: solve(*a), tuple(chunks.split(a) for a in arrays))
    return chunks.joined(ys), chunks.joined(ok)


class _Chunks(NamedTuple):
    """`C` conditions as `number` chunks of `size`, all of one size: the last padded
    (with copies of the last condition, or a constant), the padding dropped when
    the chunks are joined again."""

    n_cond: int
    number: int
    size: int

    @classmethod
    def of(cls, n_cond: int, most: int, whole: bool = False) -> "_Chunks":
        """As few chunks as hold `n_cond` conditions `most` at a time, of equal
        size; `whole`: of a size that is a power of two (at most `most`)."""
        number = -(-n_cond // most)
        size = -(-n_cond // number)
        if whole:
            size = min(most, 1 << (size - 1).bit_length())
            number = -(-n_cond // size)
        return cls(n_cond, number, size)

    def split(self, a: Array, pad: float | None = None) -> Array:
        """`(C, ...)` as `(number, size, ...)`."""
        extra = self.number * self.size - self.n_cond
        fill = a[-1:] if pad is None else jnp.full((1, *a.shape[1:]), pad, a.dtype)
        a = jnp.concatenate([a, jnp.repeat(fill, extra, axis=0)])
        return a.reshape(self.number, self.size, *a.shape[1:])

    def joined(self, a: Array) -> Array:
        """`(number, size, ...)` as `(C, ...)`."""
        return a.reshape(-1, *a.shape[2:])[: self.n_cond]
