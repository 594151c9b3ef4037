"""Which PEtab problems are stiff at their nominal parameters: an explicit method's
steps against `BDF`'s, with Hairer's stiffness test.

For each problem, at the nominal parameters, each simulation solved by
`explicit_solve` (Tsitouras's 5(4) pair, the problem's tolerances, steps that end at
the measurement times) with the stiffness test of Hairer's DOPRI5 (Hairer & Wanner,
*Solving ODEs II*, §IV.2): `h ρ`, with `ρ = |f(t + h, y₁) - f(t + h, y₆)| / |y₁ - y₆|`
from the step's last two stages (both at `t + h`), an estimate of the largest
eigenvalue along the step; a step is stiff where `h ρ > 3.25` (the stability boundary
on the negative real axis), and the solve stops at `--limit` (15) stiff steps with no
run of 6 others between. Printed: the species, the simulations, whether every explicit
solve finished (no: the test fired, or the solve failed), its steps (accepted and
rejected, summed), `BDF`'s attempts, their ratio, and `nll`'s time with each (`BDF`
alone, and explicitly, which is `inf` where a solve stops), interleaved in one
process, medians.

    python benchmarks/bench_petab_stiffness.py            # those below 20 species
    python benchmarks/bench_petab_stiffness.py --problems Borghans_BiophysChem1997
"""

import argparse
import pathlib
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import sciflat
from sciflat._petab.explicit import explicit_solve


jax.config.update("jax_enable_x64", True)

# `BDF`'s column, and the objective whose solves the explicit column replaces: `BDF`
# alone (by default a problem that is not stiff is solved explicitly first).
_BDF_ALONE = sciflat.BDF(explicit_first=False)

_SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "petab"


def _explicit(objective: Any, limit: int, constants: Any, x0: Any, need: Any) -> Any:
    """One simulation by `explicit_solve`, as `BDF(explicit_first=True)` tries it
    but with the problem's `max_steps` (100,000) for its budget, to see how far it
    goes: its solution at the measurement times, whether it finished, its steps
    (accepted and rejected)."""
    ts, rhs = objective.tables.union_times, objective.formulas.rhs
    return explicit_solve(
        rhs,
        constants,
        x0,
        ts,
        objective.rtol,
        objective.atol,
        objective._max_steps,
        need,
        limit=limit,
    )


def _bdf_attempts(objective: Any, constants: Any, x0: Any) -> int:
    """`BDF`'s attempts (accepted and rejected), each simulation alone."""
    ts, need = objective.tables.union_times, np.asarray(objective._sims.need)
    total = 0
    for s in range(len(need)):
        m = jnp.asarray(need[s : s + 1], jnp.int32)
        one = (constants[s : s + 1], x0[s : s + 1], ts)
        _, _, stats = objective._bdf_solve(*one, with_stats=True, need=m)
        total += int(stats[0, 0]) + int(stats[0, 1])
    return total


def main(problems: list[pathlib.Path], limit: int, repeats: int, every: bool) -> None:
    print(
        "| problem | species | simulations | explicit finished | explicit steps | "
        "`BDF` attempts | ratio | `nll`, ms: `BDF` / explicit |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---|")
    for yaml in problems:
        problem = sciflat.petab_problem(yaml, solver=_BDF_ALONE)
        objective = problem._objective
        constants, x0 = objective.initial(objective.ext(problem.nominal))
        if not every and x0.shape[1] >= 20:
            continue
        need = jnp.asarray(objective._sims.need, jnp.int32)
        one = lambda k, x, m, objective=objective: _explicit(objective, limit, k, x, m)
        _, ok, steps = jax.jit(jax.vmap(one))(constants, x0, need)
        finished, steps = bool(np.all(ok)), int(np.sum(steps))
        attempts = _bdf_attempts(objective, constants, x0)

        # A problem of its own (its `nll` compiled apart), its simulations explicit.
        explicit = sciflat.petab_problem(yaml, solver=_BDF_ALONE)

        def solve(ext, objective=explicit._objective, one=one, need=need):
            ys, ok, _ = jax.vmap(one)(*objective.initial(ext), need)
            return ys, jnp.all(ok)

        explicit._objective.solve_simulations = solve
        fns = {"bdf": jax.jit(problem.nll), "explicit": jax.jit(explicit.nll)}
        for fn in fns.values():
            jax.block_until_ready(fn(problem.nominal))
        times: dict[str, list[float]] = {k: [] for k in fns}
        for r in range(repeats):
            for k in np.random.default_rng(r).permutation(list(fns)):
                t = time.perf_counter()
                jax.block_until_ready(fns[k](problem.nominal))
                times[k].append(time.perf_counter() - t)
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(
            f"| {yaml.parent.name} | {x0.shape[1]} | {x0.shape[0]} | "
            f"{'yes' if finished else 'no'} | {steps:,} | {attempts:,} | "
            f"{steps / attempts:.2f} | {ms['bdf']:.2f} / {ms['explicit']:.2f} |",
            flush=True,
        )


def _yamls(folder: pathlib.Path, names: list[str]) -> list[pathlib.Path]:
    found = {}
    for sub in sorted(folder.iterdir()):
        for yaml in (sub / f"{sub.name}.yaml", sub / "problem.yaml"):
            if yaml.is_file():
                found.setdefault(sub.name, yaml)
    return [found[n] for n in names] if names else list(found.values())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--problems", nargs="*", default=[], help="default: those below 20 species"
    )
    parser.add_argument("--dir", default=str(_SHARED), help="the problems' folder")
    parser.add_argument("--limit", type=int, default=15, help="stiff steps to stop")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    yamls = _yamls(pathlib.Path(args.dir), args.problems)
    main(yamls, args.limit, args.repeats, every=bool(args.problems))
