"""Where a PEtab simulation's time goes: Diffrax solvers, root finders, tolerances and
the batching of conditions, on a few problems of the benchmark collection.

For each problem and variant, in one process, interleaved, after compilation: the
median time of one `nll` and one `jax.grad(nll)` at the nominal parameters, the number
of steps of each condition's solve (accepted and rejected), and the error of the llh
against sciflat's own solve at rtol 1e-12, atol 1e-14 (which agrees with AMICI's
converged value to 1e-11 on these problems). Variants:

- `Kvaerno5, StageChord`: sciflat's default before `BDF` (rtol 1e-8, atol 1e-10):
  the chord method, converged when its correction of the state is within the step's
  tolerance;
- `Kvaerno5, StageChord, jacfwd and LU (before)`: the default as it was, the
  Jacobian of the right-hand side by `jax.jacfwd` and the chord's linear solves by
  Lineax's LU (now: the analytic Jacobian, products with the inverse);
- `Kvaerno5, Newton`: `optimistix.Newton` (a Jacobian per iteration; its residual
  tested against `atol`), the default before;
- `Rodas5P`: `sciflat.Rodas5P`, a Rosenbrock method (one Jacobian and one LU per
  step, no iteration);
- `BDF`: `sciflat.BDF`, variable order 1 to 5 (a Jacobian and a Newton matrix kept
  over many steps, two or three evaluations of the vector field a step; the steps
  column gives its accepted + rejected steps, then its Newton matrices);
- `BDF, conditions in turn` / `as one batch`: `BDF` with its conditions solved one
  after the other (its default from 20 species) or as one batch (below 20);
- `BDF, SciPy's step choice`: `BDF` choosing its step and order from the error
  estimates alone, without CVODES's biases (`sciflat._petab.bdf._BIAS`);
- `Kvaerno3` / `Kvaerno4`, Newton: lower orders, cheaper steps, more of them;
- `Kvaerno5, chord`: Diffrax's default root finder (`VeryChord`: the Jacobian kept
  over the iterations of a stage, converged in the vector field's scale);
- `Kvaerno5, rtol 1e-6`: looser tolerances (atol 1e-8);
- `BDF (default), rtol 1e-6`: the default solver at those tolerances;
- `Tsit5`: explicit, for the problems that are not stiff;
- `BDF, explicit first`: `BDF(explicit_first=True)`, each call's simulations tried
  by `Tsit5` with a stiffness test first, by `BDF` where it stops, on every problem
  (`BDF`, the default, chooses it per problem at the nominal parameters);
- `BDF, never explicit`: `BDF(explicit_first=False)`, `BDF` alone;
- `Kvaerno5, conditions in turn`: `Kvaerno5, StageChord` with the conditions solved
  one after the other (`jax.lax.map`) rather than in one `vmap` (where every
  condition takes as many steps as the slowest).

`--variants` takes labels (each selects itself) or prefixes of labels (each selects
every label it begins).

    python benchmarks/bench_petab_solvers.py
    python benchmarks/bench_petab_solvers.py --problems Boehm_JProteomeRes2014 --repeats 5
"""

import argparse
import pathlib
import statistics
import time
from typing import Any

import diffrax
import jax
import jax.numpy as jnp
import lineax
import numpy as np
import optimistix

import sciflat
from sciflat._petab import bdf as bdf_module
from sciflat._petab.objective import StageChord, forward_sensitivities


jax.config.update("jax_enable_x64", True)

_SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "petab"
PROBLEMS = ("Boehm_JProteomeRes2014", "Crauste_CellSystems2017", "Bruno_JExpBot2016")


def _newton(solver: type, rtol: float, atol: float) -> Any:
    return solver(root_finder=optimistix.Newton(rtol=rtol, atol=atol))


_KVAERNO5 = diffrax.Kvaerno5(root_finder=StageChord(rtol=1e-8, atol=1e-10))

