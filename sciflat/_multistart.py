"""Several starting points, one compilation: the best fit and all of them."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float

from ._fitting.floats import promote_floats
from ._fitting.result import FitResult
from ._fitting.starts import stacked_starts
from ._flatten import Restructure, destructure
from ._layout import names, nonfinite_paths
from ._scipy.bounds import flat_bounds


_M = TypeVar("_M")


@dataclasses.dataclass(frozen=True)
class MultiStartResult(Generic[_M]):
    """What [`sciflat.multistart`][] returns.

    **Fields:**

    - `best`: the [`sciflat.FitResult`][] with the lowest loss among those that
        converged (among all, if none did).
    - `results`: every fit, in the order of `starts`.
    - `starts`: the starting points, one flat vector per row.
    """

    best: FitResult[_M]
    results: list[FitResult[_M]]
    starts: npt.NDArray[np.float64]

    def __str__(self) -> str:
        losses = ", ".join(
            f"{r.loss:.6g}{'' if r.success else '*'}" for r in self.results
        )
        return (
            f"{len(self.results)} starts; losses: {losses} (* not converged); best: "
            f"start {self.results.index(self.best)}\n{self.best}"
        )


def multistart(
    fit: Callable[..., FitResult[_M]],
    loss: Callable[..., Any],
    model: _M,
    starts: int | Sequence[Any] | Float[Array, "k n"],
    *,
    args: tuple[Any, ...] = (),
    bounds: Any = None,
    key: jax.Array | None = None,
    filter_spec: Any = True,
    **kwargs: Any,
) -> MultiStartResult[_M]:
    """Runs `fit` (`sciflat.least_squares`, `sciflat.minimize` or `sciflat.fit`) from
    several starts.

    The model is flattened once and every start is a different `x0` of the same
    problem, so the loss (and its derivatives) are compiled once and each further
    start costs only its iterations. Starts are given, or sampled uniformly within
    `bounds`: entries with both bounds finite are drawn, the others keep the model's
    value; the model's own start comes first.

    !!! Example

        ```python
        runs = sciflat.multistart(sciflat.least_squares, residuals, model, 20,
                                  args=(x, y), bounds={"k": (0.0, 10.0)})
        print(runs)                # every start's loss, then the best fit's report
        runs.best.model
        ```

    **Arguments:**

    - `fit`: `sciflat.least_squares` or `sciflat.minimize` (one start after the
        other, on the host: SciPy's loop; with `method="device"`, `least_squares`
        runs every start at once, as [`sciflat.least_squares_batch`][]), or
        `sciflat.fit` (every start at once: `fit`'s own compiled step `jax.vmap`ped
        over the starts, with its checks and stops, so each start's result is `fit`'s
        from it; give `optimizer=` and `steps=`; on a GPU the starts run in parallel).
    - `loss`: its `residuals` or `loss`.
    - `model`: the model (its structure, and the first start when sampling).
    - `starts`: an int (how many starts to sample within `bounds`), or a sequence of
        models of the same structure, or an array of flat vectors `(k, n)`.
    - `args`: the data, as in the fits.
    - `bounds`: as in the fits; used for sampling, and passed to every SciPy fit
        (`sciflat.fit` has no bounds: use a [`sciflat.Transform`][]).
    - `key`: a JAX PRNG key for sampling (default `jax.random.key(0)`).
    - `filter_spec`: as in the fits.
    - `**kwargs`: passed to every fit (`method`, `ftol`, ...); `progress` is off
        unless given.

    **Returns:**

    A [`sciflat.MultiStartResult`][]: `best`, `results`, `starts`.
    """
    if fit is _optax_fit():
        results, x0s = _vmapped_fit(
            loss, model, starts, bounds, key, filter_spec, args, **kwargs
        )
        return MultiStartResult(_best(results), results, x0s)
    model = promote_floats(model, "multistart")
    p, re = destructure(model, filter_spec, dtype=jnp.float64)
    x0s = _starts(starts, p, re, bounds, key, filter_spec)
    kwargs.setdefault("progress", False)
    if fit is _least_squares() and kwargs.get("method") == "device":
        results = _batched(loss, model, x0s, args, bounds, filter_spec, kwargs)
        return MultiStartResult(_best(results), results, x0s)
    if bounds is not None:
        kwargs["bounds"] = bounds
    results = [_call(fit, loss, re, args, x0, kwargs, i) for i, x0 in enumerate(x0s)]
    return MultiStartResult(_best(results), results, x0s)


def _best(results: list[FitResult[_M]]) -> FitResult[_M]:
    converged = [r for r in results if r.success] or results
    return min(converged, key=lambda r: r.loss if np.isfinite(r.loss) else np.inf)


def _least_squares() -> Callable[..., Any]:
    from ._scipy.least_squares import least_squares

    return least_squares


def _batched(loss, model, x0s, args, bounds, filter_spec, kwargs) -> list[FitResult]:
    """`least_squares(method="device")` from every start at once: one compiled
    program (`sciflat.least_squares_batch`)."""
    from ._device.batch import least_squares_batch

    if bounds is not None:
        raise ValueError(
            "`method='device'` does not take bounds (here also used to sample the "
            "starts): give the starts, or use 'trf' or 'dogbox'."
        )
    kwargs = {k: v for k, v in kwargs.items() if k not in ("method", "progress")}
    batch = least_squares_batch(
        loss,
        model,
        args=args,
        starts=x0s,
        filter_spec=filter_spec,
        progress=False,
        **kwargs,
    )
    return batch.results


def _optax_fit() -> Callable[..., Any]:
    from ._optax.fit import fit

    return fit


def _vmapped_fit(
    loss,
    model,
    starts,
    bounds,
    key,
    filter_spec,
    args: tuple,
    *,
    optimizer=None,
    steps=None,
    dtype=None,
    **rest,
) -> tuple[list[FitResult], npt.NDArray[np.float64]]:
    """`sciflat.fit` from every start at once: `fit`'s own step (the same checks, the
    same stops), `jax.vmap`ped over the starts, one compiled call per step (on a GPU,
    the starts run in parallel); each start is finished as `fit` finishes."""
    if optimizer is None or steps is None:
        raise TypeError(
            "`multistart` with `sciflat.fit` needs `optimizer=` and `steps=`."
        )
    if rest:
        raise TypeError(
            f"`multistart` with `sciflat.fit` takes `optimizer`, `steps`, `dtype`, "
            f"`args`, `filter_spec` only (all starts run as one compiled call); got "
            f"{sorted(rest)}."
        )
    from ._optax.fit import _finish
    from ._optax.loop import run_starts
    from ._optax.prepare import prepare, prepare_starts

    # Prepared as `fit` prepares: every refusal of `fit` (the loss's output, ...).
    prep = prepare(
        loss,
        model,
        optimizer,
        steps=steps,
        batches=None,
        args=args,
        filter_spec=filter_spec,
        dtype=dtype,
        checkpoint=None,
        checkpoint_every=1,
        resume=None,
    )
    x0s = _starts(starts, np.asarray(prep.state.p), prep.re, bounds, key, filter_spec)
    step, state = prepare_starts(prep, optimizer, x0s)
    outcomes = run_starts(prep, step, state, steps=steps)
    return [_finish(prep, out, None) for out in outcomes], x0s


def _call(
    fit, loss, re: Restructure, args: tuple, x0, kwargs: dict, i: int
) -> FitResult:
    if bad := nonfinite_paths(x0, re):
        # This start only, reported as `fit`'s vmapped starts report one: the others
        # are fitted (the fit itself would refuse it, and end the whole run).
        p = jnp.asarray(x0)
        return FitResult(
            model=re(p),
            p=p,
            loss=float("nan"),
            status="nonfinite",
            message=f"Not fitted: start {i} is non-finite in {names(bad)}.",
            history=np.zeros(0),
            n_steps=0,
            re=re,
            n_evaluations=0,
        )
    return fit(loss, re, args=args, x0=jnp.asarray(x0), **kwargs)


def _starts(
    starts, p, re: Restructure, bounds, key, filter_spec
) -> npt.NDArray[np.float64]:
    n = len(re)
    if isinstance(starts, int):
        if starts < 1:
            raise ValueError(f"`starts` must be at least 1, got {starts}.")
        lb_ub = flat_bounds(bounds, re, np.asarray(p))
        lower, upper = (
            (np.full(n, -np.inf), np.full(n, np.inf)) if lb_ub is None else lb_ub
        )
        finite = np.isfinite(lower) & np.isfinite(upper)
        if starts > 1 and not finite.any():
            raise ValueError(
                "`starts` as a number samples within `bounds`, but no parameter has "
                "both bounds finite: give `bounds=` (e.g. {'k': (0.0, 10.0)}) or the "
                "starts themselves."
            )
        key = jax.random.key(0) if key is None else key
        u = np.asarray(jax.random.uniform(key, (starts - 1, n), jnp.float64))
        sampled = np.where(finite, lower + u * (upper - lower), np.asarray(p))
        return np.concatenate([np.asarray(p)[None], sampled])
    return stacked_starts(starts, re, filter_spec, "multistart")
