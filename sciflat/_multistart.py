"""Several starting points, one compilation: the best fit and all of them."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float

from ._flatten import Restructure, destructure
from ._floats import promote_floats
from ._result import FitResult
from ._scipy_bounds import flat_bounds
from ._transforms import unwrapping
from ._validate import as_flat_vector


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
        `sciflat.fit` (every start at once: one `jax.vmap`ped, compiled run of
        `steps` Optax steps; give `optimizer=` and `steps=`; on a GPU the starts
        run in parallel).
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
    model = promote_floats(model, "multistart")
    on_device = fit is _optax_fit()
    dtype = kwargs.pop("dtype", None) if on_device else jnp.float64
    p, re = destructure(model, filter_spec, dtype=dtype)
    x0s = _starts(starts, p, re, bounds, key, filter_spec)
    if on_device:
        results = _vmapped_fit(loss, re, args, x0s, **kwargs)
        return MultiStartResult(_best(results), results, x0s)
    kwargs.setdefault("progress", False)
    if fit is _least_squares() and kwargs.get("method") == "device":
        results = _batched(loss, model, x0s, args, bounds, filter_spec, kwargs)
        return MultiStartResult(_best(results), results, x0s)
    if bounds is not None:
        kwargs["bounds"] = bounds
    results = [_call(fit, loss, re, args, x0, kwargs) for x0 in x0s]
    return MultiStartResult(_best(results), results, x0s)


def _best(results: list[FitResult[_M]]) -> FitResult[_M]:
    converged = [r for r in results if r.success] or results
    return min(converged, key=lambda r: r.loss if np.isfinite(r.loss) else np.inf)


def _least_squares() -> Callable[..., Any]:
    from ._scipy_least_squares import least_squares

    return least_squares


def _batched(loss, model, x0s, args, bounds, filter_spec, kwargs) -> list[FitResult]:
    """`least_squares(method="device")` from every start at once: one compiled
    program (`sciflat.least_squares_batch`)."""
    from ._batch import least_squares_batch

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
    from ._fit import fit

    return fit


def _vmapped_fit(
    loss, re: Restructure, args: tuple, x0s, *, optimizer=None, steps=None, **rest
) -> list[FitResult]:
    """`sciflat.fit` from every start at once: one compiled `vmap` over the starts of
    a `lax.scan` over the steps (on a GPU, the starts run in parallel)."""
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
    import optax

    on_values = unwrapping(loss)
    value_and_grad = jax.value_and_grad(lambda p: on_values(re(p), *args))

    def one(p):
        def step(carry, _):
            p, state = carry
            value, grad = value_and_grad(p)
            updates, state = optimizer.update(grad, state, p)
            return (optax.apply_updates(p, updates), state), value

        (p, _), history = jax.lax.scan(step, (p, optimizer.init(p)), None, length=steps)
        return p, history, on_values(re(p), *args)

    ps, histories, finals = jax.jit(jax.vmap(one))(jnp.asarray(x0s, re.dtype))
    results = []
    for p, history, final in zip(
        ps, np.asarray(histories), np.asarray(finals), strict=True
    ):
        ok = bool(np.isfinite(final)) and bool(np.isfinite(np.asarray(p)).all())
        status = "max_steps" if ok else "nonfinite"
        message = (
            f"Reached `steps` = {steps} (all starts in one vmapped call)."
            if ok
            else "The loss or parameters became non-finite (vmapped starts do not stop early)."
        )
        result = FitResult(
            model=re(p),
            p=p,
            loss=float(final),
            status=status,
            message=message,
            history=np.asarray(history, np.float64),
            n_steps=steps,
            re=re,
            n_evaluations=steps,
        )
        results.append(result)
    return results


def _call(fit, loss, re: Restructure, args: tuple, x0, kwargs: dict) -> FitResult:
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
    if isinstance(starts, jax.Array | np.ndarray):
        rows = [as_flat_vector(s, n, "`multistart` (`starts`)") for s in starts]
    else:
        rows = []
        for i, start in enumerate(starts):
            q, r = destructure(
                promote_floats(start, "multistart"), filter_spec, dtype=jnp.float64
            )
            if r.paths != re.paths:
                raise ValueError(
                    f"`starts[{i}]` does not have the model's trainable leaves: "
                    f"expected {list(re.paths)[:8]}, got {list(r.paths)[:8]}."
                )
            rows.append(q)
    if not rows:
        raise ValueError("`starts` is empty.")
    return np.stack([np.asarray(r, np.float64) for r in rows])
