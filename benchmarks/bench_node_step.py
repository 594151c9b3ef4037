"""Neural ODE training step: `sciflat.vector_field` vs the native Equinox pytree vs
`jax.flatten_util.ravel_pytree`.

MLP 2→64→64→2 (tanh), Tsit5 with 100 fixed steps, 100 save points, a batch of
initial conditions (vmap), mean squared error, value and gradient plus an SGD update,
jitted. float32 and float64. All variants in one process, interleaved, after
compilation, `jax.block_until_ready`; medians and minima over `--repeats` (on a busy
machine the minimum is the steadier estimate) and their ratios to native.

    python benchmarks/bench_node_step.py                  # batch 256, a few minutes
    python benchmarks/bench_node_step.py --batch 32 --repeats 3
"""

import argparse
import statistics
import time

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree


jax.config.update("jax_enable_x64", True)

import sciflat  # noqa: E402


LR = 1e-3


def solve(term, args, y0, dtype):
    ts = jnp.linspace(0.0, 1.0, 100, dtype=dtype)
    sol = diffrax.diffeqsolve(
        term, diffrax.Tsit5(), ts[0], ts[-1], jnp.asarray(0.01, dtype), y0, args=args,
        saveat=diffrax.SaveAt(ts=ts), stepsize_controller=diffrax.ConstantStepSize(),
    )  # fmt: skip
    return sol.ys


def mse(term, args, y0s, targets, dtype):
    ys = jax.vmap(lambda y0: solve(term, args, y0, dtype))(y0s)
    return jnp.mean((ys - targets) ** 2)


def make_steps(model, dtype):
    native_term = diffrax.ODETerm(lambda t, y, m: m(y))

    @eqx.filter_jit
    def native(model, y0s, targets):
        loss, g = eqx.filter_value_and_grad(
            lambda m: mse(native_term, m, y0s, targets, dtype)
        )(model)
        return loss, eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, g))

    params, static = eqx.partition(model, eqx.is_array)
    flat, unravel = ravel_pytree(params)
    ravel_term = diffrax.ODETerm(lambda t, y, q: eqx.combine(unravel(q), static)(y))

    @jax.jit
    def ravel(q, y0s, targets):
        loss, g = jax.value_and_grad(lambda q: mse(ravel_term, q, y0s, targets, dtype))(
            q
        )
        return loss, q - LR * g

    p, re = sciflat.destructure(model)
    ours_term = diffrax.ODETerm(sciflat.vector_field(re, "y"))

    @jax.jit
    def ours(p, y0s, targets):
        loss, g = jax.value_and_grad(lambda p: mse(ours_term, p, y0s, targets, dtype))(
            p
        )
        return loss, p - LR * g

    model_term = diffrax.ODETerm(sciflat.vector_field(re, "y", args="model"))

    @jax.jit
    def ours_model(p, y0s, targets):
        loss, g = jax.value_and_grad(
            lambda p: mse(model_term, re(p), y0s, targets, dtype)
        )(p)
        return loss, p - LR * g

    return {
        "native eqx pytree": (native, model),
        "ravel_pytree": (ravel, flat),
        "sciflat, args=p": (ours, p),
        "sciflat, args=re(p)": (ours_model, p),
    }


def main(batch: int = 256, repeats: int = 5, dtypes=("float32", "float64")) -> None:
    print(f"jax {jax.__version__}, batch {batch}, repeats {repeats}\n")
    print(
        "| dtype | variant | median step (ms) | vs native | min step (ms) | vs native (min) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name in dtypes:
        dtype = jnp.dtype(name)
        key = jax.random.key(0)
        model = eqx.nn.MLP(2, 2, 64, 2, activation=jnp.tanh, key=key)
        model = jax.tree.map(
            lambda x, dtype=dtype: x.astype(dtype) if eqx.is_inexact_array(x) else x,
            model,
        )
        y0s = jax.random.normal(jax.random.key(1), (batch, 2), dtype)
        targets = jax.random.normal(jax.random.key(2), (batch, 100, 2), dtype)
        steps = make_steps(model, dtype)
        compile_s, times = {}, {k: [] for k in steps}
        for k, (fn, arg) in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arg, y0s, targets))
            compile_s[k] = time.perf_counter() - t0
        for _ in range(repeats):
            for k, (fn, arg) in steps.items():
                t0 = time.perf_counter()
                loss, _ = jax.block_until_ready(fn(arg, y0s, targets))
                times[k].append(time.perf_counter() - t0)
                assert loss.dtype == dtype, (k, loss.dtype)
        ref = statistics.median(times["native eqx pytree"])
        ref_min = min(times["native eqx pytree"])
        for k, ts in times.items():
            med, low = statistics.median(ts), min(ts)
            print(
                f"| {name} | {k} | {med * 1e3:.1f} | {med / ref:.3f} | {low * 1e3:.1f} "
                f"| {low / ref_min:.3f} |"
            )
        print(f"compile (s): {', '.join(f'{k} {v:.1f}' for k, v in compile_s.items())}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    args = parser.parse_args()
    main(args.batch, args.repeats, tuple(args.dtypes))
