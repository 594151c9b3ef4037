"""`fit`: the common Optax training loop on the flat vector, with nothing lost.

One jit-compiled step (value and gradient, `optimizer.update`, `apply_updates`), compiled
once; a stop on a non-finite loss or gradient that names the leaves; Ctrl-C returns the
best point so far; atomic checkpoints that resume bit for bit.
"""

import itertools
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import PyTree
from tqdm.auto import tqdm

from . import _checkpoint
from ._fit_loop import END, Interrupts, dispatch, one_ahead
from ._fit_step import check_loss_output, make_step, place, reuses_value, strong
from ._flatten import destructure
from ._io import nonfinite_paths
from ._result import FitResult
from ._transforms import unwrapping


_M = TypeVar("_M")

#
# The loop
#


def _validate(
    loss, optimizer, steps, batches, args, checkpoint, checkpoint_every
) -> None:
    if not callable(loss):
        raise TypeError(
            f"`loss` must be a function of the model, got {type(loss).__name__}."
        )
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            "`optimizer` must be an Optax GradientTransformation (e.g. "
            f"`optax.adam(1e-3)`), got {type(optimizer).__name__}."
        )
    if steps is None and batches is None:
        raise ValueError(
            "Give `steps` (a number of steps), `batches` (an iterable), or both."
        )
    for name, n in (("steps", steps), ("checkpoint_every", checkpoint_every)):
        if n is not None and (
            isinstance(n, bool) or not isinstance(n, int | np.integer)
        ):
            raise TypeError(f"`{name}` must be an int, got {type(n).__name__}.")
    if steps is not None and steps < 0:
        raise ValueError(f"`steps` must be >= 0, got {steps}.")
    if checkpoint_every < 1:
        raise ValueError(f"`checkpoint_every` must be >= 1, got {checkpoint_every}.")
    if not isinstance(args, tuple | list):
        raise TypeError(
            "`args` must be a tuple of the further arguments of `loss`, e.g. "
            f"`args=(x, y)` or `args=(x,)`; got {type(args).__name__}."
        )
    if batches is not None and not isinstance(batches, Iterable):
        raise TypeError(
            f"`batches` must be an iterable of batches, got {type(batches).__name__}."
        )
    if checkpoint is not None:
        folder = os.path.dirname(os.path.abspath(checkpoint))
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"`checkpoint`: the folder {folder!r} does not exist."
            )


def _start(checkpoint, resume, re, fresh: _checkpoint.Carry) -> _checkpoint.Carry:
    if checkpoint is None or not os.path.exists(checkpoint):
        return fresh
    if resume is None:
        raise ValueError(
            f"The checkpoint {os.fspath(checkpoint)!r} already exists. Pass "
            "`resume=True` to continue from it or `resume=False` to start afresh and "
            "overwrite it."
        )
    if not resume:
        return fresh
    return _checkpoint.read(checkpoint, re, fresh.opt_state)


