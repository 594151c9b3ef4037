"""A PEtab problem (Boehm et al. 2014 by default), the field's multi-start: the same
Latin-hypercube starts
(`problem.sample_starts(n, seed=0)`) fitted by each variant, interleaved start by start
in one process (so that the machine's load falls on all alike), each start's final
-log L, wall time and end point written to a JSON-lines file; `--report` reads such
files and prints the fraction of starts ending within 0.1 of the best -log L and the
time per such start.

    python benchmarks/bench_petab_multistart.py --starts 400 --first 0 --last 100 \
        --variants recipe,hier-dogbox --out runs.jsonl
    python benchmarks/bench_petab_multistart.py --pypesto fides,trf --starts 400 \
        --out runs.jsonl            # pyPESTO + AMICI on the same starts (if installed)
    python benchmarks/bench_petab_multistart.py --report runs.jsonl
    python benchmarks/bench_petab_multistart.py --problem Bruno_JExpBot2016 \
        --starts 100 --variants recipe,trf --out bruno.jsonl
    python benchmarks/bench_petab_multistart.py --problem PATH/Bruno_JExpBot2016.yaml \
        --starts 100 --variants fides --pypesto fides --out bruno.jsonl  # interleaved

`--problem` is a name of the benchmark collection (`sciflat.petab_benchmark`) or a
problem's YAML file.

Variants:
- `recipe`: `least_squares(problem.residuals, method="dogbox")` on all parameters
  (ftol = xtol = gtol = 1e-8, max_nfev 500), the documented recipe before the
  hierarchical one (without its L-BFGS-B polish, which moves no start across 0.1);
  `trf`: the same with SciPy's `trf`.
- `fides`: `least_squares(problem.residuals, method="fides")`, Fides's trust region
  at its defaults (as pyPESTO runs it: `fides.HybridFixed()`, the Gauss–Newton matrix
  then BFGS) on sciflat's residuals and their Jacobian, one call per evaluation.
- `hier-dogbox`, `hier-trf`, `hier-fides`: the same on
  `problem.hierarchical().residuals` (the 3 σ in closed form, 6 outer parameters).
- any of these with `+rodas5p` (e.g. `fides+rodas5p`): the problem solved with
  `solver=sciflat.Rodas5P()` instead of the default (`sciflat.BDF()`); `trf` or
  `dogbox` with `+lsmr` (before `+rodas5p`): SciPy's `tr_solver="lsmr"`, the
  subproblem pyPESTO's `ls_trf` asks for (SciPy's default is `"exact"`).
- `pypesto-fides`, `pypesto-trf`: pyPESTO's PEtab importer with AMICI (its defaults),
  Fides (its defaults) or SciPy's `ls_trf`; a benchmark-only dependency.

Every start is stopped after `--limit` seconds (a callback), recorded as such.
"""

import argparse
import collections
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np


LOG10_TOL = 1e-3  # "at a bound": within this of it on the log10 scale
_BOEHM = "Boehm_JProteomeRes2014"


def _yaml(name: str) -> str:
    import sciflat

    return name if os.path.exists(name) else str(sciflat.petab_benchmark(name))


def _problem(name: str, solver=None):
    import jax

    jax.config.update("jax_enable_x64", True)
    import sciflat

    return sciflat.petab_problem(_yaml(name), solver=solver)


