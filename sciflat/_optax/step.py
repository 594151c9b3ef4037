"""The compiled step of `fit`: value and gradient, `optimizer.update`, `apply_updates`
on the flat vector, with what a clean stop needs, compiled once."""

import functools as ft
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax


class State(NamedTuple):
    """The loop's one record: what a step reads and writes, and what a stop returns."""

    p: Any
    opt_state: Any
    best_p: Any  # the lowest finite loss so far (what Ctrl-C returns)
    best_loss: Any
    last_ok: Any  # the last point whose loss, gradient and `p` were finite


def strong(state, dtype):
    """Own buffers for every leaf; weakly typed (Python-scalar-like) leaves become strong,
    floats in `dtype`, so the step's inputs and outputs match and it compiles once."""

    def fix(x):
        # Leaves may share buffers (with `p` too), and all are donated: copy each.
        x = jnp.array(x, copy=True)
        if not x.weak_type:
            return x
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return jax.lax.convert_element_type(x, dtype if floating else x.dtype)

    return jax.tree.map(fix, state)


def reuses_value(opt_state) -> bool:
    """L-BFGS & co. keep the value and gradient of the line search in their state."""
    return (
        optax.tree.get(opt_state, "value") is not None
        and optax.tree.get(opt_state, "grad") is not None
    )


def make_body(loss, re, optimizer, static_args, reuse_value: bool):
    """One step of `fit`, not compiled: `step(state, batch, dynamic_args) -> (next
    state), value, ok, flags`. `ok` says whether the
    loss, the gradient and `p` itself are finite at `p`; when not, `flags` say which
    leaves of `p` and of the gradient are not."""
    opt = optax.with_extra_args_support(optimizer)
    sizes = [leaf.size for leaf in re.layout().slots]
    # The slots tile `p`: one segment reduction flags them all (one slice per leaf
    # would add a kernel per leaf to the step's compile time).
    segment_ids = np.repeat(np.arange(len(sizes)), sizes)

    def bad_leaves(x):
        bad = (~jnp.isfinite(x)).astype(jnp.int32)
        return jax.ops.segment_max(bad, segment_ids, num_segments=len(sizes)) > 0

    def step(state: State, batch, dynamic_args):
        p, opt_state, best_p, best_loss, last_ok = state
        args = eqx.combine(dynamic_args, static_args)
        data = args if batch is None else (batch, *args)
        f = lambda q: loss(re(q), *data)
        if reuse_value:
            value, grad = optax.value_and_grad_from_state(f)(p, state=opt_state)
            grad = jnp.asarray(grad)  # a flat vector like `p`; Optax types it a pytree
        else:
            value, grad = jax.value_and_grad(f)(p)
        updates, new_opt_state = opt.update(
            grad, opt_state, p, value=value, grad=grad, value_fn=f
        )
        new_p = optax.apply_updates(p, updates)
        new_opt_state = jax.tree.map(
            lambda new, old: jax.lax.convert_element_type(new, old.dtype),
            new_opt_state,
            opt_state,
        )
        # `p` too: an update can turn a leaf the loss does not read non-finite (Adam's
        # eps underflows to 0 in float16: 0 / 0), with loss and gradient still finite.
        ok = (
            jnp.isfinite(value) & jnp.all(jnp.isfinite(grad)) & jnp.all(jnp.isfinite(p))
        )
        better = ok & (value < best_loss)
        best_p = jnp.where(better, p, best_p)
        best_loss = jnp.where(better, value, best_loss)
        last_ok = jnp.where(ok, p, last_ok)
        # Which leaves went bad, per leaf: only worked out when something did.
        n = len(sizes)
        flags = jax.lax.cond(
            ok,
            lambda: (jnp.zeros(n, bool), jnp.zeros(n, bool)),
            lambda: (bad_leaves(p), bad_leaves(grad)),
        )
        new = State(new_p, new_opt_state, best_p, best_loss, last_ok)
        return new, value, ok, flags

    return step


def make_step(loss, re, optimizer, static_args, reuse_value: bool):
    """The step of `fit`, compiled: `step(state, batch, dynamic_args)`. `p` and the
    optimiser state are donated, `best_p` is not, so Ctrl-C can return it."""
    body = make_body(loss, re, optimizer, static_args, reuse_value)

    @ft.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, opt_state, kept, batch, dynamic_args):
        return body(State(p, opt_state, *kept), batch, dynamic_args)

    return lambda state, *rest: step(state.p, state.opt_state, state[2:], *rest)


def make_value(loss, re, static_args):
    """The loss at `p`, compiled: `value(p, batch, dynamic_args)`, for the loss at a
    fit's final parameters. Run eagerly, each op of the loss would compile on its own:
    for a PINN's loss that took longer than compiling the whole step."""

    @jax.jit
    def value(p, batch, dynamic_args):
        args = eqx.combine(dynamic_args, static_args)
        return loss(re(p), *(args if batch is None else (batch, *args)))

    return value


def make_vmapped_step(loss, re, optimizer, static_args, reuse_value: bool):
    """The same step over a batch of starts (`multistart`): every state leaf has a
    leading axis of starts, and a start that is no longer `active` (stopped) keeps
    its state. `step(state, active, dynamic_args)`; donated as `make_step`'s."""
    body = make_body(loss, re, optimizer, static_args, reuse_value)

    def step(p, opt_state, kept, active, dynamic_args):
        old = State(p, opt_state, *kept)
        new, value, ok, flags = body(old, None, dynamic_args)
        keep = lambda n, o: jnp.where(active, n, o)
        return jax.tree.map(keep, new, old), value, ok, flags

    in_axes = (0, 0, 0, 0, None)
    steps = jax.jit(jax.vmap(step, in_axes=in_axes), donate_argnums=(0, 1))
    return lambda state, *rest: steps(state.p, state.opt_state, state[2:], *rest)


def check_loss_output(out, dtype) -> None:
    """A real scalar in `p.dtype`: the strict rule, as `minimize`'s."""
    if out.shape != () or not jnp.issubdtype(out.dtype, jnp.floating):
        raise TypeError(
            "`loss` must return a real scalar, got "
            f"{out.dtype}{list(out.shape)}. Reduce it, e.g. `jnp.mean(...)`."
        )
    if out.dtype != dtype:
        raise TypeError(
            f"`loss` returns {jnp.dtype(out.dtype).name}, but `p` is "
            f"{jnp.dtype(dtype).name}: the model computes in {jnp.dtype(dtype).name}, "
            "so something in the loss casts (its data, a constant, an `astype`). Find "
            "it with `sciflat.audit_dtypes`, or pass data in `p`'s dtype."
        )
