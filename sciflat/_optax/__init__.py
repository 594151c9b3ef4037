"""`fit`: Optax on `p` in one compiled step, its loop and checkpoints."""
