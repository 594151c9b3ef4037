"""A variable-order BDF method (orders 1 to 5, the numerical differentiation
formulas of Shampine and Reichelt's `ode15s`, as SciPy's `BDF`) for the stiff ODEs
of PEtab problems, with its Jacobian and its Newton matrix kept over many steps.

An implicit Runge–Kutta step (`diffrax.Kvaerno5`) builds a Jacobian and a
factorisation every step and evaluates the vector field some twenty times; a BDF step
evaluates it once to three times (Newton's iterations with the matrix of earlier
steps), builds the Newton matrix again only when the step size or the order has
moved its coefficient by more than 30 %, and the Jacobian only when Newton's
iteration fails to converge with the old one. That is what CVODES (AMICI's solver)
does, and for models of dozens to hundreds of species it is most of the difference in
cost per step. Where SciPy's `BDF` is followed and where CVODES's choices are taken
instead: the Newton matrix kept over changes of the step (its correction scaled by
`2 / (1 + c / c_lu)`, CVODES's `gamrat`), the first Newton iteration judged by the
last steps' rate of convergence, and Newton's tolerance `min(0.03, rtol ** 0.25)`
of the step's error tolerance (SciPy: `min(0.03, sqrt(rtol))`).

`bdf_solve` takes a batch of conditions: each has its own time, step size, order and
matrices; a Jacobian or a Newton matrix is computed only for the conditions that
need one, at the attempts where they do. (The PEtab objective passes a large
model's conditions a few at a time, a batch running until its longest condition
ends, a small model's as one batch, which shares the loop's kernels, and a small
model's few conditions one at a time.) The
solution at the measurement times is the BDF's own interpolating polynomial (as
CVODES's `CVodeGetDky`), so the steps need not end on them.

Differentiation is JAX's forward mode through the loop, the step sizes, orders and
matrices taken as constants, and each step's corrector differentiated at its
solution (implicitly, with the exact Jacobian there: a custom JVP), not through the
Newton iterations that found it. Reverse mode can run the same derivatives backwards
(`bdf_adjoint`, the discrete adjoint of the attempts a recorded solve made): one
transposed linear solve per accepted step instead of one direction per parameter.
The algorithm follows SciPy's
`scipy.integrate.BDF` (Shampine & Reichelt 1997, "The MATLAB ODE Suite"; Byrne and
Hindmarsh's quasi-constant step size implementation), written over a batch.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt


_NEWTON_MAXITER = 4
_MIN_FACTOR = 0.2
_MAX_FACTOR = 10.0
_MAX_REJECTED = 30
# From this many species on (a "large" model), where the Newton matrix's n³ (an
# inversion) and n² (a Newton iteration's product) weigh more than the rest of a
# step, two rules of CVODES's:
# - An accepted step's size and order are kept unless the error estimates would
#   move the step by at least `_KEEP_STEP_BELOW` times (CVODES's fixed-step bounds,
#   its η in (0, 1.5)): each move past 30 % costs a new inversion (SalazarCavazos et
#   al. 2020, 75 species: 121 inversions an llh against 139, 17 % fewer Newton
#   iterations, 11 % more steps; 0.87-0.95 of the time).
# - A step whose Newton iteration converged in `_SLOW_NEWTON` iterations or more
#   with an old Jacobian takes a fresh one at the next attempt, as CVODES refreshes
#   a Jacobian that has grown old (its `msbj`): Laske et al. 2019's llh 3,742 Newton
#   iterations against 4,654, 27 rejected steps against 89, 0.90-0.95 of the time;
#   SalazarCavazos 2,834 against 2,967 (its four failed iterations forestalled),
#   0.95; Lucarelli and Bachmann as fast as before (more Jacobians, fewer
#   iterations).
# Below, the step follows the estimates (SciPy's choice) and the Jacobian is
# renewed only where Newton's iteration fails: with the first rule, Crauste et al.
# 2017's llh at the default tolerances was 1.1e-6 off its converged value, with the
# second 1.2e-6, against 4e-7 (Borghans 1.1e-7 against 2.1e-8).
_LARGE_FROM_STATES = 20
_KEEP_STEP_BELOW = 1.5
_SLOW_NEWTON = 3
# CVODES's error biases (its BIAS1-3): a new step and order are chosen from the
# error estimates of the orders below, at and above the current one, times these.
# SciPy chooses from the estimates alone: Crauste's llh at rtol 1e-8 was 1.9e-6 off
# its converged value, 4e-7 with these, for 10-30 % more steps.
_BIAS = (6.0, 6.0, 10.0)
# The most directions (parameters the simulation reads) whose errors `BDF` controls
# by default: beyond, the steps the control asks multiply (Lang et al. 2024's 261:
# its gradient's solve more than 13 times as long).
CONTROL_UP_TO = 100
# From this many species on, reverse mode is the adjoint of the steps by default, its
# solve `ADJOINT_TIGHTER` times tighter where it stands in for the control of the
# sensitivities' errors: more accurate than the control on the seven problems
# measured, and 3.8-3.9 times faster on Laske (34 species) and Lucarelli (33), as
# fast on Bachmann (25); slower on the small models (Schwen, Fiedler, Boehm).
ADJOINT_FROM_STATES = 20
# And from this many parameters read by the simulation, whatever the species: on the
# fifteen problems of the collection below 20 species the adjoint's gradient took
# 0.63–1.04 times the controlled forward sensitivities' time from 12 parameters (11
# problems) and 1.17–2.11 times up to 10 (4), and was closer to the converged
# gradient on 14 of the 15 (`docs/devdocs/petab.md`).
ADJOINT_FROM_DIRECTIONS = 12
ADJOINT_TIGHTER = 100.0
# Newton's products `inverse @ x` as products and sums below this many species (XLA
# fuses them with their neighbours; as a batched dot, one kernel of its own, Schwen's
# 19 conditions of 11 species took 23.9 ms an llh against 19.4), as a dot from it on
# (SalazarCavazos's 75 species: 91.7 ms as a dot, 99.9 as sums).
_DOT_FROM_STATES = 20
# Up to this many species, the corrector's derivative inverts its matrix by
# Gauss-Jordan elimination written in JAX's operations (`_inverse`, unrolled over the
# columns) instead of LAPACK's LU, triangular solves and pivots-to-permutation loop,
# which cost more kernels an attempt than the whole elimination of a few species
# (Crauste's residual Jacobian 0.78-0.93 of its time; at 6 species no gain, at 8
# Boehm's gradient 1.24 times as long).
_JORDAN_UP_TO_STATES = 5
# `bdf_adjoint` runs the attempts backwards in blocks of at most this many, their
# Newton matrices (conditions times species squared each) at most this many entries.
_ADJOINT_BLOCK = 64
_ADJOINT_BLOCK_ENTRIES = 2**20
# `bdf_solve(..., record=True)` keeps the rows of at most this many attempts (the
# last segment of the solve), and the state at the start of each segment, from which
# `bdf_adjoint` runs the earlier segments again (as CVODES's adjoint keeps
# checkpoints): its memory is this many rows, not `max_steps` (Bachmann et al.
# 2011's gradient, 36 conditions of 25 species, allocated 950 MB for a record of
# 100,000 attempts, of which it needs 3,700).
_SEGMENT = 8192


@dataclasses.dataclass(frozen=True)
class BDF:
    """The variable-order BDF method (orders 1 to `max_order`) for
    [`sciflat.petab_problem`][]'s simulations: `petab_problem(path, solver=BDF())`.

    Its Jacobian and Newton matrix are kept over many steps (rebuilt when the step
    size or order moves its coefficient by more than 30 %, or Newton's iteration
    stalls), so a step costs one to three evaluations of the vector field: the method
    of CVODES (AMICI) and of PEtab.jl's `QNDF`. From 20 species on, where the
    matrix weighs most, an accepted step is kept unless it could grow by half
    again, and the Jacobian is renewed after a step whose Newton iteration took
    three iterations or more (CVODES's rules); below, the step follows the error
    estimates (SciPy's) and the Jacobian is renewed where Newton's iteration fails.
    The default solver of PEtab problems. The solution at the measurement times is
    its interpolating polynomial, and the gradient is forward mode, each step's
    corrector differentiated at its solution.

    **Fields:**

    - `max_order`: the highest order used, 1 to 5 (5: SciPy's and CVODES's).
    - `control_sensitivities`: where derivatives are taken (`jax.grad` of `nll`,
      the Jacobian of `residuals`), the solves that compute them choose their steps
      by the error of the state and of its derivative along each parameter (scaled
      to the parameter's size), as AMICI's forward sensitivities do (CVODES's
      `errconS`): the gradient converges with the tolerances as the value does.
      Those solves take more steps (Boehm et al. 2014: 16 % more, an oscillator
      55 %), and the value they return with a gradient is within the tolerances of
      `nll`'s, not the same bits. `False`: the derivatives along the state's steps,
      their error not controlled (faster; Fiedler et al. 2016's gradient 1e-3 off
      AMICI's converged one at `rtol=1e-10`, against 8e-5). `None` (the default):
      controlled where the simulation reads at most `CONTROL_UP_TO` (100) of the
      estimated parameters; with more, along the state's steps (Lang et al. 2024,
      261 of them: its gradient took 28 s along the state's steps, and more than
      6 minutes controlled). (`jax.grad` of `nll` from 20 species: `adjoint`.)
    - `adjoint`: `jax.grad` of `nll` by the discrete adjoint of the solve's steps
      (one transposed linear solve an accepted step, whatever the number of
      parameters) instead of one direction per parameter. Where the sensitivities'
      errors would be controlled, the adjoint's solve runs at tolerances
      `ADJOINT_TIGHTER` (100) times tighter instead (its steps the state's alone);
      where they are not, at the problem's (the same derivatives as forward mode
      along the state's steps: Lang et al. 2024's gradient 1.4 s against 28 s).
      `nll` then has no forward mode (`jax.jvp`, `jax.hessian`; `residuals` and
      `problem.uncertainty` keep it). Its memory: the record of the last 8,192
      attempts of a batch of conditions (`conditions × (species + 8)` numbers an
      attempt) and the solve's state at the start of each such segment; a solve
      that takes more runs its earlier segments again, backwards (Lang et al.
      2024: 12,072 attempts, one segment run again). `None` (the default): for
      models of `ADJOINT_FROM_STATES` (20) species or more, or simulations that
      read `ADJOINT_FROM_DIRECTIONS` (12) parameters or more; `True`: always;
      `False`: never.
    - `explicit_first`: whether the solves of a value (`nll`, `llh`, `residuals`;
      not `simulate`'s) are tried first by an explicit method (Tsitouras's 5(4)
      pair, Diffrax's `Tsit5` tableau, in a loop of sciflat's own that computes
      only the values) with Hairer's stiffness test, and solved by this BDF method
      where the test stops it, its budget of steps runs out, or it fails (all the
      simulations of the call by BDF then, its results as without the option;
      under `jax.vmap` over parameter sets, BDF alone). An
      explicit step costs a few evaluations of the vector field and no matrix: on a
      model that is not stiff it solves in a third of BDF's steps (Crauste et al.
      2017's llh in 0.26 of BDF's time). Derivatives are BDF's whatever solves the
      value (the sensitivities' errors controlled as `control_sensitivities` says,
      or the adjoint). `None` (the default): chosen once per problem, at its first
      solve, at the nominal parameters: tried first where the model has fewer than
      `EXPLICIT_BELOW_STATES` (20) species and the explicit solves all finish there
      in at most half of BDF's attempts (`EXPLICIT_SHARE`), with a budget of steps
      a simulation equal to BDF's attempts on its longest simulation (at most
      `explicit_max_steps`); so a stiff region met in a fit costs explicit steps
      only until the test or that budget stops them. `True`: always, with
      `explicit_max_steps` (a stiff model pays its explicit steps each call: Boehm
      et al. 2014 about BDF's time, Elowitz et al. 2000, where the test fires only
      after the budget, 10 times). `False`: never.
    - `explicit_max_steps`: the explicit solve's most steps, accepted and rejected
      (Crauste et al. 2017 takes 300, Borghans et al. 1997 1,144).
    """

    max_order: int = 5
    control_sensitivities: bool | None = None
    adjoint: bool | None = None
    explicit_first: bool | None = None
    explicit_max_steps: int = 10_000

    def __post_init__(self):
        if not isinstance(self.max_order, int) or not 1 <= self.max_order <= 5:
            raise ValueError(f"`max_order` must be 1 to 5, got {self.max_order!r}.")
        if not (
            self.control_sensitivities is None
            or isinstance(self.control_sensitivities, bool)
        ):
            raise TypeError(
                "`control_sensitivities` must be None, True or False, got "
                f"{self.control_sensitivities!r}."
            )
        if not (self.adjoint is None or isinstance(self.adjoint, bool)):
            raise TypeError(
                f"`adjoint` must be None, True or False, got {self.adjoint!r}."
            )
        if not (self.explicit_first is None or isinstance(self.explicit_first, bool)):
            raise TypeError(
                "`explicit_first` must be None, True or False, got "
                f"{self.explicit_first!r}."
            )
        steps = self.explicit_max_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"`explicit_max_steps` must be a positive int, got {steps!r}."
            )

    def controls(self, n_directions: int) -> bool:
        """Whether the sensitivities' errors are controlled, for a simulation that
        reads `n_directions` of the estimated parameters."""
        if self.control_sensitivities is None:
            return n_directions <= CONTROL_UP_TO
        return self.control_sensitivities

    def reverse(self, n_directions: int, n_states: int) -> bool:
        """Whether `jax.grad` of `nll` runs the adjoint of the steps, for a model of
        `n_states` species whose simulation reads `n_directions` parameters."""
        if self.adjoint is None:
            return (
                n_directions > CONTROL_UP_TO
                or n_directions >= ADJOINT_FROM_DIRECTIONS
                or n_states >= ADJOINT_FROM_STATES
            )
        return self.adjoint


# What `bdf_solve(..., record=True)` keeps of each attempt after its state: whether
# it was accepted, its order, the corrector's `c`, its time and step, whether the
# differences were rescaled after it, to which order and by which factor.
_RECORD = (
    "accepted", "order", "c", "t_new", "h", "rescale", "order_next", "factor"
)  # fmt: skip


def _ring_rows(row_bytes: int, rows_kept: int) -> int:
    """How many attempts' rows `bdf_solve(..., record=True)` keeps in its ring
    before copying them into the record: the most, a power of two dividing
    `rows_kept`, within XLA:CPU's 512 bytes for a loop run on the calling thread; 1
    (no ring) where two rows exceed them."""
    ring = 1
    while 2 * ring * row_bytes <= 512 and rows_kept % (2 * ring) == 0:
        ring *= 2
    return ring


def _record_rows(rows: jax.Array, n: int) -> dict[str, jax.Array]:
    """The record's rows `(..., n + 8)` as named arrays (`y` and `_RECORD`)."""
    out = {"y": rows[..., :n]}
    for i, key in enumerate(_RECORD):
        col = rows[..., n + i]
        if key in ("accepted", "rescale"):
            col = col != 0
        elif key in ("order", "order_next"):
            col = col.astype(jnp.int32)
        out[key] = col
    return out


def _inverse(w: jax.Array) -> jax.Array:
    """The inverses of a batch of matrices `(C, n, n)`: up to
    `_JORDAN_UP_TO_STATES`, by Gauss-Jordan elimination with partial pivoting
    unrolled over the columns (a few fused kernels a column, no LAPACK call);
    beyond, LAPACK's (`jnp.linalg.inv`). A singular matrix gives entries that are
    not finite either way."""
    n = w.shape[-1]
    if n > _JORDAN_UP_TO_STATES:
        return jnp.linalg.inv(w)
    a = jnp.concatenate([w, jnp.broadcast_to(jnp.eye(n, dtype=w.dtype), w.shape)], -1)
    rows = jnp.arange(n)
    for k in range(n):
        col = jnp.where(rows[None, :] >= k, jnp.abs(a[:, :, k]), -1)
        p = jnp.argmax(col, axis=1)
        row_k = a[:, k, :]
        row_p = jnp.take_along_axis(a, p[:, None, None], axis=1)[:, 0, :]
        a = jnp.where((rows[None, :] == p[:, None])[:, :, None], row_k[:, None, :], a)
        pivot = row_p / row_p[:, k : k + 1]
        factor = jnp.where(rows[None, :] == k, 0, a[:, :, k])
        a = a - factor[:, :, None] * pivot[:, None, :]
        a = jnp.where((rows == k)[None, :, None], pivot[:, None, :], a)
    return a[:, :, n:]


def _pick(table: jax.Array, order: jax.Array) -> jax.Array:
    """`table[order]` for a small table, as selects that XLA fuses into their
    users (a gather is a kernel of its own)."""
    out = jnp.full(order.shape, table[0], table.dtype)
    for j in range(1, table.shape[0]):
        out = jnp.where(order == j, table[j], out)
    return out


def _coefficients(dtype: Any) -> tuple[Any, Any, Any]:
    kappa = np.array([0, -0.1850, -1 / 9, -0.0823, -0.0415, 0])
    gamma = np.hstack((0, np.cumsum(1 / np.arange(1, 6))))
    alpha = (1 - kappa) * gamma
    error_const = kappa * gamma + 1 / np.arange(1, 7)
    return (
        jnp.asarray(gamma, dtype),
        jnp.asarray(alpha, dtype),
        jnp.asarray(error_const, dtype),
    )


def _rescale(order: jax.Array, factor: jax.Array, k: int) -> jax.Array:
    """The `(k, k)` matrix that takes the backward differences `D[:order + 1]` of a
    step `h` to those of the step `factor * h` (`D_new = RU.T @ D`), the identity
    beyond `order`."""
    i = jnp.arange(1, k, dtype=factor.dtype)[:, None]
    j = jnp.arange(1, k, dtype=factor.dtype)[None, :]

    def r(f):
        m = jnp.ones((k, k - 1), factor.dtype)
        m = m.at[1:].set((i - 1 - f * j) / i)
        return jnp.concatenate(
            [jnp.zeros((k, 1), factor.dtype).at[0, 0].set(1), jnp.cumprod(m, axis=0)],
            axis=1,
        )

    idx = jnp.arange(k)
    inside = idx <= order
    rm = jnp.where(inside[None, :], r(factor), 0)
    um = jnp.where(inside[:, None], r(jnp.ones_like(factor)), 0)
    ru = rm @ um
    both = inside[:, None] & inside[None, :]
    return jnp.where(both, ru, jnp.eye(k, dtype=factor.dtype))


def _change(d: jax.Array, order: jax.Array, factor: jax.Array) -> jax.Array:
    """`d` (`(K, n)` backward differences) for a step `factor` times the last."""
    k = 6
    ru = _rescale(order, factor, k)
    return d.at[:k].set(ru.T @ d[:k])


def _accepted(dd: jax.Array, corr: jax.Array, order: jax.Array) -> jax.Array:
    """The backward differences `(C, 8, n)` after a step accepted with the
    correction `corr` `(C, n)` (SciPy's update, with `order` per condition)."""
    rows = jnp.arange(dd.shape[1])
    upto = rows[None, :, None] <= order[:, None, None]
    masked = jnp.where(upto, dd, 0)
    tail = jnp.flip(jnp.cumsum(jnp.flip(masked, 1), axis=1), 1)
    d_top = jnp.take_along_axis(dd, (order + 1)[:, None, None], axis=1)[:, 0]
    new = jnp.where(upto, tail + corr[:, None, :], dd)
    new = jnp.where(
        rows[None, :, None] == (order + 1)[:, None, None], corr[:, None, :], new
    )
    return jnp.where(
        rows[None, :, None] == (order + 2)[:, None, None],
        (corr - d_top)[:, None, :],
        new,
    )


def bdf_solve(
    rhs: Callable[[Any, Any, Any], Any],
    jacobian: Callable[[Any, Any, Any], Any],
    constants: jax.Array,
    y0: jax.Array,
    ts: npt.NDArray[np.float64],
    rtol: float,
    atol: float,
    max_steps: int,
    max_order: int = 5,
    with_stats: bool = False,
    tangents: tuple[jax.Array, jax.Array] | None = None,
    record: bool = False,
    resume: dict[str, jax.Array] | None = None,
    need: jax.Array | None = None,
) -> Any:
    """Solves `dy/dt = rhs(t, y, k)` from `t = 0` for a batch of conditions
    (`constants`: `(C, k)`, `y0`: `(C, n)`) and returns the solution at `ts`
    (sorted, `>= 0`) as `(C, T, n)`, with whether each solve succeeded `(C,)`;
    `with_stats`: and per condition, the steps accepted and rejected, Jacobians,
    Newton matrices and Newton iterations (evaluations of `rhs`), `(C, 5)`.

    `tangents`: `(dk, dy0)`, `(P, C, k)` and `(P, C, n)`, P directions of the
    constants and the initial states; then the solution's derivatives along them
    `(P, C, T, n)` are returned after the solution, and their errors are controlled
    with the state's (CVODES's forward sensitivities with `errconS`): a step is
    accepted, and the next step and order chosen, by the largest error estimate of
    the state and of each direction, each direction weighted by `rtol` times its own
    size plus `atol` (so give directions scaled to the parameters' sizes).
    Differentiating the plain solve (`tangents=None`) gives the same derivatives
    along the state's steps, their error not controlled.

    `record` (without `tangents`): also returns what `bdf_adjoint` needs to
    differentiate the solve in reverse mode: a row for each attempt, its corrector's
    solution and its choices (`_RECORD`). The record holds one segment of at most
    `_SEGMENT` attempts, the last; where the solve may take more (`max_steps`), it
    also keeps the solve's state at the start of each segment (`points`), from
    which `resume=` one of them runs that segment again and returns its rows.

    `need`: `(C,)`, how many of `ts` each condition is solved to (by default all):
    a condition stops at `ts[need - 1]`, and its solution at the later times is 0
    (a condition whose last measurement is early takes none of the steps after
    it)."""
    dtype = y0.dtype
    n_cond, n = y0.shape
    eps = float(jnp.finfo(dtype).eps)
    gamma, alpha, error_const = _coefficients(dtype)
    # Newton's iteration converged to min(3 %, rtol ** 0.25) of the step's error
    # tolerance: 1 % at rtol 1e-8. SciPy asks min(0.03, sqrt(rtol)), 1e-4 there, two
    # or three iterations every step; CVODES about 10-30 %. Lang: 0.55 of the time,
    # the same llh; the global error at rtol 1e-10 1.2e-8 where SciPy's gives 7e-9
    # (test_bdf's oscillator).
    # (`rtol` may be traced: `check_tolerances` solves again at others.)
    newton_tol = jnp.maximum(10 * eps / rtol, jnp.minimum(0.03, rtol**0.25))
    ts_j = jnp.asarray(ts, dtype)
    n_out = len(ts)
    if need is None:
        need = jnp.full((n_cond,), n_out, jnp.int32)
    # Each condition's end; one that needs no step (its last time is 0) is done
    # from the start, its steps' numbers those of the whole span.
    t_end = ts_j[need - 1]
    t_end = jnp.where(t_end > 0, t_end, ts_j[-1])
    rows = jnp.arange(8)
    sg = jax.lax.stop_gradient

    # A right-hand side that evaluates a batch of conditions itself (`RateLaws`:
    # `N @ v` summed with the conditions last) does; any other is vmapped.
    f_b = getattr(rhs, "batched", None) or jax.vmap(rhs)

    def jac_b(t, y, k):
        return jax.vmap(jacobian)(sg(t), sg(y), sg(k))

    def norm(x):  # root mean square over the state, per condition
        return jnp.sqrt(jnp.mean(x**2, axis=-1))

    def matvec(a, x):  # (C, n, n) times (C, n)
        if n < _DOT_FROM_STATES:
            return jnp.sum(a * x[:, None, :], axis=-1)
        return jnp.einsum("cij,cj->ci", a, x)

    change = jax.vmap(_change)

    def start(constants, y0):
        """The first step (SciPy's `select_initial_step` for order 1): the
        differences and outputs `(d, ys)`, and the rest of the loop's state."""
        t0 = jnp.zeros((n_cond,), dtype)
        f0 = f_b(t0, y0, constants)
        scale = atol + rtol * jnp.abs(y0)
        d0, d1 = sg(norm(y0 / scale)), sg(norm(f0 / scale))
        h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1)
        h0 = jnp.minimum(h0, t_end)
        f1 = f_b(t0 + h0, y0 + h0[:, None] * f0, constants)
        d2 = sg(norm((f1 - f0) / scale)) / h0
        big = jnp.maximum(d1, d2)
        h1 = jnp.where(
            big <= 1e-15,
            jnp.maximum(1e-6, h0 * 1e-3),
            (0.01 / jnp.where(big <= 1e-15, 1.0, big)) ** 0.5,
        )
        # At most a tenth of the way to the first measurement, as CVODES bounds its
        # first step: where the vector field is ~0 at t = 0 and at the proposed
        # step's end (an input pulse that starts at 0 and is over by then, Fiedler
        # et al. 2016), nothing else would see it (the estimates above are 0;
        # SciPy's BDF steps over it at rtol 1e-12, the llh 52.13 where the
        # converged one is -58.58).
        t_first = float(ts[ts > 0][0]) if np.any(ts > 0) else float(ts[-1])
        h = sg(jnp.minimum(jnp.minimum(100 * h0, h1), 0.1 * t_first))
        h = jnp.where(jnp.isfinite(h) & (h > 0), h, 1e-6 * t_end)

        d = jnp.zeros((n_cond, 8, n), dtype)
        d = d.at[:, 0].set(y0).at[:, 1].set(f0 * h[:, None])
        ys = jnp.full((n_cond, n_out, n), jnp.inf, dtype)
        ys = jnp.where((ts_j <= 0)[None, :, None], y0[:, None, :], ys)
        k_out = jnp.full((n_cond,), int(np.sum(ts <= 0)), jnp.int32)
        rest = dict(
            t=t0,
            h=h,
            order=jnp.ones((n_cond,), jnp.int32),
            n_equal=jnp.zeros((n_cond,), jnp.int32),
            jac=jac_b(t0, y0, constants),
            jac_current=jnp.zeros((n_cond,), bool),
            need_jac=jnp.zeros((n_cond,), bool),
            inverse=jnp.zeros((n_cond, n, n), dtype),
            c_lu=jnp.full((n_cond,), jnp.inf, dtype),  # no Newton matrix yet
            crate=jnp.ones((n_cond,), dtype),
            k_out=k_out,
            pending=jnp.zeros((n_cond,), bool),
            t_acc=t0,
            h_acc=h,
            order_acc=jnp.ones((n_cond,), jnp.int32),
            done=k_out >= need,
            failed=jnp.zeros((n_cond,), bool),
            rejected=jnp.zeros((n_cond,), jnp.int32),
            attempts=jnp.zeros((), jnp.int32),
        )
        # The statistics only where asked for: each array of a loop's carry is a
        # kernel of its own an attempt, and another user of `accepted`.
        if with_stats:
            rest["stats"] = jnp.zeros((n_cond, 5), jnp.int32)
        return (d, ys), rest

    def _newton(
        y_pred, psi, constants, t_new, c, ratio_fix, inverse, scale, crate, live, tol
    ):
        """Newton's iteration (SciPy's `solve_bdf_system`) for the corrector
        `c f(t_new, y) - psi - (y - y_pred) = 0`, the batch together, with the
        Newton matrix of earlier steps (`inverse`)."""

        # The loop carries the state and its correction as one array `(C, 2, n)`
        # and each condition's numbers as another `(C, 5)` (the last correction's
        # norm, the rate, converged, iterations, still going; in the state's
        # dtype): XLA:CPU writes each array of a loop's carry with a kernel of its
        # own, and the seven that wrote them, ready together, went to its pool
        # (`nll` of Sneyd et al. 2002 0.72 of its time this way, SalazarCavazos et
        # al. 2020 0.76, Raia et al. 2011 0.85-0.89).
        def newton_cond(ns):
            return jnp.any(ns["s"][:, 4] > 0)

        def newton_body(ns):
            yc, sc = ns["yc"], ns["s"]
            y, corr = yc[:, 0], yc[:, 1]
            active = sc[:, 4] > 0
            fv = f_b(t_new, y, constants)
            # A right-hand side that is not finite makes the whole product `dy`
            # not finite (inf or NaN in every row: `0 * inf` is NaN), so its norm
            # says it: no test of `fv` of its own (three kernels an iteration).
            dy = matvec(inverse, c[:, None] * fv - psi - corr)
            dy = ratio_fix[:, None] * dy
            dy_norm = sg(norm(dy / scale))
            first = ns["k"] == 0
            old = jnp.where(first, 1.0, sc[:, 0])
            rate = jnp.where(first, 0.0, dy_norm / old)
            left = (_NEWTON_MAXITER - ns["k"]).astype(dtype)
            diverge = ~first & (
                (rate >= 1)
                | (rate**left / jnp.where(rate < 1, 1 - rate, 1.0) * dy_norm > tol)
            )
            stop = active & (diverge | ~jnp.isfinite(dy_norm))
            move = active & ~stop
            yc = jnp.where(move[:, None, None], yc + dy[:, None, :], yc)
            # The first iteration is judged by the rate of the last steps, as
            # CVODES does (its `crate`, 1 after a new matrix): one can be enough.
            later = (rate < 1) & (
                rate / jnp.where(rate < 1, 1 - rate, 1.0) * dy_norm < tol
            )
            conv = move & (
                (dy_norm == 0)
                | jnp.where(first, jnp.minimum(crate, 1.0) * dy_norm < tol, later)
            )
            k = ns["k"] + 1
            active = move & ~conv & (k < _NEWTON_MAXITER)
            sc = jnp.stack(
                [
                    jnp.where(move, dy_norm, sc[:, 0]),
                    jnp.where(move & ~first, rate, sc[:, 1]),
                    jnp.where((sc[:, 2] > 0) | conv, 1.0, 0.0),
                    jnp.where(move | stop, k.astype(dtype), sc[:, 3]),
                    active.astype(dtype),
                ],
                axis=1,
            )
            return dict(yc=yc, s=sc, k=k)

        ns = jax.lax.while_loop(
            newton_cond,
            newton_body,
            dict(
                yc=jnp.stack([y_pred, jnp.zeros_like(y_pred)], axis=1),
                s=jnp.stack(
                    [
                        jnp.ones((n_cond,), dtype),
                        jnp.zeros((n_cond,), dtype),
                        jnp.zeros((n_cond,), dtype),
                        jnp.zeros((n_cond,), dtype),
                        live.astype(dtype),
                    ],
                    axis=1,
                ),
                k=jnp.zeros((), jnp.int32),
            ),
        )
        yc, sc = ns["yc"], ns["s"]
        return yc[:, 0], yc[:, 1], sc[:, 2] > 0, sc[:, 3].astype(jnp.int32), sc[:, 1]

    newton = jax.custom_jvp(_newton)

    @newton.defjvp
    def _newton_jvp(primals, tangents) -> Any:
        """The derivative of the corrector's solution, not of the iterations: from
        `(I - c J(y)) dy = c df/dk dk - dpsi + dy_pred` at the converged `y`, with
        the exact Jacobian there and its matrix inverted (as the implicit stages of
        `Kvaerno5` are differentiated). Iterations stopped at the step's tolerance
        leave the state within it; their derivative (forward mode through them) is
        not: Bachmann's gradient was 5 times off its converged value that way.

        Differentiated again (a Hessian: forward mode over the sensitivities), the
        rule is differentiated: the state by this rule once more (`newton`, not its
        iterations), and the matrix `I - c J(y)` with it, its derivative the rates'
        curvature (stopped, the small problem's second derivative in its rate was
        10 % off, Boehm et al. 2014's up to 100 %)."""
        _, _, constants, t_new, c = primals[:5]
        d_pred, d_psi, d_k = tangents[:3]
        out = newton(*primals)
        y, _, converged, iterations, last_rate = out
        fk = jax.jvp(lambda k: f_b(t_new, y, k), (constants,), (d_k,))[1]
        jac_y = jax.vmap(jacobian)(t_new, y, constants)
        w_inv = _inverse(jnp.eye(n, dtype=dtype) - c[:, None, None] * jac_y)
        dy = jnp.einsum("cij,cj->ci", w_inv, c[:, None] * fk - d_psi + d_pred)
        dy = jnp.where(converged[:, None] & jnp.isfinite(dy), dy, d_pred)
        zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)
        return out, (
            dy,
            dy - d_pred,
            zero(converged),
            zero(iterations),
            jnp.zeros_like(last_rate),
        )

    def rebuilt(mask, every, one, old):
        """`old` (a matrix a condition) with those of the conditions in `mask`
        built again: `every()` builds the whole batch's, `one(i)` condition
        `i`'s. Nothing is built where no condition needs it, and in a batch only
        the conditions that need it, one after the other: each condition builds
        its matrices at its own steps, and the whole batch's whenever one needs
        them cost a chunk of four large models up to four times the rebuilds,
        four matrices each (SalazarCavazos et al. 2020's `nll` 106 ms, 76 this
        way; Schwen et al. 2014's 7 simulations in one batch 13.9, 12.0)."""
        if n_cond == 1:
            batch = lambda: jnp.where(mask[:, None, None], every(), old)
            return jax.lax.cond(jnp.any(mask), batch, lambda: old)

        def lane(carry):
            todo, out = carry
            i = jnp.argmax(todo)
            return todo.at[i].set(False), out.at[i].set(one(i))

        return jax.lax.while_loop(lambda c: jnp.any(c[0]), lane, (mask, old))[1]

    def trial(s, dd, constants):
        """A trial step from the differences `dd`: the new state and the
        correction, `(y_new, corr)`, and what the rest of the attempt needs."""
        live = ~s["done"]
        order, hh, t = s["order"], s["h"], s["t"]
        # The step was shortened to end at `t_end` (below): it ends there exactly.
        t_new = jnp.where(t + hh >= t_end, t_end, t + hh)

        below = rows[None, :] <= order[:, None]  # (C, 8)
        y_pred = jnp.sum(jnp.where(below[:, :, None], dd, 0), axis=1)
        g = jnp.where(below[:, 1:6] & (rows[None, 1:6] >= 1), gamma[None, 1:6], 0)
        a_o = _pick(alpha, order)
        psi = jnp.sum(g[:, :, None] * dd[:, 1:6], axis=1) / a_o[:, None]
        c = hh / a_o
        scale = atol + rtol * jnp.abs(y_pred)

        # The Jacobian where Newton's iteration failed with an old one.
        need_jac = live & s["need_jac"]
        jac = rebuilt(
            need_jac,
            lambda: jac_b(t_new, y_pred, constants),
            lambda i: jacobian(sg(t_new[i]), sg(y_pred[i]), sg(constants[i])),
            s["jac"],
        )
        jac_current = s["jac_current"] | need_jac
        # The Newton matrix `I - c J`, inverted, with a new Jacobian or where the
        # step or order changed: CVODES keeps its Newton matrix while `c` stays
        # within 30 % of the one it was built with, the correction scaled by
        # 2 / (1 + c / c_lu) (its `gamrat`).
        far = jnp.abs(c / s["c_lu"] - 1) > 0.3
        need_lu = live & (need_jac | far)
        eye = jnp.eye(n, dtype=dtype)
        inverse = rebuilt(
            need_lu,
            lambda: jnp.linalg.inv(sg(eye - c[:, None, None] * jac)),
            lambda i: jnp.linalg.inv(sg(eye - c[i] * jac[i])),
            s["inverse"],
        )
        c_lu = jnp.where(need_lu, c, s["c_lu"])
        crate = jnp.where(need_lu, 1.0, s["crate"])
        ratio_fix = 2 / (1 + c / c_lu)

        y_new, corr, converged, iterations, last_rate = newton(
            y_pred,
            psi,
            constants,
            t_new,
            c,
            ratio_fix,
            inverse,
            scale,
            crate,
            live,
            newton_tol,
        )
        crate = jnp.where(
            live & (iterations >= 2), jnp.maximum(0.3 * crate, last_rate), crate
        )
        return (y_new, corr), dict(
            live=live,
            t_new=t_new,
            y_new=sg(y_new),
            jac=jac,
            jac_current=jac_current,
            need_jac=need_jac,
            inverse=inverse,
            need_lu=need_lu,
            c_lu=c_lu,
            crate=crate,
            converged=converged,
            iterations=iterations,
        )

    def finish(s, tr, extra, dd, corr):
        out, rest, _ = finish_made(s, tr, extra, dd, corr)
        return out, rest

    def finish_made(s, tr, extra, dd, corr):
        """The rest of an attempt, from the trial `tr` and its correction `corr`:
        accepted or rejected, the next step and order; the new differences `d`,
        those of the accepted step before they are rescaled to the next (`d_acc`,
        for the outputs: `passed`), and the rest of the state. `extra`: None, or
        the directions' error estimates at the order below, at and above (each
        `(C,)`), which the state's are raised to. Last, what the attempt chose
        (for `bdf_adjoint`'s record)."""
        live, t_new, y_new = tr["live"], tr["t_new"], tr["y_new"]
        converged, iterations = tr["converged"], tr["iterations"]
        order, hh, t = s["order"], s["h"], s["t"]
        n_iter = jnp.maximum(iterations, 1).astype(dtype)

        # Not converged: a fresh Jacobian first, then half the step.
        newton_failed = live & ~converged
        retry_jac = newton_failed & ~tr["jac_current"]
        halve = newton_failed & tr["jac_current"]
        safety = 0.9 * (2 * _NEWTON_MAXITER + 1) / (2 * _NEWTON_MAXITER + n_iter)
        scale_new = atol + rtol * jnp.abs(y_new)
        error_norm = sg(norm(_pick(error_const, order)[:, None] * corr / scale_new))
        if extra is not None:
            error_norm = jnp.maximum(error_norm, extra[1])
        error_norm = jnp.where(jnp.isfinite(error_norm), error_norm, jnp.inf)
        error_failed = live & converged & (error_norm > 1)
        accepted = live & converged & (error_norm <= 1)

        # Rejected: a smaller step (the differences rescaled to it, below).
        shrink = jnp.where(
            halve,
            0.5,
            jnp.maximum(
                _MIN_FACTOR,
                safety
                * (_BIAS[1] * jnp.where(error_norm > 0, error_norm, 1.0))
                ** (-1 / (order + 1).astype(dtype)),
            ),
        )
        rejected_now = halve | error_failed

        # Accepted: the differences updated.
        dd = jnp.where(accepted[:, None, None], _accepted(dd, corr, order), dd)

        # The measurement times this step passed: written by `passed` once the
        # loop of attempts stops for them.
        pending = (
            accepted
            & (s["k_out"] < n_out)
            & (ts_j[jnp.minimum(s["k_out"], n_out - 1)] <= t_new)
        )
        d_acc = dd

        # Accepted: after `order + 1` steps of one size, a new order and step size
        # (SciPy's choice, from the error estimates of the orders around).
        n_equal = jnp.where(accepted, s["n_equal"] + 1, s["n_equal"])
        choose = accepted & (n_equal >= order + 1)

        def new_order():
            err_m, err_p = _around(dd, order, error_const, atol, rtol, max_order)
            errs = sg(jnp.stack([err_m, error_norm, err_p], axis=1))
            if extra is not None:
                errs = jnp.maximum(errs, jnp.stack([extra[0], error_norm, extra[2]], 1))
            errs = errs * jnp.asarray(_BIAS, dtype)
            powers = -1 / (order[:, None] + jnp.arange(3)[None, :]).astype(dtype)
            factors = jnp.where(
                errs > 0, jnp.where(errs > 0, errs, 1.0) ** powers, jnp.inf
            )
            factors = jnp.where(jnp.isfinite(errs), factors, 0.0)
            delta = jnp.argmax(factors, axis=1).astype(jnp.int32) - 1
            grow = jnp.minimum(_MAX_FACTOR, safety * jnp.max(factors, axis=1))
            return order + delta, grow

        order_next, grow = jax.lax.cond(
            jnp.any(choose), new_order, lambda: (order, jnp.ones_like(hh))
        )
        if n >= _LARGE_FROM_STATES:
            # Kept: the choice is made again after the next accepted step.
            choose = choose & (grow >= _KEEP_STEP_BELOW)
        order_next = jnp.where(choose, order_next, order)

        # One rescaling of the differences: to the smaller step of a rejection or
        # the new step (and order) chosen, and then to end at `t_end` at most.
        t_next = jnp.where(accepted, t_new, t)
        factor = jnp.where(rejected_now, shrink, jnp.where(choose, grow, 1.0))
        h_next = hh * factor
        clip = live & (t_next + h_next > t_end) & ~(accepted & (t_new >= t_end))
        factor = sg(jnp.where(clip, (t_end - t_next) / hh, factor))
        h_next = jnp.where(clip, t_end - t_next, h_next)
        rescale = rejected_now | choose | clip
        dd = jax.lax.cond(
            jnp.any(rescale),
            lambda: jnp.where(
                rescale[:, None, None], change(dd, order_next, factor), dd
            ),
            lambda: dd,
        )
        n_equal = jnp.where(rescale, 0, n_equal)

        # A fresh Jacobian after a failed Newton iteration; from
        # `_LARGE_FROM_STATES` species also after one that converged slowly with an
        # old Jacobian (in `_SLOW_NEWTON` iterations or more).
        need_jac = retry_jac
        if n >= _LARGE_FROM_STATES:
            slow = accepted & ~tr["jac_current"] & (iterations >= _SLOW_NEWTON)
            need_jac = need_jac | slow

        rejected = jnp.where(accepted, 0, s["rejected"] + (live & ~accepted))
        tiny = h_next < 10 * eps * jnp.abs(t_next)
        failed = s["failed"] | (
            live & ((rejected > _MAX_REJECTED) | tiny | ~jnp.isfinite(h_next))
        )
        done = s["done"] | failed | (accepted & (t_new >= t_end))
        rest = dict(
            t=t_next,
            h=h_next,
            order=order_next,
            n_equal=n_equal,
            jac=tr["jac"],
            jac_current=jnp.where(accepted, False, tr["jac_current"]),
            need_jac=need_jac,
            inverse=tr["inverse"],
            c_lu=tr["c_lu"],
            crate=tr["crate"],
            k_out=s["k_out"],
            pending=pending,
            t_acc=t_new,
            h_acc=hh,
            order_acc=order,
            done=done,
            failed=failed,
            rejected=rejected,
            attempts=s["attempts"] + 1,
        )
        if with_stats:
            rest["stats"] = s["stats"] + jnp.stack(
                [
                    accepted,
                    live & ~accepted,
                    tr["need_jac"],
                    tr["need_lu"],
                    live * iterations,
                ],
                axis=1,
            ).astype(jnp.int32)
        made = dict(
            accepted=accepted, rescale=rescale, order_next=order_next, factor=factor
        )
        return (dd, d_acc), rest, made

    def passed(s, d_acc, ys):
        ys, _, rest = passed_from(s, d_acc, ys, None)
        return ys, rest

    def passed_from(s, d_acc, ys, source):
        """The outputs at the measurement times the last accepted step passed
        (`s["pending"]`), from its polynomial (its differences `d_acc`): the new
        `ys`, and the state with each condition's next measurement (`k_out`) and
        none pending; `source` `(C, T)` (or None): which attempt gave each output,
        updated."""
        t_new, hh, order, want0 = s["t_acc"], s["h_acc"], s["order_acc"], s["pending"]

        def out_cond(os):
            return jnp.any(os["want"])

        def out_body(os):
            k_out, ys_ = os["k_out"], os["ys"]
            tk = ts_j[jnp.minimum(k_out, n_out - 1)]
            j = jnp.arange(1, 6, dtype=dtype)
            shift = t_new[:, None] - hh[:, None] * (j - 1)
            x = (tk[:, None] - shift) / (hh[:, None] * j)
            p = jnp.cumprod(x, axis=1)
            p = jnp.where(j[None, :] <= order[:, None].astype(dtype), p, 0)
            y_at = d_acc[:, 0] + jnp.einsum("ck,ckn->cn", p, d_acc[:, 1:6])
            y_at = jnp.where((tk >= t_new)[:, None], d_acc[:, 0], y_at)
            want = os["want"]
            onehot = (jnp.arange(n_out)[None, :] == k_out[:, None]) & want[:, None]
            # Written in place, a row a condition (the whole `ys` selected anew
            # would copy it at every output: Lang et al. 2024's 600 times).
            at = jnp.minimum(k_out, n_out - 1)
            lanes = jnp.arange(n_cond)
            ys_ = ys_.at[lanes, at].set(
                jnp.where(want[:, None], y_at, ys_[lanes, at]),
                unique_indices=True,
            )
            k_out = k_out + want.astype(jnp.int32)
            next_want = (
                want & (k_out < n_out) & (ts_j[jnp.minimum(k_out, n_out - 1)] <= t_new)
            )
            new = dict(k_out=k_out, ys=ys_, want=next_want)
            if source is not None:  # the last attempt gave them
                new["source"] = jnp.where(onehot, s["attempts"] - 1, os["source"])
            return new

        first = dict(k_out=s["k_out"], ys=ys, want=want0)
        if source is not None:
            first["source"] = source
        os = jax.lax.while_loop(out_cond, out_body, first)
        rest = dict(s, k_out=os["k_out"], pending=jnp.zeros_like(want0))
        return os["ys"], os.get("source"), rest

    def going(s):
        return jnp.any(~s["done"]) & (s["attempts"] < max_steps)

    def stepping(s):
        return going(s) & ~jnp.any(s["pending"])

    kept: dict[str, jax.Array] = {}
    if record or resume is not None:
        if tangents is not None:
            raise ValueError("`record` is for the plain solve (no `tangents`).")
        # The plain solve's two loops, each attempt written to the record: a
        # segment of `_SEGMENT` attempts at a time (`rows_kept`), into a record of
        # that many rows, the solve's state kept at the start of each segment. One
        # row an attempt, its numbers side by side (one update of the record an
        # attempt, not one for each): `_RECORD` after the state `y`.
        rows_kept = min(_SEGMENT, max_steps)
        book = jnp.zeros((rows_kept, n_cond, n + len(_RECORD)), dtype)
        # A small model's rows go first to a ring of a few attempts, copied into
        # the record when it is full or the attempts stop: the attempts' loop then
        # touches no buffer above XLA:CPU's 512 bytes, and runs kernel after kernel
        # on the calling thread instead of as a graph on its pool (the loop that
        # writes the record itself holds the whole record).
        ring = _ring_rows(book[0].nbytes, rows_kept)

        def attempt_kept(carry):
            s, book = carry
            (_, corr), tr = trial(s, s["d"], constants)
            (d, d_acc), rest, made = finish_made(s, tr, None, s["d"], corr)
            made = dict(
                made,
                order=s["order"],
                c=s["h"] / _pick(alpha, s["order"]),
                t_new=tr["t_new"],
                h=s["h"],
            )
            numbers = jnp.stack([made[k].astype(dtype) for k in _RECORD], axis=1)
            row = jnp.concatenate([tr["y_new"], numbers], axis=1)
            book = book.at[s["attempts"] % book.shape[0]].set(row)
            return dict(rest, d=d, d_acc=d_acc), book

        def segment(s, book, ys, source):
            """The attempts from `s` (at the start of a segment) to the end of
            the segment or of the solve, each written to `book`."""
            limit = (s["attempts"] // rows_kept + 1) * rows_kept

            def steps_kept(carry):
                s, book, ys, source = carry
                if ring > 1:  # the attempts to the ring's end, then the ring copied
                    end = jnp.minimum(limit, (s["attempts"] // ring + 1) * ring)
                    at = (end - ring) % rows_kept  # the ring's first row in `book`
                    s, rows = jax.lax.while_loop(
                        lambda c: stepping(c[0]) & (c[0]["attempts"] < end),
                        attempt_kept,
                        (s, jax.lax.dynamic_slice_in_dim(book, at, ring)),
                    )
                    book = jax.lax.dynamic_update_slice_in_dim(book, rows, at, axis=0)
                else:
                    s, book = jax.lax.while_loop(
                        lambda c: stepping(c[0]) & (c[0]["attempts"] < limit),
                        attempt_kept,
                        (s, book),
                    )
                # (Nothing pending, at the segment's or the ring's end: outputs
                # unchanged.)
                ys, source, s = passed_from(s, s["d_acc"], ys, source)
                return s, book, ys, source

            return jax.lax.while_loop(
                lambda c: going(c[0]) & (c[0]["attempts"] < limit),
                steps_kept,
                (s, book, ys, source),
            )

        source = jnp.full((n_cond, n_out), -1, jnp.int32)  # -1: y0 (t <= 0)
        if resume is not None:  # one segment again, from its start (`bdf_adjoint`)
            ys = jnp.zeros((n_cond, n_out, n), dtype)
            return segment(resume, book, ys, source)[1]
        (d, ys), rest = start(constants, y0)
        state = dict(rest, d=d, d_acc=d)
        points = None
        if max_steps > rows_kept:
            n_segments = -(-max_steps // rows_kept)
            points = jax.tree.map(
                lambda a: jnp.zeros((n_segments, *a.shape), a.dtype), state
            )

        def segments(carry):
            s, book, ys, source, points = carry
            if points is not None:
                at = s["attempts"] // rows_kept
                points = jax.tree.map(lambda p, a: p.at[at].set(a), points, s)
            return (*segment(s, book, ys, source), points)

        state, book, ys, source, points = jax.lax.while_loop(
            lambda c: going(c[0]), segments, (state, book, ys, source, points)
        )
        kept = {"rows": book, "attempts": state["attempts"], "h0": rest["h"]}
        kept["source"] = jnp.asarray(source)
        if points is not None:
            kept["points"] = points
        out = (ys,)
    elif tangents is None:
        # Two loops: the attempts (the inner loop) until a step passes a
        # measurement time, then that step's outputs (`passed`). The attempts' loop
        # then carries no output: XLA:CPU runs a loop body kernel after kernel on
        # the calling thread where all its buffers are at most 512 bytes (a small
        # model's), and hands ready kernels to its pool otherwise (Elowitz's `nll`
        # 1.7 times as long).

        def attempt(s):
            (_, corr), tr = trial(s, s["d"], constants)
            (d, d_acc), rest = finish(s, tr, None, s["d"], corr)
            return dict(rest, d=d, d_acc=d_acc)

        def steps(carry):
            s, ys = carry
            s = jax.lax.while_loop(stepping, attempt, s)
            ys, s = passed(s, s["d_acc"], ys)
            return s, ys

        (d, ys), rest = start(constants, y0)
        state, ys = jax.lax.while_loop(
            lambda c: going(c[0]), steps, (dict(rest, d=d, d_acc=d), ys)
        )
        out = (ys,)
    else:
        # Each direction's derivative carried beside the state (P of them, as
        # `jax.jvp` under `jax.vmap` computes them, the state's work done once),
        # its error estimated before the step is accepted.
        dk, dy0 = tangents

        def along(fn, primals, dirs):
            return jax.vmap(
                lambda *t: jax.jvp(fn, primals, t, has_aux=True),
                out_axes=(None, 0, None),
            )(*dirs)

        def directions_error(s, y_new_t, corr_t, dd_t):
            """The directions' error estimates (each the largest over them) at the
            order below, the order and above, as the state's (`(C,)` each)."""
            order = s["order"]
            scale = atol + rtol * jnp.abs(y_new_t)
            now = norm(_pick(error_const, order)[None, :, None] * corr_t / scale)
            new_t = jax.vmap(_accepted, in_axes=(0, 0, None))(dd_t, corr_t, order)
            m, p = jax.vmap(
                lambda d: _around(d, order, error_const, atol, rtol, max_order)
            )(new_t)
            return tuple(sg(jnp.max(e, axis=0)) for e in (m, now, p))

        def attempt_along(carry):
            s, dd_t, ys, ys_t = carry
            (_, corr), (y_new_t, corr_t), tr = along(
                lambda dd, k: trial(s, dd, k), (s["d"], constants), (dd_t, dk)
            )
            extra = directions_error(s, y_new_t, corr_t, dd_t)
            (d, d_acc), (dd_t, d_acc_t), rest = along(
                lambda dd, corr: finish(s, tr, extra, dd, corr),
                (s["d"], corr),
                (dd_t, corr_t),
            )
            # The outputs in the same loop: its body holds the directions, larger
            # than 512 bytes anyway (two loops: 10 % more time).
            ys, ys_t, rest = along(
                lambda d_acc, ys: passed(rest, d_acc, ys), (d_acc, ys), (d_acc_t, ys_t)
            )
            return dict(rest, d=d), dd_t, ys, ys_t

        (d, ys), (dd_t, ys_t), rest = along(start, (constants, y0), (dk, dy0))
        state, _, ys, ys_t = jax.lax.while_loop(
            lambda c: going(c[0]), attempt_along, (dict(rest, d=d), dd_t, ys, ys_t)
        )
        out = (ys, ys_t)
    ok = state["done"] & ~state["failed"] & (state["k_out"] >= need)
    # The times after a condition's end: 0, not the `inf` they start from.
    after = (jnp.arange(n_out)[None, :] >= need[:, None])[:, :, None]
    out = tuple(jnp.where(after, 0, y) for y in out)
    if with_stats:
        return (*out, ok, state["stats"])
    if record:
        return (*out, ok, kept)
    return (*out, ok)


def _around(
    dd: jax.Array,
    order: jax.Array,
    error_const: jax.Array,
    atol: Any,
    rtol: Any,
    max_order: int,
) -> tuple[jax.Array, jax.Array]:
    """The error estimates `(C,)` of the orders below and above `order` after an
    accepted step (`dd` updated), for the choice of the next order (inf where there
    is no such order)."""
    scale = atol + rtol * jnp.abs(dd[:, 0])

    def estimate(o, row):
        e = error_const[jnp.clip(o, 0, 5)][:, None]
        e = e * jnp.take_along_axis(dd, row[:, None, None], axis=1)[:, 0]
        return jnp.sqrt(jnp.mean((e / scale) ** 2, axis=-1))

    err_m = jnp.where(order > 1, estimate(order - 1, order), jnp.inf)
    err_p = jnp.where(
        order < max_order, estimate(order + 1, jnp.minimum(order + 2, 7)), jnp.inf
    )
    return err_m, err_p


def bdf_adjoint(
    rhs: Callable[[Any, Any, Any], Any],
    jacobian: Callable[[Any, Any, Any], Any],
    constants: jax.Array,
    y0: jax.Array,
    ts: npt.NDArray[np.float64],
    kept: dict[str, jax.Array],
    ys_bar: jax.Array,
    replay: Callable[[dict[str, jax.Array]], jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Reverse mode through a solve of `bdf_solve(..., record=True)`: the cotangents
    of `constants` `(C, k)` and `y0` `(C, n)` from those of its outputs `ys_bar`
    `(C, T, n)`, with `kept` its record. The discrete adjoint of the steps taken:
    the attempts from the last to the first, each step's differences updated,
    rescaled and read at the measurement times transposed (they are linear in the
    differences), and each accepted corrector's solution `y` differentiated
    implicitly, `(I - c J(y))ᵀ μ = ȳ` with the exact Jacobian at `y` (the transpose
    of the forward rule, `_newton_jvp`). The step sizes, orders and matrices are
    constants, as in forward mode: the same derivatives as `jax.jvp` of the plain
    solve along the state's steps (not `tangents`' controlled ones), for the cost of
    one transposed solve an accepted step rather than one direction per parameter.

    The record holds the last segment of the solve's attempts; `replay(point)`
    (`bdf_solve(..., resume=point)` with the solve's arguments) gives the rows of an
    earlier segment from the state at its start, `kept["points"]`."""
    if "points" in kept and replay is None:
        raise ValueError("A record of several segments needs `replay`.")
    dtype = y0.dtype
    n_cond, n = y0.shape
    gamma, alpha, _ = _coefficients(dtype)
    ts_j = jnp.asarray(ts, dtype)
    rows = jnp.arange(8)
    f_b = jax.vmap(rhs)
    change = jax.vmap(_change)
    zeros_d = jnp.zeros((n_cond, 8, n), dtype)
    zeros_y = jnp.zeros((n_cond, n), dtype)
    source = kept["source"]  # (C, T): the attempt that gave each output; -1: y0

    def read_out(lam_d, i, r):
        """The outputs of attempt `i` (`y = d[0] + Σ p_j d[j]`), transposed onto
        its differences before their rescaling."""
        mine = source == i  # (C, T)
        j = jnp.arange(1, 6, dtype=dtype)
        t_new, hh = r["t_new"][:, None, None], r["h"][:, None, None]
        x = (ts_j[None, :, None] - (t_new - hh * (j - 1))) / (hh * j)
        p = jnp.cumprod(x, axis=-1)  # (C, T, 5)
        p = jnp.where(j <= r["order"][:, None, None].astype(dtype), p, 0)
        p = jnp.where((ts_j[None, :, None] >= t_new) | ~mine[:, :, None], 0, p)
        bar = jnp.where(mine[:, :, None], ys_bar, 0)  # (C, T, n)
        lam_d = lam_d.at[:, 0].add(jnp.sum(bar, axis=1))
        return lam_d.at[:, 1:6].add(jnp.einsum("ctj,ctn->cjn", p, bar))

    def corrector(factors, lam_corr):
        """μ = (I - c J(y))⁻ᵀ ȳ, from the LU factors of `(I - c J(y))ᵀ`."""
        lu, perm = factors
        x = jnp.take_along_axis(lam_corr, perm, axis=1)[..., None]
        x = jax.lax.linalg.triangular_solve(
            lu, x, left_side=True, lower=True, unit_diagonal=True
        )
        x = jax.lax.linalg.triangular_solve(lu, x, left_side=True, lower=False)
        return x[..., 0]

    def back(i, row, factors, lam):
        """Attempt `i` (its record's row `row`, the factors of its transposed
        Newton matrix) run backwards: the differences' cotangent before it, and the
        cotangent of its corrector's `c f(t, y, k)` (for `constants`')."""
        r = _record_rows(row, n)

        # The rescaling to the next step (transposed only after the attempts that
        # rescaled, a conditional: most did not), then the outputs read before it.
        # The conditionals take the whole row, split inside them: each number
        # given apart is a kernel of its own, ready together with the others.
        def rescaled(lam, row):
            r = _record_rows(row, n)
            _, pull = jax.vjp(
                lambda d: change(d, r["order_next"], r["factor"]), zeros_d
            )
            return jnp.where(r["rescale"][:, None, None], pull(lam)[0], lam)

        def read_row(lam, i, row):
            return read_out(lam, i, _record_rows(row, n))

        lam = jax.lax.cond(jnp.any(r["rescale"]), rescaled, lambda a, b: a, lam, row)
        lam = jax.lax.cond(
            jnp.any(source == i), read_row, lambda a, b, c: a, lam, i, row
        )
        # The accepted step's update of the differences by its correction.
        acc = r["accepted"]
        _, pull = jax.vjp(
            lambda d, corr: _accepted(d, corr, r["order"]), zeros_d, zeros_y
        )
        lam_acc, lam_corr = pull(lam)
        lam = jnp.where(acc[:, None, None], lam_acc, lam)
        lam_corr = jnp.where(acc[:, None], lam_corr, 0)
        # corr = y - y_pred, y the corrector's solution from y_pred, psi and k.
        mu = jax.lax.cond(
            jnp.any(acc), corrector, lambda f, x: zeros_y, factors, lam_corr
        )
        lam_pred, lam_psi = mu - lam_corr, -mu
        order = r["order"]
        below = rows[None, :] <= order[:, None]  # (C, 8)
        g = (
            jnp.concatenate([gamma, jnp.zeros(2, dtype)])[None, :]
            / _pick(alpha, order)[:, None]
        )
        g = jnp.where(below & (rows[None, :] >= 1) & (rows[None, :] <= 5), g, 0)
        lam = lam + jnp.where(below[:, :, None], lam_pred[:, None, :], 0)
        lam = lam + g[:, :, None] * lam_psi[:, None, :]
        return lam, jnp.where(acc[:, None], r["c"][:, None] * mu, 0)

    # The attempts from the last to the first, a block of them at a time. What
    # does not depend on the cotangents runs for the whole block at once: before
    # its attempts run backwards, the Jacobians at their accepted steps and the LU
    # factors of their transposed Newton matrices; after, the correctors' share of
    # `constants`' cotangent, `(c ∂f/∂k)ᵀ μ`, which is linear in the μ the loop
    # found. The loop itself runs two triangular solves an accepted step.
    # The record: the rows of one segment of the attempts, `ring` of them.
    ring = kept["rows"].shape[0]
    size = int(min(_ADJOINT_BLOCK, max(1, _ADJOINT_BLOCK_ENTRIES // (n_cond * n * n))))
    size = min(size, ring)
    eye = jnp.eye(n, dtype=dtype)

    def pull_k(t, y, bar):
        return jax.vjp(lambda k: f_b(t, y, k), constants)[1](bar)[0]

    def block(carry):
        end, lam, k_bar, book, base = carry
        start = jnp.maximum(end - size + 1, base)
        block_rows = jax.lax.dynamic_slice_in_dim(book, start - base, size)
        part = _record_rows(block_rows, n)
        # Rows past `end` (the block clipped at the segment's first attempt) and
        # those of rejected attempts are masked: their records may be anything.
        mine = part["accepted"] & (jnp.arange(size) <= end - start)[:, None]
        k_b = jnp.broadcast_to(constants, (size, *constants.shape))
        jac = jax.vmap(jax.vmap(jacobian))(part["t_new"], part["y"], k_b)
        w = eye - part["c"][..., None, None] * jac
        w = jnp.where(mine[..., None, None], w, eye)
        lu, _, perm = jax.lax.linalg.lu(jnp.swapaxes(w, -1, -2))

        def one(c):
            j, lam, bars = c
            # The attempt's row read once (one kernel, where a read of each of
            # its numbers was one each, ready together: XLA:CPU hands more than
            # 8 ready kernels to its pool).
            lam, bar = back(start + j, block_rows[j], (lu[j], perm[j]), lam)
            return j - 1, lam, bars.at[j].set(bar)

        bars = jnp.zeros((size, n_cond, n), dtype)
        _, lam, bars = jax.lax.while_loop(
            lambda c: c[0] >= 0, one, (end - start, lam, bars)
        )
        from_k = jax.vmap(pull_k)(part["t_new"], part["y"], bars)
        k_bar = k_bar + jnp.sum(jnp.where(mine[..., None], from_k, 0), axis=0)
        return start - 1, lam, k_bar, book, base

    attempts = kept["attempts"]
    last = (attempts - 1) // ring  # the last segment; -1: no attempt

    def segment(carry):
        """The attempts of segment `j`, from the last to the first, a block of
        them at a time: its rows are the record's (the last segment) or run again
        from the state at its start."""
        j, lam, k_bar = carry
        book = kept["rows"]
        if "points" in kept:

            def again() -> jax.Array:
                assert replay is not None  # (checked above)
                return replay(jax.tree.map(lambda a: a[j], kept["points"]))

            book = jax.lax.cond(j == last, lambda: book, again)
        base = j * ring
        end = jnp.minimum(attempts, base + ring) - 1
        _, lam, k_bar, _, _ = jax.lax.while_loop(
            lambda c: c[0] >= c[4], block, (end, lam, k_bar, book, base)
        )
        return j - 1, lam, k_bar

    _, lam, k_bar = jax.lax.while_loop(
        lambda c: c[0] >= 0, segment, (last, zeros_d, jnp.zeros_like(constants))
    )
    # The start: d[0] = y0, d[1] = h0 f(0, y0, k), and the outputs at t <= 0.
    h0 = kept["h0"]
    t0 = jnp.zeros((n_cond,), dtype)
    _, pull = jax.vjp(lambda y, k: f_b(t0, y, k) * h0[:, None], y0, constants)
    y_bar, k_start = pull(lam[:, 1])
    at_start = ((source == -1) & (ts_j <= 0)[None, :])[:, :, None]
    y_bar = y_bar + lam[:, 0] + jnp.sum(jnp.where(at_start, ys_bar, 0), 1)
    return k_bar + k_start, y_bar
