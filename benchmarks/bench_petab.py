"""The Boehm et al. 2014 PEtab problem: one simulation, one gradient, one Jacobian (the
forward sensitivities of all 96 residuals to the 9 parameters), beside AMICI's reference
budgets for this model (simulation 5 ms, forward sensitivities 50 ms; AMICI's
tests/benchmark_models).

All variants in one process, interleaved, after compilation, each call until ready; the
table gives medians over `--repeats` rounds at the published parameters and at a few
starts drawn in the bounds (where the model is less stiff or more).

    python benchmarks/bench_petab.py
    python benchmarks/bench_petab.py --repeats 50 --starts 4
    python benchmarks/bench_petab.py --plain   # and without the solves' custom JVP
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import sciflat


jax.config.update("jax_enable_x64", True)

YAML = sciflat.petab_benchmark("Boehm_JProteomeRes2014")
AMICI_MS = {"simulation (nll)": 5.0, "forward sensitivities (Jacobian)": 50.0}


def main(repeats: int = 20, starts: int = 3, plain: bool = False) -> None:
    problem = sciflat.petab_problem(YAML)
    p, re = sciflat.destructure(problem.nominal, dtype=jnp.float64)
    variants = {
        "simulation (nll)": jax.jit(lambda x: problem.nll(re(x))),
        "gradient (nll, forward mode)": jax.jit(
            jax.jacfwd(lambda x: problem.nll(re(x)))
        ),
        "gradient (nll, reverse mode: jax.grad)": jax.jit(
            jax.grad(lambda x: problem.nll(re(x)))
        ),
        "forward sensitivities (Jacobian)": jax.jit(
            jax.jacfwd(lambda x: problem.residuals(re(x)))
        ),
    }
    if plain:
        # The same problem with the solves' plain `diffrax.ForwardMode` derivative,
        # without the custom JVP that carries the forward sensitivities (and gives
        # reverse mode): what that rule costs in forward mode.
        other = sciflat.petab_problem(YAML)
        objective = other._objective
        objective.solve_with_sensitivities = lambda linear: objective.solve_all(
            objective.ext_of(linear)
        )
        variants["gradient (nll, forward mode), plain solve"] = jax.jit(
            jax.jacfwd(lambda x: other.nll(re(x)))
        )
        variants["forward sensitivities (Jacobian), plain solve"] = jax.jit(
            jax.jacfwd(lambda x: other.residuals(re(x)))
        )
    points = {"published fit": p}
    for i, start in enumerate(problem.sample_starts(starts, seed=0)):
        points[f"start {i}"] = sciflat.destructure(start, dtype=jnp.float64)[0]
    compile_s = {}
    for name, fn in variants.items():
        t = time.perf_counter()
        jax.block_until_ready(fn(p))
        compile_s[name] = time.perf_counter() - t
    times = {(v, q): [] for v in variants for q in points}
    for _ in range(repeats):
        for q, x in points.items():
            for v, fn in variants.items():
                t = time.perf_counter()
                jax.block_until_ready(fn(x))
                times[v, q].append(time.perf_counter() - t)
    print(
        f"Boehm 2014, medians of {repeats} interleaved rounds, ms (first call: compile)"
    )
    header = "| | " + " | ".join(points) + " | AMICI budget | first call |"
    print(header)
    print("|" + "---|" * (len(points) + 3))
    for v in variants:
        row = [f"{1e3 * statistics.median(times[v, q]):.1f}" for q in points]
        budget = AMICI_MS.get(v)
        print(
            f"| {v} | " + " | ".join(row) + f" | {budget or '—'} | "
            f"{compile_s[v]:.1f} s |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument(
        "--plain",
        action="store_true",
        help="also time the derivatives without the custom JVP of the solves",
    )
    args = parser.parse_args()
    main(args.repeats, args.starts, args.plain)
