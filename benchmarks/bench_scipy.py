"""SciPy benchmark: `sciflat.minimize` vs a hand-written `jit(value_and_grad)` wrapper,
SciPy's own finite differences and (if installed) `jaxopt.ScipyMinimize`.

Two problems, float64, L-BFGS-B, every variant in one process, interleaved, after a
warm-up fit (so compilation is excluded); medians over `--repeats`:

1. Lotka–Volterra, 4 unknown rates, positive bounds: whole-fit time. sciflat's auto
   mode differentiates forward (the loss uses `adjoint=diffrax.ForwardMode()`); the
   hand wrapper and jaxopt use reverse mode (Diffrax's default adjoint); finite
   differences call a jitted loss.
2. PINN (MLP 1→32→32→1, 1,153 parameters, u'' + u = 0): per-call wrapper overhead
   (conversion + dispatch, i.e. SciPy's `fun(x)` minus the jitted call alone) and a
   500-iteration fit.

    python benchmarks/bench_scipy.py                 # about a minute
    python benchmarks/bench_scipy.py --repeats 3 --pinn-iters 100
    pip install jaxopt  # optional (unmaintained); never a sciflat dependency
"""

import argparse
import statistics
import time
import timeit

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
from jax.flatten_util import ravel_pytree


jax.config.update("jax_enable_x64", True)

import sciflat  # noqa: E402


try:
    import jaxopt
except ImportError:  # optional, unmaintained
    jaxopt = None


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(fns: dict, repeats: int, minima: dict | None = None) -> dict:
    """Median seconds per variant, variants interleaved round by round (and, into
    `minima` if given, the minimum: on a shared machine the least disturbed round)."""
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    if minima is not None:
        minima.update({k: min(v) for k, v in times.items()})
    return {k: statistics.median(v) for k, v in times.items()}


#
# 1. Lotka–Volterra
#

TRUE = np.array([1.5, 1.0, 3.0, 1.0])
TS = jnp.linspace(0.0, 10.0, 101)


class LotkaVolterra(eqx.Module):
    rates: jax.Array

    def __call__(self, t, y, args):
        a, b, c, d = self.rates
        return jnp.stack([a * y[0] - b * y[0] * y[1], -c * y[1] + d * y[0] * y[1]])


REVERSE = diffrax.RecursiveCheckpointAdjoint()  # Diffrax's default adjoint


def lv_loss(model, data, adjoint=REVERSE):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(model),
        diffrax.Tsit5(),
        0.0,
        10.0,
        0.01,
        jnp.asarray([1.0, 1.0]),
        saveat=diffrax.SaveAt(ts=TS),
        adjoint=adjoint,
        stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-8),
        max_steps=4096,
    )
    return jnp.sum((sol.ys - data) ** 2)


def lv_forward_loss(model, data):
    return lv_loss(model, data, diffrax.ForwardMode())


