"""What `sciflat.audit_dtypes` costs against tracing the same function with JAX.

The audit traces `fn` and its gradient (`jax.make_jaxpr`, nothing is run), walks every
equation of the jaxpr and its nested jaxprs, and finds the user's line of each finding.
The reference is the trace alone: `jax.make_jaxpr(jax.value_and_grad(fn))`. Both run in
one process, interleaved round by round, medians of `repeats` rounds.

    python benchmarks/bench_audit.py [--repeats 10]
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import sciflat


def cases():
    model = eqx.nn.MLP(2, 2, 64, 2, key=jax.random.key(0))
    p, re = sciflat.destructure(model, dtype=jnp.float64)
    x = jnp.ones((32, 2))
    mlp = lambda p, x: jnp.mean(jax.vmap(re(p))(x) ** 2)
    yield "MLP 2→64→64→2, batch 32", mlp, p, (x,)
    try:
        import diffrax
    except ImportError:
        return
    term = diffrax.ODETerm(sciflat.vector_field(re, "y"))

    def node(p, y0):
        sol = diffrax.diffeqsolve(
            term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, args=re(p), max_steps=64
        )
        return jnp.sum(sol.ys**2)

    yield "neural ODE (the MLP in Diffrax, Tsit5)", node, p, (jnp.ones(2),)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    print(f"jax {jax.__version__}, equinox {eqx.__version__}, {jax.default_backend()}")
    print(
        "| function | trace: make_jaxpr(value_and_grad) (ms) | audit_dtypes (ms) | ratio |"
    )
    print("|---|---:|---:|---:|")
    for label, fn, p, fargs in cases():
        trace, audit = measure(fn, p, fargs, args.repeats)
        print(
            f"| {label} | {1e3 * trace:.1f} | {1e3 * audit:.1f} | {audit / trace:.2f} |",
            flush=True,
        )


def measure(fn, p, fargs, repeats):
    """Medians of the trace alone and of the audit, interleaved, after a warm-up."""
    variants = {
        "trace": lambda: jax.make_jaxpr(jax.value_and_grad(fn))(p, *fargs),
        "audit": lambda: sciflat.audit_dtypes(fn, p, *fargs),
    }
    for f in variants.values():
        f()  # warm-up
    times = {k: [] for k in variants}
    for _ in range(repeats):
        for k, f in variants.items():
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    return statistics.median(times["trace"]), statistics.median(times["audit"])


if __name__ == "__main__":
    main()