def _sciflat(variant: str, limit: float, name: str):
    import sciflat

    variant, rodas = variant.removesuffix("+rodas5p"), variant.endswith("+rodas5p")
    variant, lsmr = variant.removesuffix("+lsmr"), variant.endswith("+lsmr")
    problem = _problem(name, sciflat.Rodas5P() if rodas else None)
    if variant in ("recipe", "trf", "fides"):
        target, method = problem, "dogbox" if variant == "recipe" else variant
        hier = None
    elif variant in ("hier-dogbox", "hier-trf", "hier-fides"):
        hier = problem.hierarchical()
        target, method = hier, variant.split("-")[1]
    else:
        raise ValueError(f"unknown variant {variant!r}")

    def fit(start):
        begun = time.perf_counter()
        stopped = []

        def callback(step, cost, model):
            if time.perf_counter() - begun > limit:
                stopped.append(True)
                return True
            return False

        model = start if hier is None else hier.outer(start)
        options: dict[str, Any] = (
            {}  # Fides's own defaults, as pyPESTO's
            if method == "fides"
            else dict(max_nfev=500, ftol=1e-8, xtol=1e-8, gtol=1e-8)
        )
        if lsmr:  # the trust region's step as pyPESTO asks SciPy for it
            options.update(tr_solver="lsmr")
        result = sciflat.least_squares(
            target.residuals,
            model,
            bounds=target.bounds,
            method=method,
            progress=False,
            callback=callback,
            **options,
        )
        seconds = time.perf_counter() - begun
        full = result.model if hier is None else hier.full(result.model)
        return dict(
            nll=float(problem.nll(full)),
            seconds=seconds,
            nfev=int(getattr(result.raw, "nfev", -1)),
            timed_out=bool(stopped),
            x={k: float(v) for k, v in full.items()},
        )

    fit(problem.nominal)  # compiles the residuals and their Jacobian
    return problem, fit


def _pypesto(variant: str, limit: float, out: str, name: str):
    import amici  # noqa: F401
    import petab.v1 as petab
    import petab.v1.lint
    import pypesto
    import pypesto.optimize
    import pypesto.petab

    yaml = _yaml(name)
    stem = os.path.splitext(os.path.basename(yaml))[0]
    petab_problem = petab.Problem.from_yaml(yaml)
    if petab.lint.measurement_table_has_timepoint_specific_mappings(
        petab_problem.measurement_df
    ):  # AMICI's import needs one observable per placeholder value (Fiedler's)
        petab.flatten_timepoint_specific_output_overrides(petab_problem)
    importer = pypesto.petab.PetabImporter(
        petab_problem,
        output_folder=os.path.join(
            os.path.dirname(os.path.abspath(out)), f"amici_{stem}"
        ),
    )
    objective = importer.create_objective()
    if variant == "pypesto-trf":
        # With the σ estimated, AMICI's residuals need the σ terms (Data2Dynamics').
        objective.amici_model.set_add_sigma_residuals(True)
    problem = importer.create_problem(objective)
    if variant == "pypesto-fides":
        optimizer = pypesto.optimize.FidesOptimizer(
            options={"maxtime": limit}, verbose=0
        )
    elif variant == "pypesto-trf":
        optimizer = pypesto.optimize.ScipyOptimizer(method="ls_trf")
    else:
        raise ValueError(f"unknown variant {variant!r}")
    ids = [problem.x_names[i] for i in problem.x_free_indices]

    def fit(start):
        x0 = np.zeros(problem.dim_full)
        x0[problem.x_fixed_indices] = problem.x_fixed_vals
        x0[problem.x_free_indices] = [start[k] for k in ids]
        problem.set_x_guesses(x0[None])
        begun = time.perf_counter()
        result = pypesto.optimize.minimize(
            problem, optimizer=optimizer, n_starts=1, progress_bar=False
        )
        seconds = time.perf_counter() - begun
        best = result.optimize_result.list[0]
        if best.x is None:  # no point was evaluated (the start's solve failed)
            x, fval = dict(zip(problem.x_names, x0, strict=True)), np.inf
        else:
            x = dict(zip(problem.x_names, np.asarray(best.x, float), strict=True))
            fval = float(best.fval) if best.fval is not None else np.inf
        return dict(
            nll=fval,
            seconds=seconds,
            nfev=int(best.n_fval or -1),
            timed_out=seconds > limit,
            x={k: float(x[k]) for k in ids},
        )

    return problem, fit