def lotka_volterra(repeats: int) -> None:
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(LotkaVolterra(jnp.asarray(TRUE))),
        diffrax.Tsit5(),
        0.0,
        10.0,
        0.01,
        jnp.asarray([1.0, 1.0]),
        saveat=diffrax.SaveAt(ts=TS),
        stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-10),
        max_steps=8192,
    )
    data = sol.ys
    start = np.array([1.2, 0.8, 2.6, 1.2])
    bounds = [(0.0, None)] * 4
    plain = lambda r, d: lv_loss(LotkaVolterra(r), d)
    value_and_grad = jax.jit(jax.value_and_grad(plain))
    value = jax.jit(plain)

    def hand():
        def fun(x):
            v, g = value_and_grad(x, data)
            return float(v), np.asarray(g)

        return scipy.optimize.minimize(
            fun, start, jac=True, method="L-BFGS-B", bounds=bounds
        )

    def finite_differences():
        fun = lambda x: float(value(x, data))
        return scipy.optimize.minimize(fun, start, method="L-BFGS-B", bounds=bounds)

    def ours(loss, mode="auto"):
        def run():
            return sciflat.minimize(
                loss,
                LotkaVolterra(jnp.asarray(start)),
                args=(data,),
                bounds={"rates": (0.0, None)},
                mode=mode,
                progress=False,
            )

        return run

    variants = {
        "hand jit(value_and_grad), reverse": hand,
        "hand, reverse, 1 BLAS thread": one_blas_thread(hand),
        "SciPy finite differences (jitted loss)": finite_differences,
        "finite differences, 1 BLAS thread": one_blas_thread(finite_differences),
        "sciflat.minimize, `ForwardMode()` adjoint, auto (forward)": ours(
            lv_forward_loss
        ),
        "sciflat.minimize, default adjoint, auto (reverse)": ours(lv_loss),
        "sciflat.minimize, default adjoint, new lambda per fit": lambda: ours(
            lambda m, d: lv_loss(m, d)
        )(),
    }
    if jaxopt is not None:
        solver = jaxopt.ScipyBoundedMinimize(fun=plain, method="L-BFGS-B")
        lo, hi = jnp.zeros(4), jnp.full(4, jnp.inf)
        variants["jaxopt.ScipyBoundedMinimize"] = lambda: solver.run(
            jnp.asarray(start), (lo, hi), data
        )
    results = {k: fn() for k, fn in variants.items()}  # warm-up: compiles everything
    minima = {}
    times = interleaved(variants, repeats, minima)
    ref = times["hand jit(value_and_grad), reverse"]
    ref1, min1 = (
        times["hand, reverse, 1 BLAS thread"],
        minima["hand, reverse, 1 BLAS thread"],
    )
    print("\n### Lotka–Volterra, 4 rates, L-BFGS-B (whole fit, compiled)\n")
    print(
        "| variant | median (s) | vs hand | vs hand, 1 thread | min (s) | min vs hand, "
        "1 thread | loss calls | max rel. error of rates |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, res in results.items():
        x, nfev = _x_nfev(res)
        err = np.max(np.abs(x - TRUE) / TRUE)
        t, m = times[name], minima[name]
        print(
            f"| {name} | {t:.3f} | {t / ref:.2f}× | {t / ref1:.2f}× | {m:.3f} | "
            f"{m / min1:.2f}× | {nfev} | {err:.1e} |"
        )


def one_blas_thread(fn):
    """What sciflat does by default (`blas_threads="auto"`), applied to a baseline.

    With one `ThreadpoolController` made once: `threadpool_limits(...)` scans the
    loaded libraries every time, which alone costs milliseconds."""
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()

    def run():
        with controller.limit(limits=1, user_api="blas"):
            return fn()

    return run


def _x_nfev(res):
    if isinstance(res, sciflat.FitResult):
        return np.asarray(res.p), res.raw.nfev
    if isinstance(res, scipy.optimize.OptimizeResult):
        return res.x, res.nfev
    return np.asarray(res.params), int(res.state.iter_num)


#
# 2. PINN: per-call overhead and a 500-iteration fit
#


def pinn_loss(net, t):
    u = lambda t: net(t[None])[0]
    du = lambda t: jax.jvp(u, (t,), (jnp.ones_like(t),))[1]
    ddu = lambda t: jax.jvp(du, (t,), (jnp.ones_like(t),))[1]
    interior = jax.vmap(lambda t: ddu(t) + u(t))(t)
    t0 = jnp.zeros(())
    return jnp.mean(interior**2) + (u(t0) - 1.0) ** 2 + du(t0) ** 2


def capture_fun(run) -> dict:
    """The `fun` (and `x0`) that `run` hands to `scipy.optimize.minimize`."""
    seen, real = {}, scipy.optimize.minimize

    def spy(fun, x0, **kwargs):
        seen.update(fun=fun, x0=np.copy(x0))
        return real(fun, x0, **kwargs)

    scipy.optimize.minimize = spy
    try:
        run()
    finally:
        scipy.optimize.minimize = real
    return seen


def pinn(repeats: int, iters: int) -> None:
    net = eqx.nn.MLP(1, 1, 32, 2, activation=jnp.tanh, key=jax.random.key(0))
    net = jax.tree.map(lambda x: x.astype(jnp.float64) if eqx.is_array(x) else x, net)
    t = jnp.linspace(0.0, 2 * jnp.pi, 64)
    params, static = eqx.partition(net, eqx.is_array)
    flat, unravel = ravel_pytree(params)
    assert flat.size == 1153, flat.size
    plain = lambda x, t: pinn_loss(eqx.combine(unravel(x), static), t)
    value_and_grad = jax.jit(jax.value_and_grad(plain))

    def hand_fun(x):
        v, g = value_and_grad(x, t)
        return float(v), np.asarray(g)

    options = {"maxiter": iters, "ftol": 0.0, "gtol": 0.0}
    hand = lambda: scipy.optimize.minimize(
        hand_fun, np.asarray(flat), jac=True, method="L-BFGS-B", options=options
    )
    ours = lambda: sciflat.minimize(
        pinn_loss, net, args=(t,), progress=False, options=options
    )
    # As in the docstring example: a `lambda` written in the call, so new every fit.
    new_lambda = lambda: sciflat.minimize(
        lambda net, t: pinn_loss(net, t),
        net,
        args=(t,),
        progress=False,
        options=options,
    )
    fits = {
        "hand jit(value_and_grad)": hand,
        "hand, 1 BLAS thread": one_blas_thread(hand),
        "sciflat.minimize (reverse)": ours,
        "sciflat.minimize, new lambda per fit": new_lambda,
    }
    if jaxopt is not None:
        solver = jaxopt.ScipyMinimize(
            fun=plain,
            method="L-BFGS-B",
            maxiter=iters,
            options={"ftol": 0.0, "gtol": 0.0},
        )
        fits["jaxopt.ScipyMinimize"] = lambda: solver.run(flat, t)

    # Per call: each wrapper's `fun(x)` and its jitted call alone, at the same x.
    short = {"maxiter": 1}
    ours_fun = capture_fun(
        lambda: sciflat.minimize(
            pinn_loss, net, args=(t,), progress=False, options=short
        )
    )["fun"]
    x = np.asarray(flat)
    x_dev = jnp.asarray(x)
    calls = {
        "hand: fun(x)": lambda: hand_fun(x),
        "hand: jitted call alone": lambda: jax.block_until_ready(
            value_and_grad(x_dev, t)
        ),
        "sciflat: fun(x)": lambda: ours_fun(x),
    }
    inner = _sciflat_jitted(net, t)
    calls["sciflat: jitted call alone"] = lambda: jax.block_until_ready(
        inner(x_dev, [t])
    )
    if jaxopt is not None:
        jo_fun = capture_fun(
            lambda: jaxopt.ScipyMinimize(fun=plain, method="L-BFGS-B", maxiter=1).run(
                flat, t
            )
        )["fun"]
        calls["jaxopt: fun(x)"] = lambda: jo_fun(x)
    for fn in calls.values():
        fn()
    per_call = per_call_seconds(calls, repeats)
    print("\n### PINN, 1,153 parameters: one SciPy call (value and gradient)\n")
    print("| call | µs |")
    print("| --- | ---: |")
    for name, s in per_call.items():
        print(f"| {name} | {s * 1e6:.0f} |")
    hand_over = per_call["hand: fun(x)"] - per_call["hand: jitted call alone"]
    ours_over = per_call["sciflat: fun(x)"] - per_call["sciflat: jitted call alone"]
    print(f"\nwrapper overhead per call: hand {hand_over * 1e6:.0f} µs, ", end="")
    print(f"sciflat {ours_over * 1e6:.0f} µs")

    results = {k: fn() for k, fn in fits.items()}
    minima = {}
    times = interleaved(fits, repeats, minima)
    ref = times["hand jit(value_and_grad)"]
    ref1, min1 = times["hand, 1 BLAS thread"], minima["hand, 1 BLAS thread"]
    print(f"\n### PINN, L-BFGS-B, {iters} iterations (whole fit, compiled)\n")
    print(
        "| variant | median (s) | vs hand | vs hand, 1 thread | min (s) | min vs hand, "
        "1 thread | calls | µs per call | final loss |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, res in results.items():
        _, nfev = _x_nfev(res)
        loss = (
            res.loss
            if isinstance(res, sciflat.FitResult)
            else (res.fun if hasattr(res, "fun") else res.state.fun_val)
        )
        t, m = times[name], minima[name]
        per = t / nfev * 1e6
        print(
            f"| {name} | {t:.2f} | {t / ref:.2f}× | {t / ref1:.2f}× | {m:.2f} | "
            f"{m / min1:.2f}× | {nfev} | {per:.0f} | {float(loss):.2e} |"
        )


#
# 3. NIST StRD: per-fit time of small least-squares problems
#

NIST = "../shared/data/nist_strd"
NIST_MODELS = {  # NIST's formulas, on a dict of parameters
    "Misra1a": lambda b, x: b["b1"] * (1 - jnp.exp(-b["b2"] * x)),
    "Chwirut2": lambda b, x: jnp.exp(-b["b1"] * x) / (b["b2"] + b["b3"] * x),
    "DanWood": lambda b, x: b["b1"] * x ** b["b2"],
}


def read_nist(path: str) -> tuple[dict, dict, np.ndarray, np.ndarray]:
    """Start 1, the certified values, x and y of an StRD file."""
    lines = open(path).read().splitlines()
    start, certified = {}, {}
    for line in lines:
        words = line.split()
        if len(words) == 6 and words[1] == "=" and words[0].startswith("b"):
            start[words[0]], certified[words[0]] = float(words[2]), float(words[4])
    first = next(
        i for i, line in enumerate(lines) if line.split()[:3] == ["Data:", "y", "x"]
    )
    data = np.array(
        [
            [float(v) for v in line.split()]
            for line in lines[first + 1 :]
            if line.strip()
        ]
    )
    return start, certified, data[:, 1], data[:, 0]


def nist(repeats: int, folder: str) -> None:
    print("\n### NIST StRD, Start 1: one whole fit (compiled; median ms)\n")
    print(
        "| problem | hand `trf` | sciflat `trf` | lmfit `least_squares` (trf) | hand `lm` "
        "| sciflat `lm` | lmfit `leastsq` (lm) | sciflat / lmfit, trf (min) | lm (min) | digits "
        "(sciflat trf, lmfit leastsq) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in NIST_MODELS:
        nist_problem(name, f"{folder}/{name}.dat", repeats)


def nist_problem(name: str, path: str, repeats: int) -> None:
    import lmfit

    f, f_np = NIST_MODELS[name], NIST_NUMPY[name]
    start, certified, x, y = read_nist(path)
    names = sorted(start)
    b0 = np.array([start[k] for k in names])
    plain = lambda b, x, y: f(dict(zip(names, b, strict=True)), x) - y
    r_jit, j_jit = jax.jit(plain), jax.jit(jax.jacfwd(plain))
    xj, yj = jnp.asarray(x), jnp.asarray(y)
    model = {k: jnp.asarray(v) for k, v in start.items()}
    params = lmfit.Parameters()
    for k in names:
        params.add(k, start[k])

    def hand(method):
        fun = lambda b: np.asarray(r_jit(b, xj, yj))
        jac = lambda b: np.asarray(j_jit(b, xj, yj))
        return lambda: scipy.optimize.least_squares(fun, b0, jac=jac, method=method)

    def ours(method):
        return lambda: sciflat.least_squares(
            lambda m, x, y: f(m, x) - y,
            model,
            args=(xj, yj),
            method=method,
            progress=False,
        )

    def lm(method):
        fn = lambda p, x, y: f_np(p.valuesdict(), x) - y
        return lambda: lmfit.minimize(fn, params, args=(x, y), method=method)

    variants = {
        "hand trf": hand("trf"),
        "sciflat trf": ours("trf"),
        "lmfit least_squares": lm("least_squares"),
        "hand lm": hand("lm"),
        "sciflat lm": ours("lm"),
        "lmfit leastsq": lm("leastsq"),
    }
    results = {k: fn() for k, fn in variants.items()}
    minima = {}
    ms = {k: v * 1e3 for k, v in interleaved(variants, repeats, minima).items()}
    cert = np.array([certified[k] for k in names])
    lre = lambda b: np.min(-np.log10(np.abs(b - cert) / np.abs(cert)))
    ours_b = np.array([float(results["sciflat trf"].model[k]) for k in names])
    lm_b = np.array([results["lmfit leastsq"].params[k].value for k in names])
    cells = [f"{ms[k]:.2f}" for k in variants]
    ratio = lambda a, b, t: t[a] / t[b]
    trf = [ratio("sciflat trf", "lmfit least_squares", t) for t in (ms, minima)]
    lm_ = [ratio("sciflat lm", "lmfit leastsq", t) for t in (ms, minima)]
    print(
        f"| {name} | {' | '.join(cells)} | {trf[0]:.2f}× ({trf[1]:.2f}×) | "
        f"{lm_[0]:.2f}× ({lm_[1]:.2f}×) | {lre(ours_b):.1f}, {lre(lm_b):.1f} |"
    )


# lmfit works on NumPy: the same formulas in NumPy.
NIST_NUMPY = {
    "Misra1a": lambda b, x: b["b1"] * (1 - np.exp(-b["b2"] * x)),
    "Chwirut2": lambda b, x: np.exp(-b["b1"] * x) / (b["b2"] + b["b3"] * x),
    "DanWood": lambda b, x: b["b1"] * x ** b["b2"],
}


def per_call_seconds(calls: dict, rounds: int, number: int = 100) -> dict:
    """Seconds per call: in each round, the best of 3 loops of `number` calls per
    variant (interleaved); the median over rounds. The best-of filters out the other
    jobs on a shared machine, which otherwise swamp a difference of a few µs."""
    best = {k: [] for k in calls}
    for _ in range(max(rounds, 5)):
        for name, fn in calls.items():
            best[name].append(min(timeit.repeat(fn, number=number, repeat=3)) / number)
    return {k: statistics.median(v) for k, v in best.items()}


def _sciflat_jitted(net, t):
    """The compiled value-and-gradient that sciflat calls (for the overhead split)."""
    from sciflat._fitting import programs as _scipy_programs
    from sciflat._scipy import minimize as _scipy_minimize

    p, re = sciflat.destructure(net, dtype=jnp.float64)
    programs = _scipy_programs.Programs(_scipy_minimize._build, pinn_loss, re, (t,))
    return programs.get("value_and_grad", "reverse", np.asarray(p))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pinn-iters", type=int, default=500)
    parser.add_argument("--nist-repeats", type=int, default=40)
    parser.add_argument("--nist", default=NIST, help="folder of the StRD .dat files")
    parser.add_argument("--only", choices=["lv", "pinn", "nist"], default=None)
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, scipy {scipy.__version__}, jaxopt: {jaxopt is not None}"
    )
    if args.only in (None, "lv"):
        lotka_volterra(args.repeats)
    if args.only in (None, "pinn"):
        pinn(args.repeats, args.pinn_iters)
    if args.only in (None, "nist"):
        nist(args.nist_repeats, args.nist)