def fit(
    loss: Callable[..., Any],
    model: _M,
    optimizer: optax.GradientTransformation,
    *,
    steps: int | None = None,
    batches: Iterable[PyTree] | None = None,
    args: tuple = (),
    filter_spec=True,
    dtype=None,
    progress: bool = True,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 100,
    resume: bool | None = None,
    callback: Callable[[int, float, _M], Any] | None = None,
) -> FitResult[_M]:
    """Trains a model with an Optax optimiser on its flat parameter vector.

    The model is destructured once; each step is one jit-compiled call (value and
    gradient of `loss`, `optimizer.update`, `optax.apply_updates`) on the flat vector,
    compiled once, with `p` and the optimiser state donated. Optimisers that need the
    loss itself, such as `optax.lbfgs`, get `value`, `grad` and `value_fn`. The fit
    stops cleanly on a non-finite loss or gradient (status `"nonfinite"`, the last
    finite point, the step and leaf paths in the message) and on Ctrl-C (status
    `"interrupted"`, the best point so far). With `checkpoint`, `p`, the optimiser state
    and the step are written atomically every `checkpoint_every` steps, at the end and
    on Ctrl-C; `resume=True` continues from the file with the same result as an
    uninterrupted run.

    !!! Example

        ```python
        loss = lambda model, x, y: jnp.mean((jax.vmap(model)(x) - y) ** 2)
        result = sciflat.fit(loss, model, optax.adam(1e-2), steps=500, args=(x, y))
        result.model, result.history
        ```

    **Arguments:**

    - `loss`: `loss(model, *args)`, or `loss(model, batch, *args)` with `batches`; returns
        a real scalar.
    - `model`: the model to train.
    - `optimizer`: an Optax `GradientTransformation`.
    - `steps`: number of steps. With `batches` too: at most this many.
    - `batches`: an iterable of batches (pytrees of arrays), one per step. On resume,
        the batches of the steps already done are skipped.
    - `args`: further arguments of `loss`, the same at every step.
    - `filter_spec`, `dtype`: as in [`sciflat.destructure`][]; `dtype` trains in that
        precision whatever the model was initialised in.
    - `progress`: show a progress bar with the loss.
    - `checkpoint`: file to checkpoint to; `checkpoint_every`: how often, in steps.
    - `resume`: `True` continues from `checkpoint` if it exists, `False` overwrites it;
        the default refuses to overwrite an existing one.
    - `callback`: `callback(step, loss, model)` after every step; a true return value
        stops the fit (status `"converged"`).

    **Returns:**

    A [`sciflat.FitResult`][]; `raw` is the final optimiser state (`None` after a
    non-finite stop, where the state of the returned point is not kept).
    """
    _validate(loss, optimizer, steps, batches, args, checkpoint, checkpoint_every)
    loss = unwrapping(loss)  # the loss sees the values of `sciflat.Transform`s
    p, re = destructure(model, filter_spec, dtype=dtype)
    if len(re) == 0:
        raise ValueError(
            "`model` has no trainable floating leaves, so there is nothing to fit. "
            "Check `filter_spec` and that the parameters are floating arrays."
        )
    if bad := nonfinite_paths(p, re):
        raise ValueError(f"`model` starts with NaN or infinity in {_names(bad)}.")
    args = tuple(args)
    dynamic_args, static_args = eqx.partition(args, eqx.is_array)
    opt_state = strong(optimizer.init(p), p.dtype)
    if checkpoint is not None:
        _checkpoint.check_state_leaves(opt_state)
    batch_iter = None if batches is None else iter(batches)
    first = None if batch_iter is None else next(batch_iter, END)
    if first is END:
        raise ValueError("`batches` is empty: there is nothing to train on.")
    data = args if batch_iter is None else (first, *args)
    copy = lambda: jnp.array(p, copy=True)  # `p` is donated, these two are not
    fresh = _checkpoint.Carry(p, opt_state, copy(), None, copy(), 0, [])
    carry = _start(checkpoint, resume, re, fresh)  # a checkpoint is checked first
    loss_out = jax.eval_shape(lambda q: loss(re(q), *data), p)
    check_loss_output(loss_out)
    if carry.best_loss is None:
        carry.best_loss = jnp.asarray(jnp.inf, loss_out.dtype)
    step = make_step(loss, re, optimizer, static_args, reuses_value(opt_state))
    if batch_iter is None:
        feed = itertools.repeat(None)
    else:
        feed = itertools.islice(itertools.chain([first], batch_iter), carry.step, None)
    total = steps if steps is not None else _len_or_none(batches)
    status, message = "max_steps", f"Reached `steps` = {steps}."
    bar = tqdm(
        total=total,
        initial=carry.step,
        disable=not progress,
        desc="sciflat.fit",
        unit="step",
    )
    state = (carry.p, carry.opt_state, carry.best_p, carry.best_loss, carry.last_ok)
    state = place(state, p)
    last_batch = first
    n_left = None if steps is None else max(steps - carry.step, 0)
    # Without a callback or checkpoints, nothing needs the parameters between steps:
    # step k+1 is dispatched before step k's loss is read, so the device never waits.
    pipelined = callback is None and checkpoint is None
    try:
        with Interrupts() as interrupts:
            steps_run = dispatch(step, state, dynamic_args, feed, n_left, interrupts)
            for state, value, ok, flags, batch in (
                one_ahead(steps_run) if pipelined else steps_run
            ):
                last_batch = batch
                value, ok = jax.device_get((value, ok))  # one transfer
                value, ok = float(value), bool(ok)
                if not ok:
                    status = "nonfinite"
                    message = _nonfinite_message(carry.step, value, flags, re)
                    break
                carry.history.append(value)
                carry.step += 1
                bar.update()
                bar.set_postfix(loss=f"{value:.6g}", refresh=False)
                if callback is not None and callback(carry.step, value, re(state[0])):
                    status = "converged"
                    message = f"`callback` asked to stop after step {carry.step}."
                    break
                if checkpoint is not None and carry.step % checkpoint_every == 0:
                    _write(checkpoint, re, carry, state)
            else:
                if steps is None or carry.step < steps:
                    message = f"`batches` ran out after {carry.step} steps."
    except KeyboardInterrupt:
        status = "interrupted"
        message = f"Interrupted (KeyboardInterrupt) after {carry.step} steps"
        if checkpoint is not None and not _deleted(state):
            _write(checkpoint, re, carry, state)
            message += f"; checkpoint written to {os.fspath(checkpoint)!r}"
    finally:
        bar.close()
    p, opt_state, best_p, best_loss, last_ok = state
    history = np.asarray(carry.history, dtype=np.float64)
    if status == "interrupted":
        found = bool(np.isfinite(best_loss))
        p, value = best_p, float(best_loss) if found else float("nan")
        message += ". Returning the best parameters so far" + (
            f" (loss {value:.6g})." if found else "; no step had finished."
        )
        opt_state = None if _deleted(state) else opt_state
    elif status == "nonfinite":
        # The state after the bad step is unusable (and may be donated already).
        p, value = last_ok, (history[-1] if len(history) else float("nan"))
        opt_state = None
    else:
        if checkpoint is not None:
            _write(checkpoint, re, carry, state)
        # Eagerly: one forward pass is not worth a compilation.
        value = float(loss(re(p), *_data(last_batch, dynamic_args, static_args)))
        if not np.isfinite(value):
            status = "nonfinite"
            message = (
                f"Stopped after step {carry.step}: the loss at the final parameters is "
                f"{value}. Returning the last parameters with a finite loss and gradient."
            )
            p, value, opt_state = last_ok, float(history[-1]), None
    return FitResult(re(p), p, value, status, message, history, carry.step, opt_state)


