"""`profile`: profile-likelihood intervals of a finished fit.

For a parameter θ_j: fix it on a path away from the fit, refit the others, and read
the interval where the profile statistic rises past a threshold. Every path (one per
parameter, side and level) walks at once, each step one stage: a stage's refits run as one
`least_squares_batch` (residuals without bounds), else one by one with SciPy on the
same reduced problem on the flat vector (bounds, or a negative log-likelihood). A
path steps by Newton on √statistic (exact for a linear model, whose √Δχ² is linear in
θ_j), with the slope from the envelope theorem, ∂objective/∂θ_j at the refit; each
refit starts from its path's last point, extrapolated; a crossing is bracketed and
refined to `rtol`. A path that reaches a bound, a flat stretch or its `max_steps`
below a threshold ends there: that side is open, flagged, never an exception.
"""

import dataclasses
import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from ._fitting.band import ONE_SIGMA
from ._fitting.delta import derivative, value_names
from ._fitting.fn_key import identity_key
from ._fitting.problem import split_args
from ._fitting.programs import shared, structure_key
from ._fitting.report import pretty
from ._fitting.result import FitResult
from ._flatten import Restructure
from ._scipy.bounds import flat_bounds
from ._transforms import constrained, has_transforms, unwrap


#
# What a profile returns
#


@dataclasses.dataclass(frozen=True)
class ProfileInterval:
    """The profile-likelihood interval of one parameter at one level.

    **Fields:**

    - `name`, `level`, `value` (the fitted value).
    - `lower`, `upper`: where the profile statistic crosses the threshold; on an open
        side, the farthest value the profile reached below it (a bound, or where the
        search stopped): the confidence set reaches at least that far.
    - `lower_open`, `upper_open`: True where the profile never rose past the
        threshold on that side.
    - `threshold`: the value of the statistic that bounds the interval.
    """

    name: str
    level: float
    value: float
    lower: float
    upper: float
    lower_open: bool
    upper_open: bool
    threshold: float


@dataclasses.dataclass(frozen=True)
class Profile:
    """The profile of one parameter: its curve and its intervals.

    **Fields:**

    - `name`, `index` (in `p`), `value` (the fitted value).
    - `values`: the parameter's values along the profile, ascending (the fit's among
        them), in its constrained units (through a transform).
    - `statistic`: the profile statistic at each (0 at the fit; see
        [`sciflat.ProfileResult`][] for which).
    - `points`: `(k, n)`: the refitted flat vector `p` at each value.
    - `intervals`: one [`sciflat.ProfileInterval`][] per level.
    - `message`: how each side ended.
    """

    name: str
    index: int
    value: float
    values: npt.NDArray[np.float64]
    statistic: npt.NDArray[np.float64]
    points: npt.NDArray[np.float64] = dataclasses.field(repr=False)
    intervals: tuple[ProfileInterval, ...]
    message: str

    def interval(self, level: float = 0.95) -> ProfileInterval:
        """The interval at `level` (one of those the profile was computed for)."""
        for it in self.intervals:
            if math.isclose(it.level, level, rel_tol=1e-9):
                return it
        have = [it.level for it in self.intervals]
        raise ValueError(
            f"`level`: this profile has the levels {have}, got {level!r}; pass "
            "`levels=` to `sciflat.profile`."
        )

    def _smooth(self, k: int = 16) -> tuple[np.ndarray, np.ndarray]:
        """The curve between the refits, for the eye: the signed √statistic (linear
        for a linear model) interpolated monotonically (PCHIP), then squared."""
        from scipy.interpolate import PchipInterpolator

        v = self.values
        if len(v) < 3:
            return v, self.statistic
        signed = np.sign(v - self.value) * np.sqrt(np.maximum(self.statistic, 0.0))
        # `k` points between each two refits: the curve also on a log axis.
        grid = [np.linspace(a, b, k, endpoint=False) for a, b in itertools.pairwise(v)]
        grid = np.concatenate([*grid, v[-1:]])
        return grid, PchipInterpolator(v, signed)(grid) ** 2

    def plot(self, ax: Any = None) -> Any:
        """The profile (statistic against value) with its thresholds and intervals;
        returns the matplotlib axes. The refits are the points; the curve between
        them is interpolated for the eye (PCHIP on the signed √statistic), not
        refitted."""
        plt = _pyplot()
        if ax is None:
            ax = plt.subplots(figsize=(4, 3))[1]
        ax.plot(self.values, self.statistic, "o", ms=3, color="C0", label="refits")
        ax.plot(*self._smooth(), color="C0", lw=1)
        for i, it in enumerate(self.intervals):
            color = f"C{i + 1}"
            ax.axhline(it.threshold, ls="--", lw=0.8, color=color)
            label = f"{it.level:.4g}"
            for end, is_open in ((it.lower, it.lower_open), (it.upper, it.upper_open)):
                style = ":" if is_open else "-"
                ax.axvline(end, ls=style, lw=0.8, color=color, label=label)
                label = None
        ax.axvline(self.value, color="gray", lw=0.6)
        ax.set(xlabel=pretty(self.name), ylabel="profile statistic")
        ax.legend(title="level (dotted: open)", fontsize="small")
        return ax


