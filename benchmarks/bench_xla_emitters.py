"""XLA:CPU's two code generators for fused kernels, on sciflat's programs: compile time,
run time and the values, with XLA's default emitters against its older ones
(`--xla_cpu_use_fusion_emitters=false`, which a user sets in `XLA_FLAGS`).

In one process, each program lowered once and compiled with each setting in turn
(`compiler_options`, the per-program form of the flag), `--repeats` times, alternated;
then the two executables called in turn, medians after compilation:

    python benchmarks/bench_xla_emitters.py
    python benchmarks/bench_xla_emitters.py --only Boehm_JProteomeRes2014

Programs: a PEtab problem's `nll` and `jax.value_and_grad(nll)` (BDF, sciflat's
defaults) for each problem named, and a small MLP's loss and gradient in float32.
"""

import argparse
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


_SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "petab"
OLDER = {"xla_cpu_use_fusion_emitters": False}
PROBLEMS = (
    "Boehm_JProteomeRes2014",
    "Bruno_JExpBot2016",
    "Crauste_CellSystems2017",
    "SalazarCavazos_MBoC2020",
)


def programs(names: list[str], folder: pathlib.Path):
    import equinox as eqx

    import sciflat

    for name in names:
        yaml = folder / name / f"{name}.yaml"
        problem = sciflat.petab_problem(
            yaml if yaml.exists() else sciflat.petab_benchmark(name)
        )
        p, re = sciflat.destructure(problem.nominal, dtype=jnp.float64)
        nll = lambda x, problem=problem, re=re: problem.nll(re(x))
        yield f"{name} nll", nll, p
        yield f"{name} value and gradient", jax.value_and_grad(nll), p
    mlp = eqx.nn.MLP(2, 1, 64, 3, activation=jnp.tanh, key=jax.random.key(0))
    q, re_mlp = sciflat.destructure(mlp, dtype=jnp.float32)
    xs = jax.random.normal(jax.random.key(1), (256, 2), dtype=jnp.float32)
    loss = lambda q: jnp.mean(jax.vmap(re_mlp(q))(xs) ** 2)
    label = f"MLP ({len(re_mlp):,} parameters) loss and gradient, float32"
    yield label, jax.value_and_grad(loss), q


def median_call(fn, arg, seconds: float) -> float:
    jax.block_until_ready(fn(arg))
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=list(PROBLEMS))
    parser.add_argument("--dir", type=pathlib.Path, default=_SHARED)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)

    print(
        "| program | compile, s: default / older | ratio | per call: default / older "
        "| ratio | max rel. difference |"
    )
    print("|---|---|---:|---|---:|---:|")
    for label, fn, arg in programs(args.only, args.dir):
        lowered = jax.jit(fn).lower(arg)
        compile_s = {"default": [], "older": []}
        exes = {}
        for r in range(args.repeats):
            # A distinct, inert option each time: JAX keeps executables per options.
            inert = {"xla_dump_max_hlo_modules": 1000 + r}
            order = ("default", "older") if r % 2 == 0 else ("older", "default")
            for which in order:
                options = inert if which == "default" else {**inert, **OLDER}
                t = time.perf_counter()
                exes[which] = lowered.compile(compiler_options=options)
                compile_s[which].append(time.perf_counter() - t)
        calls = {"default": [], "older": []}
        for _ in range(3):
            for which, exe in exes.items():
                calls[which].append(median_call(exe, arg, args.seconds / 3))
        a = [np.asarray(v) for v in jax.tree.leaves(exes["default"](arg))]
        b = [np.asarray(v) for v in jax.tree.leaves(exes["older"](arg))]
        diff = max(
            float(np.max(np.abs(x - y) / np.maximum(np.abs(x), 1e-300)))
            for x, y in zip(a, b, strict=True)
        )
        c0, c1 = (statistics.median(compile_s[k]) for k in ("default", "older"))
        t0, t1 = (statistics.median(calls[k]) for k in ("default", "older"))
        print(
            f"| {label} | {c0:.2f} / {c1:.2f} | {c1 / c0:.2f} | {t0 * 1e3:.2f} / "
            f"{t1 * 1e3:.2f} ms | {t1 / t0:.2f} | {diff:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
