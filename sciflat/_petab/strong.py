"""Models of weakly typed values made strongly typed before `jax.jit` sees them: one
compilation per problem, whatever the user's floats."""

import functools as ft

import jax
import jax.numpy as jnp


def strongly_typed(fn):
    """`fn(model, *args)`, each weakly typed value of `model` (a Python float,
    `jnp.asarray(0.7)`) first made a strongly typed array of the dtype the values
    compute in anyway (their `jnp.result_type`, as `_ext` takes it). `jax.jit` keys on
    weak types: `nll(problem.nominal)` and `nll({"k": jnp.asarray(-0.7), ...})` would
    compile twice (seconds each) for the same arithmetic."""

    @ft.wraps(fn)
    def call(model, *args):
        return fn(_strong_values(model), *args)

    return call


def _strong_values(model):
    if not isinstance(model, dict):
        return model  # `check_model` says what was expected
    weak = [k for k, v in model.items() if _weak(v)]
    if not weak:
        return model
    try:
        dtype = jnp.result_type(*model.values())
    except TypeError:  # a value that is not a number: `check_model` names it
        return model
    if not jnp.issubdtype(dtype, jnp.inexact):
        return model
    return {**model, **{k: jnp.asarray(model[k], dtype) for k in weak}}


def _weak(x) -> bool:
    try:
        return jax.typeof(x).weak_type
    except TypeError:
        return False
