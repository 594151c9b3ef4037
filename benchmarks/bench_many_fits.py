"""Many fits at once: the device fit and batches of it, against lmfit and SciPy's loop.

Five tables (docs/many_fits.md):

1. `--single`: one small fit after compilation, per NIST StRD problem and start:
   `least_squares(method="device")` against lmfit's default fit (MINPACK, finite
   differences, NumPy residuals) and sciflat's SciPy path (`method="lm"`), interleaved
   fit by fit in one process, medians; and the first (compiling) fit of each.
2. `--many`: K fits of one structure as one program (`least_squares_batch`), for
   (a) NIST Misra1a fitted to K noisy replicates of its data and (b) Gpufit's 2-D
   Gaussian spot (5 parameters, 11 × 11 pixels, Poisson noise, starts perturbed by up
   to 20%): the compile time, the time of the batch after compilation, fits per
   second, and the ratio against a loop of lmfit fits and against a loop of sciflat's
   SciPy-path fits, both timed on `--loop` fits (interleaved) and extrapolated to K.

    python benchmarks/bench_many_fits.py --single --repeats 20
    python benchmarks/bench_many_fits.py --many --ks 10 100 1000 10000
    python benchmarks/bench_many_fits.py --many --cases spot --ks 100000 --loop 50

3. `--devices`, with `--cpu-devices N` (JAX's CPU as N devices, one thread each): the
   same batches on one device (`shard=False`) and split over the N (`shard=True`),
   interleaved in one process, medians, and whether both give the same fits.

    python benchmarks/bench_many_fits.py --devices --cpu-devices 2 --ks 1000 10000

4. `--runtime [PROBLEM ...]`: what XLA:CPU's way of running a program costs one small
   fit (default DanWood, from Start 2): its program with the history of costs as
   built and capped so that no buffer exceeds 512 bytes (`runtime` says why).
   Under `taskset -c 0` (one core), the same without the other threads.

    python benchmarks/bench_many_fits.py --runtime --repeats 300

5. `--floor`: what one turn of a batch costs a slot, piece by piece (the residuals
   and Jacobian, `JᵀJ` and `Jᵀf`, the step, the acceptance; and MINPACK's QR and SVD
   for comparison), each timed alone at the pool's size.

    python benchmarks/bench_many_fits.py --floor --repeats 20

6. `--cpufit [--max-k K]`: Gpufit's own benchmark (GAUSS_2D, 5 × 5 pixels): Cpufit,
   built here from `../shared/anchors/gpufit/` (float32 and float64, one thread), and
   `least_squares_batch` on the same data and starts, K = 10 ... `--max-k`,
   interleaved in one process.

    python benchmarks/bench_many_fits.py --cpufit --max-k 100000

7. `--nist-batch`: NIST's problems from both starts through the batch's default
   algorithm: the digits, and which fits were run again with `MinpackQR`.

    python benchmarks/bench_many_fits.py --nist-batch

8. `--evaluations --ks K --loop N`: why a spot takes its evaluations: the batch at
   sciflat's tolerances and at lmfit's, MINPACK (`leastsq`, exact Jacobian) and
   lmfit's loop on the first N spots, and what the fits at `max_nfev` reach.

    python benchmarks/bench_many_fits.py --evaluations --ks 10000 --loop 300

Each figure is a median over `--repeats` (the batch: `--batch-repeats`) runs in one
process; on a shared machine the ratios move by tens of percent: say so with them.
"""

import argparse
import functools
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import lmfit
import numpy as np


jax.config.update("jax_enable_x64", True)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import nist  # noqa: E402

import sciflat  # noqa: E402


def _lmfit(residuals_np, names, start, data, max_nfev=None):
    params = lmfit.Parameters()
    for name, value in zip(names, start, strict=True):
        params.add(name, value=float(value))
    return lmfit.minimize(residuals_np, params, args=data, max_nfev=max_nfev)


def _medians(calls: dict, repeats: int, clock=time.perf_counter) -> dict[str, float]:
    """Seconds of each call (`jax.block_until_ready` of what it returns), the calls
    interleaved `repeats` times, medians (`clock`: wall time, or the process's CPU
    time, `time.process_time`)."""
    times: dict[str, list[float]] = {key: [] for key in calls}
    for call in calls.values():
        jax.block_until_ready(call())  # compiled
    for _ in range(repeats):
        for key, call in calls.items():
            t0 = clock()
            jax.block_until_ready(call())
            times[key].append(clock() - t0)
    return {key: statistics.median(v) for key, v in times.items()}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    out = fn()
    if hasattr(out, "p"):
        jax.block_until_ready(out.p)
    return time.perf_counter() - t0