def _data(batch, dynamic_args, static_args):
    args = eqx.combine(dynamic_args, static_args)
    return args if batch is None else (batch, *args)


def _write(path, re, carry, state) -> None:
    p, opt_state, best_p, best_loss, last_ok = state
    _checkpoint.write(
        path,
        re,
        _checkpoint.Carry(
            p, opt_state, best_p, best_loss, last_ok, carry.step, carry.history
        ),
    )


def _deleted(state) -> bool:
    return any(
        x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array)
    )


def _len_or_none(x) -> int | None:
    try:
        return len(x)
    except TypeError:
        return None


def _names(paths) -> str:
    return ", ".join(f"`{p}`" for p in paths)


def _nonfinite_message(step: int, value: float, flags, re) -> str:
    bad_p, bad_grad = (np.asarray(f) for f in flags)
    leaves = [leaf for leaf in re.layout() if leaf["kind"] == "trainable"]
    unique = [leaf for leaf in leaves if leaf["tied_to"] is None]
    name = lambda bad: _names(u["path"] for u, b in zip(unique, bad, strict=True) if b)
    message = f"Stopped at step {step}: the loss is {value}"
    if bad_p.any():
        message += f"; the parameters are non-finite in {name(bad_p)}"
    if bad_grad.any():
        message += f"; the gradient is non-finite in {name(bad_grad)}"
    elif not bad_p.any():
        message += " (the gradient is finite)"
    return message + ". Returning the last parameters with a finite loss and gradient."
