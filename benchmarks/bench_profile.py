"""Profile-likelihood intervals: `sciflat.profile` against lmfit's `conf_interval`
(time, and the same F-test intervals) and iminuit's `minos` (the intervals), on a NIST
StRD problem; and Boehm et al. 2014's nine profiles (PEtab, `minimize` on -log L).

    pip install lmfit iminuit            # references only, never CI dependencies
    python benchmarks/bench_profile.py                     # Lanczos3 (6 parameters)
    python benchmarks/bench_profile.py --problem Gauss1     # any file of tests/data/nist_strd
    python benchmarks/bench_profile.py --minos             # every NIST file vs minos
    python benchmarks/bench_profile.py --boehm             # the nine Boehm profiles

Every variant runs in this one process; timings are medians of `--repeats` runs,
interleaved, after one run each that compiles (reported apart: the first call).
"""

import argparse
import importlib.util
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats


jax.config.update("jax_enable_x64", True)
import sciflat  # noqa: E402


ROOT = pathlib.Path(__file__).resolve().parent.parent
LEVELS = (0.6826894921370859, 0.95)


def _nist():
    spec = importlib.util.spec_from_file_location("nist", ROOT / "benchmarks/nist.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nist_problem(name: str, repeats: int) -> None:
    import lmfit

    nist = _nist()
    problem = nist.read(ROOT / f"tests/data/nist_strd/{name}.dat")
    x, y = np.asarray(problem.x), np.asarray(problem.y)
    names = problem.names
    start = problem.start(1)
    fit = sciflat.least_squares(problem.residuals, start, args=(x, y), progress=False)
    n, m = len(names), len(y)
    print(f"{name}: {n} parameters, {m} residuals; fit {fit.status}")

    # lmfit: the same model, fitted by its leastsq, then conf_interval (F test).
    def lm_residual(params):
        b = {k: params[k].value for k in names}
        return problem.f(b, x, numpy=True) - y

    params = lmfit.Parameters()
    for k in names:
        params.add(k, value=start[k])
    minimizer = lmfit.Minimizer(lm_residual, params)
    out = minimizer.minimize(method="leastsq", xtol=1e-12, ftol=1e-12)

    def ours():
        return sciflat.profile(fit, problem.residuals, args=(x, y), levels=LEVELS)

    def theirs():
        return lmfit.conf_interval(minimizer, out, sigmas=LEVELS)

    def ours_scipy():
        return sciflat.profile(
            fit, problem.residuals, args=(x, y), levels=LEVELS, batch=False
        )

    variants = {
        "sciflat.profile": ours,
        "sciflat.profile(batch=False)": ours_scipy,
        "lmfit.conf_interval": theirs,
    }
    first = {}
    for label, f in variants.items():
        t = time.perf_counter()
        f()
        first[label] = time.perf_counter() - t
    prof, ci = ours(), theirs()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for label, f in variants.items():
            t = time.perf_counter()
            f()
            times[label].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nAll {n} profiles at {LEVELS[0]:.4f} and 0.95 ({repeats} runs, medians):")
    print("| | first call (compiles) | then | vs lmfit |")
    print("|---|---|---|---|")
    ref = med["lmfit.conf_interval"]
    for label, v in med.items():
        print(
            f"| {label} | {first[label] * 1e3:.0f} ms | {v * 1e3:.1f} ms "
            f"| {v / ref:.3f}x |"
        )
    print(f"refits: {prof.n_fits} ({prof.method})")

    # The F-test intervals: sciflat's against lmfit's.
    worst_lmfit = 0.0
    for k in names:
        for lv in LEVELS:
            it = prof[k].interval(lv)
            pairs = ci[k]
            lo = next(v for p, v in pairs if np.isclose(p, lv) and v < it.value)
            hi = next(v for p, v in pairs[::-1] if np.isclose(p, lv) and v > it.value)
            se = float(fit.stderr[k])
            worst_lmfit = max(
                worst_lmfit, abs(it.lower - lo) / se, abs(it.upper - hi) / se
            )

    print(f"\nlargest difference from lmfit's conf_interval: {worst_lmfit:.1e} stderr")


def against_minos() -> None:
    """Every NIST file: sciflat's intervals with known errors against iminuit's
    `minos` on χ²/s² (s² fixed at the fit, `errordef=1`): Δ(χ²/s²) against χ²₁."""
    import iminuit

    nist = _nist()
    print("\n| problem | n | MIGRAD | largest relative difference from minos |")
    print("|---|---|---|---|")
    for problem in nist.problems():
        x, y = np.asarray(problem.x), np.asarray(problem.y)
        names = problem.names
        fit = sciflat.least_squares(
            problem.residuals, problem.start(2), args=(x, y), progress=False
        )
        s = float(np.sqrt(2 * fit.loss / (len(y) - len(names))))
        scaled = lambda b, x, y, s=s, r=problem.residuals: r(b, x, y) / s
        known = sciflat.least_squares(
            scaled, problem.start(2), args=(x, y), progress=False
        )
        prof = sciflat.profile(
            known.with_known_errors(), scaled, args=(x, y), levels=LEVELS
        )
        # χ² and its gradient compiled by JAX, for MIGRAD.
        chi2_of = lambda b, names=names, scaled=scaled, x=x, y=y: jnp.sum(
            scaled(dict(zip(names, b, strict=True)), x, y) ** 2
        )
        value_grad = jax.jit(jax.value_and_grad(chi2_of))
        best = [float(known.model[k]) for k in names]
        minuit = iminuit.Minuit(
            lambda b, vg=value_grad: float(vg(jnp.asarray(b))[0]),
            best,
            grad=lambda b, vg=value_grad: np.asarray(vg(jnp.asarray(b))[1]),
            name=names,
        )
        minuit.errordef = iminuit.Minuit.LEAST_SQUARES
        minuit.strategy = 2
        minuit.tol = 1e-6  # MINUIT's EDM goal 2e-9 (default 2e-4): minos to more digits
        minuit.migrad()
        fmin = minuit.fmin
        assert fmin is not None
        if not (fmin.is_valid and fmin.has_accurate_covar):
            print(
                f"| {problem.name} | {len(names)} | no accurate covariance (minos invalid) | |"
            )
            continue
        worst = 0.0
        for lv in LEVELS:
            minuit.minos(cl=lv)
            for k in names:
                it = prof[k].interval(lv)
                me = minuit.merrors[k]
                lo, hi = minuit.values[k] + me.lower, minuit.values[k] + me.upper
                worst = max(
                    worst, abs(it.lower - lo) / abs(lo), abs(it.upper - hi) / abs(hi)
                )
        print(f"| {problem.name} | {len(names)} | valid | {worst:.1e} |")


def boehm() -> None:
    yaml = sciflat.petab_benchmark("Boehm_JProteomeRes2014")
    t0 = time.perf_counter()
    problem = sciflat.petab_problem(yaml)
    fit = sciflat.minimize(
        problem.nll, problem.nominal, bounds=problem.bounds, progress=False
    )
    t1 = time.perf_counter()
    print(
        f"read and fit from the published optimum: {t1 - t0:.1f} s, -log L {fit.loss:.6f}"
    )
    prof = sciflat.profile(fit, problem.nll, bounds=problem.bounds, levels=(0.95,))
    t2 = time.perf_counter()
    print(
        f"nine profiles at 95 %: {t2 - t1:.1f} s, {prof.n_fits} refits ({prof.method})"
    )
    print(prof)
    for p in prof.profiles:
        print(f"{p.name}: {p.message}")
    threshold = scipy.stats.chi2.ppf(0.95, 1)
    print(f"(2 Δ(-log L) threshold {threshold:.4f})")
    fig = prof.plot()
    out = ROOT / "docs/figures/profile_boehm.png"
    fig.savefig(out, dpi=90)
    print(f"figure: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="Lanczos3")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--boehm", action="store_true")
    parser.add_argument("--minos", action="store_true", help="every NIST file vs minos")
    a = parser.parse_args()
    if a.boehm:
        boehm()
    elif a.minos:
        against_minos()
    else:
        nist_problem(a.problem, a.repeats)