VARIANTS: dict[str, dict[str, Any]] = {
    "Kvaerno5, StageChord": {"solver": _KVAERNO5},
    "Kvaerno5, StageChord, jacfwd and LU (before)": {
        "solver": diffrax.Kvaerno5(
            root_finder=StageChord(
                rtol=1e-8, atol=1e-10, linear_solver=lineax.AutoLinearSolver(None)
            )
        ),
        "plain_jacobian": True,
    },
    "Kvaerno5, Newton": {"solver": _newton(diffrax.Kvaerno5, 1e-8, 1e-10)},
    "Rodas5P": {"solver": sciflat.Rodas5P()},
    "BDF": {"solver": sciflat.BDF()},
    "BDF, conditions in turn": {"solver": sciflat.BDF(), "bdf_in_turn": True},
    "BDF, conditions as one batch": {"solver": sciflat.BDF(), "bdf_in_turn": False},
    "BDF, SciPy's step choice": {"solver": sciflat.BDF(), "bias": (1.0, 1.0, 1.0)},
    "BDF, explicit first": {"solver": sciflat.BDF(explicit_first=True)},
    "BDF, never explicit": {"solver": sciflat.BDF(explicit_first=False)},
    "Kvaerno4, Newton": {"solver": _newton(diffrax.Kvaerno4, 1e-8, 1e-10)},
    "Kvaerno3, Newton": {"solver": _newton(diffrax.Kvaerno3, 1e-8, 1e-10)},
    "Kvaerno5, chord": {"solver": diffrax.Kvaerno5()},
    "Kvaerno5, rtol 1e-6": {
        "solver": diffrax.Kvaerno5(root_finder=StageChord(rtol=1e-6, atol=1e-8)),
        "rtol": 1e-6,
        "atol": 1e-8,
    },
    "BDF (default), rtol 1e-6": {"rtol": 1e-6, "atol": 1e-8},
    "Tsit5 (max_steps 20000)": {"solver": diffrax.Tsit5(), "max_steps": 20_000},
    "Kvaerno5, conditions in turn": {"solver": _KVAERNO5, "in_turn": True},
}


def _in_turn(problem: Any) -> None:
    """The conditions solved one after the other instead of one `vmap`."""
    objective = problem._objective
    ts = objective.tables.union_times

    def solve_all(ext):
        constants, x0 = objective.initial_all(ext)
        ys, ok = jax.lax.map(
            lambda a: objective.integrate(a[0], a[1], ts), (constants, x0)
        )
        return ys, jnp.all(ok)

    objective.solve_all = solve_all
    objective.solve_with_sensitivities = forward_sensitivities(
        lambda linear: objective.solve_all(objective.ext_of(linear))
    )


def _steps(problem: Any, model: dict[str, Any]) -> str:
    """Accepted and rejected steps of each condition's solve, as the objective solves
    it (its solver, tolerances and measurement times)."""
    objective = problem._objective
    ext = objective.ext(model)
    ts = objective.tables.union_times
    out = []
    if isinstance(objective._solver, sciflat.BDF):
        all_constants, all_x0 = objective.initial_all(ext)
        for c in range(len(objective.tables.conditions)):
            one = (all_constants[c : c + 1], all_x0[c : c + 1], ts)
            _, _, stats = objective._bdf_solve(*one, with_stats=True)
            a, r, _, lu, _ = (int(v) for v in stats[0])
            out.append(f"{a}+{r} ({lu} LU)")
        return (
            ", ".join(out) if len(out) < 4 else f"{out[0]}, ... ({len(out)} conditions)"
        )
    all_constants, all_x0 = objective.initial_all(ext)
    for c in range(len(objective.tables.conditions)):
        constants, x0 = all_constants[c], all_x0[c]
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(sciflat.ReactionODE(constants, objective.formulas.rhs)),
            objective._solver,
            t0=0.0,
            t1=float(ts[-1]),
            dt0=None,
            y0=x0,
            saveat=diffrax.SaveAt(t1=True),
            stepsize_controller=diffrax.ClipStepSizeController(
                diffrax.PIDController(rtol=objective.rtol, atol=objective.atol),
                step_ts=jnp.asarray(ts[ts > 0]),
            ),
            max_steps=objective._max_steps,
            throw=False,
        )
        out.append(
            f"{int(sol.stats['num_accepted_steps'])}+{int(sol.stats['num_rejected_steps'])}"
        )
    return ", ".join(out) if len(out) < 4 else f"{out[0]}, ... ({len(out)} conditions)"


