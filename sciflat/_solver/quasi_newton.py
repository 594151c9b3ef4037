"""Self-scaled quasi-Newton minimisers on a flat vector: SSBroyden, SSBFGS and BFGS.

The updates of the inverse Hessian approximation are the self-scaled Broyden family of
Urbán, Stefanou & Pons, J. Comput. Phys. 523, 113656 (2025), arXiv:2405.04230 (after
Al-Baali & Khalfan), as used for PINNs by Kiyani et al., CMAME 446, 118308 (2025). The
whole iteration, line search included, is one compiled `lax.while_loop`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._fitting.result import FitResult, Status
from .._flatten import Restructure
from .._validate import as_flat_vector
from .wolfe import Trial, wolfe_search


Method = Literal["ssbroyden", "ssbfgs", "bfgs"]
_METHODS = ("ssbroyden", "ssbfgs", "bfgs")
_STATUS: tuple[Status, ...] = ("max_steps", "converged", "nonfinite", "failed")
_RUNNING, _CONVERGED, _NONFINITE, _FAILED = -1, 1, 2, 3

#
# The update.
#


def update_inverse_hessian(
    H: Float[Array, "n n"],
    s: Float[Array, " n"],
    y: Float[Array, " n"],
    grad: Float[Array, " n"],
    alpha: Float[Array, ""],
    method: Method,
    first: Bool[Array, ""],
) -> Float[Array, "n n"]:
    """The Broyden-family update of the inverse Hessian approximation `H`, scaled by 1/τ:

        H₊ = (H − H y yᵀH / yᵀHy + φ yᵀHy v vᵀ) / τ + s sᵀ / yᵀs,
        v = s / yᵀs − H y / yᵀHy,

    for the step `s = alpha * d` (d = −H `grad`) and the change of gradient `y`. H₊ y = s
    for every φ and τ. BFGS: φ = 1, τ = 1. SSBFGS: φ = 1, τ = min(1, 1/b) (τ = h on the
    first update). SSBroyden: φ and τ from θ as in Urbán et al. (their Algorithm 2).
    With b = −α sᵀg / yᵀs (= sᵀBs / yᵀs, B = H⁻¹) and h = yᵀHy / yᵀs."""
    ys = y @ s
    Hy = H @ y
    yHy = y @ Hy
    b = -alpha * (s @ grad) / ys
    h = yHy / ys
    a = b * h - 1  # ≥ 0 (Cauchy–Schwarz): 0 when every member of the family agrees
    if method == "bfgs":
        theta, tau = jnp.zeros_like(ys), jnp.ones_like(ys)
    elif method == "ssbfgs":
        theta, tau = jnp.zeros_like(ys), jnp.where(first, h, jnp.minimum(1, 1 / b))
    else:
        theta, tau = _ssbroyden_scaling(a, b, h, first, s.size)
    phi = (1 - theta) / (1 + a * theta)
    v = s / ys - Hy / yHy
    # Three symmetric rank-one terms ±w wᵀ, each w scaled beforehand: entry (i, j) is
    # then ±wᵢwⱼ + ..., whose rounding (fused multiply-adds included) is that of (j, i),
    # so H₊ stays exactly symmetric. φ < 0 happens (SSBroyden's θ > 1): its sign goes
    # on one side, exactly.
    w_hy = Hy / jnp.sqrt(tau * yHy)
    w_v = v * jnp.sqrt(jnp.abs(phi) * yHy / tau)
    w_s = s / jnp.sqrt(ys)
    outer = lambda u, w: u[:, None] * w[None, :]
    return (
        H / tau - outer(w_hy, w_hy) + outer(jnp.sign(phi) * w_v, w_v) + outer(w_s, w_s)
    )


def _ssbroyden_scaling(a, b, h, first, n):
    """θ (φ = (1 − θ)/(1 + aθ)) and τ of SSBroyden (Urbán et al., 2025, after Al-Baali
    & Khalfan): θ in the interval that keeps the update positive definite and well
    scaled, τ from the same quantities."""
    ok = a > jnp.finfo(a.dtype).eps
    a_ = jnp.where(ok, a, 1)
    c = jnp.sqrt(a_ / (1 + a_))
    rho_minus = jnp.minimum(1, h * (1 - c))
    theta_minus, theta_plus = (rho_minus - 1) / a_, 1 / rho_minus
    theta = jnp.maximum(theta_minus, jnp.minimum(theta_plus, (1 - b) / b))
    theta = jnp.where(ok, theta, 0)
    sigma = 1 + a * theta
    # With one parameter every member of the family is the secant s / y (a = 0, so
    # σ = 1): σ^(1/(1-n)) has no exponent there, and 1 is its value in the limit.
    sigma_n = sigma ** (1 / (1 - n)) if n > 1 else jnp.ones_like(sigma)
    rho_k = jnp.minimum(1, 1 / b)
    later = jnp.where(
        theta <= 0,
        jnp.minimum(rho_k * sigma_n, sigma),
        rho_k * jnp.minimum(sigma_n, 1 / jnp.where(theta > 0, theta, 1)),
    )
    return theta, jnp.where(first, h / sigma, later)


#
# The loop.
#


class QuasiNewtonState(eqx.Module):
    """Where a [`sciflat.quasi_newton`][] run ended (its `FitResult.raw`): pass it as
    `state=` to go on with the same inverse Hessian approximation.

    **Fields:**

    - `p`, `loss`, `grad`: the last point, its loss and gradient.
    - `hessian_inv`: the `(n, n)` inverse Hessian approximation, in `p.dtype`.
    - `scaled`: whether the first (self-scaling) update has happened.
    - `n_steps`, `n_evaluations`: steps, and loss-and-gradient evaluations, of this run.
    - `history`: the loss at the start and after each step (`max_steps + 1` entries, NaN
        past `n_steps`).
    - `step_size`, `slope0`, `slope`, `wolfe`: per step, the step α, ∇f·d before and
        after it, and whether both strong Wolfe conditions held (NaN / False past
        `n_steps`).
    """

    p: Float[Array, " n"]
    loss: Float[Array, ""]
    grad: Float[Array, " n"]
    hessian_inv: Float[Array, "n n"]
    scaled: Bool[Array, ""]
    n_steps: Int[Array, ""]
    n_evaluations: Int[Array, ""]
    status: Int[Array, ""]
    history: Float[Array, " m1"]
    step_size: Float[Array, " m"]
    slope0: Float[Array, " m"]
    slope: Float[Array, " m"]
    wolfe: Bool[Array, " m"]


@dataclasses.dataclass(frozen=True)
class _Options:
    method: Method
    max_steps: int
    gtol: float
    c1: float
    c2: float
    max_line_search: int


@eqx.filter_jit
def _run(fn, p, args, hessian_inv, scaled, options: _Options) -> QuasiNewtonState:
    value_and_grad = jax.value_and_grad(lambda p: fn(p, *args))
    f, g = value_and_grad(p)
    m, nan = options.max_steps, jnp.full((), jnp.nan, p.dtype)
    init = QuasiNewtonState(
        p,
        f,
        g,
        hessian_inv,
        scaled,
        jnp.array(0),
        jnp.array(1),
        jnp.where(jnp.isfinite(f) & jnp.all(jnp.isfinite(g)), _RUNNING, _NONFINITE),
        jnp.full(m + 1, nan).at[0].set(f),
        jnp.full(m, nan),
        jnp.full(m, nan),
        jnp.full(m, nan),
        jnp.zeros(m, bool),
    )

    def step(st: QuasiNewtonState) -> QuasiNewtonState:
        d = -(st.hessian_inv @ st.grad)
        start = Trial(jnp.zeros((), p.dtype), st.loss, st.grad @ d, st.grad)
        search = wolfe_search(
            value_and_grad,
            st.p,
            d,
            start,
            c1=options.c1,
            c2=options.c2,
            max_evaluations=options.max_line_search,
        )
        new = search.point
        finite = jnp.all(jnp.isfinite(new.grad))
        moved = (new.alpha > 0) & finite & (start.slope < 0)
        s, y = new.alpha * d, new.grad - st.grad
        update = moved & (y @ s > 0)
        H = jax.lax.cond(
            update,
            lambda: update_inverse_hessian(
                st.hessian_inv, s, y, st.grad, new.alpha, options.method, ~st.scaled
            ),
            lambda: st.hessian_inv,
        )
        H_ok = jnp.all(jnp.isfinite(H))  # a degenerate update is skipped
        H = jax.lax.cond(H_ok, lambda: H, lambda: st.hessian_inv)
        grad = jnp.where(moved, new.grad, st.grad)
        status = jnp.where(
            ~finite,
            _NONFINITE,
            jnp.where(
                ~moved,
                _FAILED,
                jnp.where(jnp.max(jnp.abs(grad)) <= options.gtol, _CONVERGED, _RUNNING),
            ),
        )
        k = st.n_steps
        return QuasiNewtonState(
            jnp.where(moved, st.p + s, st.p),
            jnp.where(moved, new.f, st.loss),
            grad,
            H,
            st.scaled | (update & H_ok),
            k + moved.astype(k.dtype),
            st.n_evaluations + search.n_evaluations,
            status,
            st.history.at[k + 1].set(jnp.where(moved, new.f, nan)),
            st.step_size.at[k].set(jnp.where(moved, new.alpha, nan)),
            st.slope0.at[k].set(jnp.where(moved, start.slope, nan)),
            st.slope.at[k].set(jnp.where(moved, new.slope, nan)),
            st.wolfe.at[k].set(moved & search.wolfe),
        )

    running = lambda st: (st.status == _RUNNING) & (st.n_steps < m)
    return jax.lax.while_loop(running, step, init)


#
# The public function.
#


def quasi_newton(
    fn: Callable[..., Any],
    p: Float[ArrayLike, " n"],
    *,
    args: tuple[Any, ...] = (),
    method: Method = "ssbroyden",
    max_steps: int = 1000,
    gtol: float = 0.0,
    state: QuasiNewtonState | None = None,
    re: Restructure[Any] | None = None,
    c1: float = 1e-4,
    c2: float = 0.9,
    max_line_search: int = 25,
) -> FitResult[Any]:
    """Minimises `fn(p, *args)` over a flat vector `p` by a self-scaled quasi-Newton
    method with a strong Wolfe line search, the whole loop compiled.

    `method` is `"ssbroyden"` (self-scaled Broyden), `"ssbfgs"` (self-scaled BFGS) or
    `"bfgs"` (their unscaled special case; the same iterates as
    `optimistix.BFGS` wherever both accept the unit step). The inverse Hessian
    approximation is a dense `(n, n)` matrix in `p.dtype`: 8n² bytes in float64, so
    72 MB at n = 3,000 and 800 MB at n = 10,000; each step costs two matrix-vector
    products and one rank-two update, O(n²). Beyond n ≈ 10⁴ use L-BFGS
    ([`sciflat.minimize`][] with `method="L-BFGS-B"`).

    Every step starts from α = 1, brackets and zooms (Nocedal & Wright, Algorithms 3.5
    and 3.6) until both strong Wolfe conditions hold with `c1` and `c2`, within
    `max_line_search` evaluations (else the lowest point found, if lower). The loss is
    computed in `p.dtype` throughout: float64 stays float64. Compilations are reused
    for the same `fn` (by identity), the same shapes and the same options.

    !!! Example

        ```python
        import jax.numpy as jnp
        import sciflat

        rosenbrock = lambda p: (1 - p[0]) ** 2 + 100 * (p[1] - p[0] ** 2) ** 2
        result = sciflat.quasi_newton(rosenbrock, jnp.array([-1.2, 1.0]), gtol=1e-10)
        print(result.status, result.p)
        more = sciflat.quasi_newton(rosenbrock, result.p, state=result.raw)
        ```

    **Arguments:**

    - `fn`: the loss, `fn(p, *args) -> scalar`, differentiable in `p`.
    - `p`: the start, a 1-D real floating vector (e.g. from [`sciflat.destructure`][]).
    - `args`: further arguments of `fn` (traced: new values do not recompile).
    - `method`: `"ssbroyden"`, `"ssbfgs"` or `"bfgs"`.
    - `max_steps`: steps at most (each one line search, mostly one evaluation).
    - `gtol`: stop when every entry of the gradient is at most this (0: never).
    - `state`: a previous run's `result.raw`, to go on with its inverse Hessian
        approximation (the loss and gradient are recomputed at `p`, so `args` may have
        changed, e.g. resampled collocation points).
    - `re`: a [`sciflat.Restructure`][]: `result.model` is then `re(result.p)`.
    - `c1`, `c2`: the sufficient-decrease and curvature constants, 0 < c1 < c2 < 1.
    - `max_line_search`: evaluations per line search at most.

    **Returns:**

    A [`sciflat.FitResult`][] with `status` `"converged"` (`gtol` met), `"max_steps"`,
    `"nonfinite"` (a non-finite loss or gradient at `p`, or a non-finite gradient at the
    step found) or `"failed"` (no lower point along the direction). `history` holds
    the loss at the start and after each step; `raw` is the [`sciflat.QuasiNewtonState`][].
    """
    if method not in _METHODS:
        raise ValueError(f"`method` must be one of {_METHODS}, got {method!r}.")
    if not 0 < c1 < c2 < 1:
        raise ValueError(f"`c1` and `c2` need 0 < c1 < c2 < 1, got {c1} and {c2}.")
    if max_steps < 1:
        raise ValueError(f"`max_steps` must be at least 1, got {max_steps}.")
    if np.ndim(p) != 1:
        raise ValueError(
            f"`p` must be a flat 1-D vector, got shape {np.shape(p)}: flatten a model "
            "with `p, re = sciflat.destructure(model)` and pass `re=re`."
        )
    p = as_flat_vector(p, np.shape(p)[0], "`quasi_newton`")
    if p.weak_type:  # `jnp.full(n, 0.5)`: strong, like the `p` the run returns
        p = jnp.asarray(p, dtype=p.dtype)
    if state is None:
        hessian_inv, scaled = jnp.eye(p.size, dtype=p.dtype), jnp.array(False)
        if getattr(p, "committed", False) and p.sharding.is_fully_replicated:
            # Placed, and committed, as `p` is: `jax.jit` keys on that, and a resumed
            # run (whose state and `p` are this run's outputs, committed where `p`
            # is) then reuses this run's compilation instead of compiling anew.
            hessian_inv, scaled = jax.device_put((hessian_inv, scaled), p.sharding)
    else:
        hessian_inv, scaled = state.hessian_inv, state.scaled
        if hessian_inv.shape != (p.size, p.size) or hessian_inv.dtype != p.dtype:
            raise ValueError(
                f"`state` holds an inverse Hessian of shape {hessian_inv.shape} and "
                f"dtype {hessian_inv.dtype}, but `p` has length {p.size} and dtype "
                f"{p.dtype}: pass the state of a run on the same `p` (or convert it "
                "with `state.hessian_inv.astype(...)`)."
            )
    options = _Options(method, max_steps, gtol, c1, c2, max_line_search)
    st = _run(fn, p, tuple(args), hessian_inv, scaled, options)
    n, code = int(st.n_steps), int(st.status)
    status = _STATUS[0] if code == _RUNNING else _STATUS[code]
    return FitResult(
        model=st.p if re is None else re(st.p),
        p=st.p,
        loss=float(st.loss),
        status=status,
        message=_message(status, n, method, gtol, max_steps),
        history=np.asarray(st.history[: n + 1], dtype=np.float64),
        n_steps=n,
        raw=st,
        re=re,
        n_evaluations=int(st.n_evaluations),
    )


def _message(status: Status, n: int, method: str, gtol: float, max_steps: int) -> str:
    return {
        "converged": f"{method}: every gradient entry ≤ gtol = {gtol:g} after {n} steps.",
        "max_steps": f"{method}: reached max_steps = {max_steps}; pass "
        "`state=result.raw` (and `result.p`) to go on.",
        "nonfinite": f"{method}: a non-finite loss or gradient after {n} steps; `p` is "
        "the last finite point.",
        "failed": f"{method}: the line search found no lower point along the "
        f"quasi-Newton direction after {n} steps (converged as far as {method} can).",
    }[status]
