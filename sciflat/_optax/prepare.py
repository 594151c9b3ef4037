"""Preparing `fit`: check the arguments, destructure, resume, compile the step.

Everything that can be refused is refused here, before the first step runs.
"""

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._fitting.floats import float_dtype, promote_floats
from .._fitting.fn_key import Same, identity_key
from .._fitting.problem import check_args, check_start, split_args
from .._fitting.programs import shared, structure_key
from .._flatten import Restructure, destructure
from .._sharding import place
from .._transforms import unwrapping
from . import checkpoint as ckpt
from .step import (
    State,
    check_loss_output,
    make_step,
    make_value,
    make_vmapped_step,
    reuses_value,
    strong,
)


END = object()  # what `next` gives for an exhausted iterator of batches


@dataclasses.dataclass
class Prepared:
    """What running and finishing a fit need."""

    loss: Callable[..., Any]
    re: Restructure
    step: Callable  # the compiled step
    value: Callable  # the compiled loss at `p` (for the final loss)
    state: State  # placed on p's devices
    carry: ckpt.Carry  # step count and history (from a checkpoint when resuming)
    feed: Iterator  # one batch (or None) per step, the done ones skipped
    dynamic_args: Any  # the array leaves of `args`, traced
    static_args: Any  # the rest, compiled in
    first_batch: Any  # None without `batches`
    total: int | None  # for the progress bar


def prepare(
    loss,
    model,
    optimizer,
    *,
    steps,
    batches,
    args,
    filter_spec,
    dtype,
    checkpoint,
    checkpoint_every,
    resume,
) -> Prepared:
    _validate(loss, optimizer, steps, batches, args, checkpoint, checkpoint_every)
    loss = unwrapping(loss)  # the loss sees the values of `sciflat.Transform`s
    # {"b1": 1.0, "b2": jnp.asarray(0.1)}: b1 is fitted too, in the dtype of `p`.
    model = promote_floats(model, "fit", float_dtype(model, dtype))
    p, re = destructure(model, filter_spec, dtype=dtype)
    check_start(p, re, "fit")
    dynamic_args, static_args = eqx.partition(tuple(args), eqx.is_array)
    opt_state = strong(optimizer.init(p), p.dtype)
    if checkpoint is not None:
        ckpt.check_state_leaves(opt_state)
    batch_iter = None if batches is None else iter(batches)
    first = None if batch_iter is None else next(batch_iter, END)
    if first is END:
        raise ValueError("`batches` is empty: there is nothing to train on.")
    copy = lambda: jnp.array(p, copy=True)  # `p` is donated, these two are not
    fresh = ckpt.Carry(State(p, opt_state, copy(), None, copy()), 0, [])
    carry = _start(checkpoint, resume, re, fresh)  # a checkpoint is checked first
    data = tuple(args) if batch_iter is None else (first, *args)
    loss_out = jax.eval_shape(lambda q: loss(re(q), *data), p)
    check_loss_output(loss_out, p.dtype)
    if carry.state.best_loss is None:
        no_loss_yet = jnp.asarray(jnp.inf, loss_out.dtype)
        carry.state = carry.state._replace(best_loss=no_loss_yet)
    reuse = reuses_value(opt_state)
    key = ("fit:step", *_step_key(loss, re, optimizer, args), reuse)
    step = shared(key, lambda: make_step(loss, re, optimizer, static_args, reuse))
    # The final loss: keyed as the step, less the optimiser it does not read.
    loss_key, _, re_key, rebuild = _step_key(loss, re, optimizer, args)
    key = ("fit:value", loss_key, re_key, rebuild)
    value = shared(key, lambda: make_value(loss, re, static_args))
    if batch_iter is None:
        feed = itertools.repeat(None)
    else:
        feed = itertools.islice(itertools.chain([first], batch_iter), carry.step, None)
    total = steps if steps is not None else _len_or_none(batches)
    return Prepared(
        loss=loss,
        re=re,
        step=step,
        value=value,
        state=place(carry.state, p, (dynamic_args, first)),
        carry=carry,
        feed=feed,
        dynamic_args=dynamic_args,
        static_args=static_args,
        first_batch=first,
        total=total,
    )


def prepare_starts(prep: Prepared, optimizer, x0s) -> tuple[Callable, State]:
    """The vmapped step and its state for `multistart`: every start as `prepare` would
    start `fit` from it (its own optimiser state, best and last finite points)."""
    ps = jnp.asarray(x0s, prep.re.dtype)
    opt_states = strong(jax.vmap(optimizer.init)(ps), ps.dtype)
    copy = lambda: jnp.array(ps, copy=True)  # `ps` is donated, these two are not
    best_loss = jnp.full(len(ps), jnp.inf, prep.state.best_loss.dtype)
    state = State(ps, opt_states, copy(), best_loss, copy())
    reuse = reuses_value(prep.state.opt_state)
    loss, re, static = prep.loss, prep.re, prep.static_args
    args = eqx.combine(prep.dynamic_args, static)
    key = ("fit:starts", *_step_key(loss, re, optimizer, args), reuse)
    step = shared(key, lambda: make_vmapped_step(loss, re, optimizer, static, reuse))
    return step, state


def _step_key(loss, re, optimizer, args) -> tuple:
    """What the compiled step depends on besides the traced arrays, keyed as
    `jax.jit` keys a function: the loss and the optimiser by identity (a new
    `optax.adam(...)` is a new optimiser), `re` and the static part of `args` by
    structure. So a second `fit` of the same loss with the same optimiser object
    (chunks of one training, a resumed fit) reuses the compilation."""
    rebuild = split_args(tuple(args), to_device=False)[1]
    return identity_key(loss), Same(optimizer), structure_key(re), rebuild


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
    check_args(args, "fit")
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


def _start(checkpoint, resume, re, fresh: ckpt.Carry) -> ckpt.Carry:
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
    return ckpt.read(checkpoint, re, fresh.state.opt_state)


def _len_or_none(x) -> int | None:
    try:
        return len(x)
    except TypeError:
        return None