@dataclasses.dataclass(frozen=True)
class ProfileResult:
    """What [`sciflat.profile`][] returns: one [`sciflat.Profile`][] per parameter.

    `print(result)` shows the intervals as a table (`*`: open on that side).

    **Fields:**

    - `profiles`: the profiles, in `p` order of the parameters asked for.
    - `levels`: the levels, ascending.
    - `statistic`: what the profile statistic is and its thresholds, in words.
    - `method`: how the refits ran (one batch per stage, or SciPy one by one).
    - `n_fits`: the number of refits.
    """

    profiles: tuple[Profile, ...]
    levels: tuple[float, ...]
    statistic: str
    method: str
    n_fits: int

    def __getitem__(self, name: str | int) -> Profile:
        """The profile of `name` (as in the report: `"b1"`, `"w[0, 1]"`) or of entry
        `name` of `p`."""
        for prof in self.profiles:
            if name in (prof.name, prof.index, pretty(prof.name)):
                return prof
        names = [pretty(p.name) for p in self.profiles]
        raise KeyError(f"No profile of {name!r}; there are {names}.")

    def interval(self, level: float = 0.95) -> dict[str, ProfileInterval]:
        """Every parameter's interval at `level`, by name."""
        return {pretty(p.name): p.interval(level) for p in self.profiles}

    def plot(self, columns: int = 3) -> Any:
        """Every profile in a grid; returns the matplotlib figure."""
        plt = _pyplot()
        k = len(self.profiles)
        cols = min(columns, k)
        rows = -(-k // cols)
        fig, axes = plt.subplots(
            rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False
        )
        for ax, prof in zip(axes.flat, self.profiles, strict=False):
            prof.plot(ax)
        for ax in list(axes.flat)[k:]:
            ax.set_visible(False)
        fig.tight_layout()
        return fig

    def __str__(self) -> str:
        levels = self.levels
        head = [f"{'-' + _pct(lv):>13s}" for lv in reversed(levels)]
        head += [f"{'best':>13s}"] + [f"{'+' + _pct(lv):>13s}" for lv in levels]
        width = max(len(pretty(p.name)) for p in self.profiles)
        lines = [f"{'':{width}s}" + "".join(head)]
        for prof in self.profiles:
            cells = []
            for lv in reversed(levels):
                it = prof.interval(lv)
                cells.append(_cell(it.lower, it.lower_open))
            cells.append(_cell(prof.value, False))
            for lv in levels:
                it = prof.interval(lv)
                cells.append(_cell(it.upper, it.upper_open))
            lines.append((f"{pretty(prof.name):{width}s}" + "".join(cells)).rstrip())
        lines.append(f"({self.statistic}; * open: never crossed on that side)")
        return "\n".join(lines)


def _pct(level: float) -> str:
    return f"{100 * level:.4g}%"


def _cell(x: float, is_open: bool) -> str:
    return f"{x:>12.6g}" + ("*" if is_open else " ")


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "Plotting a profile draws with matplotlib, which is not installed (it is "
            "not a dependency of sciflat): `pip install matplotlib`."
        ) from e
    return plt


#
# The objective, reduced to the other parameters
#


