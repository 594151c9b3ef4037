"""`least_squares(method="device")`: the whole Levenberg–Marquardt fit as one
compiled program (`_lm.py`), on the problem layer the SciPy fits share."""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike

from .._fitting.delta import for_values
from .._fitting.gradients import Mode, choose_modes
from .._fitting.inputs import Inputs
from .._fitting.programs import Programs
from .._fitting.result import FitResult
from .._fitting.uncertainty import (
    Uncertainty,
    from_jacobian,
    member_uncertainty,
)
from .._flatten import from_pieces, pieces
from .._solver import lm as _lm
from .._solver.minpack import (
    OPTIONS,
    Minpack,
    minpack_options,
    optimize_result,
    status_and_message,
)
from .._transforms import has_transforms
from .jacobian import evaluation, residual_fn


# The history keeps the cost of at most this many accepted steps (it is part of the
# compiled program: one float per step).
_HISTORY_MAX = 10_000


def check_options(kwargs: dict, who: str) -> None:
    """The device fit takes MINPACK's options only."""
    if extra := sorted(set(kwargs) - OPTIONS):
        raise TypeError(
            f"`{who}` with the device fit takes {sorted(OPTIONS)} as options, got "
            f"{extra}: those are SciPy's (use `method='trf'` for a robust `loss`, ...)."
        )


def options(
    kwargs: dict, n: int, who: str, dtype: DTypeLike = np.float64
) -> tuple[_lm.Options, int]:
    """MINPACK's options from `kwargs` (sciflat's defaults) as the loop takes them,
    in `dtype`, and `max_nfev`."""
    check_options(kwargs, who)
    config = minpack_options(kwargs, n, who)
    return lm_options(config, n, dtype), config.max_nfev