def main(
    problems: list[str], repeats: int, folder: pathlib.Path, variants: list[str]
) -> None:
    for name in problems:
        yaml = folder / name / f"{name}.yaml"
        if not yaml.exists():  # NAME/problem.yaml (Bertozzi_PNAS2020)
            yaml = folder / name / "problem.yaml"
        ref = sciflat.petab_problem(yaml, rtol=1e-12, atol=1e-14)
        ref_llh = float(ref.llh(ref.nominal))
        rows, fns = {}, {}
        for label, options in VARIANTS.items():
            if variants and not any(
                label == v if v in VARIANTS else label.startswith(v) for v in variants
            ):
                continue
            options = dict(options)
            in_turn = options.pop("in_turn", False)
            plain_jacobian = options.pop("plain_jacobian", False)
            bdf_in_turn = options.pop("bdf_in_turn", None)
            bias = options.pop("bias", bdf_module._BIAS)
            problem = sciflat.petab_problem(yaml, **options)
            problem._objective._bdf_in_turn = bdf_in_turn
            if plain_jacobian:  # `jax.jacfwd` of the plain right-hand side
                problem._objective.formulas.rhs.analytic = False
            if in_turn:
                if len(problem.conditions) == 1:
                    continue
                _in_turn(problem)
            p, re = sciflat.destructure(problem.nominal, dtype=jnp.float64)
            llh_fn = jax.jit(lambda x, problem=problem, re=re: problem.nll(re(x)))
            grad_fn = jax.jit(
                jax.grad(lambda x, problem=problem, re=re: problem.nll(re(x)))
            )
            t = time.perf_counter()
            default_bias, bdf_module._BIAS = bdf_module._BIAS, bias  # while tracing
            try:
                llh = -float(llh_fn(p)) - float(problem.log_prior(problem.nominal))
                jax.block_until_ready(grad_fn(p))
                steps = _steps(problem, problem.nominal)
            finally:
                bdf_module._BIAS = default_bias
            compile_s = time.perf_counter() - t
            err = abs(llh - ref_llh) / abs(ref_llh) if np.isfinite(llh) else llh
            rows[label] = {
                "err": err,
                "steps": steps,
                "compile": compile_s,
            }
            fns[label] = (llh_fn, grad_fn, p)
        times = {(k, kind): [] for k in fns for kind in (0, 1)}
        for _ in range(repeats):
            for k, (llh_fn, grad_fn, p) in fns.items():
                for kind, fn in enumerate((llh_fn, grad_fn)):
                    t = time.perf_counter()
                    jax.block_until_ready(fn(p))
                    times[k, kind].append(time.perf_counter() - t)
        print(
            f"\n{name}: llh {ref_llh:.10f} at rtol 1e-12; medians of {repeats} rounds"
        )
        print(
            "| variant | llh, ms | gradient, ms | llh rel. error | "
            "steps (accepted+rejected) | compile, s |"
        )
        print("|---|---|---|---|---|---|")
        for k, r in rows.items():
            err = f"{r['err']:.0e}" if isinstance(r["err"], float) else str(r["err"])
            print(
                f"| {k} | {1e3 * statistics.median(times[k, 0]):.1f} | "
                f"{1e3 * statistics.median(times[k, 1]):.1f} | {err} | {r['steps']} | "
                f"{r['compile']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="*", default=list(PROBLEMS))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dir", default=str(_SHARED), help="the problems' folder")
    parser.add_argument(
        "--variants", nargs="*", default=[], help="these (label prefixes) only"
    )
    args = parser.parse_args()
    main(args.problems, args.repeats, pathlib.Path(args.dir), args.variants)
