"""Vmapped neural-ODE solves, value and gradient: sciflat vs the native Equinox
pytree vs `jax.flatten_util.ravel_pytree`.

Diffrax's own neural-ODE pattern: `jax.vmap(lambda y0: diffeqsolve(...))(y0s)`. MLP
2→64→64→2 (tanh), Tsit5 on [0, 5] with 50 save points, constant step 0.1 or an
adaptive PID controller, a batch of initial conditions, `jit(value_and_grad)` of a
mean squared error. Variants:

- native: `ODETerm(lambda t, y, m: m(y))`, the model as `args`;
- `ravel_pytree`: the flat vector as `args`, unravelled in the field;
- sciflat, `args=re(p)`: `ODETerm(sciflat.vector_field(re, "y"))`, the model rebuilt
  once outside the solve (what the docs teach);
- sciflat, `args=p`: the same field with the flat vector, rebuilt at every evaluation.

All variants of one configuration in one process, interleaved, after compilation,
`jax.block_until_ready`; medians and minima over `--repeats` rounds and their ratios
to native (on a busy machine the minimum is the steadier estimate).

    python benchmarks/bench_node_step.py                     # 8 configurations
    python benchmarks/bench_node_step.py --batches 64 --dtypes float32 --steps constant
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


def make_loss(term, dtype, steps: str):
    ts = jnp.linspace(0.0, 5.0, 50, dtype=dtype)
    if steps == "constant":
        controller = diffrax.ConstantStepSize()
    else:
        tol = 1e-6 if dtype == jnp.float64 else 1e-4
        controller = diffrax.PIDController(rtol=tol, atol=tol)

    def solve(args, y0):
        return diffrax.diffeqsolve(
            term,
            diffrax.Tsit5(),
            ts[0],
            ts[-1],
            jnp.asarray(0.1, dtype),
            y0,
            args=args,
            saveat=diffrax.SaveAt(ts=ts),
            stepsize_controller=controller,
            max_steps=4096,
        ).ys

    def loss(args, y0s, targets):
        ys = jax.vmap(lambda y0: solve(args, y0))(y0s)
        return jnp.mean((ys - targets) ** 2)

    return loss


def make_steps(model, dtype, steps: str):
    native = make_loss(diffrax.ODETerm(lambda t, y, m: m(y)), dtype, steps)
    native_step = eqx.filter_jit(eqx.filter_value_and_grad(native))

    params, static = eqx.partition(model, eqx.is_array)
    flat, unravel = ravel_pytree(params)
    field = lambda t, y, q: eqx.combine(unravel(q), static)(y)
    ravel_step = jax.jit(
        jax.value_and_grad(make_loss(diffrax.ODETerm(field), dtype, steps))
    )

    p, re = sciflat.destructure(model)
    ours = make_loss(diffrax.ODETerm(sciflat.vector_field(re, "y")), dtype, steps)
    model_step = jax.jit(jax.value_and_grad(lambda p, *a: ours(re(p), *a)))
    p_step = jax.jit(jax.value_and_grad(ours))
    return {
        "native Equinox (model as args)": (native_step, model),
        "ravel_pytree (flat as args)": (ravel_step, flat),
        "sciflat, args=re(p)": (model_step, p),
        "sciflat, args=p": (p_step, p),
    }


def run(name: str, batch: int, steps: str, repeats: int) -> None:
    dtype = jnp.dtype(name)
    model = eqx.nn.MLP(2, 2, 64, 2, activation=jnp.tanh, key=jax.random.key(0))
    model = jax.tree.map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model
    )
    y0s = jax.random.normal(jax.random.key(1), (batch, 2), dtype)
    targets = jax.random.normal(jax.random.key(2), (batch, 50, 2), dtype)
    variants = make_steps(model, dtype, steps)
    compile_s, times = {}, {k: [] for k in variants}
    for k, (fn, arg) in variants.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg, y0s, targets))
        compile_s[k] = time.perf_counter() - t0
    for _ in range(repeats):
        for k, (fn, arg) in variants.items():
            t0 = time.perf_counter()
            loss, _ = jax.block_until_ready(fn(arg, y0s, targets))
            times[k].append(time.perf_counter() - t0)
            assert loss.dtype == dtype, (k, loss.dtype)
    ref = times["native Equinox (model as args)"]
    for k, ts in times.items():
        med, low = statistics.median(ts), min(ts)
        print(
            f"| {name} | {batch} | {steps} | {k} | {med * 1e3:.1f} "
            f"| {med / statistics.median(ref):.2f} | {low / min(ref):.2f} "
            f"| {compile_s[k]:.1f} |",
            flush=True,
        )


def main(dtypes, batches, steps, repeats: int) -> None:
    print(f"jax {jax.__version__}, diffrax {diffrax.__version__}, repeats {repeats}\n")
    print(
        "| dtype | batch | steps | variant | median (ms) | vs native (median) "
        "| vs native (min) | first call (s) |"
    )
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for name in dtypes:
        for batch in batches:
            for s in steps:
                run(name, batch, s, repeats)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--steps", nargs="+", default=["constant", "adaptive"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    main(args.dtypes, args.batches, args.steps, args.repeats)
