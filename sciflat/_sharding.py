"""Where arrays live: a copy on every device of `p`'s sharding, for what is not `p`."""

import jax


def replicated_like(sharding):
    """A sharding that puts a whole copy of an array on every device of `sharding`."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def place(tree, p, data=()):
    """Every leaf committed to `p`'s device(s): arrays shaped like `p` sharded as `p`,
    the others replicated (as a jitted step's outputs will be, so that its second call
    sees the same input shardings and does not compile again), where anything in
    `tree` or `data` (what the step also reads) is committed. All uncommitted, `tree`
    stays as it is: the step's outputs are then uncommitted too, and so is a model
    rebuilt from them, which calls a compiled function as the start model did
    (`jax.jit` keys on commitment)."""
    leaves = jax.tree.leaves((tree, data))
    if not any(isinstance(x, jax.Array) and x.committed for x in leaves):
        return tree
    sharding = p.sharding
    replicated = replicated_like(sharding)
    put = lambda x: jax.device_put(x, sharding if x.shape == p.shape else replicated)
    return jax.tree.map(put, tree)
