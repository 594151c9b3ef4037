"""PEtab problems: sciflat's simulation, gradient and first call, on Boehm et al. 2014
alone (default) or on every problem of a folder beside AMICI (`--amici`).

**Boehm** (default): one simulation, one gradient, one Jacobian (the forward
sensitivities of all 96 residuals to the 9 parameters), beside AMICI's reference
budgets for this model (simulation 5 ms, forward sensitivities 50 ms; AMICI's
tests/benchmark_models). All variants in one process, interleaved, after compilation,
each call until ready; the table gives medians over `--repeats` rounds at the published
parameters and at a few starts drawn in the bounds (where the model is less stiff or
more).

    python benchmarks/bench_petab.py
    python benchmarks/bench_petab.py --repeats 50 --starts 4
    python benchmarks/bench_petab.py --plain   # and without the solves' custom JVP

**Against AMICI** (`--amici`; needs `amici` installed, a reference tool for benchmarks,
never a dependency of sciflat: `apt-get install swig libopenblas-dev
libhdf5-serial-dev`, then `pip install amici threadpoolctl`): every problem folder (`NAME/NAME.yaml`
or `NAME/problem.yaml`) under `--dir` (default `../shared/data/petab`, beside the
repository) and `--extra` (or `$SCIFLAT_PETAB_EXTRA`, folders separated by `:`). Each
problem runs in a child process of its own, with a `--timeout`, so a problem that
sciflat cannot solve in time is reported as such and the others still run. In the
child, after AMICI's model and sciflat's problem are loaded and compiled, at the
nominal parameters:

- llh: sciflat's `problem.llh` with its defaults against AMICI's at rtol 1e-12, atol
  1e-14 (converged), relative error; AMICI's own at its defaults in parentheses.
- gradient: sciflat's `jax.grad` of the data's −log L (of `nll` less the priors; at
  `--grad-tol RTOL ATOL` if given, else sciflat's defaults) against AMICI's forward
  sensitivities at rtol 1e-12, atol 1e-14 (or its adjoint: `--amici-sensitivities
  adjoint`), relative error in the 2-norm, both on the parameters' scales; AMICI's own
  at its defaults in parentheses.
- per call: sciflat's jitted `nll` and `jax.grad(nll)`; AMICI's `simulate_petab` with
  the ExpData and parameter mapping made once (what pyPESTO's objective calls), at its
  defaults (rtol 1e-8, atol 1e-16), without and with its sensitivities; both
  single-threaded on the host. Medians of interleaved rounds, and the ratio: each
  round runs every call `--block` times in a row (3), in a shuffled order, and
  times all but the first of each block (a call right after the other tool's runs
  slower, both ways; `--block 1`: every call timed as it comes). Where
  AMICI's defaults fail (their 10,000 steps too few: its llh nan), AMICI is timed
  with `max_steps` 10**6, and the table says so. With `--processes N`, each problem
  is measured in N fresh processes, one after the other (a process's times can move
  by up to a half from one process to the next, with how XLA's pool of threads runs
  the solves' loops in it): the times are the medians over the processes, and the
  ratio's cell gives the range of the N processes' own ratios beside the median's.
- first call: sciflat's `petab_problem` (read) plus its first `nll` (trace, compile,
  run) and its first gradient; AMICI's model build (code generation and C++ build,
  once per model: cached under `--amici-models`, its time kept beside it) and its load
  in a fresh process (tables, model module, ExpData, first simulation).

    python benchmarks/bench_petab.py --amici --extra /path/to/more/problems
    python benchmarks/bench_petab.py --amici --only Boehm_JProteomeRes2014 --repeats 5
    python benchmarks/bench_petab.py --amici --amici-only   # AMICI's reference llh
    python benchmarks/bench_petab.py --amici --only Laske_PLOSComputBiol2019 --processes 3

Without AMICI installed, `--amici` says so and measures nothing.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any


_HERE = pathlib.Path(__file__).resolve()
_SHARED = _HERE.parents[2] / "shared" / "data" / "petab"
_MODELS = pathlib.Path.home() / ".cache" / "sciflat-bench" / "amici-models"
_TIGHT = (1e-12, 1e-14)  # AMICI's converged reference: rtol, atol
_BLOCK = 3  # each call this many times in a row in a round, the first not timed


# -- Boehm alone (the default) --------------------------------------------------------


AMICI_MS = {"simulation (nll)": 5.0, "forward sensitivities (Jacobian)": 50.0}


def boehm(repeats: int = 20, starts: int = 3, plain: bool = False) -> None:
    import jax
    import jax.numpy as jnp

    import sciflat

    jax.config.update("jax_enable_x64", True)
    yaml = sciflat.petab_benchmark("Boehm_JProteomeRes2014")
    problem = sciflat.petab_problem(yaml)
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
        other = sciflat.petab_problem(yaml)
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


# -- every problem against AMICI: the child, one problem -------------------------------


def _emit(**record: Any) -> None:
    """One line of results for the parent (it keeps what came before a timeout)."""
    print("@@ " + json.dumps(record), flush=True)


def _amici_solver(
    model: Any,
    rtol: float,
    atol: float | None,
    sensitivities: str | None,
    max_steps: int | None = None,
):
    """AMICI's solver at `rtol`, `atol` (None: AMICI's defaults, rtol 1e-8, atol
    1e-16), with first-order `"forward"` or `"adjoint"` sensitivities or none, and
    `max_steps` (None: AMICI's 10,000; 10**6 where tolerances are given)."""
    from amici.sim.sundials import SensitivityMethod, SensitivityOrder

    solver = model.create_solver()
    if atol is not None:
        solver.set_relative_tolerance(rtol)
        solver.set_absolute_tolerance(atol)
        solver.set_relative_tolerance_fsa(rtol)
        solver.set_absolute_tolerance_fsa(atol)
        solver.set_relative_tolerance_b(rtol)
        solver.set_absolute_tolerance_b(atol)
        solver.set_relative_tolerance_quadratures(rtol)
        solver.set_absolute_tolerance_quadratures(atol)
        max_steps = max_steps or 10**6
    if max_steps is not None:
        solver.set_max_steps(max_steps)
    if sensitivities is not None:
        solver.set_sensitivity_order(SensitivityOrder.first)
        solver.set_sensitivity_method(
            SensitivityMethod.forward
            if sensitivities == "forward"
            else SensitivityMethod.adjoint
        )
    return solver


def _amici_model(yaml: pathlib.Path, models: pathlib.Path, compile_: bool) -> Any:
    import petab.v1 as petab
    import petab.v1.lint
    from amici.importers.petab.v1 import import_petab_problem

    petab_problem = petab.Problem.from_yaml(str(yaml))
    if petab.lint.measurement_table_has_timepoint_specific_mappings(
        petab_problem.measurement_df
    ):  # AMICI's import needs one observable per placeholder value (as pyPESTO does)
        petab.flatten_timepoint_specific_output_overrides(petab_problem)
    name = yaml.parent.name
    model = import_petab_problem(
        petab_problem, models / name, model_name=name, compile_=compile_
    )
    return petab_problem, model


def build_amici(yaml: pathlib.Path, models: pathlib.Path) -> None:
    """Generates and compiles AMICI's model (once per model), keeping its time."""
    t = time.perf_counter()
    _amici_model(yaml, models, compile_=True)
    build_s = time.perf_counter() - t
    (models / f"{yaml.parent.name}.build.json").write_text(
        json.dumps({"build_s": build_s})
    )
    _emit(amici_build_s=build_s)


def _one_thread_but_jax() -> list[str]:
    """Holds the thread pools of this process's BLAS and OpenMP libraries to one
    thread, all but SciPy's OpenBLAS (where JAX's LAPACK calls run, left as a user
    has it): AMICI's own OpenBLAS and OpenMP, and NumPy's OpenBLAS, which AMICI's
    Python side calls. Their idle workers spin after a call and took a core from
    the next call in the process (Laske et al. 2019: sciflat's llh 20-25 ms in the
    benchmark's rounds, 14-19 ms with them held, 13.5 ms alone). The names
    of the libraries held; none where `threadpoolctl` is not installed."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return []
    held = []
    for lib in ThreadpoolController().lib_controllers:
        if "scipy" not in pathlib.Path(lib.filepath).parent.name:
            lib.set_num_threads(1)
            held.append(pathlib.Path(lib.filepath).name)
    return held


# `--explicit-first`: sciflat's `BDF(explicit_first=...)`.
_EXPLICIT_FIRST = {"default": None, "always": True, "never": False}


def one_problem(
    yaml: pathlib.Path,
    models: pathlib.Path,
    repeats: int,
    seconds: float,
    amici_only: bool = False,
    grad_tol: tuple[float, float] | None = None,
    values_only: bool = False,
    method: str = "forward",
    block: int = _BLOCK,
    explicit_first: bool | None = None,
) -> None:
    """Everything for one problem, in this (fresh) process; results as `_emit` lines.
    `values_only`: the llh and its time, no sensitivities on either side; `method`:
    AMICI's sensitivities, `"forward"` or `"adjoint"`; `explicit_first`: sciflat's
    solver `BDF(explicit_first=...)` (None: the default)."""
    import logging

    import amici  # noqa: F401  (imported before any clock starts, as JAX is)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from amici.sim.sundials.petab.v1 import create_edatas, simulate_petab
    from amici.sim.sundials.petab.v1._parameter_mapping import (
        create_parameter_mapping,
    )

    import sciflat

    jax.config.update("jax_enable_x64", True)
    logging.getLogger("amici").setLevel(logging.ERROR)

    # AMICI: load in this fresh process (tables, module, ExpData, first simulation).
    t = time.perf_counter()
    petab_problem, model = _amici_model(yaml, models, compile_=False)
    conditions = petab_problem.get_simulation_conditions_from_measurement_df()
    edatas = create_edatas(
        amici_model=model, petab_problem=petab_problem, simulation_conditions=conditions
    )
    mapping = create_parameter_mapping(
        petab_problem, conditions, scaled_parameters=True, amici_model=model
    )
    ids = list(petab_problem.x_free_ids)
    nominal = dict(
        zip(petab_problem.x_ids, petab_problem.get_x_nominal(scaled=True), strict=True)
    )
    x_amici = {k: nominal[k] for k in ids}

    def amici_call(solver: Any, x: dict[str, float] = x_amici) -> dict[str, Any]:
        return simulate_petab(
            petab_problem,
            amici_model=model,
            solver=solver,
            problem_parameters=x,
            scaled_parameters=True,
            edatas=edatas,
            parameter_mapping=mapping,
            scaled_gradients=True,
        )

    plain = _amici_solver(model, 1e-8, None, None)
    amici_call(plain)
    _emit(amici_load_s=time.perf_counter() - t)
    jnp.linalg.inv(jnp.eye(2))  # JAX's LAPACK (SciPy's OpenBLAS) loaded, then held
    _emit(one_thread=_one_thread_but_jax())
    tight = amici_call(_amici_solver(model, *_TIGHT, None if values_only else method))
    ref_llh = float(tight["llh"])
    ref_grad = (
        None
        if tight["sllh"] is None
        else [-float(tight["sllh"][k]) for k in ids]  # of −llh
    )
    default_llh = float(amici_call(plain)["llh"])
    # Where AMICI's defaults stop short (10,000 steps; Lang et al. 2024 takes
    # 12,140), the time to that failure is no simulation: both AMICI calls timed
    # with the steps it needs, as its user would have to set them.
    max_steps = None if np.isfinite(default_llh) else 10**6
    if max_steps is not None:
        plain = _amici_solver(model, 1e-8, None, None, max_steps)
    sens = _amici_solver(model, 1e-8, None, method, max_steps)
    sllh = None if values_only else amici_call(sens)["sllh"]
    _emit(
        amici_max_steps=max_steps,
        amici_method=method,
        amici_llh=ref_llh,
        amici_grad=ref_grad,
        amici_default_llh=default_llh,
        amici_default_grad=None if sllh is None else [-float(sllh[k]) for k in ids],
    )
    if amici_only:  # and AMICI's gradient against its own central differences
        tight_plain = _amici_solver(model, *_TIGHT, None)
        fd = []
        for k in ids:
            h = 1e-5 * max(1.0, abs(x_amici[k]))
            up = amici_call(tight_plain, {**x_amici, k: x_amici[k] + h})["llh"]
            down = amici_call(tight_plain, {**x_amici, k: x_amici[k] - h})["llh"]
            fd.append(-(up - down) / (2 * h))
        _emit(amici_fd_grad=fd)
        return

    # sciflat: read, then the first calls (trace, compile, run).
    solver = sciflat.BDF(explicit_first=explicit_first)
    t = time.perf_counter()
    try:
        problem = sciflat.petab_problem(yaml, solver=solver)
    except (ValueError, TypeError, NotImplementedError) as e:
        _emit(sciflat_error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return
    read_s = time.perf_counter() - t
    if list(problem.parameter_ids) != ids:
        _emit(sciflat_error="estimated parameters differ from AMICI's")
        return
    p, re = sciflat.destructure(problem.nominal, dtype=jnp.float64)
    llh_fn = jax.jit(lambda x: problem.nll(re(x)))
    # The gradient at the tolerances recommended for gradients, if they differ.
    problem_g = problem
    if grad_tol is not None:
        problem_g = sciflat.petab_problem(
            yaml, rtol=grad_tol[0], atol=grad_tol[1], solver=solver
        )
    grad_fn = jax.jit(jax.grad(lambda x: problem_g.nll(re(x))))
    t = time.perf_counter()
    nll = float(llh_fn(p))
    first_llh_s = time.perf_counter() - t
    _emit(sciflat_read_s=read_s, sciflat_first_llh_s=first_llh_s)
    llh = -nll - float(problem.log_prior(problem.nominal))
    _emit(sciflat_llh=llh)
    calls = {
        "sciflat_llh": lambda: jax.block_until_ready(llh_fn(p)),
        "amici_llh": lambda: amici_call(plain),
    }
    if values_only:
        _time_calls(calls, repeats, seconds, block)
        return
    t = time.perf_counter()
    grad = np.asarray(jax.block_until_ready(grad_fn(p)))
    _emit(sciflat_first_grad_s=time.perf_counter() - t)
    prior_grad = np.asarray(jax.grad(lambda x: problem.log_prior(re(x)))(p))
    by_id = re(jnp.asarray(grad + prior_grad))  # `p` is in the pytree's (sorted) order
    _emit(sciflat_grad=[float(by_id[k]) for k in ids])  # of the data's −log L

    calls["sciflat_grad"] = lambda: jax.block_until_ready(grad_fn(p))
    calls["amici_grad"] = lambda: amici_call(sens)
    _time_calls(calls, repeats, seconds, block)


def _time_calls(
    calls: dict[str, Any], repeats: int, seconds: float, block: int = _BLOCK
) -> None:
    """Per call, interleaved in blocks: each round runs every call `block` times in
    a row, the calls in an order of their own (shuffled, seeded), for `repeats`
    rounds or `seconds`, at least 3 rounds. The first call of a block is not
    timed: on these 2 cores a call right after another tool's ran slower, both
    ways (in one process, Laske et al. 2019, medians: sciflat's llh 21.5 ms after
    AMICI's gradient, 15.2 after AMICI's llh, 13.9 after its own; AMICI's llh 16.0
    after sciflat's llh, 12.5 after its own), and a user's fit calls one tool
    over and over, not the two in turn. `block=1` times every call as it comes
    (each round's calls shuffled: the interference averaged, not removed)."""
    import numpy as np

    times: dict[str, list[float]] = {k: [] for k in calls}
    cpp: dict[str, list[float]] = {k: [] for k in calls if k.startswith("amici")}
    names = list(calls)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for r in range(repeats):
        for k in rng.permutation(names):
            fn = calls[k]
            for i in range(block):
                t = time.perf_counter()
                out = fn()
                elapsed = time.perf_counter() - t
                if block > 1 and i == 0:
                    continue
                times[k].append(elapsed)
                if k in cpp:  # AMICI's own clock: the C++ simulation alone, in ms
                    cpp[k].append(sum(d["cpu_time"] for d in out["rdatas"]))
        if r >= 2 and time.perf_counter() - start > seconds:
            break
    _emit(
        rounds=r + 1,
        block=block,
        **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
        **{f"{k}_cpp_ms": statistics.median(v) for k, v in cpp.items()},
    )


# -- every problem against AMICI: the parent -------------------------------------------


def _problems(dirs: list[pathlib.Path], only: list[str]) -> list[pathlib.Path]:
    found: dict[str, pathlib.Path] = {}
    for d in dirs:
        if not d.is_dir():
            raise SystemExit(f"No folder {d}: give the problems' folder with --dir.")
        for sub in sorted(d.iterdir()):
            # NAME/NAME.yaml, or NAME/problem.yaml (Bertozzi_PNAS2020)
            yamls = [sub / f"{sub.name}.yaml", sub / "problem.yaml"]
            yaml = next((y for y in yamls if y.is_file()), None)
            if yaml is not None and (not only or sub.name in only):
                found.setdefault(sub.name, yaml)
    order = [k for k in only if k in found] if only else sorted(found)
    return [found[k] for k in order]


def _child(args: list[str], timeout: float) -> tuple[dict[str, Any], str]:
    """Runs this script on one problem; its records, and how it ended."""
    command = [sys.executable, str(_HERE), *args]
    env = {**os.environ, "AMICI_LOG": "WARNING"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a true first call
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        status = f"timeout {timeout:.0f} s"
    records: dict[str, Any] = {}
    tail = []
    for line in out.splitlines():
        if line.startswith("@@ "):
            records.update(json.loads(line[3:]))
        elif line.strip():
            tail.append(line.strip())
    if status.startswith("exit") and tail:
        status += ": " + tail[-1][:160]
    return records, status


def _over_processes(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One problem measured in several fresh processes: the first process's record
    (values, first calls), its per-call times replaced by their medians over the
    processes, and each process's ratios sciflat / AMICI kept (`ratios`)."""
    record = dict(runs[0])
    for key in [k for k in record if k.endswith("_ms")]:
        values = [r[key] for r in runs if r.get(key) is not None]
        record[key] = statistics.median(values) if values else None
    record["ratios"] = {
        kind: [
            r[f"sciflat_{kind}_ms"] / r[f"amici_{kind}_ms"]
            for r in runs
            if r.get(f"sciflat_{kind}_ms") and r.get(f"amici_{kind}_ms")
        ]
        for kind in ("llh", "grad")
    }
    return record


def _rel(a: Any, b: Any) -> float | None:
    import numpy as np

    if a is None or b is None:
        return None
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _fmt_err(e: float | None) -> str:
    if e is None:
        return "—"
    if not e == e or e == float("inf"):
        return str(e)
    return f"{e:.0e}"


def _fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "—"
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _llh_err(llh: float | None, ref: float | None) -> str:
    if llh is None or ref is None:
        return "—"
    if not abs(llh) < 1e300:  # inf or nan
        return str(llh)
    return _fmt_err(abs(llh - ref) / abs(ref))


def _row(name: str, r: dict[str, Any], status: str) -> str:
    ref = r.get("amici_llh")
    llh_cell = _llh_err(r.get("sciflat_llh"), ref)
    llh_cell += f" ({_llh_err(r.get('amici_default_llh'), ref)})"
    grad_cell = _fmt_err(_rel(r.get("sciflat_grad"), r.get("amici_grad")))
    grad_cell += (
        f" ({_fmt_err(_rel(r.get('amici_default_grad'), r.get('amici_grad')))})"
    )
    times = []
    for kind in ("llh", "grad"):
        s, a = r.get(f"sciflat_{kind}_ms"), r.get(f"amici_{kind}_ms")
        ratio = f" ({s / a:.1f}×)" if s and a else ""
        each = r.get("ratios", {}).get(kind, [])
        if len(each) > 1:  # the median over processes, then each process's range
            ratio = f" ({s / a:.1f}×; {min(each):.1f}–{max(each):.1f})"
        times.append(f"{_fmt_ms(s)} / {_fmt_ms(a)}{ratio}")
    first = "—"
    if "sciflat_read_s" in r:
        first = f"{r['sciflat_read_s'] + r['sciflat_first_llh_s']:.1f} s"
        if "sciflat_first_grad_s" in r:
            first += f" + {r['sciflat_first_grad_s']:.1f} s"
    build = r.get("amici_build_s")
    load = r.get("amici_load_s")
    amici_first = f"{build:.0f} s / {load:.2f} s" if build is not None and load else "—"
    notes = [] if status == "ok" else [status]
    if "sciflat_error" in r:
        notes = [r["sciflat_error"]]
    if r.get("amici_method", "forward") != "forward":
        notes.append(f"AMICI's gradient: {r['amici_method']}")
    if r.get("amici_max_steps"):
        notes.append(
            f"AMICI timed with max_steps {r['amici_max_steps']:.0e} (its defaults fail)"
        )
    note = "; ".join(notes)
    return (
        f"| {name} | {llh_cell} | {grad_cell} | {times[0]} | {times[1]} | {first} | "
        f"{amici_first} | {note} |"
    )


def against_amici(args: argparse.Namespace) -> None:
    try:
        import amici
    except ImportError:
        print(
            "AMICI is not installed: `--amici` compares with it where it is "
            "(apt-get install swig libopenblas-dev libhdf5-serial-dev; pip install "
            "amici). Nothing measured."
        )
        return
    dirs = [pathlib.Path(args.dir)]
    extra = args.extra or os.environ.get("SCIFLAT_PETAB_EXTRA", "")
    dirs += [pathlib.Path(d) for d in extra.split(":") if d]
    yamls = _problems(dirs, args.only)
    models = pathlib.Path(args.amici_models)
    models.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for yaml in yamls:
        name = yaml.parent.name
        built = models / f"{name}.build.json"
        if not built.is_file():
            print(f"{name}: building AMICI's model ...", file=sys.stderr, flush=True)
            rec, status = _child(
                ["--build-one", str(yaml), "--amici-models", str(models)],
                args.build_timeout,
            )
            if status != "ok":
                results[name] = {"status": f"AMICI build: {status}"}
                print(f"{name}: AMICI build: {status}", file=sys.stderr, flush=True)
                continue
        record: dict[str, Any] = {
            "amici_build_s": json.loads(built.read_text())["build_s"]
        }
        print(f"{name}: measuring ...", file=sys.stderr, flush=True)
        child = [
            "--one",
            str(yaml),
            "--amici-models",
            str(models),
            "--repeats",
            str(args.repeats),
            "--seconds",
            str(args.seconds),
            "--block",
            str(args.block),
            *(["--amici-only"] if args.amici_only else []),
            *(["--values-only"] if args.values_only else []),
            "--explicit-first",
            args.explicit_first,
            *(["--grad-tol", *map(str, args.grad_tol)] if args.grad_tol else []),
            "--amici-sensitivities",
            args.amici_sensitivities,
        ]
        rec, status = _child(child, args.timeout)
        runs = [rec]
        while status == "ok" and len(runs) < args.processes:
            again, status = _child(child, args.timeout)
            runs.append(again)
        rec = _over_processes(runs) if status == "ok" else rec
        record.update(rec)
        record["status"] = status
        results[name] = record
        print(_row(name, record, status), file=sys.stderr, flush=True)
        if args.json:  # after each problem: a run stopped early keeps what it measured
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    _table(results, amici.__version__, args.repeats)


def _table(results: dict[str, dict[str, Any]], version: str, repeats: int) -> None:
    if any("amici_fd_grad" in r for r in results.values()):
        print("problem\tAMICI llh (rtol 1e-12, atol 1e-14)\tat AMICI's defaults\t")
        for name, r in results.items():
            fd = _fmt_err(_rel(r.get("amici_grad"), r.get("amici_fd_grad")))
            print(
                f"{name}\t{r.get('amici_llh')!r}\t{r.get('amici_default_llh')!r}"
                f"\tgradient vs central differences: {fd}\t{r['status']}"
            )
        return
    blocks = sorted({r["block"] for r in results.values() if "block" in r})
    each = (
        f", each call {'/'.join(map(str, blocks))} times in a row, the first not timed"
        if blocks
        else ""
    )
    print(
        f"\nAMICI {version}; per call: medians of up to {repeats} "
        f"interleaved rounds at the nominal parameters{each}\n"
    )
    print(
        "| problem | llh: rel. error (AMICI's) | gradient: rel. error (AMICI's) | "
        "llh, ms: sciflat / "
        "AMICI | gradient, ms: sciflat / AMICI | first call: sciflat (read + llh + "
        "gradient) | AMICI: build once / load | |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, record in results.items():
        print(_row(name, record, record["status"]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument(
        "--plain",
        action="store_true",
        help="Boehm: also time the derivatives without the custom JVP of the solves",
    )
    parser.add_argument(
        "--amici", action="store_true", help="every problem, against AMICI"
    )
    parser.add_argument("--dir", default=str(_SHARED), help="the problems' folder")
    parser.add_argument(
        "--extra", help="more problem folders, ':'-separated ($SCIFLAT_PETAB_EXTRA)"
    )
    parser.add_argument(
        "--only", nargs="*", default=[], help="these problems only, in this order"
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds per problem"
    )
    parser.add_argument("--build-timeout", type=float, default=3600)
    parser.add_argument(
        "--seconds", type=float, default=60, help="timing rounds per problem, at most"
    )
    parser.add_argument(
        "--amici-models",
        default=os.environ.get("SCIFLAT_AMICI_MODELS", str(_MODELS)),
        help="where AMICI's built models are kept",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="measure each problem in this many fresh processes: per-call times are "
        "the medians over them, with each process's ratio's range",
    )
    parser.add_argument("--json", help="also write the records to this file")
    parser.add_argument("--from-json", help="only print the table of these records")
    parser.add_argument(
        "--amici-only", action="store_true", help="AMICI's reference values only"
    )
    parser.add_argument(
        "--grad-tol",
        nargs=2,
        type=float,
        metavar=("RTOL", "ATOL"),
        help="sciflat's tolerances for the gradient (default: its defaults)",
    )
    parser.add_argument(
        "--values-only",
        action="store_true",
        help="the llh and its time only: no sensitivities (hundreds of parameters)",
    )
    parser.add_argument(
        "--amici-sensitivities",
        choices=("forward", "adjoint"),
        default="forward",
        help="AMICI's gradient (the reference and the timed one): forward "
        "sensitivities (default) or its adjoint (hundreds of parameters)",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=_BLOCK,
        help="--amici: each call this many times in a row in a round, the first not "
        "timed (1: every call timed, the calls of a round shuffled)",
    )
    parser.add_argument(
        "--explicit-first",
        choices=sorted(_EXPLICIT_FIRST),
        default="default",
        help="--amici: sciflat's BDF(explicit_first=...): None (default), True "
        "(always), False (never)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--build-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_one:
        build_amici(pathlib.Path(args.build_one), pathlib.Path(args.amici_models))
    elif args.one:
        one_problem(
            pathlib.Path(args.one),
            pathlib.Path(args.amici_models),
            args.repeats,
            args.seconds,
            args.amici_only,
            None if args.grad_tol is None else tuple(args.grad_tol),
            args.values_only,
            args.amici_sensitivities,
            args.block,
            _EXPLICIT_FIRST[args.explicit_first],
        )
    elif args.from_json:
        _table(json.loads(pathlib.Path(args.from_json).read_text()), "", args.repeats)
    elif args.amici:
        against_amici(args)
    else:
        boehm(args.repeats, args.starts, args.plain)