#
# 1. One small fit
#


def single(repeats: int) -> None:
    print(
        "| problem | start | device ms | lmfit ms | SciPy path (lm) ms | device / lmfit "
        "| SciPy path / lmfit | device digits | first device fit s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for p in nist.problems():
        names = p.names

        def res_np(params, x, y, p=p):
            return p.f({k: params[k].value for k in p.names}, x, numpy=True) - y

        for s in (1, 2):
            variants = {
                "device": lambda p=p, s=s: nist.fit(p, s, method="device"),
                "lmfit": lambda p=p, s=s, r=res_np: _lmfit(
                    r, p.names, p.starts[s - 1], (p.x, p.y)
                ),
                "lm": lambda p=p, s=s: nist.fit(p, s, method="lm"),
            }
            first = _timed(variants["device"])
            for fn in variants.values():
                fn()
            times: dict[str, list[float]] = {k: [] for k in variants}
            for _ in range(repeats):
                for k, fn in variants.items():
                    times[k].append(_timed(fn))
            med = {k: statistics.median(v) for k, v in times.items()}
            result = variants["device"]()
            digits = min(
                nist.digits(float(result.model[b]), c)
                for b, c in zip(names, p.certified, strict=True)
            )
            ratio = med["device"] / med["lmfit"]
            ratios.append(ratio)
            print(
                f"| {p.name} | {s} | {1e3 * med['device']:.3f} | {1e3 * med['lmfit']:.3f} "
                f"| {1e3 * med['lm']:.3f} | {ratio:.2f} | {med['lm'] / med['lmfit']:.2f} "
                f"| {digits:.1f} | {first:.2f} |",
                flush=True,
            )
    print(f"\nmedian device / lmfit: {np.median(ratios):.2f} (max {max(ratios):.2f})")


#
# 2. Many fits
#


def misra_case(k: int, rng):
    p = nist.read("Misra1a")
    ys = p.y + 0.1 * rng.standard_normal((k, len(p.y)))
    starts = np.tile(np.array(p.starts[1]), (k, 1))

    def res_np(params, x, y):
        return p.f({n: params[n].value for n in p.names}, x, numpy=True) - y

    return dict(
        residuals=p.residuals,
        model=p.start(2),
        names=p.names,
        args=(p.x,),
        data=ys,
        starts=starts,
        res_np=res_np,
        x=p.x,
        options={},  # the defaults of each: max_nfev 2000 (n + 1) for all three
    )


SIZE = 11
_GRID = np.stack(np.meshgrid(np.arange(SIZE), np.arange(SIZE), indexing="ij"))
GRID = _GRID.reshape(2, -1).astype(np.float64)


def spot(m, xy, z):
    r2 = (xy[0] - m["x0"]) ** 2 + (xy[1] - m["y0"]) ** 2
    return m["a"] * jnp.exp(-r2 / (2 * m["s"] ** 2)) + m["b"] - z


def spot_case(k: int, rng):
    """Gpufit's 2-D Gaussian example: amplitude 10, offset 10, width 1, centre
    (5, 5) ± 0.5, Poisson noise; starts the truth perturbed by up to 20%. Columns in
    `p`'s order: a dict's keys sorted (a, b, s, x0, y0)."""
    names = ("a", "b", "s", "x0", "y0")
    truth = np.tile(np.array([10.0, 10.0, 1.0, 5.0, 5.0]), (k, 1))
    truth[:, 3:5] += rng.uniform(-0.5, 0.5, (k, 2))
    a, b, width, x0, y0 = (truth[:, i : i + 1] for i in range(5))
    r2 = (GRID[0] - x0) ** 2 + (GRID[1] - y0) ** 2
    mean = a * np.exp(-r2 / (2 * width**2)) + b
    data = rng.poisson(mean).astype(np.float64)
    starts = truth * (1 + rng.uniform(-0.2, 0.2, truth.shape))

    def res_np(params, xy, z):
        v = {n: params[n].value for n in names}
        r2 = (xy[0] - v["x0"]) ** 2 + (xy[1] - v["y0"]) ** 2
        return v["a"] * np.exp(-r2 / (2 * v["s"] ** 2)) + v["b"] - z

    return dict(
        residuals=spot,
        model=dict(zip(names, starts[0], strict=True)),
        names=names,
        args=(GRID,),
        data=data,
        starts=starts,
        res_np=res_np,
        x=GRID,
        # As Gpufit's benchmarks cap the iterations (its default: 25): a few of
        # these low-signal spots wander for hundreds of evaluations, and a batch runs
        # as long as its slowest fit. The same cap for all three.
        options={"max_nfev": 100},
    )


def case_options(name: str) -> dict:
    make = misra_case if name == "misra" else spot_case
    return make(1, np.random.default_rng(0))["options"]


def loop_per_fit(case, n: int, repeats: int) -> dict[str, float]:
    """Seconds per fit of a loop of lmfit fits and of sciflat's SciPy-path fits
    (`least_squares` defaults: MINPACK here), interleaved fit by fit."""
    names, x = case["names"], case["x"]
    as_model = lambda s: dict(zip(names, map(float, s), strict=True))
    lm = lambda i: sciflat.least_squares(
        case["residuals"],
        as_model(case["starts"][i]),
        args=(x, case["data"][i]),
        progress=False,
        **case["options"],
    )
    # lmfit counts the n + 1 calls of each finite-difference Jacobian: its cap is
    # (n + 1) times the others' for the same number of iterations (as its default).
    cap = case["options"].get("max_nfev")
    cap = None if cap is None else cap * (len(names) + 1)
    lf = lambda i: _lmfit(
        case["res_np"], names, case["starts"][i], (x, case["data"][i]), cap
    )
    lm(0), lf(0)
    per: dict[str, list[float]] = {"lmfit": [], "scipy": []}
    for _ in range(repeats):
        t = {"lmfit": 0.0, "scipy": 0.0}
        for i in range(n):
            for name, fn in (("lmfit", lf), ("scipy", lm)):
                t[name] += _timed(lambda fn=fn, i=i: fn(i))
        for name in per:
            per[name].append(t[name] / n)
    return {k: statistics.median(v) for k, v in per.items()}


def _batch(case: dict, **kwargs) -> sciflat.BatchResult:
    """The case's K fits as one `least_squares_batch`."""
    return sciflat.least_squares_batch(
        case["residuals"],
        case["model"],
        args=case["args"],
        batch_args=(case["data"],),
        starts=case["starts"],
        progress=False,
        **case["options"],
        **kwargs,
    )


# lmfit's own defaults for `leastsq`, for the spots' same-tolerance row.
LMFIT_TOLERANCES = dict(ftol=1.5e-8, xtol=1.5e-8, gtol=0.0)


def many(cases: list[str], ks: list[int], loop: int, repeats: int, chunk) -> None:
    """Each K: the batch (sciflat's defaults; for the spots also at lmfit's
    tolerances), and the loops of `loop` fits timed after each repeat of the batches,
    in one process; medians of `repeats`."""
    print(f"JAX devices: {jax.devices()}")
    for name in cases:
        make = misra_case if name == "misra" else spot_case
        loop_case = make(loop, np.random.default_rng(0))
        print(f"\n### {name}: options {case_options(name)}")
        print(
            "| K | tolerances | compile s (CPU) | batch s | fits/s | lmfit ms a fit "
            "| lmfit loop / batch | SciPy path ms a fit | SciPy loop / batch | converged "
            "| evaluations median / max |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        variants = {"sciflat's (1e-12)": {}}
        if name == "spot":
            variants["lmfit's (1.5e-8)"] = LMFIT_TOLERANCES
        for k in ks:
            case = make(k, np.random.default_rng(1))
            runs = {
                label: functools.partial(_batch, case, chunk_size=chunk, **kw)
                for label, kw in variants.items()
            }
            first = {}
            for label, run in runs.items():
                t0 = time.process_time()
                run()
                first[label] = time.process_time() - t0
            times: dict[str, list[float]] = {label: [] for label in runs}
            cpu: dict[str, list[float]] = {label: [] for label in runs}
            loops: dict[str, list[float]] = {"lmfit": [], "scipy": []}
            outs = {}
            for _ in range(repeats):
                for label, run in runs.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    outs[label] = run()
                    times[label].append(time.perf_counter() - t0)
                    cpu[label].append(time.process_time() - c0)
                for key, t in loop_per_fit(loop_case, loop, 1).items():
                    loops[key].append(t)
            per = {key: statistics.median(v) for key, v in loops.items()}
            for label, out in outs.items():
                batch = statistics.median(times[label])
                # CPU seconds of the first call less a later one's.
                compile_s = max(first[label] - statistics.median(cpu[label]), 0.0)
                print(
                    f"| {k} | {label} | {compile_s:.1f} | {batch:.3f} | {k / batch:,.0f} "
                    f"| {1e3 * per['lmfit']:.2f} | {k * per['lmfit'] / batch:.0f}× "
                    f"| {1e3 * per['scipy']:.2f} | {k * per['scipy'] / batch:.0f}× "
                    f"| {int(out.converged.sum())} "
                    f"| {int(np.median(out.n_evaluations))} / "
                    f"{int(out.n_evaluations.max())} |",
                    flush=True,
                )


def devices(cases: list[str], ks: list[int], repeats: int) -> None:
    """The batch on one device against the batch split over every device."""
    n = jax.device_count()
    print(f"JAX devices: {jax.devices()}")
    if n < 2:
        raise SystemExit("--devices needs several devices: add --cpu-devices N.")
    print(
        f"| case | K | one device s | {n} devices s | speed-up | same fits (1e-10) |\n"
        "|---|---:|---:|---:|---:|---|"
    )
    for name in cases:
        make = misra_case if name == "misra" else spot_case
        for k in ks:
            case = make(k, np.random.default_rng(1))
            run = lambda shard, case=case: _batch(case, shard=shard)
            out = {shard: run(shard) for shard in (False, True)}  # compiles
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(repeats):
                for shard in (False, True):
                    times[shard].append(_timed(lambda s=shard, r=run: r(s)))
            one, many_ = (statistics.median(times[s]) for s in (False, True))
            same = np.allclose(out[True].p, out[False].p, rtol=1e-10, atol=0)
            print(
                f"| {name} | {k} | {one:.3f} | {many_:.3f} | {one / many_:.2f}× "
                f"| {'yes' if same else 'NO'} |",
                flush=True,
            )


#
# 4. What XLA:CPU's runtime costs one small fit
#


def runtime(names: list[str], repeats: int) -> None:
    """A small fit's compiled program as `least_squares(method="device")` builds it,
    against the same program with its history of costs capped at 20 entries (the
    default is sized by `max_nfev`: 6,001 floats for 2 parameters). XLA:CPU runs a
    sequence of kernels in order, on one thread, when every buffer it touches is at
    most 512 bytes (or the sequence is a chain, or of at most 8 kernels), and
    otherwise as a graph whose ready kernels it hands to the other threads of its
    pool. With the cap, DanWood's program (6 × 2, the smallest of the eight) has no
    larger buffer; a problem with more than 64 residuals, or whose packed outputs
    exceed 64 floats, has one either way. The programs alone and the whole fits,
    interleaved in one process, medians."""
    from sciflat._device import least_squares as dls

    default_cap = dls._HISTORY_MAX
    print(
        "| problem | m × n | program µs (as built) | program µs (history 20) "
        "| ratio | fit µs (as built) | fit µs (history 20) | ratio |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|"
    )
    for name in names:
        p = nist.read(name)

        def fit(cap, p=p):
            dls._HISTORY_MAX = cap
            try:
                return nist.fit(p, 2, method="device")
            finally:
                dls._HISTORY_MAX = default_cap

        first = fit(default_cap)
        opts, max_nfev = dls.options({}, len(p.names), "runtime")
        start = dls.packed_start(np.array(p.starts[1], np.float64), opts)
        programs = {}
        for cap in (default_cap, 20):
            n_history = min(max_nfev, cap) + 1
            build = dls._build(
                dls.DeviceFit(n_history),
                p.residuals,
                first.re,
                lambda leaves: leaves,
                "forward",
            )
            programs[cap] = jax.jit(build)
            assert np.array_equal(  # the same fit either way
                np.asarray(programs[cap](start, [p.x, p.y])["x"]), first.raw.x
            )
        data = [p.x, p.y]
        calls = {}
        for cap, program in programs.items():
            calls[f"program{cap}"] = lambda g=program, a=start, d=data: g(a, d)["host"]
            calls[f"fit{cap}"] = lambda c=cap, f=fit: f(c).p
        med = {key: 1e6 * t for key, t in _medians(calls, repeats).items()}
        big, small = (f"program{default_cap}", "program20")
        fbig, fsmall = (f"fit{default_cap}", "fit20")
        print(
            f"| {name} | {len(p.y)} × {len(p.names)} | {med[big]:.0f} | {med[small]:.0f} "
            f"| {med[big] / med[small]:.2f} | {med[fbig]:.0f} | {med[fsmall]:.0f} "
            f"| {med[fbig] / med[fsmall]:.2f} |",
            flush=True,
        )


#
# 5. What one turn of a batch costs at least
#


def floor(cases: list[str], repeats: int) -> None:
    """The pieces of one turn of the batch's default algorithm (the normal equations),
    each timed alone under `vmap` at the pool's size for K = 10,000 fits (as
    `least_squares_batch` chooses it), µs a slot, wall time and CPU time of the
    process (both cores): the residuals and the Jacobian (one forward-mode pass);
    `JᵀJ`, `Jᵀf` and the norms of that evaluation (`normal.moments`, what a slot
    keeps of it: timed with the evaluation, as the program fuses them, less the
    evaluation alone); the step (the scaled normal equations, their Cholesky and Moré's
    Levenberg parameter); MINPACK's acceptance and tests; and, for the old design,
    LAPACK's QR and SVD of the scaled Jacobian (`MinpackQR`'s step)."""
    print(
        "| case | m × n | slots | residuals + Jacobian | JᵀJ, Jᵀf, norms | step "
        "| acceptance | sum | MinpackQR's QR + SVD |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for name in cases:
        make = misra_case if name == "misra" else spot_case
        _floor_row(name, make(10_000, np.random.default_rng(1)), repeats)
    print("(µs a slot: wall time / CPU time of the process, medians)")


def _floor_row(name: str, case: dict, repeats: int) -> None:
    # The batch's own pieces (`_device.jacobian.evaluation`, `_normal`, `_lm`),
    # each jitted and vmapped over the slots on its own.
    from sciflat._device import batch as batch_module, least_squares as dls
    from sciflat._device.jacobian import evaluation
    from sciflat._solver import lm as _lm, normal as _normal

    names, (k, m), n = case["names"], case["data"].shape, len(case["names"])
    slots = min(k, batch_module._auto_chunk(m, n) or k)
    xs, data = jnp.asarray(case["starts"][:slots]), jnp.asarray(case["data"][:slots])
    residuals, args = case["residuals"], case["args"]
    opts, _ = dls.options(case["options"], n, "floor")

    _, re = sciflat.destructure(dict(zip(names, case["starts"][0], strict=True)))
    both = evaluation(lambda m, z: residuals(m, *args, z), re, tuple, "forward")
    evaluate = jax.jit(jax.vmap(lambda x, z: both(x, [z])))
    moments = jax.jit(_normal.moments)
    # As in the pool's program: `moments` of the evaluation (written to memory first
    # above 64 residuals).
    evaluated = jax.jit(
        lambda x, z: _normal.moments(*batch_module._written(*evaluate(x, z)))
    )
    start = jax.vmap(lambda x, g, a, ms: _lm.started(x, g, a, opts, 1, ms))
    f, jac = evaluate(xs, data)
    states = jax.jit(start)(xs, *_swap(moments(f, jac)))

    def step(states):
        h, b = _normal.equations(states)
        return _normal.steps(states, h, b)[0]

    step = jax.jit(step)
    steps = step(states)
    x_new = jax.vmap(_lm.trial_point)(states, steps)
    f, jac = evaluate(x_new, data)
    ms, g, a = moments(f, jac)
    accept = jax.jit(
        jax.vmap(lambda st, sp, x, g, a, ms: _lm.accepted(st, sp, x, g, a, opts, ms))
    )
    full = jax.vmap(lambda st: _lm.minpack_step(st, False))
    old = states._replace(f=f, jac=jac, diag=jnp.sqrt(jnp.sum(jac * jac, axis=1)))
    calls = {
        "evaluate": lambda: evaluate(x_new, data),
        "evaluated": lambda: evaluated(x_new, data),
        "step": lambda: step(states),
        "accept": lambda: accept(states, steps, x_new, g, a, ms),
        "qr_svd": functools.partial(jax.jit(full), old),
    }
    wall, cpu = _medians(calls, repeats), _medians(calls, repeats, time.process_time)
    for t in (wall, cpu):
        t["moments"] = t["evaluated"] - t["evaluate"]
    us = lambda key: f"{1e6 * wall[key] / slots:.2f} / {1e6 * cpu[key] / slots:.2f}"
    total = [
        sum(t[key] for key in ("evaluated", "step", "accept")) for t in (wall, cpu)
    ]
    print(
        f"| {name} | {m} × {n} | {slots} | {us('evaluate')} | {us('moments')} "
        f"| {us('step')} | {us('accept')} "
        f"| {1e6 * total[0] / slots:.2f} / {1e6 * total[1] / slots:.2f} "
        f"| {us('qr_svd')} |",
        flush=True,
    )


def _swap(moments):
    """`normal.moments`' `(measure, g, a)` as `started`'s `(g, a, measure)`."""
    ms, g, a = moments
    return g, a, ms


def evaluations(k: int, loop: int) -> None:
    """How many evaluations a spot fit takes, and what the fits at `max_nfev` do: the
    batch with sciflat's defaults and with lmfit's tolerances (`ftol = xtol =
    1.5e-8`, `gtol = 0`), on K spots; on the first `loop` of them lmfit's loop (its
    calls, finite differences included) and MINPACK's `lmder` (SciPy's `leastsq` with
    the exact Jacobian: its evaluations are the batch's) at both tolerances."""
    from scipy.optimize import leastsq

    case = spot_case(k, np.random.default_rng(1))
    names, grid = case["names"], case["x"]
    runs = {
        "defaults (1e-12)": _batch(case),
        "lmfit's tolerances": _batch(case, **LMFIT_TOLERANCES),
    }
    print(
        "| fits | tolerances | evaluations median / mean | at max_nfev=100 "
        "| converged |\n|---|---|---:|---:|---:|"
    )
    for label, out in runs.items():
        nfev = out.n_evaluations
        print(
            f"| batch, K = {k} | {label} | {np.median(nfev):.0f} / {nfev.mean():.1f} "
            f"| {np.mean(nfev >= 100):.1%} | {out.converged.mean():.1%} |"
        )

    def res(x, i):
        return np.asarray(spot(dict(zip(names, x, strict=True)), grid, case["data"][i]))

    jac = jax.jit(
        jax.jacfwd(lambda x, z: spot(dict(zip(names, x, strict=True)), grid, z))
    )
    for label, tol in (("defaults (1e-12)", 1e-12), ("lmfit's tolerances", 1.5e-8)):
        nfev = [
            leastsq(
                res,
                case["starts"][i],
                args=(i,),
                Dfun=lambda x, i: np.asarray(jac(x, case["data"][i])),
                full_output=True,
                ftol=tol,
                xtol=tol,
                gtol=0.0 if tol > 1e-12 else 1e-12,
                maxfev=100,
            )[2]["nfev"]
            for i in range(loop)
        ]
        print(
            f"| MINPACK lmder, first {loop} | {label} | {np.median(nfev):.0f} / "
            f"{np.mean(nfev):.1f} | {np.mean(np.array(nfev) >= 100):.1%} | |"
        )
    calls = [
        _lmfit(
            case["res_np"], names, case["starts"][i], (grid, case["data"][i]), 600
        ).nfev
        for i in range(loop)
    ]
    print(
        f"| lmfit's loop, first {loop} | its defaults (1.5e-8) | calls {np.median(calls):.0f} "
        f"/ {np.mean(calls):.1f} (n + 1 = 6 a Jacobian) | | |"
    )
    out = runs["defaults (1e-12)"]
    capped = out.n_evaluations >= 100
    print("\nmedian fitted (a, b, s, x0, y0), fits at max_nfev vs the others:")
    print("at max_nfev:", np.round(np.median(out.p[capped], axis=0), 3))
    print("the others: ", np.round(np.median(out.p[~capped], axis=0), 3))
    print(
        f"width s < 0.5 px: {np.mean(np.abs(out.p[capped, 2]) < 0.5):.0%} of the fits at "
        f"max_nfev, {np.mean(np.abs(out.p[~capped, 2]) < 0.5):.1%} of the others"
    )


#
# 6. Gpufit's own benchmark: the batch against Cpufit
#

_GPUFIT = pathlib.Path(__file__).resolve().parents[2] / "shared" / "anchors" / "gpufit"


def build_cpufit(where: pathlib.Path, double: bool):
    """Cpufit built from the unchanged copy in `../shared/anchors/gpufit/` (its
    README's `g++` line) in a copy under `where`, float32 as Gpufit ships or float64
    (`-DGPUFIT_DOUBLE` and the README's two edits, in the copy); its binding
    `pycpufit.cpufit` as a module. None, with a message, where it cannot be built."""
    import importlib.util
    import shutil
    import subprocess

    compiler = shutil.which("g++")
    if compiler is None or not _GPUFIT.is_dir():
        print(f"Cpufit skipped: no g++ ({compiler}) or no {_GPUFIT}.")
        return None
    copy = where / ("gpufit64" if double else "gpufit32")
    shutil.copytree(_GPUFIT, copy)
    for path in copy.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    binding = copy / "Cpufit" / "python" / "pycpufit" / "cpufit.py"
    flags = []
    if double:
        flags = ["-DGPUFIT_DOUBLE"]
        source = copy / "Cpufit" / "lm_fit_cpp.cpp"
        source.write_text(
            source.read_text().replace("float& parameter", "REAL& parameter")
        )
        text = binding.read_text().replace("np.float32", "np.float64")
        binding.write_text(text.replace("c_float", "c_double"))
    sources = "cpufit.cpp info.cpp lm_fit.cpp lm_fit_cpp.cpp interface.cpp".split()
    command = [compiler, "-O3", "-march=native", "-std=c++14", "-shared", "-fPIC"]
    command += [*flags, *sources, "-o", "python/pycpufit/libCpufit.so"]
    done = subprocess.run(command, cwd=copy / "Cpufit", capture_output=True, text=True)
    if done.returncode != 0:
        print(f"Cpufit skipped: {' '.join(command)} failed:\n{done.stderr[-2000:]}")
        return None
    name = f"pycpufit{64 if double else 32}"
    spec = importlib.util.spec_from_file_location(name, binding)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpufit_case(k: int, rng):
    """Gpufit's benchmark (`Gpufit_Cpufit_Performance_Comparison.cpp`): GAUSS_2D on
    5 × 5 pixels, amplitude 500, centre (2, 2), width 1, background 10, each times
    U(0.9, 1.1); Gaussian noise at SNR 10 (its formula: standard deviation 17.05);
    starts the truth times U(0.9, 1.1). Parameters in Gpufit's order."""
    truth = np.array([500.0, 2.0, 2.0, 1.0, 10.0]) * rng.uniform(0.9, 1.1, (k, 5))
    pixel = np.arange(25)
    xy = np.stack([pixel % 5, pixel // 5]).astype(np.float64)
    a, x0, y0, w, b = (truth[:, i : i + 1] for i in range(5))
    mean = a * np.exp(-((xy[0] - x0) ** 2 + (xy[1] - y0) ** 2) / (2 * w**2)) + b
    fwtm = 4.292  # Gpufit's full width at a tenth of the maximum, for width 1
    std = 2 * np.pi * 500.0 / fwtm**2 / 10
    data = mean + rng.normal(0.0, std, mean.shape)
    starts = truth * rng.uniform(0.9, 1.1, truth.shape)
    return truth, xy, data, starts


def gauss_2d(p, xy, z):
    r2 = (xy[0] - p[1]) ** 2 + (xy[1] - p[2]) ** 2
    return p[0] * jnp.exp(-r2 / (2 * p[3] ** 2)) + p[4] - z


def cpufit_table(ks: list[int], repeats: int) -> None:
    """Cpufit (one thread) and `least_squares_batch` on the same data and starts,
    interleaved in one process: fits/s (median of `repeats`), the batch's compile
    time, the median absolute error of the centre's x against the truth, the mean
    number of iterations (Cpufit) or evaluations (sciflat), the converged fraction."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cpufit = {
            bits: build_cpufit(pathlib.Path(tmp), double=bits == 64)
            for bits in (32, 64)
        }
        print(
            "| K | fit | fits/s | vs Cpufit float32 | compile s (CPU) | median abs. error "
            "of x0 (px) | iterations / evaluations | converged |\n"
            "|---:|---|---:|---:|---:|---:|---:|---:|"
        )
        for k in ks:
            truth, xy, data, starts = gpufit_case(k, np.random.default_rng(0))
            variants: dict = {}
            for bits, module in cpufit.items():
                if module is None:
                    continue
                dtype = np.float32 if bits == 32 else np.float64
                d, s = data.astype(dtype), starts.astype(dtype)
                variants[f"Cpufit float{bits}, 1 thread"] = lambda m=module, d=d, s=s: (
                    m.fit(d, None, m.ModelID.GAUSS_2D, s, 1e-4, 10)
                )
            normal = sciflat.NormalEquations()
            tol = {"ftol": 1e-4, "xtol": 1e-4, "max_nfev": 11}
            for label, algorithm, dtype, options in (
                ("NormalEquations, float64, defaults", normal, np.float64, {}),
                ("NormalEquations, float64, tol 1e-4, 11 ev.", normal, np.float64, tol),
                ("NormalEquations, float32, tol 1e-4, 11 ev.", normal, np.float32, tol),
                (
                    "MinpackQR, float64, tol 1e-4, 11 ev.",
                    sciflat.MinpackQR(),
                    np.float64,
                    tol,
                ),
            ):
                variants[f"`least_squares_batch`, {label}"] = functools.partial(
                    sciflat.least_squares_batch,
                    gauss_2d,
                    jnp.asarray(starts[0], dtype),
                    args=(xy.astype(dtype),),
                    batch_args=(data.astype(dtype),),
                    starts=starts.astype(dtype),
                    progress=False,
                    algorithm=algorithm,
                    **options,
                )
            first = {}
            for key, call in variants.items():
                c0 = time.process_time()
                _timed(call)
                first[key] = time.process_time() - c0
            times: dict[str, list[float]] = {key: [] for key in variants}
            cpu: dict[str, list[float]] = {key: [] for key in variants}
            out = {}
            for _ in range(repeats):
                for key, call in variants.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    out[key] = call()
                    if hasattr(out[key], "p"):
                        jax.block_until_ready(out[key].p)
                    times[key].append(time.perf_counter() - t0)
                    cpu[key].append(time.process_time() - c0)
            med = {key: statistics.median(v) for key, v in times.items()}
            base = next((med[key] for key in med if "float32" in key), None)
            for key, result in out.items():
                if key.startswith("Cpufit"):
                    p, states, _, iterations, _ = result
                    steps, ok = np.mean(iterations), np.mean(states == 0)
                    compile_s = "—"
                else:
                    p, steps, ok = (
                        result.p,
                        np.mean(result.n_evaluations),
                        np.mean(result.converged),
                    )
                    # CPU seconds of the first call less a later one's.
                    later = statistics.median(cpu[key])
                    compile_s = f"{max(first[key] - later, 0.0):.1f}"
                error = np.median(np.abs(np.asarray(p, np.float64)[:, 1] - truth[:, 1]))
                ratio = f"{base / med[key]:.2f}" if base else "—"
                print(
                    f"| {k:,} | {key} | {k / med[key]:,.0f} | {ratio} | {compile_s} "
                    f"| {error:.4f} | {steps:.2f} | {ok:.3f} |",
                    flush=True,
                )


def nist_batch() -> None:
    """Each NIST problem from each start as a batch of one with the default
    algorithm (`NormalEquations`): the certified digits reached, and whether the fit
    was run again with `MinpackQR` (its normal equations ill-conditioned)."""
    print(
        "| problem | start | value digits | stderr digits | evaluations | steps |\n"
        "|---|---:|---:|---:|---:|---|"
    )
    for p in nist.problems():
        for s in (1, 2):
            batch = sciflat.least_squares_batch(
                p.residuals,
                p.start(1),
                args=(p.x, p.y),
                starts=np.array([p.starts[s - 1]]),
                progress=False,
            )
            values = min(map(nist.digits, batch.p[0], p.certified))
            errors = min(map(nist.digits, batch.stderr_flat[0], p.certified_stderr))
            steps = "MinpackQR (rerun)" if "MinpackQR" in batch.message[0] else "normal"
            print(
                f"| {p.name} | {s} | {values:.1f} | {errors:.1f} "
                f"| {batch.n_evaluations[0]} | {steps} |",
                flush=True,
            )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--many", action="store_true")
    parser.add_argument("--devices", action="store_true")
    parser.add_argument("--runtime", nargs="*", metavar="PROBLEM")
    parser.add_argument("--floor", action="store_true")
    parser.add_argument(
        "--evaluations",
        action="store_true",
        help="the spots' evaluations: the batch, lmfit and MINPACK, two tolerances",
    )
    parser.add_argument(
        "--cpufit",
        action="store_true",
        help="Gpufit's benchmark: the batch against Cpufit built from ../shared",
    )
    parser.add_argument(
        "--nist-batch",
        action="store_true",
        help="NIST from both starts through the batch: digits, QR reruns",
    )
    parser.add_argument(
        "--max-k", type=int, default=1_000_000, help="the largest K of --cpufit"
    )
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="JAX's CPU as this many devices (jax_num_cpu_devices); 0: JAX's default",
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch-repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="*", default=["misra", "spot"])
    parser.add_argument("--ks", nargs="*", type=int, default=[10, 100, 1000, 10000])
    parser.add_argument("--loop", type=int, default=200, help="fits timed per loop")
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="OpenBLAS threads for everything (lmfit's covariance uses them; sciflat's "
        "SciPy path limits them to 1 itself); 0: leave them alone",
    )
    args = parser.parse_args(argv)
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    print(f"jax {jax.__version__}, lmfit {lmfit.__version__}, {jax.default_backend()}")
    if args.blas_threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.blas_threads, user_api="blas")
        print(f"BLAS threads limited to {args.blas_threads}")
    if args.devices:
        devices(args.cases, args.ks, args.batch_repeats)
        return
    if args.floor:
        floor(args.cases, args.repeats)
        return
    if args.evaluations:
        evaluations(args.ks[-1], args.loop)
        return
    if args.nist_batch:
        nist_batch()
        return
    if args.cpufit:
        ks = [10**e for e in range(1, 7) if 10**e <= args.max_k]
        cpufit_table(ks, args.batch_repeats)
        return
    if args.runtime is not None:
        runtime(args.runtime or ["DanWood"], args.repeats)
        return
    if args.single or not args.many:
        single(args.repeats)
    if args.many or not args.single:
        many(args.cases, args.ks, args.loop, args.batch_repeats, args.chunk_size)


if __name__ == "__main__":
    main()