def fit_dtype(model) -> np.dtype:
    """The dtype a device fit computes in: `p`'s, the promoted dtype of the model's
    floating leaves (float64 where there are none)."""
    dtypes = [
        jnp.result_type(x)
        for x in jax.tree.leaves(model)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return np.dtype(jnp.result_type(*dtypes) if dtypes else np.float64)


# Below float64, no tolerance is tighter than this many eps of the fit's dtype
# (sciflat's default of 1e-12 included): 1.2e-6 in float32.
_TOL_EPS = 10


def lm_options(options: Minpack, n: int, dtype: DTypeLike = np.float64) -> _lm.Options:
    """`options` as scalars of the fit's `dtype` and `diag` (zeros: from the
    Jacobian). Below float64, each tolerance is at least `_TOL_EPS` eps."""
    diag = np.zeros(n) if options.diag is None else options.diag
    floor = 0.0 if np.dtype(dtype) == np.float64 else _TOL_EPS * np.finfo(dtype).eps
    tol = lambda v: np.asarray(max(v, floor), dtype)
    return _lm.Options(
        tol(options.ftol),
        tol(options.xtol),
        tol(options.gtol),
        np.asarray(options.max_nfev, dtype),
        np.asarray(diag, dtype),
    )


@dataclasses.dataclass(frozen=True)
class DeviceFit:
    """What the compiled single fit is built for (static: `jit` keys on it)."""

    history: int  # the length of the cost history: the start's, then each step's


def _build(kind: DeviceFit, residuals, re, rebuild, mode: str) -> Callable:
    """The compiled single fit: `(start, leaves) -> outputs` (`start` from
    `packed_start`; `outputs`, with the residuals, the history and the pieces of the
    fitted model)."""
    history = kind.history
    r = residual_fn(residuals, re, rebuild)
    evaluate = evaluation(residuals, re, rebuild, mode)

    def fit(start, leaves):
        x0, opts = _unpack_start(start)
        check_shape(
            jax.eval_shape(r, x0, leaves).shape[0], x0.shape[0], "least_squares"
        )
        both = lambda x: evaluate(x, leaves)
        state = _lm.solve(both, x0, opts, history)
        grad = state.jac.T @ state.f  # SciPy's `grad` and `optimality`, of the cost
        host = dict(outputs(state), f=state.f, history=state.history, grad=grad)
        host["optimality"] = jnp.max(jnp.abs(grad), initial=0.0)
        # A fit that cannot start keeps its start: `state.x` is `x0` then.
        return dict(host=_pack(host), x=state.x, model=pieces(re, state.x))

    return fit


# The start and the options of a single fit, as one vector of the fit's dtype (`x0`,
# `ftol`, `xtol`, `gtol`, `max_nfev`, `diag`), and what the host reads of the fit, as
# another: one transfer each way, where each array of its own costs one (~5 µs each
# on the CPU; the whole fit of a NIST problem is under 1 ms). Integers below 2**53
# are exact in float64, below 2**24 in float32.
_PACKED = (
    "cost",
    "nfev",
    "njev",
    "info",
    "full",
    "optimality",
    "x",
    "grad",
    "f",
    "jac",
    "cov",
    "history",
)
_SCALARS = 6


def packed_start(x0: np.ndarray, opts: _lm.Options) -> np.ndarray:
    dtype = np.asarray(opts.ftol).dtype
    return np.concatenate([x0, np.stack(opts[:4]), opts.diag]).astype(dtype)


def _unpack_start(start: jax.Array) -> tuple[jax.Array, _lm.Options]:
    n = (start.shape[0] - 4) // 2
    ftol, xtol, gtol, max_nfev = (start[n + i] for i in range(4))
    return start[:n], _lm.Options(ftol, xtol, gtol, max_nfev, start[n + 4 :])


def _pack(out: dict) -> jax.Array:
    dtype = out["x"].dtype
    return jnp.concatenate([jnp.ravel(out[k]).astype(dtype) for k in _PACKED])


def _unpack(packed: np.ndarray, n: int, n_history: int) -> dict:
    # Six scalars, x (n), grad (n), f (m), jac (m, n), cov (n, n), the history.
    m = (len(packed) - _SCALARS - 2 * n - n * n - n_history) // (n + 1)
    out: dict = dict(zip(_PACKED[:_SCALARS], packed[:_SCALARS].tolist(), strict=True))
    at = _SCALARS
    for k, shape in (
        ("x", (n,)),
        ("grad", (n,)),
        ("f", (m,)),
        ("jac", (m, n)),
        ("cov", (n, n)),
        ("history", (n_history,)),
    ):
        size = math.prod(shape)
        out[k] = packed[at : at + size].reshape(shape)
        at += size
    return out


def outputs(state: _lm.State, serial: bool = False) -> dict:
    """What the host needs of one finished fit. The covariance is computed here, on
    the device (`covariance`)."""
    cost = 0.5 * state.fnorm**2
    return finished(state, cost, *covariance(state.jac, cost, serial))


def covariance(jac, cost, serial: bool = False):
    """`(cov, full)` of a fit with the Jacobian `jac` and the cost `cost`, as
    `from_jacobian` computes it for a Jacobian of full rank (an SVD of the
    column-scaled Jacobian); `full` says whether it has full rank, and the host
    computes it again (naming the undetermined directions) where not. `serial`:
    under `vmap`, the SVDs one at a time (`_lm.one_at_a_time`)."""
    m, n = jac.shape
    d = jnp.sqrt(jnp.sum(jac * jac, axis=0))
    d = jnp.where(d > 0, d, 1.0)
    _, s, vt = (_lm.one_at_a_time(_lm.svd) if serial else _lm.svd)(jac / d)
    values = s**2
    cutoff = (max(m, n) * float(jnp.finfo(jac.dtype).eps)) ** 2 * jnp.max(values)
    full = jnp.all(values > jnp.maximum(cutoff, jnp.finfo(jac.dtype).tiny))
    v = vt.T
    s2 = 2.0 * cost / (m - n) if m > n else jnp.nan
    cov = s2 * (v / values) @ v.T / jnp.outer(d, d)
    return cov, full


def finished(state: _lm.State, cost, cov, full) -> dict:
    """The outputs of a finished fit (or of every fit of a pool, stacked)."""
    return dict(
        x=state.x,
        cost=cost,
        nfev=state.nfev,
        njev=state.njev,
        info=state.info,
        cov=cov,
        full=full,
        jac=state.jac,
    )


def uncertainty(cov, on_device: bool, jac, cost: float, re, x, model) -> Uncertainty:
    """The `Uncertainty` of a finished device fit (NumPy `cov`, `jac`): the device's
    covariance when `on_device` (a Jacobian of full rank, no transforms), else
    `from_jacobian`'s, for the constrained values through transforms (`model`:
    `re(x)`, None where it has none)."""
    if on_device:
        return member_uncertainty(cov, re, cost, np.shape(jac)[0], (), None)
    unc = from_jacobian(jac, cost, re)
    return unc if model is None else for_values(unc, re, jnp.asarray(x), model)


def check_shape(m: int, n: int, who: str) -> None:
    if m < n:
        raise ValueError(
            f"`{who}`: the device fit (Levenberg–Marquardt) needs at least as many "
            f"residuals as parameters, got {m} residuals for {n} parameters: use "
            "`method='trf'`."
        )


def least_squares_on_device(inputs: Inputs, options: Minpack, mode: Mode) -> FitResult:
    """What `sciflat.least_squares(..., method="device")` runs, once its front has
    checked the inputs and the options."""
    # One call: the data go to the device with it (`jax.jit` copies NumPy arrays).
    re = inputs.re
    programs = Programs(_build, inputs.fn, re, inputs.args, to_device=False)
    n_history = min(options.max_nfev, _HISTORY_MAX) + 1
    kind = DeviceFit(history=n_history)
    # Forward mode first: the fit needs m >= n, where it is the cheaper one.
    dtype = fit_dtype(inputs.model)
    start = packed_start(inputs.start, lm_options(options, len(re), dtype))
    fn, used = programs.first_working(kind, choose_modes(mode, True), start)
    out = fn(start, programs.leaves)
    how = f"Jacobian: {used} mode"
    return fit_result(out, re, n_history, options.max_nfev, how)


def fit_result(out: dict, re, n_history: int, max_nfev: int, how: str) -> FitResult:
    """The `FitResult` of one finished fit: `out` from the compiled program, brought
    to the host at once (`p` and the model stay on the device)."""
    model = from_pieces(re, out["model"])
    p = out["x"]
    host = _unpack(np.asarray(out["host"]), len(re), n_history)
    m = len(host["f"])
    info = int(host["info"])
    status, message = status_and_message(info, max_nfev)
    ok = info != _lm.NONFINITE_START
    x = host["x"]
    cost = host["cost"] if ok else np.nan
    unc = None
    if ok:
        on_device = bool(host["full"]) and not has_transforms(model)
        unc = uncertainty(host["cov"], on_device, host["jac"], cost, re, x, model)
    njev = int(host["njev"])
    history = host["history"][: min(njev, len(host["history"]))]
    raw = optimize_result(
        x=x,
        cost=cost,
        f=host["f"],
        jac=host["jac"],
        grad=host["grad"],
        optimality=host["optimality"],
        nfev=host["nfev"],
        njev=njev,
        info=info,
        message=message,
    )
    return FitResult(
        model=model,
        p=p,
        loss=cost,
        status=status,
        message=f"{message} (method: device; {how})",
        history=history,
        n_steps=len(history),
        raw=raw,
        re=re,
        uncertainty=unc,
        chisqr=2.0 * cost,
        n_data=m,
        n_evaluations=int(host["nfev"]),
    )
