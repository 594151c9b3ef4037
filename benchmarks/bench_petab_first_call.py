"""Where a PEtab problem's first call goes: reading (the tables and the SBML model into
SymPy), compiling the formulas to JAX, tracing `nll`, XLA's compilation, and the first
run; then the median of later calls and the llh against a reference; then what a user
meets, the problem read again: the first `problem.nll(p)`, the first
`jax.grad(problem.nll)(p)` and how many XLA programs of `nll` they compiled.

Each problem in a child process of its own (a fresh JAX: nothing compiled before),
at the nominal parameters, with sciflat's defaults:

    python benchmarks/bench_petab_first_call.py
    python benchmarks/bench_petab_first_call.py --only Lang_PLOSComputBiol2024
    python benchmarks/bench_petab_first_call.py --extra /path/to/Benchmark-Models
    python benchmarks/bench_petab_first_call.py --cache /tmp/jax-cache  # twice

`--dir` (default `../shared/data/petab` beside the repository) and `--extra` hold
problem folders `NAME/NAME.yaml` (or one YAML file of another name); the reference
llh is read from `--refs` files (lines `NAME<tab>llh`, or the `| NAME | llh |` rows
of a README's table).
"""

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import time


_HERE = pathlib.Path(__file__).resolve()
_SHARED = _HERE.parents[2] / "shared" / "data" / "petab"


def child(yaml: str, cache: str | None) -> dict:
    import logging

    import jax

    jax.config.update("jax_enable_x64", True)
    if cache:  # JAX's persistent compilation cache, read back by a later process
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    programs = []  # the XLA programs compiled for `nll` and its gradient

    class Log(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Finished XLA compilation of jit(_nll)"):
                programs.append(message)

    logging.getLogger("jax").addHandler(Log())
    logging.getLogger("jax").propagate = False
    jax.config.update("jax_log_compiles", True)
    import sciflat
    from sciflat._petab import formulas, problem, sbml, tables

    _, sympy, yaml_mod, petab = problem._imports()
    t0 = time.perf_counter()
    files = tables.read_files(yaml, yaml_mod, petab)
    ode = sbml.read_sbml(files.sbml)
    tabs = tables.read_tables(files, ode)
    t1 = time.perf_counter()
    formulas.compile_formulas(sympy, ode, tabs)
    t2 = time.perf_counter()
    pr = sciflat.petab_problem(yaml)  # again, whole: what a user calls
    t3 = time.perf_counter()
    lowered = jax.jit(pr._nll).lower(pr.nominal)
    t4 = time.perf_counter()
    compiled = lowered.compile()
    t5 = time.perf_counter()
    nll = float(compiled(pr.nominal))
    t6 = time.perf_counter()
    calls = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(compiled(pr.nominal))
        calls.append(time.perf_counter() - t)
    llh = -nll - float(pr.log_prior(pr.nominal))
    # What a user calls: the problem's `nll`, then `jax.grad` of it, each the
    # first time (trace, compile, run), the problem read again so nothing is shared
    # with the steps above.
    fresh = sciflat.petab_problem(yaml)
    del programs[:]
    t7, c7 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fresh.nll(fresh.nominal))
    t8, c8 = time.perf_counter(), time.process_time()
    jax.block_until_ready(jax.grad(fresh.nll)(fresh.nominal))
    t9, c9 = time.perf_counter(), time.process_time()
    return {
        "first_nll": t8 - t7,
        "first_grad": t9 - t8,
        "first_cpu": (c8 - c7, c9 - c8),
        "programs": len(programs),
        "read": t1 - t0,
        "formulas": t2 - t1,
        "petab_problem": t3 - t2,
        "trace": t4 - t3,
        "compile": t5 - t4,
        "run": t6 - t5,
        "call": statistics.median(calls),
        "llh": llh,
        "species": len(pr.species),
        "reactions": len(pr.ode.rates),
    }


def refs(paths: list[str]) -> dict[str, float]:
    out = {}
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            m = re.match(r"\|?\s*(\w+_\w+)\s*[|\t]\s*([−\-]?\d+\.\d+)", line)
            if m:
                try:
                    out.setdefault(m.group(1), float(m.group(2).replace("−", "-")))
                except ValueError:
                    pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=str(_SHARED))
    parser.add_argument("--extra", nargs="*", default=[])
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--refs", nargs="*", default=[str(_SHARED / "README.md")])
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--cache",
        help="JAX's persistent compilation cache (a folder): run twice, the second "
        "run reads what the first compiled",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(child(args.one, args.cache)))
        return
    ref = refs([p for p in args.refs if pathlib.Path(p).exists()])
    yamls = {}
    for folder in [args.dir, *args.extra]:
        for sub in sorted(p for p in pathlib.Path(folder).iterdir() if p.is_dir()):
            found = sorted(sub.glob("*.yaml"))
            named = [y for y in found if y.stem == sub.name]
            if not named and len(found) != 1:
                continue  # Bertozzi's is `problem.yaml`, alone in its folder
            if not args.only or sub.name in args.only:
                yamls[sub.name] = (named or found)[0]
    print(
        "| problem | species | reactions | read, s | formulas, s | trace, s | "
        "compile, s | first run, s | per call, ms | llh | rel. error | "
        "first nll, s (CPU) | first gradient, s (CPU) | programs |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, y in yamls.items():
        cmd = [sys.executable, str(_HERE), "--one", str(y)]
        if args.cache:
            cmd += ["--cache", args.cache]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.timeout
            )
            r = json.loads(done.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as e:
            print(f"| {name} | failed: {type(e).__name__} |", flush=True)
            continue
        want = ref.get(name)
        err = f"{abs(r['llh'] - want) / abs(want):.1e}" if want else "—"
        print(
            f"| {name} | {r['species']} | {r['reactions']} | {r['read']:.1f} | "
            f"{r['formulas']:.1f} | {r['trace']:.1f} | {r['compile']:.1f} | "
            f"{r['run']:.2f} | {1e3 * r['call']:.1f} | {r['llh']:.8f} | {err} | "
            f"{r['first_nll']:.1f} ({r['first_cpu'][0]:.1f}) | "
            f"{r['first_grad']:.1f} ({r['first_cpu'][1]:.1f}) | {r['programs']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
