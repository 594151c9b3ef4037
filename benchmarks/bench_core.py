"""Core benchmark: `sciflat.destructure` vs `jax.flatten_util.ravel_pytree` vs the native
Equinox pytree (`eqx.filter_jit(eqx.filter_value_and_grad(...))`).

Every variant runs in one process, interleaved, after compilation, with
`jax.block_until_ready`; the tables report medians and ratios to the native pytree.

    python benchmarks/bench_core.py                 # all tables (several minutes)
    python benchmarks/bench_core.py --leaves 10 100 --batches 1 --repeats 20
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

import sciflat


def _timeit(repeats, fn, *args):
    """Median seconds of `fn(*args)` over `repeats` calls, each until ready."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _first_call(fn, *args):
    return _timeit(1, fn, *args)


class Leaves(eqx.Module):
    """`n` small independent leaves: the many-argument case."""

    ws: tuple

    def __call__(self, x):
        return sum(jnp.sum(jnp.tanh(w * x)) for w in self.ws)


class DistinctLeaves(eqx.Module):
    """`n` leaves of `n` different lengths: no two per-leaf kernels alike."""

    ws: tuple

    def __call__(self, x):
        return sum(jnp.sum(jnp.tanh(w * x[0])) for w in self.ws)


def many_leaves(n, distinct=False):
    keys = jax.random.split(jax.random.key(0), n)
    if distinct:
        return DistinctLeaves(
            tuple(
                jax.random.normal(k, (8 + i,), jnp.float32) for i, k in enumerate(keys)
            )
        )
    return Leaves(tuple(jax.random.normal(k, (8,), jnp.float32) for k in keys))


def big_mlp():
    return eqx.nn.MLP(1024, 1024, 1024, 4, key=jax.random.key(0), dtype=jnp.float32)


def _variants(model, loss):
    """The three ways of computing value-and-grad of `loss(model, x)`."""
    p, re = sciflat.destructure(model)
    flat, unravel = ravel_pytree(eqx.filter(model, eqx.is_inexact_array))
    static = eqx.filter(model, eqx.is_inexact_array, inverse=True)
    ravel_model = lambda f: eqx.combine(unravel(f), static)
    return {
        "native": (
            lambda: eqx.filter_jit(eqx.filter_value_and_grad(loss)),
            model,
        ),
        "ravel_pytree": (
            lambda: jax.jit(jax.value_and_grad(lambda f, x: loss(ravel_model(f), x))),
            flat,
        ),
        "sciflat": (
            lambda: jax.jit(jax.value_and_grad(lambda q, x: loss(re(q), x))),
            p,
        ),
    }


def bench_steps(model, loss, x, repeats, rounds=5):
    """Compile time (first call minus a step) and median step time per variant."""
    variants = _variants(model, loss)
    compiled, compile_s = {}, {}
    for name, (make, arg) in variants.items():
        f = make()
        t = _first_call(f, arg, x)
        compiled[name] = (f, arg)
        compile_s[name] = t
    steps = {name: [] for name in variants}
    for _ in range(rounds):  # interleave the variants
        for name, (f, arg) in compiled.items():
            steps[name].append(_timeit(repeats, f, arg, x))
    step_s = {name: statistics.median(v) for name, v in steps.items()}
    compile_s = {name: compile_s[name] - step_s[name] for name in variants}
    return compile_s, step_s


def bench_leaves(n_list, repeats, eager_ravel_max, distinct=False):
    rows = []
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    loss = lambda m, x: m(x)
    for n in n_list:
        model = many_leaves(n, distinct)
        params = eqx.filter(model, eqx.is_inexact_array)
        t_destructure = _first_call(sciflat.destructure, model)
        t_ravel = _first_call(ravel_pytree, params)
        p, re = sciflat.destructure(model)
        t_re_first = _first_call(re, p)
        t_re = _timeit(5, re, p + 1)
        if n <= eager_ravel_max:
            flat, unravel = ravel_pytree(params)
            t_unravel_first = _first_call(unravel, flat)
        else:
            t_unravel_first = float("nan")
        compile_s, step_s = bench_steps(model, loss, x, repeats)
        rows.append(
            (
                n,
                t_destructure,
                t_ravel,
                t_re_first,
                t_re,
                t_unravel_first,
                compile_s,
                step_s,
            )
        )
        _print_leaves(rows[-1:], header=len(rows) == 1)
    return rows


