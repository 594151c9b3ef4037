"""The figures of `docs/uncertainty.md`: Wald against the profile, known errors, bands,
an open profile.

    python benchmarks/uncertainty_figures.py      # writes docs/figures/uncertainty_*.png

(The Boehm profiles: `python benchmarks/bench_profile.py --boehm`.)
"""

import pathlib

import jax
import jax.numpy as jnp
import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import scipy.stats


jax.config.update("jax_enable_x64", True)
import sciflat  # noqa: E402


ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "figures"

# NIST Misra1a.
X = np.r_[77.6, 114.9, 141.1, 190.8, 239.9, 289.0, 332.8, 378.4, 434.8, 477.3]
X = np.r_[X, 536.8, 593.1, 689.1, 760.0]
Y = np.r_[10.07, 14.73, 17.94, 23.93, 29.61, 35.18, 40.02, 44.82, 50.76, 55.05]
Y = np.r_[Y, 61.01, 66.40, 75.47, 81.78]


def misra(m, x):
    return m["b1"] * (1 - jnp.exp(-m["b2"] * x))


def residuals(m, x, y):
    return misra(m, x) - y


def wald_and_profile() -> None:
    """Misra1a's b1: the profile statistic against the Wald parabola."""
    fit = sciflat.least_squares(residuals, {"b1": 500.0, "b2": 1e-4}, args=(X, Y))
    prof = sciflat.profile(fit, residuals, args=(X, Y), levels=(0.95, 0.999))
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, name in zip(axes, ("b1", "b2"), strict=True):
        curve = prof[name]
        se = float(fit.stderr[name])
        v = np.linspace(curve.values.min(), curve.values.max(), 200)
        ax.plot(curve.values, curve.statistic, "o", ms=3, color="C0", label="refits")
        ax.plot(*curve._smooth(), color="C0", label="profile")
        ax.plot(v, ((v - curve.value) / se) ** 2, "--", color="C1", label="Wald")
        for it in curve.intervals:
            ax.axhline(it.threshold, color="gray", lw=0.6)
            ax.text(v[0], it.threshold, f" {it.level:.1%}", va="bottom", fontsize=8)
        ax.set(xlabel=name, ylabel="Δχ² / s²")
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4))
        ax.legend(fontsize="small")
    fig.suptitle("NIST Misra1a: the profile and the Wald approximation")
    fig.tight_layout()
    fig.savefig(OUT / "uncertainty_wald.png", dpi=90)


def known_errors_and_bands() -> None:
    """A decay with known σ: the confidence bands (scaled: t; known: normal) and the
    prediction band."""
    x = np.linspace(0.0, 3.0, 12)
    sigma = 0.05 + 0.04 * x
    rng = np.random.default_rng(0)
    y = 2.5 * np.exp(-1.3 * x) + 0.4 + sigma * rng.normal(size=x.size)
    curve = lambda m, x: m["a"] * jnp.exp(-m["k"] * x) + m["c"]
    weighted = lambda m, x, y, s: (curve(m, x) - y) / s
    fit = sciflat.least_squares(
        weighted, {"a": 2.0, "k": 1.0, "c": 0.0}, args=(x, y, sigma)
    )
    known = fit.with_known_errors()
    xs = np.linspace(-0.2, 3.5, 200)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.errorbar(x, y, sigma, fmt="o", ms=3, color="k", label="data ± σ (known)")
    ax.plot(xs, curve(sciflat.unwrap(fit.model), xs), color="C0", label="fit")
    for res, color, what in (
        (fit, "C1", "scaled by s² (t)"),
        (known, "C2", "known σ (normal)"),
    ):
        b = sciflat.band(res, lambda m: curve(m, xs), level=0.95)
        ax.fill_between(
            xs, b.lower, b.upper, color=color, alpha=0.3, label=f"95 % band, {what}"
        )
    s_new = 0.05 + 0.04 * xs
    p = sciflat.band(known, lambda m: curve(m, xs), prediction=True, noise=s_new)
    ax.plot(xs, p.lower, ":", color="C2", label="95 % prediction band (known σ)")
    ax.plot(xs, p.upper, ":", color="C2")
    ax.set(xlabel="x", ylabel="y")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(OUT / "uncertainty_band.png", dpi=90)


def open_profile() -> None:
    """A rate the data bound only from below: its profile never crosses above."""
    x = np.linspace(0.1, 5.0, 20)
    y = 1 - np.exp(-50 * x) + 0.01 * np.random.default_rng(1).normal(size=20)
    rise = lambda m, x, y: m["a"] * (1 - jnp.exp(-m["k"] * x)) - y
    fit = sciflat.least_squares(
        rise, {"a": 1.0, "k": sciflat.Positive(5.0)}, args=(x, y)
    )
    prof = sciflat.profile(fit, rise, args=(x, y), levels=(0.95,))
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    prof["k"].plot(ax)
    ax.set_xscale("log")
    ax.set_ylim(0, 12)
    ax.set_title("open above: the rise is over before x = 0.1")
    fig.tight_layout()
    fig.savefig(OUT / "uncertainty_open.png", dpi=90)
    print(prof)


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    wald_and_profile()
    known_errors_and_bands()
    open_profile()
    print("threshold check:", scipy.stats.f.ppf(0.95, 1, 12))
    print(f"wrote {sorted(p.name for p in OUT.glob('uncertainty_*.png'))}")
