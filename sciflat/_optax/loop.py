"""Running `fit`: the steps, one in flight ahead, Ctrl-C between steps, the stops."""

import dataclasses
import itertools
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

import jax
import numpy as np

from .._fitting.progress import progress_bar
from .._fitting.result import Status
from .._layout import names
from . import checkpoint as ckpt
from .prepare import Prepared
from .step import State


_T = TypeVar("_T")


class Interrupts:
    """The first Ctrl-C only sets `requested` (the loop stops after the running step);
    it also restores the previous handler, so a second Ctrl-C interrupts at once.
    Only over Python's own handler: a process that ignores SIGINT (a shell's
    background job) or handles it itself keeps its own behaviour."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._old)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def dispatch(step, state, dynamic_args, feed, n_left, interrupts):
    """Runs the steps lazily, one per `next`; Ctrl-C is honoured between steps."""
    for batch in itertools.islice(feed, n_left):
        if interrupts.requested:
            raise KeyboardInterrupt
        state, value, ok, flags = step(state, batch, dynamic_args)
        yield state, value, ok, flags, batch


def one_ahead(steps_run: Iterator[_T]) -> Iterator[_T]:
    """Yields step k once step k+1 is dispatched (or there is none, or Ctrl-C came).
    `p` and the optimiser state of step k are then donated to step k+1, but what a
    stop needs of step k (its loss, flags, best and last finite points) is not."""
    try:
        previous = next(steps_run)
    except StopIteration:
        return
    try:
        for current in steps_run:
            yield previous
            previous = current
    except KeyboardInterrupt:
        yield previous  # not donated yet: recorded before the interrupt is handled
        raise
    yield previous


@dataclasses.dataclass
class Outcome:
    """How the loop ended: the last state, why, and the last batch (for the final loss)."""

    state: State
    status: Status
    message: str
    last_batch: Any
    history: list[float] | None = None  # one start of `run_starts` (else the carry's)


def run(
    prep: Prepared, *, steps, progress, checkpoint, checkpoint_every, callback
) -> Outcome:
    carry = prep.carry
    status: Status = "completed"
    message = f"Completed `steps` = {steps}."
    bar = progress_bar(
        enabled=progress,
        desc="sciflat.fit",
        unit="step",
        total=prep.total,
        initial=carry.step,
    )
    state, last_batch = prep.state, prep.first_batch
    n_left = None if steps is None else max(steps - carry.step, 0)
    # Without a callback or checkpoints, nothing needs the parameters between steps:
    # step k+1 is dispatched before step k's loss is read, so the device never waits.
    pipelined = callback is None and checkpoint is None
    try:
        with Interrupts() as interrupts:
            args = (prep.step, state, prep.dynamic_args, prep.feed, n_left)
            steps_run = dispatch(*args, interrupts)
            for state, value, ok, flags, batch in (
                one_ahead(steps_run) if pipelined else steps_run
            ):
                last_batch = batch
                value, ok = jax.device_get((value, ok))  # one transfer
                if not ok:
                    status = "nonfinite"
                    message = _nonfinite_message(carry.step, float(value), flags, prep)
                    break
                carry.history.append(float(value))
                carry.step += 1
                bar.update()
                bar.set_postfix(loss=f"{float(value):.6g}", refresh=False)
                if callback is not None and callback(
                    carry.step, float(value), prep.re(state.p)
                ):
                    status = "converged"
                    message = f"`callback` asked to stop after step {carry.step}."
                    break
                if checkpoint is not None and carry.step % checkpoint_every == 0:
                    ckpt.write_state(checkpoint, prep.re, carry, state)
            else:
                if steps is None or carry.step < steps:
                    message = f"`batches` ran out after {carry.step} steps."
    except KeyboardInterrupt:
        status = "interrupted"
        message = f"Interrupted (KeyboardInterrupt) after {carry.step} steps"
        if checkpoint is not None and not deleted(state):
            ckpt.write_state(checkpoint, prep.re, carry, state)
            message += f"; checkpoint written to {os.fspath(checkpoint)!r}"
    finally:
        bar.close()
    return Outcome(state, status, message, last_batch)


def run_starts(prep: Prepared, step, state: State, *, steps: int) -> list[Outcome]:
    """The loop of `run` for a batch of starts (`multistart`), one vmapped `step` per
    step: each start stops as `fit` from it would (non-finite loss, gradient or `p`:
    the same message; Ctrl-C: all of them), and is frozen from then on."""
    k = int(np.shape(state.p)[0])
    status: list[Status] = ["completed"] * k
    message = [f"Completed `steps` = {steps}."] * k
    history: list[list[float]] = [[] for _ in range(k)]
    active = np.ones(k, bool)
    try:
        with Interrupts() as interrupts:
            for _ in range(steps):
                if interrupts.requested:
                    raise KeyboardInterrupt
                mask = jax.device_put(active)
                state, values, oks, flags = step(state, mask, prep.dynamic_args)
                values, oks = jax.device_get((values, oks))  # one transfer
                for i in np.flatnonzero(active):
                    if oks[i]:
                        history[i].append(float(values[i]))
                        continue
                    one = (flags[0][i], flags[1][i])
                    status[i] = "nonfinite"
                    message[i] = _nonfinite_message(
                        len(history[i]), float(values[i]), one, prep
                    )
                    active[i] = False
                if not active.any():
                    break
    except KeyboardInterrupt:
        for i in np.flatnonzero(active):
            status[i] = "interrupted"
            message[i] = (
                f"Interrupted (KeyboardInterrupt) after {len(history[i])} steps"
            )
    outcomes = []
    for i in range(k):
        one = jax.tree.map(lambda x, i=i: x[i], state)
        outcomes.append(Outcome(one, status[i], message[i], None, history[i]))
    return outcomes


def deleted(state) -> bool:
    """Whether some buffer of `state` was donated to a step that did not return."""
    leaves = jax.tree.leaves(state)
    return any(x.is_deleted() for x in leaves if isinstance(x, jax.Array))


def _nonfinite_message(step: int, value: float, flags, prep: Prepared) -> str:
    bad_p, bad_grad = (np.asarray(f) for f in flags)
    slots = prep.re.layout().slots
    name = lambda bad: names(x.path for x, b in zip(slots, bad, strict=True) if b)
    message = f"Stopped at step {step}: the loss is {value}"
    if bad_p.any():
        message += f"; the parameters are non-finite in {name(bad_p)}"
    if bad_grad.any():
        message += f"; the gradient is non-finite in {name(bad_grad)}"
    elif not bad_p.any():
        message += " (the gradient is finite)"
    return message + ". Returning the last parameters with a finite loss and gradient."
