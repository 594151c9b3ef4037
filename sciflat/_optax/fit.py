"""`fit`: the common Optax training loop on the flat vector, with nothing lost.

One jit-compiled step (value and gradient, `optimizer.update`, `apply_updates`), compiled
once; a stop on a non-finite loss or gradient that names the leaves; Ctrl-C returns the
best point so far; atomic checkpoints that resume bit for bit. In three phases, one
module each: preparing (`_fit_prepare.py`: every refusal happens there), running
(`_fit_loop.py`) and finishing (here: the result for each way the loop ended).
"""

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from jax.typing import DTypeLike

from .._custom_types import FilePath, FilterSpec, PyTree
from .._fitting.problem import data_by_keyword
from .._fitting.result import FitResult
from .._layout import names, nonfinite_paths
from . import checkpoint as ckpt
from .loop import Outcome, deleted, run
from .prepare import Prepared, prepare


if TYPE_CHECKING:
    import optax


_M = TypeVar("_M")


@data_by_keyword  # `fit(loss, model, opt, x, y)`: a TypeError naming `args=`
def fit(
    loss: Callable[..., Any],
    model: _M,
    optimizer: "optax.GradientTransformation",
    *,
    steps: int | None = None,
    batches: Iterable[PyTree[Any]] | None = None,
    args: tuple[Any, ...] = (),
    filter_spec: FilterSpec = True,
    dtype: DTypeLike | None = None,
    progress: bool = True,
    checkpoint: FilePath | None = None,
    checkpoint_every: int = 100,
    resume: bool | None = None,
    callback: Callable[[int, float, _M], Any] | None = None,
) -> FitResult[_M]:
    """Trains a model with an Optax optimiser on its flat parameter vector.

    The model is destructured once; each step is one jit-compiled call (value and
    gradient of `loss`, `optimizer.update`, `optax.apply_updates`) on the flat vector,
    compiled once, with `p` and the optimiser state donated. Optimisers that need the
    loss itself, such as `optax.lbfgs`, get `value`, `grad` and `value_fn`. A run of
    all its steps is status `"completed"`, a success (`result.success`). The fit
    stops cleanly on a non-finite loss, gradient or `p` (status `"nonfinite"`, the
    last finite point, the step and leaf paths in the message) and on Ctrl-C (status
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
    - `model`: the model to train. Python floats in its dicts, lists and tuples are
        parameters too, in the dtype of `p`; a float field of an `eqx.Module` stays
        static, as in Equinox.
    - `optimizer`: an Optax `GradientTransformation`.
    - `steps`: number of steps. With `batches` too: at most this many.
    - `batches`: an iterable of batches (pytrees of arrays), one per step. On resume,
        the batches of the steps already done are skipped.
    - `args`: further arguments of `loss`, a tuple unpacked as `loss(model, *args)`,
        the same at every step. `args` and `callback` follow one convention in all
        three fits ([`sciflat.minimize`][], [`sciflat.least_squares`][] too), that of
        `scipy.optimize`'s `args=`: see [Migrating](migration.md#the-three-fits).
    - `filter_spec`, `dtype`: as in [`sciflat.destructure`][]; `dtype` trains in that
        precision whatever the model was initialised in.
    - `progress`: show a progress bar with the loss (live on a terminal, a widget in a
        notebook, a plain line every 30 s when the output is a log or a file).
    - `checkpoint`: file to checkpoint to; `checkpoint_every`: how often, in steps.
    - `resume`: `True` continues from `checkpoint` if it exists, `False` overwrites it;
        the default refuses to overwrite an existing one.
    - `callback`: `callback(step, loss, model)` after every step (`step` counts from
        1); a true return value stops the fit (status `"converged"`).

    **Returns:**

    A [`sciflat.FitResult`][]; `raw` is the final optimiser state (`None` after a
    non-finite stop, where the state of the returned point is not kept).
    """
    prep = prepare(
        loss,
        model,
        optimizer,
        steps=steps,
        batches=batches,
        args=args,
        filter_spec=filter_spec,
        dtype=dtype,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        resume=resume,
    )
    outcome = run(
        prep,
        steps=steps,
        progress=progress,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        callback=callback,
    )
    return _finish(prep, outcome, checkpoint)


def _finish(prep: Prepared, out: Outcome, checkpoint) -> FitResult:
    """The result for each way the loop ended; a normal end computes the final loss."""
    re, carry, status, message = prep.re, prep.carry, out.status, out.message
    p, opt_state, best_p, best_loss, last_ok = out.state  # a `State`
    # One start of `multistart` brings its own history; `fit` has the carry's.
    done = carry.history if out.history is None else out.history
    n_steps = carry.step if out.history is None else len(done)
    history = np.asarray(done, dtype=np.float64)
    if status == "interrupted":
        found = bool(np.isfinite(best_loss))
        p, value = best_p, float(best_loss) if found else float("nan")
        message += ". Returning the best parameters so far" + (
            f" (loss {value:.6g})." if found else "; no step had finished."
        )
        opt_state = None if deleted(out.state) else opt_state
    elif status == "nonfinite":
        # The state after the bad step is unusable (and may be donated already).
        p, value = last_ok, (history[-1] if len(history) else float("nan"))
        opt_state = None
    else:
        if checkpoint is not None:
            ckpt.write_state(checkpoint, re, carry, out.state)
        value = float(prep.value(p, out.last_batch, prep.dynamic_args))
        # The last update is checked here: no step ran at its result.
        if bad := nonfinite_paths(p, re):
            status = "nonfinite"
            message = (
                f"Stopped after step {n_steps}: the last update made the "
                f"parameters non-finite in {names(bad)} (the loss there is {value}). "
                "Returning the last parameters with a finite loss and gradient."
            )
            p, value, opt_state = last_ok, float(history[-1]), None
        elif not np.isfinite(value):
            status = "nonfinite"
            message = (
                f"Stopped after step {n_steps}: the loss at the final parameters "
                f"is {value}. Returning the last parameters with a finite loss and "
                "gradient."
            )
            p, value, opt_state = last_ok, float(history[-1]), None
    return FitResult(
        re(p), p, value, status, message, history, n_steps, opt_state, re=re
    )
