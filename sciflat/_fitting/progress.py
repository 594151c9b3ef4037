"""Progress bars that behave wherever the output goes: a terminal, a notebook, a log.

On a terminal, tqdm's live bar; in a Jupyter notebook, its widget (when `ipywidgets`
is installed; the text bar otherwise, which notebooks render too); anywhere else (a
CI log, output redirected to a file) one plain line at the start, at most one every
`LOG_INTERVAL` seconds, and one at the end (even for a bar that a terminal would
wipe), instead of a carriage-return animation
that a log stores as one endless line. tqdm is imported on first use.
"""

import importlib.util
import sys
from typing import Any


LOG_INTERVAL = 30.0  # seconds between two lines when the output is not a terminal


def in_notebook() -> bool:
    """Whether we run in a Jupyter kernel (Jupyter, VS Code, Colab, ...)."""
    ipython = sys.modules.get("IPython")  # never imported by us: only if already used
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no `isatty`, or a closed stream
        return False


class _Lines:
    """A stream for tqdm that turns each redraw into one line of its own."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:  # tqdm also writes blanks to wipe the previous redraw: skip them
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _NoBar:
    """What `progress=False` gets: a bar that does nothing (a disabled tqdm still costs
    ~0.1 ms to make and a call per update: a NIST fit takes about 1 ms in all)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(*, enabled: bool, desc: str, unit: str, leave: bool = True, **kw):
    """A tqdm bar suited to where `sys.stderr` goes; one that does nothing if not
    `enabled`."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    options: dict[str, Any] = dict(desc=desc, unit=unit, leave=leave, **kw)
    if in_notebook():
        if importlib.util.find_spec("ipywidgets") is None:  # tqdm's widget needs it
            return tqdm(file=sys.stderr, **options)
        from tqdm.notebook import tqdm as notebook_tqdm

        return notebook_tqdm(**options)
    if _is_terminal(sys.stderr):
        return tqdm(file=sys.stderr, **options)
    # A log cannot wipe a line: always end with the final state (`leave`).
    options["leave"] = True
    return tqdm(
        file=_Lines(sys.stderr), mininterval=LOG_INTERVAL, ascii=True, **options
    )