def run(args) -> None:
    jax_free = [v for v in args.variants if v.startswith("pypesto")]
    ours = [v for v in args.variants if v not in jax_free]
    fits = {}
    for v in ours:
        fits[v] = _sciflat(v, args.limit, args.problem)[1]
    for v in jax_free:
        fits[v] = _pypesto(v, args.limit, args.out, args.problem)[1]
    problem = _problem(args.problem)
    starts = problem.sample_starts(args.starts, seed=args.seed)
    last = args.last if args.last is not None else args.starts
    load = os.getloadavg()[0]
    with open(args.out, "a") as f:
        for i in range(args.first, last):
            start = {k: float(v) for k, v in starts[i].items()}
            for v in fits:
                out = fits[v](start)
                row = dict(
                    problem=args.problem,
                    variant=v,
                    start=i,
                    seed=args.seed,
                    load=load,
                    **out,
                )
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(
                    f"{i:4d} {v:14s} -log L {out['nll']:11.4f} "
                    f"{out['seconds']:6.1f} s{' (limit)' if out['timed_out'] else ''}",
                    flush=True,
                )
            load = os.getloadavg()[0]


def report(
    paths: list[str], only: list[str] | None, name: str, tol: float = 0.1
) -> None:
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    # Rows written before `--problem` existed are Boehm's.
    rows = [r for r in rows if r.get("problem", _BOEHM) == name]
    best = min(r["nll"] for r in rows if np.isfinite(r["nll"]))
    by = collections.defaultdict(dict)
    for r in rows:
        if only is None or r["variant"] in only:
            by[r["variant"]][r["start"]] = r  # the last run of a start counts
    # The starts every variant ran: the same starts for all.
    common = set.intersection(*(set(starts) for starts in by.values()))
    by = {v: {i: r for i, r in s.items() if i in common} for v, s in by.items()}
    print(f"best -log L over all runs: {best:.6f}; {len(common)} starts run by all")
    print(
        "| variant | starts | within 0.1 | fraction | s per start (median) | "
        "s per start (mean) | s per start within 0.1 | stopped at the limit |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for v, starts in by.items():
        rs = list(starts.values())
        ok = sum(r["nll"] <= best + tol for r in rs)
        total = sum(r["seconds"] for r in rs)
        print(
            f"| {v} | {len(rs)} | {ok} | {100 * ok / len(rs):.1f} % | "
            f"{statistics.median(r['seconds'] for r in rs):.2f} | "
            f"{total / len(rs):.2f} | "
            f"{total / ok if ok else float('inf'):.1f} | "
            f"{sum(r['timed_out'] for r in rs)} |"
        )
    lower, upper = _problem(name).bounds
    for v, starts in by.items():
        print(f"\n{v}: where the starts end (-log L rounded to 0.1; count; at bounds)")
        clusters = collections.defaultdict(list)
        for r in starts.values():
            clusters[round(r["nll"], 1)].append(r)
        for value, rs in sorted(clusters.items(), key=lambda kv: -len(kv[1]))[:8]:
            at = collections.Counter()
            for r in rs:
                for k, x in r["x"].items():
                    if k in lower and abs(x - lower[k]) < LOG10_TOL:
                        at[f"{k}=lo"] += 1
                    elif k in upper and abs(x - upper[k]) < LOG10_TOL:
                        at[f"{k}=hi"] += 1
            common = ", ".join(f"{k} {n}" for k, n in at.most_common(5))
            print(f"  {value:9.1f}: {len(rs):3d} starts; {common}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--problem", default=_BOEHM, help="a collection name or a YAML file")
    add("--starts", type=int, default=400, help="how many starts are drawn")
    add("--first", type=int, default=0, help="the first start to fit")
    add("--last", type=int, default=None, help="one past the last start to fit")
    add("--seed", type=int, default=0)
    add("--variants", default="recipe,hier-dogbox", help="'' for none")
    add("--pypesto", default=None, help="e.g. fides,trf: pyPESTO + AMICI variants")
    add("--limit", type=float, default=60.0, help="seconds per start")
    add("--out", default="multistart.jsonl")
    add("--report", nargs="*", default=None, help="JSON-lines files to summarise")
    add("--only", default=None, help="--report: these variants (default: all)")
    args = parser.parse_args(argv)
    if args.report is not None:
        only = args.only.split(",") if args.only else None
        report(args.report or [args.out], only, args.problem)
        return
    args.variants = [v for v in args.variants.split(",") if v]
    if args.pypesto:  # beside `--variants`, interleaved start by start
        args.variants += [f"pypesto-{v}" for v in args.pypesto.split(",")]
    run(args)


if __name__ == "__main__":
    sys.exit(main())
