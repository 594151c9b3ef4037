"""Per-step cost of `sciflat.fit` against hand-written Optax loops on `destructure`.

`fit` reads the loss back every step (history, progress bar, the non-finite check) and
keeps the best point so far on the device; a bare hand loop does neither. This measures
what that costs per step, after compilation: for each variant the time of `long`
steps minus the time of `short` steps, divided by `long - short`. Each `fit` call
compiles its step afresh (a new closure); JAX's persistent compilation cache, in a
temporary folder, turns that into a constant, small load, so that compile-time noise
does not swamp the per-step difference. All variants run in one process, interleaved,
`repeats` times; medians.

    python benchmarks/bench_optax_fit.py [--width 64] [--batch 256] [--repeats 5]
"""

import argparse
import contextlib
import io
import statistics
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import sciflat


def problem(width: int, batch: int, dtype):
    key = jax.random.key(0)
    model = eqx.nn.MLP(2, 1, width, 2, key=key, dtype=dtype)
    x = jax.random.normal(jax.random.key(1), (batch, 2), dtype)
    y = jnp.sin(x[:, :1]) * jnp.cos(x[:, 1:])
    loss = lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2)
    return model, x, y, loss


def hand_loop(model, x, y, loss, sync_every_step: bool):
    p, re = sciflat.destructure(model)
    optimizer = optax.adam(1e-3)

    @jax.jit
    def step(p, state):
        value, grad = jax.value_and_grad(lambda p: loss(re(p), x, y))(p)
        updates, state = optimizer.update(grad, state, p)
        return optax.apply_updates(p, updates), state, value

    def run(n):
        q, state = p, optimizer.init(p)
        history = []
        for _ in range(n):
            q, state, value = step(q, state)
            history.append(float(value) if sync_every_step else value)
        jax.block_until_ready((q, history))

    return run


def fit_loop(model, x, y, loss, progress: bool):
    def run(n):
        with contextlib.redirect_stderr(io.StringIO()):
            result = sciflat.fit(
                loss, model, optax.adam(1e-3), steps=n, args=(x, y), progress=progress
            )
        jax.block_until_ready(result.p)

    return run


def seconds(run, n) -> float:
    start = time.perf_counter()
    run(n)
    return time.perf_counter() - start


def main(width=64, batch=256, repeats=5, short=50, long=1050):
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    print(
        f"MLP 2->{width}->{width}->1, batch {batch}, Adam; per-step time after compile"
    )
    print(f"| dtype | variant | µs/step (median of {repeats}) | ratio to hand loop |")
    print("|---|---|---|---|")
    for dtype in (jnp.float32, jnp.float64):
        model, x, y, loss = problem(width, batch, dtype)
        variants = {
            "hand loop, no sync (reference)": hand_loop(model, x, y, loss, False),
            "hand loop, float(loss) each step": hand_loop(model, x, y, loss, True),
            "sciflat.fit(progress=False)": fit_loop(model, x, y, loss, False),
            "sciflat.fit(progress=True)": fit_loop(model, x, y, loss, True),
        }
        for run in variants.values():  # compile (and fill the cache) once
            run(2)
        times = {name: [] for name in variants}
        for _ in range(repeats):
            for name, run in variants.items():  # interleaved
                per_step = (seconds(run, long) - seconds(run, short)) / (long - short)
                times[name].append(per_step)
        reference = statistics.median(times["hand loop, no sync (reference)"])
        for name, values in times.items():
            median = statistics.median(values)
            print(
                f"| {np.dtype(dtype).name} | {name} | {median * 1e6:.0f} | "
                f"{median / reference:.2f} |"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    main(args.width, args.batch, args.repeats)