def _print_leaves(rows, header):
    if header:
        print(
            "| leaves | destructure | ravel_pytree flatten | eager re(p) first / warm | "
            "eager unravel first | compile: native / ravel / sciflat | "
            "step: native / ravel / sciflat | step speed-up vs native: ravel / sciflat |"
        )
        print("|---" * 8 + "|")
    for n, td, tr, tre1, tre, tun, c, s in rows:
        print(
            f"| {n} | {td * 1e3:.1f} ms | {tr * 1e3:.1f} ms | "
            f"{tre1 * 1e3:.0f} ms / {tre * 1e3:.2f} ms | "
            f"{tun:.2f} s | {c['native']:.2f} / {c['ravel_pytree']:.2f} / {c['sciflat']:.2f} s | "
            f"{s['native'] * 1e6:.0f} / {s['ravel_pytree'] * 1e6:.0f} / "
            f"{s['sciflat'] * 1e6:.0f} µs | "
            f"{s['native'] / s['ravel_pytree']:.2f}× / {s['native'] / s['sciflat']:.2f}× |",
            flush=True,
        )


def bench_mlp(batches, repeats):
    model = big_mlp()
    loss = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)
    print(
        "| batch | compile: native / ravel / sciflat | step: native / ravel / sciflat "
        "| ratio to native: ravel / sciflat |"
    )
    print("|---" * 4 + "|")
    for b in batches:
        x = jax.random.normal(jax.random.key(1), (b, 1024), jnp.float32)
        c, s = bench_steps(model, loss, x, repeats)
        print(
            f"| {b} | {c['native']:.2f} / {c['ravel_pytree']:.2f} / {c['sciflat']:.2f} s | "
            f"{s['native'] * 1e3:.2f} / {s['ravel_pytree'] * 1e3:.2f} / "
            f"{s['sciflat'] * 1e3:.2f} ms | "
            f"{s['ravel_pytree'] / s['native']:.2f}× / {s['sciflat'] / s['native']:.2f}× |",
            flush=True,
        )


def bench_tanh(repeats):
    """Σ tanh over every parameter of the big MLP: no matmul, so memory-bound."""
    model = big_mlp()

    def loss(m, x):
        leaves = jax.tree.leaves(eqx.filter(m, eqx.is_inexact_array))
        return x * sum(jnp.sum(jnp.tanh(w)) for w in leaves)

    c, s = bench_steps(model, loss, jnp.float32(1.0), repeats)
    print(
        "| loss | compile: native / ravel / sciflat | step: native / ravel / sciflat "
        "| ratio to native: ravel / sciflat |"
    )
    print("|---" * 4 + "|")
    print(
        f"| Σ tanh(params) | {c['native']:.2f} / {c['ravel_pytree']:.2f} / "
        f"{c['sciflat']:.2f} s | {s['native'] * 1e3:.2f} / "
        f"{s['ravel_pytree'] * 1e3:.2f} / {s['sciflat'] * 1e3:.2f} ms | "
        f"{s['ravel_pytree'] / s['native']:.2f}× / {s['sciflat'] / s['native']:.2f}× |",
        flush=True,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--leaves", type=int, nargs="*", default=[10, 100, 1000, 5000])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 32, 256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--distinct",
        type=int,
        nargs="*",
        default=[100, 1000],
        help="leaf counts for the variant in which every leaf has its own length",
    )
    parser.add_argument(
        "--eager-ravel-max",
        type=int,
        default=1000,
        help="skip ravel_pytree's eager unravel above this many leaves (≈69 s at 5000)",
    )
    parser.add_argument(
        "--tanh",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the Σ tanh(params) table on the big MLP",
    )
    args = parser.parse_args(argv)
    print(
        f"jax {jax.__version__}, equinox {eqx.__version__}, backend {jax.default_backend()}, "
        f"{jax.device_count()} device(s)\n"
    )
    if args.leaves:
        print("Leaves of one shape, (8,) each:")
        bench_leaves(args.leaves, args.repeats, args.eager_ravel_max)
        print()
    if args.distinct:
        print("Leaves of distinct lengths, (8 + i,):")
        bench_leaves(args.distinct, args.repeats, args.eager_ravel_max, distinct=True)
        print()
    if args.batches:
        bench_mlp(args.batches, args.repeats)
        print()
    if args.tanh:
        bench_tanh(args.repeats)


if __name__ == "__main__":
    main()
