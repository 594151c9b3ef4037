"""NIST StRD nonlinear regression: `sciflat.least_squares` (defaults) against lmfit.

For every StRD file in `tests/data/nist_strd/` (or the ones named), from NIST's Start 1
and Start 2: correct significant digits (LRE, the smallest over the parameters) of the
values and of the standard errors against NIST's certified ones, and the time per fit.
lmfit runs `lmfit.minimize` with its defaults (MINPACK's Levenberg–Marquardt, a finite
difference Jacobian), as its own NIST tests do; sciflat runs `least_squares` with its
defaults (`method="auto"`: MINPACK's Levenberg–Marquardt, as lmfit, since these fits have
no bounds; a JAX forward-mode Jacobian). Both in one process,
interleaved fit by fit, after one warm-up fit each (compilation excluded); medians over
`--repeats`.

    python benchmarks/bench_nist.py                  # about a minute
    python benchmarks/bench_nist.py --repeats 3 Misra1a Chwirut2
    python benchmarks/bench_nist.py path/to/BoxBOD.dat   # any StRD file
    python benchmarks/bench_nist.py --sync-dispatch      # JAX's CPU async dispatch off

`--sync-dispatch` sets `jax_cpu_enable_async_dispatch` to False before JAX starts: JAX
then runs each compiled call on the calling thread instead of handing it to a worker
thread that has to be woken (tens of microseconds per call on a host-driven loop as
MINPACK's). It is a setting of the user's program, not sciflat's; its figures go beside
the default's.
"""

import argparse
import pathlib
import statistics
import sys
import time

import jax
import lmfit
import numpy as np


jax.config.update("jax_enable_x64", True)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import nist  # noqa: E402


def fit_lmfit(problem: nist.Problem, start: int):
    params = lmfit.Parameters()
    for name, value in problem.start(start).items():
        params.add(name, value=value)

    def residuals(params, x, y):  # NumPy, as an lmfit user writes it
        values = {k: params[k].value for k in problem.names}
        return problem.f(values, x, numpy=True) - y

    return lmfit.minimize(residuals, params, args=(problem.x, problem.y))


def summary(values, stderr, problem: nist.Problem) -> tuple[float, float]:
    value_digits = min(
        nist.digits(v, c) for v, c in zip(values, problem.certified, strict=True)
    )
    stderr_digits = min(
        nist.digits(s, c) if s is not None and np.isfinite(s) else 0.0
        for s, c in zip(stderr, problem.certified_stderr, strict=True)
    )
    return value_digits, stderr_digits


def run_one(problem: nist.Problem, start: int, repeats: int) -> dict:
    ours = lambda: nist.fit(problem, start)
    theirs = lambda: fit_lmfit(problem, start)
    # Warm-up, timed: sciflat's first fit of a problem compiles its functions (Start 2
    # then reuses them); lmfit's first fit is as fast as its others.
    t0 = time.perf_counter()
    result = ours()
    t1 = time.perf_counter()
    reference = theirs()
    first = (t1 - t0, time.perf_counter() - t1)
    times: dict[str, list[float]] = {"sciflat": [], "lmfit": []}
    for _ in range(repeats):
        for name, fn in (("sciflat", ours), ("lmfit", theirs)):
            t0 = time.perf_counter()
            out = fn()
            if name == "sciflat":
                jax.block_until_ready(out.p)
            times[name].append(time.perf_counter() - t0)
    ours_digits = summary(
        [float(result.model[b]) for b in problem.names],
        [float(result.stderr[b]) for b in problem.names],
        problem,
    )
    theirs_digits = summary(
        [reference.params[b].value for b in problem.names],
        [reference.params[b].stderr for b in problem.names],
        problem,
    )
    t_ours, t_theirs = (statistics.median(times[k]) for k in ("sciflat", "lmfit"))
    return dict(
        name=problem.name,
        start=start,
        ours=ours_digits,
        theirs=theirs_digits,
        t_ours=t_ours,
        t_theirs=t_theirs,
        first=first,
        nfev=(result.n_evaluations, reference.nfev),
        status=result.status,
    )


