"""One evaluation of a fit, sciflat against pyPESTO + AMICI: what a trust region
(Fides) asks for at each point.

sciflat: the residuals with their Jacobian from one compiled call (what
`least_squares(method="fides")` calls), with the default solver (`sciflat.BDF()`)
and with `sciflat.Rodas5P()`; pyPESTO + AMICI: its PEtab objective's value, gradient and
Fisher information matrix (`sensi_orders=(0, 1, 2)`, forward sensitivities in
AMICI's C++, what pyPESTO's Fides asks for). At the nominal parameters and at the
first starts of `problem.sample_starts(n, seed=0)`, one process, interleaved, medians
after compilation, in ms. AMICI and pyPESTO are benchmark-only dependencies.

    python benchmarks/bench_petab_evaluations.py --problem PATH/Bruno_JExpBot2016.yaml
"""

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import sciflat


jax.config.update("jax_enable_x64", True)


def _amici_objective(yaml: str, folder: str):
    import petab.v1 as petab
    import pypesto.petab

    importer = pypesto.petab.PetabImporter(
        petab.Problem.from_yaml(yaml), output_folder=folder
    )
    problem = importer.create_problem(importer.create_objective())
    ids = [problem.x_names[i] for i in problem.x_free_indices]

    def at(point: dict):
        x = np.array([float(point[k]) for k in ids])
        return lambda: problem.objective(x, sensi_orders=(0, 1, 2))

    return at


def _sciflat_both(yaml: str, solver):
    problem = sciflat.petab_problem(yaml, solver=solver)
    _, re = sciflat.destructure(problem.nominal, dtype=jnp.float64)
    both = jax.jit(jax.jacfwd(lambda x: (problem.residuals(re(x)),) * 2, has_aux=True))

    def at(point: dict):
        x = sciflat.destructure(point, dtype=jnp.float64)[0]
        return lambda: jax.block_until_ready(both(x))

    return problem, at


def main(yaml: str, starts: int, repeats: int, folder: str) -> None:
    problem, default = _sciflat_both(yaml, None)
    _, rodas = _sciflat_both(yaml, sciflat.Rodas5P())
    amici = _amici_objective(yaml, folder)
    points = [problem.nominal, *problem.sample_starts(starts, seed=0)]
    names = ("sciflat, BDF (default)", "sciflat, Rodas5P", "pyPESTO + AMICI")
    print(f"| point | {' | '.join(names)} |")
    print("|---|" + "---:|" * len(names))
    for i, point in enumerate(points):
        calls = dict(
            zip(names, (default(point), rodas(point), amici(point)), strict=True)
        )
        for call in calls.values():  # compiles; AMICI's first call loads
            call()
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(repeats):
            for k, call in calls.items():
                t = time.perf_counter()
                call()
                times[k].append(time.perf_counter() - t)
        label = "nominal" if i == 0 else f"start {i - 1}"
        cells = " | ".join(f"{1e3 * statistics.median(times[k]):.1f}" for k in names)
        print(f"| {label} | {cells} |", flush=True)
    print(
        f"\n(ms per evaluation, medians of {repeats}; load average {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problem", required=True, help="the problem's YAML file")
    parser.add_argument("--starts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--amici-dir", default=None, help="AMICI's model folder (default: a temporary)"
    )
    args = parser.parse_args()
    stem = os.path.splitext(os.path.basename(args.problem))[0]
    folder = args.amici_dir or os.path.join(
        os.path.expanduser("~/.cache/sciflat-bench"), f"amici_{stem}"
    )
    main(args.problem, args.starts, args.repeats, folder)
