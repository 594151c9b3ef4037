"""Where arrays live: a copy on every device of `p`'s sharding, for what is not `p`."""

import jax


def replicated_like(sharding):
    """A sharding that puts a whole copy of an array on every device of `sharding`."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def place(tree, p):
    """Every leaf committed to `p`'s device(s): arrays shaped like `p` sharded as `p`,
    the others replicated (as a jitted step's outputs will be, so that its second call
    sees the same input shardings and does not compile again)."""
    sharding = p.sharding
    replicated = replicated_like(sharding)
    put = lambda x: jax.device_put(x, sharding if x.shape == p.shape else replicated)
    return jax.tree.map(put, tree)
