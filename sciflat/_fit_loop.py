"""Running the steps of `fit`: Ctrl-C between steps, and one step in flight ahead."""

import itertools
import signal
import threading
from collections.abc import Iterator
from typing import TypeVar


_T = TypeVar("_T")


class Interrupts:
    """The first Ctrl-C only sets `requested` (the loop stops after the running step);
    it also restores the previous handler, so a second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._old)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


END = object()


def dispatch(step, state, dynamic_args, feed, n_left, interrupts):
    """Runs the steps lazily, one per `next`; Ctrl-C is honoured between steps."""
    for batch in itertools.islice(feed, n_left):
        if interrupts.requested:
            raise KeyboardInterrupt
        state, value, ok, flags = step(*state, batch, dynamic_args)
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