def _embed(y, j, xj):
    """The flat vector with entry `j` (traced) set to `xj` and the others from `y`."""
    n = y.shape[0] + 1
    idx = jnp.arange(n - 1)
    pos = idx + (idx >= j)
    return jnp.zeros(n, y.dtype).at[pos].set(y).at[j].set(xj)


def _drop(x: np.ndarray, j: int) -> np.ndarray:
    return np.delete(x, j, axis=-1)


def _objective_fn(fn: Callable, re: Restructure, vector: bool, rebuild) -> Callable:
    """`(x, leaves) -> objective`: Σr² of residuals, or 2 × a negative
    log-likelihood: in either, the statistic is a difference of it (divided by s²
    where scaled). `rebuild(leaves)` gives `args` back (`split_args`)."""

    def objective(x, leaves):
        out = jnp.asarray(fn(unwrap(re(x)), *rebuild(leaves)))
        return jnp.sum(out**2) if vector else 2.0 * out

    return objective


def _forward(f: Callable) -> Callable:
    """`(x, *rest) -> (f, ∂f/∂x)` by forward mode: n JVPs (profiles have a few
    parameters), and through an ODE solve that only forward mode differentiates
    (Diffrax's `ForwardMode`, as PEtab problems use)."""

    def both(x, *rest):
        twice = lambda x: (f(x, *rest),) * 2
        grad, value = jax.jacfwd(twice, has_aux=True)(x)
        return value, grad

    return both


def _value_and_grads(fn, re, vector: bool, rebuild) -> Callable:
    """`(xs (K, n), args) -> (objective (K,), gradient (K, n))`, compiled once per
    function and structure (kept, as the fits' programs: keyed by identity)."""

    def make():
        obj = _objective_fn(fn, re, vector, rebuild)
        return jax.jit(jax.vmap(_forward(obj), (0, None)))

    key = ("profile:value", identity_key(fn), structure_key(re), vector, rebuild)
    return shared(key, make)


def _reduced_residuals(fn, re):
    """The residuals on the other parameters: `(y, *args, j, xj)`; a closure of
    sciflat's over `fn` and `re`, so the batch reuses its compilation by identity."""

    def residuals(y, *rest):
        *args, j, xj = rest
        return jnp.ravel(jnp.asarray(fn(unwrap(re(_embed(y, j, xj))), *args)))

    return residuals


def _reduced_value_and_grad(fn, re, vector: bool, rebuild) -> Callable:
    """`(y, j, xj, args) -> (objective, gradient in y)` for SciPy's refits."""

    def make():
        obj = _objective_fn(fn, re, vector, rebuild)
        return jax.jit(_forward(lambda y, j, xj, args: obj(_embed(y, j, xj), args)))

    key = ("profile:reduced", identity_key(fn), structure_key(re), vector, rebuild)
    return shared(key, make)


def _reduced_residuals_and_jac(fn, re, rebuild) -> Callable:
    def make():
        r = _reduced_residuals(fn, re)
        f = lambda y, j, xj, leaves: r(y, *rebuild(leaves), j, xj)
        return jax.jit(
            lambda y, j, xj, args: (f(y, j, xj, args), jax.jacfwd(f)(y, j, xj, args))
        )

    key = ("profile:residuals", identity_key(fn), structure_key(re), rebuild)
    return shared(key, make)


#
# Refits: one stage of every path at once
#


