"""A line search for the strong Wolfe conditions, compiled: one `lax.while_loop`.

Nocedal & Wright, *Numerical Optimization* (2nd ed., 2006): Algorithm 3.5 (bracket a
step) and 3.6 (zoom into the bracket), with the cubic interpolation of their eq. (3.59),
safeguarded by bisection. Every trial evaluates the loss and its gradient together, so
the accepted point's gradient is at hand for the quasi-Newton update.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


class Trial(eqx.Module):
    """One point on the line p + α d: the step, φ(α) = f(p + α d), φ'(α) = ∇f · d."""

    alpha: Float[Array, ""]
    f: Float[Array, ""]
    slope: Float[Array, ""]
    grad: Float[Array, " n"]


class WolfeResult(eqx.Module):
    """The accepted step (or, if none met both conditions, the lowest point found)."""

    point: Trial
    wolfe: Bool[Array, ""]  # both strong Wolfe conditions hold at `point`
    n_evaluations: Int[Array, ""]


class _Search(eqx.Module):
    lo: Trial  # lowest point so far meeting sufficient decrease (α = 0 at first)
    hi: Trial  # the other end of the bracket, once there is one
    alpha: Float[Array, ""]  # the next trial step
    zoom: Bool[Array, ""]
    done: Bool[Array, ""]
    i: Int[Array, ""]


def wolfe_search(
    value_and_grad: Callable[[Array], tuple[Array, Array]],
    p: Float[Array, " n"],
    d: Float[Array, " n"],
    start: Trial,
    *,
    alpha: float | Array = 1.0,
    c1: float = 1e-4,
    c2: float = 0.9,
    max_evaluations: int = 25,
) -> WolfeResult:
    """A step α along the descent direction `d` from `p` with

        f(p + α d) ≤ f(p) + c1 α ∇f(p)·d         (sufficient decrease)
        |∇f(p + α d)·d| ≤ c2 |∇f(p)·d|           (strong curvature)

    `start` is the point at α = 0. Tries `alpha` first, doubles it while the loss keeps
    falling and the slope stays negative, then zooms into the bracket. A non-finite loss
    counts as too long a step."""
    f0, slope0 = start.f, start.slope
    dtype = p.dtype

    def evaluate(a):
        f, g = value_and_grad(p + a * d)
        return Trial(a, f, g @ d, g)

    def body(s: _Search) -> _Search:
        cur = evaluate(s.alpha)
        too_long = (
            ~jnp.isfinite(cur.f)
            | (cur.f > f0 + c1 * cur.alpha * slope0)
            | (cur.f >= s.lo.f)
        )
        curved = jnp.abs(cur.slope) <= -c2 * slope0
        # In the bracketing phase "the far end" is +∞, so only the slope's sign counts.
        uphill = jnp.where(
            s.zoom, cur.slope * (s.hi.alpha - s.lo.alpha) >= 0, cur.slope >= 0
        )
        done = ~too_long & curved
        swap = ~too_long & ~curved & uphill
        lower = ~too_long & ~curved  # cur is the new lowest point
        pick = lambda c, a, b: jax.tree.map(lambda x, y: jnp.where(c, x, y), a, b)
        hi = pick(too_long, cur, pick(swap, s.lo, s.hi))
        lo = pick(lower | done, cur, s.lo)
        zoom = s.zoom | too_long | swap
        alpha = jnp.where(zoom, _interpolate(lo, hi), 2 * cur.alpha)
        return _Search(lo, hi, alpha.astype(dtype), zoom, done, s.i + 1)

    def cond(s: _Search):
        collapsed = s.zoom & (
            jnp.abs(s.hi.alpha - s.lo.alpha)
            <= jnp.finfo(dtype).eps * jnp.maximum(s.lo.alpha, s.hi.alpha)
        )
        return ~s.done & (s.i < max_evaluations) & ~collapsed

    init = _Search(
        start,
        start,
        jnp.asarray(alpha, dtype),
        jnp.array(False),
        jnp.array(False),
        jnp.array(0),
    )
    s = jax.lax.while_loop(cond, body, init)
    return WolfeResult(s.lo, s.done, s.i)


def _interpolate(lo: Trial, hi: Trial) -> Array:
    """The minimiser of the cubic through φ and φ' at both ends (N&W eq. 3.59), or the
    midpoint when that falls outside the middle 80% of the bracket (or is not finite:
    a non-finite end)."""
    d1 = lo.slope + hi.slope - 3 * (lo.f - hi.f) / (lo.alpha - hi.alpha)
    d2 = jnp.sign(hi.alpha - lo.alpha) * jnp.sqrt(
        jnp.maximum(d1**2 - lo.slope * hi.slope, 0)
    )
    cubic = hi.alpha - (hi.alpha - lo.alpha) * (hi.slope + d2 - d1) / (
        hi.slope - lo.slope + 2 * d2
    )
    a, b = jnp.minimum(lo.alpha, hi.alpha), jnp.maximum(lo.alpha, hi.alpha)
    margin = 0.1 * (b - a)
    inside = jnp.isfinite(cubic) & (cubic >= a + margin) & (cubic <= b - margin)
    return jnp.where(inside, cubic, (a + b) / 2)
