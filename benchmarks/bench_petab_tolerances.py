"""Is a PEtab objective converged in the ODE tolerances at a point? `nll` and its
gradient at sciflat's defaults against the same 100 times tighter
(`problem.check_tolerances`), at the nominal parameters of each problem given, and on
Crauste et al. 2017 also 1e-4 away in `rho_E` (log10 scale) (where the optimum's knife edge
makes the solve fail).

    python benchmarks/bench_petab_tolerances.py
    python benchmarks/bench_petab_tolerances.py --problems Boehm_JProteomeRes2014

`--first-call`: what the first `check_tolerances` costs (compilation included), on a
fresh problem object each, in one process: the way it was built before (a program of
`nll` and its gradient for the problem's tolerances and another for the tighter ones)
first, then today's (one program, the tolerances among its inputs), and whether both
give the same figures; `--now-first` the other way round (a process's later
compilations are a little faster: run both).

    python benchmarks/bench_petab_tolerances.py --first-call --problems Boehm_JProteomeRes2014
    python benchmarks/bench_petab_tolerances.py --first-call --now-first
"""

import argparse
import pathlib
import time
import warnings

import jax

import sciflat


jax.config.update("jax_enable_x64", True)
_SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "petab"
PROBLEMS = ("Crauste_CellSystems2017", "Boehm_JProteomeRes2014", "Bruno_JExpBot2016")


def main(problems: list[str], folder: pathlib.Path) -> None:
    print(
        "| problem | point | nll (defaults) | nll (100x tighter) | nll rel. change | "
        "gradient rel. change | sensitive | time, s |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for name in problems:
        problem = sciflat.petab_problem(folder / name / f"{name}.yaml")
        points = {"nominal": problem.nominal}
        if "rho_E" in problem.parameter_ids:
            for step in (1e-4, -1e-4):
                moved = dict(problem.nominal)
                moved["rho_E"] = problem.nominal["rho_E"] + step
                points[f"rho_E {step:+g} (log10)"] = moved
        for label, model in points.items():
            t = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = problem.check_tolerances(model)
            print(
                f"| {name} | {label} | {out['nll'][0]:.8f} | {out['nll'][1]:.8f} | "
                f"{out['nll_error']:.1e} | {out['grad_error']:.2g} | "
                f"{out['sensitive']} | {time.perf_counter() - t:.0f} |",
                flush=True,
            )


def _before(problem, model, factor: float = 100.0):
    """`check_tolerances`' two solves as they were compiled before: one program
    per pair of tolerances."""
    objective = problem._objective
    tight = objective.with_tolerances(objective.rtol / factor, objective.atol / factor)
    here = jax.jit(jax.value_and_grad(objective.nll))(model)
    there = jax.jit(jax.value_and_grad(tight.nll))(model)
    return [float(here[0]), float(there[0])]


def _now(problem):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(problem.check_tolerances(problem.nominal)["nll"])


def first_call(problems: list[str], folder: pathlib.Path, now_first: bool) -> None:
    print("| problem | before, s | now, s | now / before | the same nll |")
    print("|---|---:|---:|---:|---|")
    for name in problems:
        path = folder / name / f"{name}.yaml"
        times, values = {}, {}
        for way in ("now", "before") if now_first else ("before", "now"):
            problem = sciflat.petab_problem(path)  # a fresh one: nothing compiled
            t = time.perf_counter()
            if way == "now":
                values[way] = _now(problem)
            else:
                values[way] = _before(problem, problem.nominal)
            times[way] = time.perf_counter() - t
        before, now = times["before"], times["now"]
        print(
            f"| {name} | {before:.1f} | {now:.1f} | {now / before:.2f} | "
            f"{values['now'] == values['before']} |",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="*", default=list(PROBLEMS))
    parser.add_argument("--dir", default=str(_SHARED), help="the problems' folder")
    parser.add_argument(
        "--first-call", action="store_true", help="its first call, before and now"
    )
    parser.add_argument("--now-first", action="store_true")
    args = parser.parse_args()
    if args.first_call:
        first_call(args.problems, pathlib.Path(args.dir), args.now_first)
    else:
        main(args.problems, pathlib.Path(args.dir))