def per_call_us(problem: nist.Problem, host_us: float, calls: int = 1000) -> float:
    """Median µs of one jitted residual call after `host_us` of other host work (as
    MINPACK's own step between two calls): JAX's CPU runtime runs a computation
    estimated at under 1000 flops inline, and hands a larger one to a worker thread,
    which sleeps between calls of a host-driven loop and must be woken."""
    values = np.array(problem.starts[1])
    residuals = problem.residuals
    named = lambda b: {k: b[i] for i, k in enumerate(problem.names)}
    f = jax.jit(lambda b, x, y: residuals(named(b), x, y))
    x, y = jax.numpy.asarray(problem.x), jax.numpy.asarray(problem.y)
    np.asarray(f(values, x, y))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < host_us * 1e-6:
            pass
        t1 = time.perf_counter()
        np.asarray(f(values, x, y))
        times.append(time.perf_counter() - t1)
    return 1e6 * statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("problems", nargs="*", help="names in tests/data or .dat paths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sync-dispatch",
        action="store_true",
        help="run JAX's CPU computations on the calling thread (no async dispatch)",
    )
    args = parser.parse_args(argv)
    if args.sync_dispatch:  # read when JAX's CPU backend starts, i.e. on first use
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    print(
        f"JAX's CPU async dispatch: {'off' if args.sync_dispatch else 'on (default)'}"
    )
    problems = (
        [nist.read(p) for p in args.problems] if args.problems else nist.problems()
    )
    for p in [q for q in problems if q.name in ("Misra1a", "Chwirut1")]:
        calls = ", ".join(
            f"{per_call_us(p, us):.0f} µs after {us} µs" for us in (0, 100)
        )
        print(
            f"one jitted {p.name} residual call ({len(p.x)} points): {calls} of host work"
        )
    rows = [run_one(p, s, args.repeats) for p in problems for s in (1, 2)]
    print(
        "| problem | start | digits sciflat | digits lmfit | stderr digits sciflat "
        "| stderr digits lmfit | evaluations sciflat / lmfit | ms per fit sciflat "
        "| ms per fit lmfit | time ratio sciflat / lmfit | first fit ms sciflat / lmfit |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['name']} | {r['start']} | {r['ours'][0]:.1f} | {r['theirs'][0]:.1f} "
            f"| {r['ours'][1]:.1f} | {r['theirs'][1]:.1f} | {r['nfev'][0]} / {r['nfev'][1]} "
            f"| {1e3 * r['t_ours']:.2f} | {1e3 * r['t_theirs']:.2f} "
            f"| {r['t_ours'] / r['t_theirs']:.2f} "
            f"| {1e3 * r['first'][0]:.0f} / {1e3 * r['first'][1]:.1f} |"
        )
    col = lambda key, i: [r[key][i] for r in rows]
    ratios = [r["t_ours"] / r["t_theirs"] for r in rows]
    print(
        f"\nmedian digits: sciflat {np.median(col('ours', 0)):.1f}, lmfit "
        f"{np.median(col('theirs', 0)):.1f}; minimum: sciflat {min(col('ours', 0)):.1f}, "
        f"lmfit {min(col('theirs', 0)):.1f}"
    )
    print(
        f"median stderr digits: sciflat {np.median(col('ours', 1)):.1f}, lmfit "
        f"{np.median(col('theirs', 1)):.1f}; minimum: sciflat {min(col('ours', 1)):.1f}, "
        f"lmfit {min(col('theirs', 1)):.1f}"
    )
    print(
        f"time ratio sciflat / lmfit: median {np.median(ratios):.2f}, "
        f"max {max(ratios):.2f}"
    )


if __name__ == "__main__":
    main()
