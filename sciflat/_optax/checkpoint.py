"""Checkpoints of a fit: `p`, the optimiser state and the step, without pickle.

The optimiser state is stored as its `jax.tree` leaves and rebuilt into the structure of
a freshly `optimizer.init`-ed state, leaf by leaf checked for shape and dtype.
"""

import dataclasses
import re as regex

import jax
import jax.numpy as jnp
import numpy as np

from .._flatten import Restructure
from .._io import from_numpy, header, load_flat, to_numpy, write_atomic
from .step import State


@dataclasses.dataclass
class Carry:
    """Everything a fit needs to continue: restored from a checkpoint bit for bit."""

    state: State
    step: int
    history: list[float]


def _treedef_str(treedef) -> str:
    return regex.sub(r" at 0x[0-9a-fA-F]+", "", str(treedef))


def check_state_leaves(opt_state) -> None:
    for x in jax.tree.leaves(opt_state):
        if not isinstance(x, jax.Array | np.ndarray | np.generic):
            raise TypeError(
                f"The optimiser state has a leaf of type {type(x).__name__}; "
                "checkpoints store array leaves only."
            )
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            raise TypeError(
                "The optimiser state holds a typed PRNG key; checkpoints store plain "
                "arrays only. Use a raw key (`jax.random.PRNGKey`) in the optimiser."
            )


def write(path, re: Restructure, carry: Carry) -> None:
    state = carry.state
    leaves, treedef = jax.tree.flatten(state.opt_state)
    arrays = {f"opt_state_{i}": to_numpy(x) for i, x in enumerate(leaves)}
    arrays |= {
        "p": to_numpy(state.p),
        "best_p": to_numpy(state.best_p),
        "last_ok": to_numpy(state.last_ok),
        "best_loss": to_numpy(state.best_loss),
        "history": np.asarray(carry.history, dtype=np.float64),
    }
    head = header(state.p, re)
    head["checkpoint"] = {
        "step": carry.step,
        "loss_dtype": str(state.best_loss.dtype),
        "opt_state_treedef": _treedef_str(treedef),
        "opt_state": [
            {"shape": list(np.shape(x)), "dtype": str(x.dtype)} for x in leaves
        ],
    }
    write_atomic(path, arrays, head)


def read(path, re: Restructure, fresh_state) -> Carry:
    """Restores a checkpoint into the structure of `fresh_state`, or raises."""
    head, arrays, p = load_flat(path, re, None, "sciflat.fit")
    if "checkpoint" not in head:
        raise ValueError(f"{str(path)!r} is a saved model, not a checkpoint of `fit`.")
    meta = head["checkpoint"]
    fresh, treedef = jax.tree.flatten(fresh_state)
    if meta["opt_state_treedef"] != _treedef_str(treedef):
        raise ValueError(
            f"The optimiser state in {str(path)!r} has structure "
            f"{meta['opt_state_treedef']}, but this optimiser's is "
            f"{_treedef_str(treedef)}: resume with the optimiser the checkpoint was "
            "written with."
        )
    leaves = []
    for i, (want, got) in enumerate(zip(fresh, meta["opt_state"], strict=True)):
        if list(np.shape(want)) != got["shape"] or str(want.dtype) != got["dtype"]:
            raise ValueError(
                f"Optimiser state leaf {i} in {str(path)!r} is {got['dtype']}"
                f"{got['shape']}; this optimiser expects {want.dtype}"
                f"{list(np.shape(want))}."
            )
        name = f"opt_state_{i}"
        leaves.append(jnp.asarray(from_numpy(arrays[name], got["dtype"], path, name)))
    as_p = lambda name: jnp.asarray(from_numpy(arrays[name], head["dtype"], path, name))
    state = State(
        p=jnp.asarray(p),
        opt_state=jax.tree.unflatten(treedef, leaves),
        best_p=as_p("best_p"),
        best_loss=jnp.asarray(
            from_numpy(arrays["best_loss"], meta["loss_dtype"], path, "best_loss")
        ),
        last_ok=as_p("last_ok"),
    )
    return Carry(
        state=state,
        step=int(meta["step"]),
        history=[float(x) for x in arrays["history"]],
    )


def write_state(path, re: Restructure, carry: Carry, state: State) -> None:
    """Writes the loop's `state` with `carry`'s step and history."""
    write(path, re, Carry(state, carry.step, carry.history))
