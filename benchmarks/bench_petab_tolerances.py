"""Is a PEtab objective converged in the ODE tolerances at a point? `nll` and its
gradient at sciflat's defaults against the same 100 times tighter
(`problem.check_tolerances`), at the nominal parameters of each problem given, and on
Crauste et al. 2017 also 1e-4 away in `rho_E` (log10 scale) (where the optimum's knife edge
makes the solve fail).

    python benchmarks/bench_petab_tolerances.py
    python benchmarks/bench_petab_tolerances.py --problems Boehm_JProteomeRes2014
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="*", default=list(PROBLEMS))
    parser.add_argument("--dir", default=str(_SHARED), help="the problems' folder")
    args = parser.parse_args()
    main(args.problems, pathlib.Path(args.dir))
