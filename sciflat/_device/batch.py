"""Many least-squares fits of one structure as one compiled program.

K starts, K datasets stacked along a leading axis, or both: the device fit (`_lm`) in a
pool of slots, each turn one trial of every slot under `jax.vmap` (slot by slot where
the residuals call LAPACK themselves on a CPU), each fit stopping on its own and its
slot taking the next queued fit at the next turn, inside the compiled program; the
slots sharded over every device of JAX's (`jax.shard_map`: each device runs its own
loop on its own queue). Memory: the data and results grow with K; between turns a slot
keeps its fit's normal equations (`MinpackQR`: its Jacobian); never K².
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float, PyTree

from .._fitting.gradients import Mode, choose_modes
from .._fitting.inputs import checked_inputs
from .._fitting.problem import split_args
from .._fitting.programs import Programs
from .._fitting.progress import progress_bar
from .._fitting.result import FitResult, Status, _model_shaped
from .._fitting.starts import stacked_starts
from .._fitting.uncertainty import (
    DELTA,
    KNOWN,
    member_uncertainty,
    residual_variances,
)
from .._flatten import Restructure
from .._solver import lm as _lm, normal as _normal
from .._transforms import has_transforms
from . import least_squares as dls
from .jacobian import evaluation, residual_fn


_M = TypeVar("_M")
_WHO = "least_squares_batch"


@dataclasses.dataclass(frozen=True)
class NormalEquations:
    """The batch's default algorithm: MINPACK's Levenberg–Marquardt (its trust
    region, Moré's Levenberg parameter, its scaling and tests), each trial's step
    solved from the damped normal equations `(J̃ᵀJ̃ + λ I) a = J̃ᵀ f` of the
    column-scaled Jacobian `J̃` by a Cholesky written over the batch (no LAPACK call
    per fit), in the fits' dtype.

    The normal equations square the Jacobian's condition number: a fit whose
    `J̃ᵀJ̃` gets a Cholesky pivot under 1e4 eps of its diagonal (its dtype's eps) is
    run again from its start with [`sciflat.MinpackQR`][] (its message says so). The
    covariance comes from the same Cholesky where every pivot is above 1e8 eps (at
    most 1e-3) of its diagonal, else from an SVD of the Jacobian. The same minimum as
    MINPACK to the digits the data determine; the last bits and, rarely, the number
    of evaluations differ from `least_squares(method="device")`.

    !!! Example

        ```python
        batch = sciflat.least_squares_batch(
            residuals, model, batch_args=(ys,), algorithm=sciflat.NormalEquations())
        ```
    """


@dataclasses.dataclass(frozen=True)
class MinpackQR:
    """MINPACK's Levenberg–Marquardt with every trial's step from a QR and an SVD of
    the scaled Jacobian (LAPACK, one call per fit and turn), as
    `least_squares(method="device")` computes it: fit `i` of the batch then equals
    that single fit. Slower than [`sciflat.NormalEquations`][] for small fits.

    !!! Example

        ```python
        batch = sciflat.least_squares_batch(
            residuals, model, batch_args=(ys,), algorithm=sciflat.MinpackQR())
        ```
    """


Algorithm = NormalEquations | MinpackQR


@dataclasses.dataclass(frozen=True)
class _Pool:
    """What a pool's compiled program is built for (`Programs`' key, with the
    residuals, `re`, the data's shapes): the number of shared leaves of `args`, of
    devices, the algorithm, and whether the whole batch is one call (its slots then
    start empty: at most the queue's fits finish in it)."""

    n_shared: int
    n_devices: int
    algorithm: Algorithm
    one_call: bool = False


@dataclasses.dataclass(frozen=True)
class _Fits:
    """Every fit of a batch: the residuals, `re`, the shared `args`, the stacked
    `data` (leading axis K), the starts `x0s`, the number of residuals `m`, and
    whether the model has transforms."""

    residuals: Callable
    re: Restructure
    args: tuple
    data: tuple
    x0s: np.ndarray
    m: int
    transforms: bool


@dataclasses.dataclass(frozen=True)
class BatchResult(Generic[_M]):
    """What [`sciflat.least_squares_batch`][] returns: K fits as arrays, and each as
    a [`sciflat.FitResult`][] on request (`result[i]`).

    `print(result)` summarises the batch: how many converged, the best, and every
    fit that did not converge by index (never hidden in an average).

    **Fields:**

    - `p`: `(K, n)` fitted flat vectors (a fit that could not start keeps its start).
    - `stderr_flat`: `(K, n)` standard errors in `p` order (NaN where the data do not
        determine a parameter, or the fit did not start).
    - `covariance`: `(K, n, n)`.
    - `loss`: `(K,)` costs `0.5 Σr²` (NaN where the fit could not start).
    - `status`, `message`: one per fit, as in `FitResult`.
    - `n_evaluations`, `n_steps`: `(K,)` residual evaluations and accepted steps.
    - `n_data`: the number of residuals of each fit.
    - `starts`: `(K, n)` starting points.
    - `re`: the [`sciflat.Restructure`][] of every fit.
    - `unidentifiable`: per fit, the directions the data do not determine.
    """

    p: npt.NDArray[np.floating]
    stderr_flat: npt.NDArray[np.floating]
    covariance: npt.NDArray[np.floating]
    loss: npt.NDArray[np.floating]
    status: tuple[Status, ...]
    message: tuple[str, ...]
    n_evaluations: npt.NDArray[np.int64]
    n_steps: npt.NDArray[np.int64]
    n_data: int
    starts: npt.NDArray[np.floating]
    re: Restructure[_M] = dataclasses.field(repr=False)
    unidentifiable: tuple[tuple[str, ...], ...] = ()
    # How the host scaled the fits whose covariance it computed (rank-deficient, or
    # through transforms); the others' text is made when a `FitResult` is asked for.
    scale: dict[int, str] = dataclasses.field(default_factory=dict, repr=False)
    known_errors: bool = False

    def with_known_errors(self) -> "BatchResult[_M]":
        """Every fit with the unscaled covariance (JᵀJ)⁻¹, for residuals already
        divided by their known standard deviations (as
        [`sciflat.FitResult.with_known_errors`][])."""
        if self.known_errors:
            raise ValueError("This batch's covariances are unscaled already.")
        s2 = residual_variances(
            np.asarray(self.loss, np.float64),
            self.n_data,
            len(self.re),
            self.unidentifiable,
        ).astype(self.loss.dtype)
        cov = self.covariance / s2[:, None, None]
        scale = {i: KNOWN + DELTA * t.endswith(DELTA) for i, t in self.scale.items()}
        known = KNOWN + DELTA * has_transforms(self.re(jnp.asarray(self.p[0])))
        return dataclasses.replace(
            self,
            covariance=cov,
            stderr_flat=self.stderr_flat / np.sqrt(s2)[:, None],
            scale={i: scale.get(i, known) for i in range(len(self))},
            known_errors=True,
        )

    def __len__(self) -> int:
        return len(self.p)

    @property
    def converged(self) -> npt.NDArray[np.bool_]:
        """`(K,)`: which fits converged."""
        return np.array([s == "converged" for s in self.status])

    @property
    def failed(self) -> list[int]:
        """The indices of the fits that did not converge."""
        return [i for i, s in enumerate(self.status) if s != "converged"]

    @property
    def best_index(self) -> int:
        """The converged fit with the lowest loss (among all, if none converged)."""
        ok = self.converged if self.converged.any() else np.ones(len(self), bool)
        loss = np.where(ok & np.isfinite(self.loss), self.loss, np.inf)
        return int(np.argmin(loss))

    @property
    def best(self) -> FitResult[_M]:
        """`self[self.best_index]`."""
        return self[self.best_index]

    @property
    def model(self) -> _M:
        """Every fitted model at once: the model with a leading axis K on each
        trainable leaf (`jax.vmap(re)(p)`)."""
        return jax.vmap(self.re)(jnp.asarray(self.p))

    @property
    def stderr(self) -> Any:
        """Standard errors in the model's structure, each leaf with a leading axis K."""
        shaped = jax.vmap(lambda s: _model_shaped(self.re, s))
        return jax.tree.map(np.asarray, shaped(jnp.asarray(self.stderr_flat)))

    def __getitem__(self, i: int) -> FitResult[_M]:
        """Fit `i` as a [`sciflat.FitResult`][] (with its uncertainty and report)."""
        i = range(len(self))[i]
        p = jnp.asarray(self.p[i])
        unc = None
        if np.isfinite(self.loss[i]):
            unc = member_uncertainty(
                self.covariance[i],
                self.re,
                float(self.loss[i]),
                self.n_data,
                self.unidentifiable[i],
                self.scale.get(i),
            )
            if self.known_errors:
                unc = dataclasses.replace(unc, residual_variance=None, dof=None)
        cost = float(self.loss[i])
        return FitResult(
            model=self.re(p),
            p=p,
            loss=cost,
            status=self.status[i],
            message=self.message[i],
            history=np.array([cost]),
            n_steps=int(self.n_steps[i]),
            re=self.re,
            uncertainty=unc,
            chisqr=2.0 * cost,
            n_data=self.n_data,
            n_evaluations=int(self.n_evaluations[i]),
        )

    @property
    def results(self) -> list[FitResult[_M]]:
        """Every fit as a `FitResult` (built on request: for K fits, K models)."""
        return [self[i] for i in range(len(self))]

    def summary(self) -> str:
        """How many converged, the best, and the fits that did not converge."""
        ok = self.converged
        best = self.best_index
        n_ok = int(ok.sum())
        head = f"{len(self)} fits: {n_ok} converged, {len(self) - n_ok} not; "
        lines = [head + f"best: fit {best} (loss {self.loss[best]:.6g})"]
        if ok.any():
            q = np.quantile(self.loss[ok], [0.0, 0.5, 1.0])
            lines.append(
                f"loss of the converged fits: min {q[0]:.6g}, median {q[1]:.6g}, "
                f"max {q[2]:.6g}"
            )
        by_status: dict[str, list[int]] = {}
        for i in self.failed:
            by_status.setdefault(self.status[i], []).append(i)
        for status, where in by_status.items():
            shown = ", ".join(map(str, where[:20])) + (" ..." * (len(where) > 20))
            lines.append(
                f"{status} ({len(where)}): fits {shown}; e.g. fit {where[0]}: "
                f"{self.message[where[0]]}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def least_squares_batch(
    residuals: Callable[..., Float[Array, "..."]],
    model: _M,
    *,
    args: tuple = (),
    batch_args: tuple | Sequence[tuple] = (),
    starts: Float[Array, "k n"] | Sequence[Any] | None = None,
    mode: Mode = "auto",
    filter_spec: PyTree = True,
    shard: bool | None = None,
    chunk_size: int | None = None,
    progress: bool = True,
    algorithm: Algorithm = NormalEquations(),
    **kwargs: Any,
) -> BatchResult[_M]:
    """K least-squares fits of one structure as one compiled program.

    Each fit is MINPACK's Levenberg–Marquardt (its scaling and stopping rules, as
    the device fit of [`sciflat.least_squares`][], `method="device"`), and the K
    fits run together under `jax.vmap` in a pool of slots, each stopping on its own
    (its slot then takes the next fit), with exactly the turns it takes alone: fit
    `i` of a batch equals the fit of its start and data run alone with the same
    `algorithm`. By default each trial's step comes from the normal equations
    ([`sciflat.NormalEquations`][]: elementwise over the batch, no LAPACK call per
    fit); with [`sciflat.MinpackQR`][] from a QR and an SVD as the single device fit
    (fit `i` then equals `least_squares(method="device")`). The fits differ in their
    start (`starts`), their data (`batch_args`, stacked along a leading axis), or
    both; `args` is shared. On several devices the slots are sharded over all of
    them.

    !!! Example

        ```python
        # One model, 10,000 datasets: ys has shape (10000, len(x)).
        batch = sciflat.least_squares_batch(
            lambda m, x, y: m["a"] * jnp.exp(-m["k"] * x) - y,
            {"a": 1.0, "k": 0.5}, args=(x,), batch_args=(ys,))
        print(batch)                  # how many converged, the best, the failed ones
        batch.model["k"]              # (10000,) fitted rates; batch.stderr["k"] too
        batch[17]                     # fit 17 as a FitResult, with its report
        ```

    **Arguments:**

    - `residuals`: `residuals(model, *args, *batch_args) -> array`, for one fit
        (`batch_args` without their leading axis).
    - `model`: the model (its structure, and the start of every fit if `starts` is
        None).
    - `args`: data shared by every fit.
    - `batch_args`: data of each fit: a tuple whose array leaves are stacked along a
        leading axis of length K, or a list of K tuples of the same structure.
    - `starts`: None, an array `(K, n)` of flat vectors (in `p`'s order: see
        `re.paths`; a dict's keys are sorted), or a sequence of K models of
        `model`'s structure. A start that is not finite is a failed fit (reported by
        index), not an error.
    - `mode`: the Jacobian's mode, as in `least_squares`.
    - `filter_spec`: as in `least_squares`.
    - `shard`: split the batch over `jax.devices()` (default: when there are several).
        On a CPU, a `residuals` that calls LAPACK itself (`jnp.linalg.solve`, ...)
        runs its slots one at a time, as jaxlib 0.10 can hang on batches of LAPACK
        calls there.
    - `chunk_size`: the number of slots that run at once (one compilation for any
        K): each slot takes the next fit when its own has finished, so a slow fit
        holds only its slot. Default: all at once on an accelerator; on a CPU, about
        4 MB of Jacobians (728 slots for 121 residuals and 5 parameters), which keeps
        each turn in cache. With `NormalEquations`, a pool of 128 slots or more a
        device is rounded up to a multiple of 8 (its last turns evaluate an eighth
        of them). A progress bar counts the finished fits when K is larger.
    - `progress`: show that bar.
    - `algorithm`: [`sciflat.NormalEquations`][] (default) or
        [`sciflat.MinpackQR`][].
    - `**kwargs`: `ftol`, `xtol`, `gtol`, `max_nfev`, `x_scale`, as in
        `least_squares`.

    **Returns:**

    A [`sciflat.BatchResult`][].
    """
    if not isinstance(algorithm, NormalEquations | MinpackQR):
        raise TypeError(
            f"`{_WHO}`: `algorithm` must be `sciflat.NormalEquations()` or "
            f"`sciflat.MinpackQR()`, got {algorithm!r}."
        )
    inputs = checked_inputs(residuals, model, args, None, filter_spec, _WHO, True)
    residuals, re, args = inputs.fn, inputs.re, inputs.args
    x0s = inputs.start[None]
    if starts is not None:
        x0s = stacked_starts(starts, re, filter_spec, _WHO)
    data, k_data = _stack(batch_args)
    k = _batch_size(len(x0s), k_data)
    # Every fit computes in `p`'s dtype (the model's floating leaves').
    dtype = dls.fit_dtype(inputs.model)
    x0s = np.broadcast_to(x0s, (k, len(re))).astype(dtype)
    opts, max_nfev = dls.options(kwargs, len(re), _WHO, dtype)
    devices = jax.devices() if (shard is None or shard) else jax.devices()[:1]
    if shard and len(devices) == 1:
        devices = jax.devices()  # one device: nothing to split
    m = _n_residuals(residuals, re, args, data, x0s[0])
    if chunk_size is None:
        chunk_size = _auto_chunk(m, len(re))
    size = k if chunk_size is None else max(1, min(int(chunk_size), k))
    size = -(-size // len(devices)) * len(devices)  # a multiple of the device count
    if isinstance(algorithm, NormalEquations) and size // len(devices) >= _MIN_TAIL:
        # Each device's slots a multiple of `_NARROW` (`_tail_width`).
        per = -(-size // (len(devices) * _NARROW)) * _NARROW
        size = per * len(devices)
    transforms = has_transforms(inputs.model)
    fits = _Fits(residuals, re, args, data, x0s, m, transforms)
    bar = progress_bar(enabled=progress and k > size, desc=_WHO, unit="fit", total=k)
    try:
        host, how = _run_pool(fits, opts, mode, size, devices, algorithm, bar)
        redo = np.flatnonzero(host["info"] == _NEEDS_QR)
        if len(redo):
            # Fits whose normal equations became ill-conditioned: again from their
            # start, every step MINPACK's (a QR and an SVD), in a pool of their own.
            # Its pool padded to a power of two: a few programs for any count.
            few = dataclasses.replace(fits, data=_member(data, redo), x0s=x0s[redo])
            slots = min(size, 1 << (len(redo) - 1).bit_length())
            again, _ = _run_pool(few, opts, mode, slots, devices[:1], MinpackQR(), bar)
            for key in ("x", "cost", "nfev", "njev", "info", "cov", "full"):
                host[key][redo] = again[key]
            host["jac"].update({int(redo[j]): a for j, a in again["jac"].items()})
    finally:
        bar.close()
    return _result(host, re, x0s, max_nfev, how, redo, transforms)


# `info` of a fit whose normal equations became ill-conditioned (a Cholesky pivot
# under `_normal.TOO_SMALL` eps of its diagonal): it stops, and is run again with
# `MinpackQR`.
_NEEDS_QR = -3


# Fits queued for each call of the pool's program, as a multiple of its slots. The
# program takes the next queued fit into a slot at the turn after the slot's fit
# finished (its start evaluated in the same pass as the other slots' trial points),
# and returns once every queued fit has a slot (the last call: once every fit has
# finished); the host then collects the finished fits and queues the next ones. A
# slot never waits for the host, and the host's visits (a few transfers) come every
# `_QUEUE` fits of a slot.
_QUEUE = 8


class _Slots(NamedTuple):
    """The pool between two calls of its program: each slot's fit (`_lm.State`, the
    slots' axis first), the fit's index in the batch (-1: none, or collected), and
    the fit's data (the leaves of `batch_args`, the slots' axis first)."""

    states: _lm.State
    ids: Any
    data: list


# What the host reads of each finished fit (the Jacobian only where it computes the
# covariance itself).
_GOT = ("id", "x", "cost", "nfev", "njev", "info", "cov", "full")
# What the pool's calls computed, summed over them and the devices: their turns, and
# the slots evaluated in those turns (`_run_pool`'s `work`).
_WORK = ("turns", "evaluated")


def _run_pool(
    fits: _Fits, opts, mode, size: int, devices, algorithm: Algorithm, bar
) -> tuple[dict, str]:
    """Every fit through a pool of `size` slots: each call of the compiled program
    takes the next `_QUEUE * size` fits (fewer at the end), runs every slot's fit
    turn by turn, a slot taking the next queued fit as soon as its own has finished,
    and returns the fits that finished. Each fit's turns are those of `_lm.solve`
    (its state never leaves the device between calls), so it equals the single
    fit."""
    args, data, x0s, m = fits.args, fits.data, fits.x0s, fits.m
    k, n = x0s.shape
    n_dev = len(devices)
    shared = split_args(args, to_device=False)[0]
    pool = _Pool(len(shared), n_dev, algorithm, one_call=k <= size)
    dtype = x0s.dtype
    queue = size if k <= size else _QUEUE * size  # a multiple of `n_dev`, as `size`
    host = dict(
        x=np.zeros((k, n), dtype),
        cost=np.zeros(k, dtype),
        nfev=np.zeros(k, np.int64),
        njev=np.zeros(k, np.int64),
        info=np.zeros(k, np.int64),
        cov=np.zeros((k, n, n), dtype),
        full=np.zeros(k, bool),
    )
    jacs: dict[int, np.ndarray] = {}  # of the fits whose covariance the host computes
    work: dict[str, int] = dict.fromkeys(_WORK, 0)
    pending: list[np.ndarray] = []  # those fits, where the program keeps no Jacobian
    slots: Any = None
    fn, how, used = None, "", ""
    for begin in range(0, k, queue):
        # Device `d` queues fits `begin + d`, `begin + d + n_dev`, ... (its own loop).
        ids = np.full((n_dev, queue // n_dev), -1, np.int32)
        counts = np.zeros(n_dev, np.int32)
        for d in range(n_dev):
            mine = np.arange(begin + d, min(begin + queue, k), n_dev)
            ids[d, : len(mine)], counts[d] = mine, len(mine)
        ids = ids.ravel()
        rows = np.where(ids >= 0, ids, begin)  # a padding entry: a fit's data, unused
        part = _member(data, rows)
        if slots is None:
            # Empty slots (finished, holding no fit) with the first queued fit's data.
            slots = _Slots(
                _empty_states(size, n, m, dtype, algorithm),
                np.full(size, -1, np.int32),
                [a[np.zeros(size, int)] for a in split_args(part, False)[0]],
            )
        last = np.bool_(begin + queue >= k)
        placed = _place((slots, x0s[rows], ids, counts, part), devices)
        leaves = [*shared, *split_args(placed[4], to_device=False)[0]]
        if fn is None:
            programs = Programs(
                _build, fits.residuals, fits.re, (*args, *placed[4]), to_device=False
            )
            fn, used = programs.first_working(
                pool, choose_modes(mode, True), *placed[:4], last, opts
            )
            how = f"Jacobian: {used} mode"
        slots, out = fn(*placed[:4], last, opts, leaves)
        got = jax.device_get({key: out[key] for key in (*_GOT, *_WORK)})
        for key in _WORK:
            work[key] += int(np.sum(got[key]))
        done = np.flatnonzero(np.asarray(got["id"]) >= 0)
        finished = np.asarray(got["id"])[done]
        for key in host:
            host[key][finished] = np.asarray(got[key])[done]
        recompute = done[~np.asarray(got["full"])[done] | fits.transforms]
        if len(recompute) and "jac" in out:
            jac = np.asarray(out["jac"])
            jacs.update({int(got["id"][i]): jac[i] for i in recompute})
        elif len(recompute):
            pending.append(np.asarray(got["id"])[recompute])
        bar.update(len(done))
    if pending:
        which = np.concatenate(pending)
        jac = _jacobians(fits, used, host["x"], which)
        jacs.update(zip(which.tolist(), jac, strict=True))
    return dict(host, jac=jacs, m=m, work={**work, "slots": size}), how


def _empty_states(k: int, n: int, m: int, dtype, algorithm: Algorithm) -> _lm.State:
    """`_lm.empty_states`; with the normal equations, each slot's `f` and `jac` hold
    `Jᵀf` and the lower triangle of `JᵀJ` (`_normal.moments`)."""
    states = _lm.empty_states(k, n, m, dtype)
    if isinstance(algorithm, MinpackQR):
        return states
    zeros = lambda *shape: cast(jax.Array, np.zeros((k, *shape), dtype))
    return states._replace(f=zeros(n), jac=zeros(n * (n + 1) // 2))


@dataclasses.dataclass(frozen=True)
class _Jacobians:
    """The program of `_jacobians` (`Programs`' key): the number of shared leaves
    of `args`."""

    n_shared: int


def _jacobians(fits: _Fits, mode: str, xs: np.ndarray, which: np.ndarray) -> list:
    """The Jacobians of fits `which` at their points `xs[which]`, evaluated again
    (one program for the few fits whose covariance the host computes: those of
    rank-deficient fits, or fits through transforms), padded to a power of two so
    that a few sizes compile."""
    size = 1 << (len(which) - 1).bit_length()
    rows = np.concatenate([which, np.full(size - len(which), which[0])])
    shared = split_args(fits.args, to_device=False)[0]
    part = _member(fits.data, rows)
    batched = split_args(part, to_device=False)[0]
    programs = Programs(
        _build_jacobians, fits.residuals, fits.re, (*fits.args, *part), to_device=False
    )
    fn = programs.get(_Jacobians(len(shared)), mode, xs[rows])
    jac = np.asarray(fn(xs[rows], [*shared, *batched]))
    return list(jac[: len(which)])


def _build_jacobians(kind: _Jacobians, residuals, re, rebuild, mode: str) -> Callable:
    r = residual_fn(residuals, re, rebuild)
    evaluate = evaluation(residuals, re, rebuild, mode)

    def jacobians(xs, leaves):
        shared, batched = leaves[: kind.n_shared], leaves[kind.n_shared :]
        one = lambda x, b: evaluate(x, [*shared, *b])
        first = lambda x: r(x, [*shared, *_member(batched, 0)])
        one_by_one = jax.default_backend() == "cpu" and _calls_lapack(first, xs[0])
        return _over_slots(one, (0, 0), one_by_one)(xs, batched)[1]

    return jacobians


# On a CPU, a chunk's loop state (its Jacobians, their QR) is kept near this size:
# larger, every turn streams it from memory (Gpufit's 2-D spot, 10,000 fits: 84 fits/s
# in one piece, 205 in chunks of 500; `benchmarks/bench_many_fits.py`), and each chunk
# also stops with its own slowest fit rather than the whole batch's.
_CPU_CHUNK_BYTES = 4 * 2**20


def _auto_chunk(m: int, n: int) -> int | None:
    if jax.default_backend() != "cpu":
        return None
    return max(64, _CPU_CHUNK_BYTES // (8 * max(m, 1) * (n + 1)))


def _member(data: tuple, i: int | np.ndarray) -> tuple:
    """The batched data of fit `i` (or of the fits `i`, an index array)."""
    return jax.tree.map(lambda a: a[i], data)


# `jax.lax.linalg`'s primitives: on a CPU, calls of LAPACK.
_LAPACK = frozenset(
    "cholesky cholesky_update eig eigh geqp3 geqrf hessenberg householder_product lu "
    "ormqr qr schur svd symmetric_product triangular_solve tridiagonal "
    "tridiagonal_solve".split()
)


def _calls_lapack(fn: Callable, x) -> bool:
    """Whether `residuals` calls LAPACK itself (`jnp.linalg`, `jax.scipy.linalg`).

    `vmap` would batch those calls, and jaxlib 0.10 splits a large batched LAPACK
    call over XLA's thread pool and waits for it on the pool thread it runs on: two
    such calls at once (two triangular solves of `jnp.linalg.solve`, or two devices'
    loops) hold every thread of a 2-core machine and hang (an 8 × 8 solve in the
    residuals, 4,000 fits, one CPU device). Then the pool runs its slots one at a
    time (`_over_slots`). Decided while the pool's program is traced: kept with it."""
    return bool(_primitives(jax.make_jaxpr(fn)(x).jaxpr) & _LAPACK)


def _primitives(jaxpr) -> set[str]:
    """The names of every primitive in `jaxpr` and in the jaxprs inside it."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's own jaxpr
                if hasattr(sub, "eqns"):
                    names |= _primitives(sub)
    return names


def _n_residuals(residuals, re, args, data, x0) -> int:
    """The number of residuals of one fit (its first), checked against `n`: traced
    once per signature, as the fits' programs are (`Programs`)."""
    first = (*args, *_member(data, 0))
    programs = Programs(_residuals, residuals, re, first, to_device=False)
    programs.get("residuals", "none", x0)
    m = programs.out_info["residuals"].shape[0]
    dls.check_shape(m, len(re), _WHO)
    return m


def _residuals(kind, residuals, re, rebuild, mode: str) -> Callable:
    return residual_fn(residuals, re, rebuild)


def _place(tree, devices):
    """The batch axis split over `devices` (one device: left where it is; `jax.jit`
    copies NumPy arrays at the call)."""
    if len(devices) == 1:
        return tree
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    return jax.tree.map(lambda a: jax.device_put(a, sharding), tree)


def _written(f, jac):
    """The residuals `f` and Jacobian `jac` of an evaluation (of one slot, or of
    every slot: the residuals' axis last), written to memory once where there are
    more than `_lm._IN_ORDER` residuals. Else XLA fuses the Jacobian's computation
    into each of its consumers: into `_lm._sum`'s tree (MinpackQR), computing it
    four times a turn, and into `_normal.moments`' one pass, where Gpufit's 11 x 11
    spots (a model of five scalars, each differentiated on its own: `jacobian.py`)
    ran 1.8x slower and gave other bits (fits up to 2.5e-2 apart at lmfit's
    tolerances) than with the Jacobian computed on its own. Gpufit's 5 x 5 spots ran
    1.06-1.2x slower with the barrier: below `_IN_ORDER` residuals there is none."""
    if f.shape[-1] > _lm._IN_ORDER:
        f, jac = jax.lax.optimization_barrier((f, jac))
    return f, jac


def _build(pool: _Pool, residuals, re, rebuild, mode: str) -> Callable:
    """`(slots, x0s, ids, counts, last, options, leaves) -> (slots, finished)`: the
    pool's program (`_run_pool`). `x0s`, `ids` (the fits' indices in the batch, -1
    for padding) and the batched leaves (those after the first `n_shared`) are the
    queue; `counts` the number of queued fits of each device. Each turn collects the
    finished fits into `finished` (their outputs, one row each, `id` -1 for an
    unused row), puts the next queued fits into the freed slots, and runs one trial
    of every slot (`_lm.accepted`), a new fit's first evaluation in the same pass.
    The covariances are computed once per finished fit, after the loop."""
    n_shared, n_devices = pool.n_shared, pool.n_devices
    normal = isinstance(pool.algorithm, NormalEquations)
    one_call = pool.one_call
    r = residual_fn(residuals, re, rebuild)
    evaluate = evaluation(residuals, re, rebuild, mode)
    # Several CPU devices run their loops at once on XLA's thread pool, where
    # jaxlib's batched LAPACK calls can wait on each other for ever: one matrix at a
    # time there (`_lm.one_at_a_time`), and one slot at a time where the residuals
    # call LAPACK themselves (`_calls_lapack`).
    cpu = jax.default_backend() == "cpu"
    serial = n_devices > 1 and cpu

    def evaluated(state, step, new, x0, opts, shared, batched):
        """A slot's turn: a `new` slot starts its fit at `x0`, another tries `step`
        (`_lm.accept`), with one evaluation either way."""
        both = lambda x: evaluate(x, [*shared, *batched])
        x_new = _lm.trial_point(state, step)
        f, jac = _written(*both(jnp.where(new, x0, x_new)))
        start = _lm.started(x0, f, jac, opts, 1)
        moved = _lm.accepted(state, step, x_new, f, jac, opts)
        return jax.tree.map(lambda a, b: jnp.where(new, a, b), start, moved)

    def normal_turn(over_slots, states, steps, new, x0, opts, shared, data):
        """Every slot's turn with the normal equations: the trial points (or new
        fits' starts) evaluated, what each fit keeps of its
        evaluation summed in one pass (`_normal.moments`: `Jᵀf`, `JᵀJ`, the norms),
        then `_lm.started` and `_lm.accepted` slot by slot on those few numbers. No
        Jacobian is carried from turn to turn, transposed or copied.

        Where at most `_tail_width` slots run or start a fit (`need`: at the end
        of a batch), only those are evaluated, gathered into that many rows; the
        others' readings are zeros, which `_lm.accepted` leaves unread for a fit
        that does not run. Returns the slots' states and the number of slots
        evaluated."""
        x_new = jax.vmap(_lm.trial_point)(states, steps)
        x = jnp.where(new[:, None], x0, x_new)

        def both(x, batched):
            return evaluate(x, [*shared, *batched])

        def reading(x, batched):
            return _normal.moments(*_written(*over_slots(both, (0, 0))(x, batched)))

        size = x.shape[0]
        width = _tail_width(size)
        need = (states.info == 0) | new
        if width == size:
            measure, g, a = reading(x, data)
            evaluated = jnp.asarray(size, jnp.int32)
        else:
            i32 = jnp.int32

            def narrow(x, batched):
                # Slot `j` is row `to[j]` of the narrow evaluation (`width`: none).
                to = jnp.where(need, jnp.cumsum(need, dtype=i32) - 1, width)
                rows = jnp.zeros(width, i32).at[to].set(jnp.arange(size, dtype=i32))
                read = reading(x[rows], [u[rows] for u in batched])
                back = jnp.minimum(to, width - 1)
                return jax.tree.map(
                    lambda u: jnp.where(
                        need.reshape(-1, *[1] * (u.ndim - 1)),
                        u[back],
                        jnp.zeros((), u.dtype),
                    ),
                    read,
                )

            tail = jnp.sum(need, dtype=i32) <= width
            measure, g, a = jax.lax.cond(tail, narrow, reading, x, data)
            evaluated = jnp.where(tail, width, size).astype(i32)
        start = jax.vmap(lambda x, g, a, ms: _lm.started(x, g, a, opts, 1, ms))
        move = jax.vmap(
            lambda st, stp, x, g, a, ms: _lm.accepted(st, stp, x, g, a, opts, ms)
        )
        pick = lambda u, v: jnp.where(new.reshape(-1, *[1] * (u.ndim - 1)), u, v)
        started, moved = (
            start(x0, g, a, measure),
            move(states, steps, x_new, g, a, measure),
        )
        return jax.tree.map(pick, started, moved), evaluated

    def trial_steps(states, h, b):
        """Every slot's step. With the normal equations (`h`, `b`), a slot where
        they are ill-conditioned stops (`_NEEDS_QR`: the host runs its fit again
        with `MinpackQR`), so that this program holds no QR or SVD."""
        if not normal:
            return states, jax.vmap(lambda st: _lm.minpack_step(st, serial))(states)
        steps, ill = _normal.steps(states, h, b)
        info = jnp.where(ill & (states.info == 0), _NEEDS_QR, states.info)
        return states._replace(info=info), steps

    def many(slots, x0s, ids_q, counts, last, opts, shared, batched):
        states, ids, data = slots
        size, queue = ids.shape[0], ids_q.shape[0]
        rows = queue + size * (not one_call)  # the most fits that finish in a call
        count = counts[0]
        first = lambda x: r(x, [*shared, *_member(batched, 0)])
        one_by_one = cpu and _calls_lapack(first, x0s[0])
        over_slots = functools.partial(_over_slots, one_by_one=one_by_one)
        turn = over_slots(evaluated, (0, 0, 0, 0, None, None, 0))
        i32 = jnp.int32

        def equations(states):
            return _normal.equations(states) if normal else (None, None)

        def collect(states, h, ids, out, at):
            """The finished fits' outputs into rows `at`, ... of `out`. Not their
            Jacobians (a scatter of every slot's at every turn cost more than the
            turn), but their normal equations `h`; with `MinpackQR`, which has
            none, the Jacobians."""
            done = (states.info != 0) & (ids >= 0)
            to = jnp.where(done, at + jnp.cumsum(done, dtype=i32) - 1, rows)
            new = dict(
                id=ids,
                x=states.x,
                cost=0.5 * states.fnorm**2,
                nfev=states.nfev,
                njev=states.njev,
                info=states.info,
            )
            if normal:
                new.update(scale=states.diag, gram=_triangle(h))
            else:
                new.update(jac=states.jac)
            out = {key: out[key].at[to].set(new[key], mode="drop") for key in out}
            return jnp.where(done, -1, ids), out, at + jnp.sum(done, dtype=i32)

        def body(carry):
            states, ids, data, taken, out, at, turns, computed = carry
            h, b = equations(states)
            ids, out, at = collect(states, h, ids, out, at)
            free = ids < 0
            order = taken + jnp.cumsum(free, dtype=i32) - 1
            new = free & (order < count)
            pick = jnp.clip(order, 0, queue - 1)
            ids = jnp.where(new, ids_q[pick], ids)
            data = [
                jnp.where(new.reshape(-1, *[1] * (a.ndim - 1)), q[pick], a)
                for q, a in zip(batched, data, strict=True)
            ]
            states, steps = trial_steps(states, h, b)
            if normal:
                states, slots = normal_turn(
                    over_slots, states, steps, new, x0s[pick], opts, shared, data
                )
            else:
                states = turn(states, steps, new, x0s[pick], opts, shared, data)
                slots = jnp.asarray(size, i32)
            taken = taken + jnp.sum(new, dtype=i32)
            return states, ids, data, taken, out, at, turns + 1, computed + slots

        def running(carry):
            # The last call runs until every fit is collected: a turn after the
            # last one finished (a fit that finished at the last turn of another
            # call is collected at the first turn of the next).
            _, ids, _, taken, *_ = carry
            return (taken < count) | (last & jnp.any(ids >= 0))

        like = lambda a: jnp.zeros((rows, *a.shape[1:]), a.dtype)
        out = dict(
            id=jnp.full(rows, -1, i32),
            x=like(states.x),
            cost=like(states.fnorm),
            nfev=like(states.nfev),
            njev=like(states.njev),
            info=like(states.info),
        )
        n = states.x.shape[1]
        if normal:
            gram = jnp.zeros((rows, n * (n + 1) // 2), states.x.dtype)
            out.update(scale=like(states.x), gram=gram)
        else:
            out.update(jac=like(states.jac))
        zero = jnp.zeros((), i32)
        carry = (states, ids, data, zero, out, zero, zero, zero)
        states, ids, data, _, out, _, turns, computed = jax.lax.while_loop(
            running, body, carry
        )
        # What the call computed: its turns, and the slots it evaluated in them.
        out.update(turns=turns[None], evaluated=computed[None])
        # The covariance of each finished fit, once: from the normal equations where
        # well conditioned (else `full` is False and the host computes it from the
        # Jacobian's SVD), or from an SVD (`MinpackQR`, as the single device fit).
        if normal:
            h = _untriangle(out["gram"], n)
            m = jax.eval_shape(first, x0s[0]).shape[0]
            cov, full = _normal.covariance(h, out["scale"], out["cost"], m)
        else:
            cov, full = jax.vmap(lambda j, c: dls.covariance(j, c, serial))(
                out["jac"], out["cost"]
            )
        return _Slots(states, ids, data), dict(out, cov=cov, full=full)

    def fit(slots, x0s, ids, counts, last, opts, leaves):
        shared, batched = leaves[:n_shared], leaves[n_shared:]
        if n_devices == 1:
            # (As arrays: the queue is indexed by traced values.)
            slots, x0s, ids, counts, batched = jax.tree.map(
                jnp.asarray, (slots, x0s, ids, counts, batched)
            )
            return many(slots, x0s, ids, counts, last, opts, shared, batched)
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n_devices]), ("batch",))
        spec, rep = jax.sharding.PartitionSpec("batch"), jax.sharding.PartitionSpec()
        # Each device runs its own loop over its own slots and its own queue.
        return jax.shard_map(
            many,
            mesh=mesh,
            in_specs=(spec, spec, spec, spec, rep, rep, rep, spec),
            out_specs=spec,
            check_vma=False,
        )(slots, x0s, ids, counts, last, opts, shared, batched)

    return fit


# At the end of a batch (its queue used up), once at most `1 / _NARROW` of the normal
# equations' slots hold running fits, those slots alone are evaluated, gathered
# (`_tail_width`): the emptied slots then cost no evaluation (residuals, Jacobian,
# normal equations: most of a turn). Pools of fewer than `_MIN_TAIL` slots a device
# have no tail width.
_NARROW = 8
_MIN_TAIL = 128


def _tail_width(size: int) -> int:
    """The slots evaluated at the end of a batch, of a device's `size` slots (the
    pool's size where it has no tail width)."""
    if size < _MIN_TAIL or size % _NARROW:
        return size
    return size // _NARROW


def _triangle(h: list) -> jax.Array:
    """The lower triangle of `h` (`_normal.equations`', entries over the slots) as one
    array, the lanes first: `(K, n (n + 1) / 2)`, row after row."""
    return jnp.stack([x for row in h for x in row], axis=-1)


def _untriangle(tri: jax.Array, n: int) -> list:
    """`_triangle`'s inverse."""
    it = iter(tri[:, j] for j in range(tri.shape[1]))
    return [[next(it) for _ in range(i + 1)] for i in range(n)]


def _over_slots(fn: Callable, in_axes: tuple, one_by_one: bool) -> Callable:
    """`jax.vmap(fn, in_axes)` over the slots (`in_axes` of 0 or None), or, where
    `one_by_one`, a `lax.map`: each slot computed as a single fit is, its LAPACK
    calls never batched (`_calls_lapack`)."""
    if not one_by_one:
        return jax.vmap(fn, in_axes=in_axes)

    def mapped(*args):
        pairs = list(zip(args, in_axes, strict=True))

        def one(sliced):
            it = iter(sliced)
            return fn(*(next(it) if ax == 0 else a for a, ax in pairs))

        return jax.lax.map(one, tuple(a for a, ax in pairs if ax == 0))

    return mapped


def _result(
    h: dict, re, x0s, max_nfev: int, how: str, redo, transforms: bool
) -> BatchResult:
    """The `BatchResult` from the host's arrays of every fit (`_run_pool`); the fits
    `redo` were run again with `MinpackQR`, which their own messages say."""
    k = len(x0s)
    m = h["m"]
    started = h["info"] != _lm.NONFINITE_START
    p = np.where(started[:, None], h["x"], x0s)
    loss = np.where(started, h["cost"], np.nan)
    cov = np.where(started[:, None, None], h["cov"], np.nan)
    scales: dict[int, str] = {}
    dropped: list[tuple[str, ...]] = [()] * k
    # Rank-deficient fits (and fits through transforms) go through `from_jacobian`,
    # which names the undetermined directions, and the delta method.
    for i in np.flatnonzero(started & (~h["full"] | transforms)):
        x = p[i]
        # The model only for the delta method (rebuilding it cost 1.5 ms a fit).
        model = re(jnp.asarray(x)) if transforms else None
        unc = dls.uncertainty(cov[i], False, h["jac"][i], float(loss[i]), re, x, model)
        cov[i], scales[int(i)], dropped[i] = (
            unc.covariance,
            unc.scale,
            unc.unidentifiable,
        )
    # One status and message per `info` code and rerun (a batch has a few), shared by
    # its fits.
    rerun = np.zeros(k, bool)
    rerun[redo] = True
    # (`info`, rerun) as one small integer, and each fit's index among the few that
    # occur by a table (a unique of rows sorted 10,000 keys in 6 ms; `np.unique`'s
    # sort of 100,000 integers took 13 ms of a 200 ms batch).
    keys = 2 * h["info"].astype(np.int64) + rerun
    low = int(keys.min(initial=0))
    present = np.flatnonzero(np.bincount(keys - low))
    table = np.zeros(len(present) and present[-1] + 1, np.int64)
    table[present] = np.arange(len(present))
    which = table[keys - low]
    codes = [((int(key) + low) // 2, (int(key) + low) % 2) for key in present]
    words = [dls.status_and_message(c, max_nfev) for c, _ in codes]
    again = "; run again with MinpackQR: its normal equations were ill-conditioned"
    texts = [
        f"{text} (method: device; {how}{again if r else ''}; batch of {k})"
        for (_, text), (_, r) in zip(words, codes, strict=True)
    ]
    # Shared strings picked by an object array's indexing (a generator of 100,000
    # took 8 ms each).
    status: tuple[Status, ...] = tuple(_objects([w for w, _ in words])[which])
    message = tuple(_objects(texts)[which])
    with np.errstate(invalid="ignore"):
        stderr = np.sqrt(np.diagonal(cov, axis1=1, axis2=2))
    return BatchResult(
        p=p,
        stderr_flat=stderr,
        covariance=cov,
        loss=loss,
        status=status,
        message=message,
        n_evaluations=h["nfev"].astype(np.int64),
        n_steps=h["njev"].astype(np.int64),
        n_data=m,
        starts=x0s,
        re=re,
        unidentifiable=tuple(dropped),
        scale=scales,
    )


def _objects(items: list) -> np.ndarray:
    """`items` as a one-dimensional array of objects (NumPy would make an array of
    strings of them)."""
    out = np.empty(len(items), object)
    out[:] = items
    return out


def _stack(batch_args) -> tuple[tuple, int | None]:
    """`batch_args` as one tuple of stacked arrays, and K (None if there are none)."""
    if isinstance(batch_args, list):
        if not batch_args:
            raise ValueError(f"`{_WHO}`: `batch_args` is an empty list.")
        first = jax.tree.structure(tuple(batch_args[0]))
        shapes0 = [np.shape(x) for x in jax.tree.leaves(tuple(batch_args[0]))]
        for i, member in enumerate(batch_args):
            shapes = [np.shape(x) for x in jax.tree.leaves(tuple(member))]
            if jax.tree.structure(tuple(member)) != first or shapes != shapes0:
                raise ValueError(
                    f"`{_WHO}`: the members of the batch differ in structure: "
                    f"`batch_args[{i}]` has leaves of shapes {shapes}, "
                    f"`batch_args[0]` {shapes0}. Every fit of a batch has data of the "
                    "same shapes (pad, or fit them in separate batches)."
                )
        batch_args = jax.tree.map(lambda *xs: np.stack(xs), *map(tuple, batch_args))
    if not isinstance(batch_args, tuple):
        raise TypeError(
            f"`{_WHO}`: `batch_args` must be a tuple of arrays stacked along a leading "
            f"axis, or a list of per-fit tuples; got {type(batch_args).__name__}."
        )
    leaves = jax.tree_util.tree_leaves_with_path(batch_args)
    sizes = {}
    for path, x in leaves:
        if not hasattr(x, "shape") or np.ndim(x) == 0:
            raise ValueError(
                f"`{_WHO}`: `batch_args{jax.tree_util.keystr(path)}` has no leading "
                "batch axis; data shared by every fit goes in `args`."
            )
        sizes[jax.tree_util.keystr(path)] = np.shape(x)[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"`{_WHO}`: the members of the batch differ in structure: the leading axes "
            f"of `batch_args` differ: {sizes}. Each leaf holds one entry per fit."
        )
    return batch_args, (next(iter(sizes.values())) if sizes else None)


def _batch_size(k_starts: int, k_data: int | None) -> int:
    if k_data is None or k_starts == 1:
        return k_starts if k_data is None else k_data
    if k_data != k_starts:
        raise ValueError(
            f"`{_WHO}`: {k_starts} starts but {k_data} datasets in `batch_args`: give "
            "one start (for every dataset), or as many starts as datasets."
        )
    return k_starts