@dataclasses.dataclass
class _Engine:
    fn: Callable
    re: Restructure
    args: tuple
    leaves: list
    rebuild: Any
    vector: bool
    lb: np.ndarray
    ub: np.ndarray
    batch: bool
    options: dict
    n_fits: int = 0

    def refit(self, js: np.ndarray, xjs: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The refitted flat vectors (K, n), each with entry `js[k]` fixed at
        `xjs[k]`, from `starts` (K, n)."""
        self.n_fits += len(js)
        n = starts.shape[1]
        out = starts.copy()
        out[np.arange(len(js)), js] = xjs
        if n == 1:
            return out  # nothing left to fit
        if self.batch:
            return self._batch(js, xjs, out)
        # Refits one by one, on every core: XLA runs each call without the GIL.
        one = lambda k: self._one(int(js[k]), float(xjs[k]), out[k])
        with ThreadPoolExecutor(min(len(js), os.cpu_count() or 1)) as pool:
            return np.stack(list(pool.map(one, range(len(js)))))

    def _batch(self, js, xjs, starts) -> np.ndarray:
        from ._device.batch import least_squares_batch

        ys = np.stack([_drop(s, j) for s, j in zip(starts, js, strict=True)])
        res = least_squares_batch(
            _reduced_residuals(self.fn, self.re),
            jnp.asarray(ys[0]),
            args=self.args,
            batch_args=(np.asarray(js, np.int32), np.asarray(xjs, np.float64)),
            starts=jnp.asarray(ys),
            progress=False,
            **self.options,
        )
        out = starts.copy()
        for k, j in enumerate(js):
            out[k] = np.insert(res.p[k], j, xjs[k])
        return out

    def _one(self, j: int, xj: float, start: np.ndarray) -> np.ndarray:
        import scipy.optimize

        y0 = _drop(start, j)
        lb, ub = _drop(self.lb, j), _drop(self.ub, j)
        y0 = np.clip(y0, lb, ub)
        bounded = np.isfinite(lb).any() or np.isfinite(ub).any()
        jj, xx = np.int32(j), np.float64(xj)
        if self.vector:
            f = _reduced_residuals_and_jac(self.fn, self.re, self.rebuild)
            cache: dict = {}

            def both(y):
                key = y.tobytes()
                if key not in cache:
                    cache.clear()
                    r, jac = f(jnp.asarray(y), jj, xx, self.leaves)
                    cache[key] = (np.asarray(r), np.asarray(jac))
                return cache[key]

            tol = {k: self.options.get(k, 1e-12) for k in ("ftol", "xtol", "gtol")}
            sol = scipy.optimize.least_squares(
                lambda y: both(y)[0],
                y0,
                jac=lambda y: both(y)[1],  # pyright: ignore[reportArgumentType]
                bounds=(lb, ub),
                method="trf" if bounded else "lm",
                max_nfev=self.options.get("max_nfev"),
                **tol,
            )
            y = sol.x
        else:
            g = _reduced_value_and_grad(self.fn, self.re, False, self.rebuild)

            def fun(y):
                v, d = g(jnp.asarray(y), jj, xx, self.leaves)
                return float(v), np.asarray(d, np.float64)

            sol = scipy.optimize.minimize(
                fun,
                y0,
                jac=True,
                method="L-BFGS-B",
                bounds=list(zip(lb, ub, strict=True)) if bounded else None,
                options=dict(
                    ftol=self.options.get("ftol", 1e-14),
                    gtol=self.options.get("gtol", 1e-8),
                    maxiter=self.options.get("max_nfev", 5000),
                ),
            )
            y = sol.x
        return np.insert(y, j, xj)


#
# The paths
#


@dataclasses.dataclass
class _Path:
    """One side of one parameter's profile: points at signed distance h >= 0 from
    the fit (h along `side`), and the crossings of each threshold in turn."""

    j: int
    side: int
    x0: float
    scale: float  # the first step's length (the Wald error, or a guess)
    room: float  # the distance to the bound on this side (inf without)
    targets: list[float]
    max_steps: int
    rtol: float
    hs: list[float] = dataclasses.field(default_factory=list)
    us: list[float] = dataclasses.field(default_factory=list)  # √statistic
    dus: list[float] = dataclasses.field(default_factory=list)  # d√stat/dh
    xs: list[np.ndarray] = dataclasses.field(default_factory=list)
    stats: list[float] = dataclasses.field(default_factory=list)
    crossings: list[float] = dataclasses.field(default_factory=list)
    done: bool = False
    reason: str = ""
    flat: int = 0

    @property
    def target(self) -> float:
        return self.targets[len(self.crossings)]

    def start(self, x: np.ndarray, stat: float) -> None:
        self.hs, self.us, self.dus, self.xs, self.stats = (
            [0.0],
            [0.0],
            [np.nan],
            [x],
            [stat],
        )
        if self.room <= 0:
            self._open("the fit is on its bound")

    def propose(self) -> tuple[float, np.ndarray]:
        """The next h, and the start of its refit."""
        U = math.sqrt(self.target)
        order = np.argsort(self.hs)
        us = np.asarray(self.us)[order]
        below = np.flatnonzero(us < U)
        above = np.flatnonzero(us >= U)
        a = int(order[below[-1]])
        if len(above) and above[0] > below[-1]:
            b = int(order[above[0]])
            h = self._inside(a, b, U)
        else:
            h = self._outward(a, U)
        h = min(h, self.room)
        return h, self._start_at(h)

    def _inside(self, a: int, b: int, U: float) -> float:
        """A step inside the bracket [h_a, h_b]: Newton on √stat from the nearer end,
        else the secant, else the midpoint (safeguarded)."""
        ha, hb, ua, ub = self.hs[a], self.hs[b], self.us[a], self.us[b]
        secant = ha + (U - ua) * (hb - ha) / (ub - ua)
        candidates = []
        for i in (a, b) if abs(U - ua) < abs(ub - U) else (b, a):
            du = self.dus[i]
            if np.isfinite(du) and du > 0:
                candidates.append(self.hs[i] + (U - self.us[i]) / du)
        candidates.append(secant)
        for h in candidates:
            if ha < h < hb:
                return h
        return 0.5 * (ha + hb)

    def _outward(self, a: int, U: float) -> float:
        """A step beyond the farthest point: Newton on √stat, capped at 4x the last
        step (2x where the profile is flat there)."""
        h, u, du = self.hs[a], self.us[a], self.dus[a]
        last = h - max((x for x in self.hs if x < h), default=0.0)
        if h == 0:
            return self.scale * U
        cap = 4.0 * max(last, self.scale * 1e-3)
        if np.isfinite(du) and du > 0:
            return h + min(max((U - u) / du * 1.02, 0.1 * last), cap)
        return h + 2.0 * max(last, self.scale)

    def _start_at(self, h: float) -> np.ndarray:
        """The refit's start: the nearest point, extrapolated linearly from its
        neighbour below (a predictor step)."""
        hs = np.asarray(self.hs)
        i = int(np.argmin(np.abs(hs - h)))
        x = self.xs[i].copy()
        lower = [k for k in range(len(hs)) if hs[k] < hs[i]]
        if lower and h > hs[i]:
            k = max(lower, key=lambda k: hs[k])
            x = x + (self.xs[i] - self.xs[k]) * (h - hs[i]) / (hs[i] - hs[k])
        x[self.j] = self.x0 + self.side * h
        return x

    def accept(self, h: float, x: np.ndarray, stat: float, slope: float) -> None:
        """The refit at h: its statistic and d stat / dθ_j (envelope theorem)."""
        if not (np.isfinite(stat) and np.isfinite(slope)):
            return self._open(f"the refit at {self.x0 + self.side * h:.6g} failed")
        u = math.sqrt(max(stat, 0.0))
        du = self.side * slope / (2 * u) if u > 0 else np.nan
        outward = h > max(self.hs)
        previous = max(self.stats)
        self.hs.append(h)
        self.us.append(u)
        self.dus.append(du)
        self.xs.append(x)
        self.stats.append(stat)
        T = self.target
        converged = abs(stat - T) <= self.rtol * T
        if not converged:
            # The bracket has closed to rounding: take its root by the secant.
            hs, us = np.asarray(self.hs), np.asarray(self.us)
            U = math.sqrt(T)
            lo = hs[us < U].max(initial=-np.inf) if (us < U).any() else -np.inf
            hi = hs[us >= U].min(initial=np.inf) if (us >= U).any() else np.inf
            converged = hi - lo <= 1e-12 * (abs(self.x0) + self.scale)
        if converged:
            self._crossed(T)
        elif stat < T and h >= self.room:
            return self._open("the profile reaches the bound below the threshold")
        if self.done:
            return
        if outward:
            self.flat = self.flat + 1 if stat <= previous + 1e-9 * T else 0
        if self.flat >= 6:
            self._open("the profile is flat there")
        elif len(self.hs) > self.max_steps:
            self._open(f"`max_steps` ({self.max_steps}) refits did not cross")

    def _crossed(self, T: float) -> None:
        hs, us = np.asarray(self.hs), np.asarray(self.us)
        U = math.sqrt(T)
        # The root by the secant through the bracket's ends (√stat is nearly linear).
        below, above = us < U, us >= U
        if below.any() and above.any():
            a = np.flatnonzero(below)[np.argmax(hs[below])]
            b = np.flatnonzero(above)[np.argmin(hs[above])]
            h = hs[a] + (U - us[a]) * (hs[b] - hs[a]) / (us[b] - us[a])
        else:
            h = hs[np.argmin(np.abs(us - U))]
        self.crossings.append(float(h))
        if len(self.crossings) == len(self.targets):
            self.done = True
            self.reason = "crossed every threshold"

    def _open(self, why: str) -> None:
        self.done = True
        self.reason = f"open: {why}"


#
# profile
#


def profile(
    result: FitResult[Any],
    fn: Callable[..., Any],
    *,
    args: tuple[Any, ...] = (),
    which: Sequence[str | int] | str | int | None = None,
    levels: Sequence[float] = (ONE_SIGMA, 0.95),
    bounds: Mapping | tuple | None = None,
    max_steps: int = 40,
    rtol: float = 1e-9,
    batch: bool | None = None,
    **kwargs: Any,
) -> ProfileResult:
    """Profile-likelihood intervals of a fit: for each parameter, its profile (the
    best objective with the parameter fixed, the others refitted) and the interval
    where the profile stays below a threshold, at each level.

    The interval is asymmetric where the profile is, and follows bounds, transforms
    and ties. What is profiled is chosen by what `fn` returns:

    - residuals (an array): the statistic is Δχ² / s², χ² = Σr², against
        F(1, m - n) at `level` (lmfit's `conf_interval`; for a linear model exactly
        the Student-t Wald interval); with known errors (the result of
        [`sciflat.FitResult.with_known_errors`][]), Δχ² against χ²₁.
    - a negative log-likelihood (a scalar): 2 Δ(−log L) against χ²₁ (pyPESTO's and
        MINUIT's `minos`).

    A side on which the profile never crosses (a bound, a flat profile, `max_steps`)
    is flagged open (`lower_open`, `upper_open`), with the farthest value reached.

    !!! Example

        ```python
        result = sciflat.least_squares(residuals, model, args=(x, y))
        prof = sciflat.profile(result, residuals, args=(x, y))
        print(prof)                      # the intervals at 68.27 % and 95 %
        prof["b1"].interval(0.95)        # lower, upper, and whether open
        prof.plot()
        ```

    **Arguments:**

    - `result`: the fit ([`sciflat.least_squares`][], [`sciflat.minimize`][], ...):
        its `p` must be the minimum. A standard error is not needed (it only sets the
        first step).
    - `fn`, `args`: the residuals the fit minimised (`fn(model, *args) -> array`) or
        its negative log-likelihood (`-> scalar`), with their data.
    - `which`: the parameters (names as in the report, `"b1"`, `"w[0, 1]"`, or
        indices of `p`); default all.
    - `levels`: the probabilities (default 1σ, 0.6827, and 0.95).
    - `bounds`: the bounds the fit had, as in `least_squares` and `minimize`.
    - `max_steps`: refits per side before it is called open.
    - `rtol`: the relative tolerance of the statistic at a crossing.
    - `batch`: run each stage's refits as one [`sciflat.least_squares_batch`][]
        (default: for residuals without bounds); else SciPy one refit at a time.
    - `**kwargs`: the refits' tolerances (`ftol`, `xtol`, `gtol`, `max_nfev`).

    **Returns:**

    A [`sciflat.ProfileResult`][]: `print` it, `.interval(level)`, `[name]`, `.plot()`.
    """
    import scipy.stats

    if not isinstance(result, FitResult) or result.re is None:
        raise TypeError(
            "`result` must be the `sciflat.FitResult` of a fit (with its `re`), got "
            f"{type(result).__name__}."
        )
    levels = tuple(sorted(float(lv) for lv in levels))
    if not levels or not all(0.0 < lv < 1.0 for lv in levels):
        raise ValueError(f"`levels` must be probabilities in (0, 1), got {levels}.")
    re = result.re
    x_hat = np.asarray(result.p, np.float64)
    n = len(x_hat)
    names = value_names(re)
    indices = _which(which, names)
    args = tuple(args)
    out = jax.eval_shape(lambda x: fn(unwrap(re(x)), *args), jnp.asarray(x_hat))
    vector = len(getattr(out, "shape", ())) > 0
    leaves, rebuild = split_args(args)
    evaluate = _value_and_grads(fn, re, vector, rebuild)
    f_hat = float(evaluate(jnp.asarray(x_hat)[None], leaves)[0][0])

    unc = result.uncertainty
    if vector:
        m = int(np.prod(out.shape))
        known = unc is not None and unc.residual_variance is None
        if known:
            scale, quantile = 1.0, lambda lv: scipy.stats.chi2.ppf(lv, 1)
            words = "Δχ² against χ²₁ (known errors)"
        else:
            dof = m - n
            if dof <= 0:
                raise ValueError(
                    f"`fn`: {m} residuals for {n} parameters leave no degree of freedom "
                    "for the residual variance s²; with known errors pass "
                    "`result.with_known_errors()`."
                )
            scale = f_hat / dof
            quantile = lambda lv: scipy.stats.f.ppf(lv, 1, dof)
            words = f"Δχ²/s² against F(1, {dof}), s² = χ²/(m - n) = {scale:.6g}"
    else:
        scale, quantile = 1.0, lambda lv: scipy.stats.chi2.ppf(lv, 1)
        words = "2 Δ(-log L) against χ²₁"
    thresholds = [float(quantile(lv)) for lv in levels]

    fb = flat_bounds(bounds, re, x_hat) if bounds is not None else None
    lb, ub = fb if fb is not None else (np.full(n, -np.inf), np.full(n, np.inf))
    lb, ub = np.asarray(lb, np.float64), np.asarray(ub, np.float64)
    # The device fit takes no bounds and needs m >= n - 1 residuals.
    batchable = vector and fb is None and int(np.prod(out.shape)) >= n - 1
    use_batch = batchable if batch is None else bool(batch)
    if use_batch and not batchable:
        raise ValueError(
            "`batch=True` needs residuals without bounds, at least as many as the "
            "other parameters (the device fit's); leave `batch` unset to refit with "
            "SciPy."
        )
    engine = _Engine(fn, re, args, leaves, rebuild, vector, lb, ub, use_batch, kwargs)
    steps = _first_steps(result, x_hat, re)
    # One path per parameter, side and level: the levels' crossings are sought at
    # once (a wider batch, half the stages of one path crossing them in turn).
    paths = [
        _Path(
            j,
            side,
            float(x_hat[j]),
            steps[j],
            float(ub[j] - x_hat[j]) if side > 0 else float(x_hat[j] - lb[j]),
            [threshold],
            max_steps,
            rtol,
        )
        for j in indices
        for side in (-1, 1)
        for threshold in thresholds
    ]
    for path in paths:
        path.start(x_hat, 0.0)
    width = len(paths)  # each stage refits this many (padded): one compilation
    while active := [p for p in paths if not p.done]:
        proposals = [p.propose() for p in active]
        js = np.array([p.j for p in active] + [active[0].j] * (width - len(active)))
        hs = [h for h, _ in proposals]
        xjs = np.array([p.x0 + p.side * h for p, h in zip(active, hs, strict=True)])
        xjs = np.concatenate([xjs, np.full(width - len(active), xjs[0])])
        starts = np.stack(
            [s for _, s in proposals] + [proposals[0][1]] * (width - len(active))
        )
        starts = np.clip(starts, lb, ub)
        fitted = engine.refit(js, xjs, starts)
        values, grads = evaluate(jnp.asarray(fitted), leaves)
        values, grads = np.asarray(values), np.asarray(grads)
        for k, (path, h) in enumerate(zip(active, hs, strict=True)):
            stat = (values[k] - f_hat) / scale
            path.accept(h, fitted[k], float(stat), float(grads[k, path.j] / scale))
        engine.n_fits -= width - len(active)

    to_values = _constrained_rows(re, result.model)
    profiles = tuple(
        _profile_of(
            j,
            [p for p in paths if p.j == j],
            names,
            to_values,
            x_hat,
            levels,
            thresholds,
        )
        for j in indices
    )
    method = "one least_squares_batch per stage" if use_batch else "SciPy, one by one"
    return ProfileResult(profiles, levels, words, method, engine.n_fits)


def _which(which, names: tuple[str, ...]) -> list[int]:
    if which is None:
        return list(range(len(names)))
    if isinstance(which, str | int):
        which = [which]
    out = []
    for w in which:
        if isinstance(w, int) and not isinstance(w, bool):
            if not 0 <= w < len(names):
                raise ValueError(f"`which`: index {w} is not in p (n = {len(names)}).")
            out.append(w)
            continue
        hits = [i for i, nm in enumerate(names) if w in (nm, pretty(nm))]
        if not hits:
            shown = [pretty(nm) for nm in names[:20]]
            raise ValueError(f"`which`: no parameter named {w!r}; there are {shown}.")
        out.append(hits[0])
    return sorted(set(out))


def _first_steps(result: FitResult, x_hat: np.ndarray, re: Restructure) -> np.ndarray:
    """The Wald standard error of each entry of `p` (raw, through a transform), where
    the result has one; else a tenth of the value's size."""
    guess = 0.1 * np.maximum(np.abs(x_hat), 1e-2)
    unc = result.uncertainty
    if unc is None:
        return guess
    var = np.diag(unc.covariance).copy()
    if has_transforms(result.model):
        d = np.asarray(derivative(re)(jnp.asarray(x_hat)), np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            var = var / d**2
    sd = np.sqrt(var)
    return np.where(np.isfinite(sd) & (sd > 0), sd, guess)


def _constrained_rows(re: Restructure, model: Any) -> Callable:
    """`xs (K, n) -> constrained values (K, n)` (compiled once per structure), or
    the identity without transforms."""
    if not has_transforms(model):
        return lambda xs: np.asarray(xs, np.float64)

    def make():
        return jax.jit(jax.vmap(lambda x: constrained(re, x)))

    f = shared(("profile:constrained", structure_key(re)), make)
    return lambda xs: np.asarray(f(jnp.asarray(xs, jnp.float64)), np.float64)


def _profile_of(j, paths, names, to_values, x_hat, levels, thresholds) -> Profile:
    """The profile of parameter `j` from its two paths, in its constrained values."""
    pts = [(x, s) for p in paths for x, s in zip(p.xs, p.stats, strict=True)]
    xs = np.stack([x for x, _ in pts])
    stats = np.array([s for _, s in pts])
    # The ends of every interval, each on the path's own line through the fit.
    ends, opens = [], []
    for t in range(len(levels)):
        for side in (-1, 1):
            p = next(p for p in paths if p.side == side and thresholds[t] in p.targets)
            k = p.targets.index(thresholds[t])
            crossed = k < len(p.crossings)
            h = p.crossings[k] if crossed else max(p.hs)
            x = x_hat.copy()
            x[j] = p.x0 + p.side * h
            ends.append(x)
            opens.append(not crossed)
    mapped = to_values(np.concatenate([xs, np.stack(ends), x_hat[None]]))[:, j]
    values, end_values, value = mapped[: len(xs)], mapped[len(xs) : -1], mapped[-1]
    order = np.argsort(values, kind="stable")
    keep = np.concatenate([[True], np.diff(values[order]) != 0])
    order = order[keep]
    intervals = []
    for t, lv in enumerate(levels):
        pair = sorted(
            zip(end_values[2 * t : 2 * t + 2], opens[2 * t : 2 * t + 2], strict=True)
        )
        (lo, lo_open), (hi, hi_open) = pair
        intervals.append(
            ProfileInterval(
                pretty(names[j]),
                lv,
                float(value),
                float(lo),
                float(hi),
                bool(lo_open),
                bool(hi_open),
                thresholds[t],
            )
        )
    message = "; ".join(
        f"{'lower' if p.side < 0 else 'upper'} side"
        + (
            f" ({_pct(levels[thresholds.index(p.targets[0])])})"
            if len(levels) > 1
            else ""
        )
        + f": {p.reason}"
        for p in paths
    )
    return Profile(
        names[j],
        j,
        float(value),
        values[order],
        stats[order],
        xs[order],
        tuple(intervals),
        message,
    )
