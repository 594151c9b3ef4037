"""`sciflat.save` / `sciflat.load` against Equinox's own serialisation and a bare `np.save`.

`save` writes `p` and a JSON header (every leaf's path, shape, dtype, tie), and `load`
checks that header leaf by leaf against the model it loads into; Equinox's
`tree_serialise_leaves` writes the leaves and checks nothing. This measures what the
header and the checks cost: for each model, every variant writes (or reads) the same
parameters in one process, interleaved round by round, medians of `repeats` rounds.

    python benchmarks/bench_io.py [--repeats 20]
"""

import argparse
import os
import statistics
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import sciflat


def models():
    key = jax.random.key(0)
    yield "MLP 2→64→64→2", eqx.nn.MLP(2, 2, 64, 2, key=key)
    yield "MLP 1024, 4 hidden layers", eqx.nn.MLP(1024, 1024, 1024, 4, key=key)
    leaves = [jnp.full((8,), float(i)) for i in range(1000)]
    yield "1000 leaves of shape (8,)", leaves


def variants(model, folder):
    p, re = sciflat.destructure(model)
    path_s = os.path.join(folder, "s.npz")
    path_e = os.path.join(folder, "e.eqx")
    path_n = os.path.join(folder, "p.npy")
    sciflat.save(path_s, p, re)
    eqx.tree_serialise_leaves(path_e, model)
    np.save(path_n, np.asarray(p))

    def block(x):
        return jax.block_until_ready(x)

    return {
        "save": {
            "sciflat.save(path, p, re)": lambda: sciflat.save(path_s, p, re),
            "eqx.tree_serialise_leaves": lambda: eqx.tree_serialise_leaves(
                path_e, model
            ),
            "np.save(np.asarray(p))": lambda: np.save(path_n, np.asarray(p)),
        },
        "load": {
            "sciflat.load(path, re)": lambda: block(sciflat.load(path_s, re)),
            "eqx.tree_deserialise_leaves": lambda: block(
                eqx.tree_deserialise_leaves(path_e, model)
            ),
            "np.load": lambda: np.load(path_n),
        },
    }


def measure(fns, repeats):
    for fn in fns.values():  # warm-up: imports, first compilation
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, equinox {eqx.__version__}, {jax.default_backend()}")
    print("| model | operation | variant | median (ms) | vs Equinox |")
    print("|---|---|---|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for label, model in models():
            for op, fns in variants(model, folder).items():
                medians = measure(fns, args.repeats)
                ref = next(v for k, v in medians.items() if k.startswith("eqx"))
                for name, t in medians.items():
                    print(
                        f"| {label} | {op} | {name} | {1e3 * t:.2f} | {t / ref:.2f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
