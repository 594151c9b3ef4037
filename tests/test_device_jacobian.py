"""The device fits' Jacobian: forward mode one trainable array at a time.

Reference: `jax.jacfwd` of the residuals of `re(p)`, the flat vector differentiated
at once, in the same test."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

import sciflat
from sciflat._device import jacobian


jax.config.update("jax_enable_x64", True)

T = jnp.linspace(0.0, 2.0, 7)


def _residuals(m, t):
    out = m["a"] * jnp.exp(-m["b"] * t) + m["s1"] * m["s2"] * jnp.sin(t) - m["c"]
    if "w" in m:
        out = out + jnp.sum(m["w"]) * t**2 + m["w"].ravel()[0] * jnp.cos(m["a"] * t)
    return out


def _plain_jacobian(residuals, re, p, *args):
    return jax.jacfwd(lambda p: residuals(re(p), *args))(p)


@settings(max_examples=8, deadline=None)
@given(
    values=st.lists(st.floats(-2.0, 2.0), min_size=9, max_size=9),
    w_shape=st.sampled_from([None, (1,), (3,), (2, 2)]),
)
def test_the_jacobian_by_arrays_equals_jacfwd_of_p(values, w_shape):
    """Scalars, an array, one array used twice (once in `p`) and a frozen leaf: each
    array differentiated on its own gives `jax.jacfwd`'s Jacobian of `p`, and the
    residuals themselves, to their last bits, as the plain residuals compiled give
    them (run eagerly, op by op, they were an ulp of their largest term away: 1.8e-15
    at -0.36, the terms about 8)."""
    shared = jnp.asarray(values[2])
    model = dict(a=values[0], b=values[1], c=values[3])
    model = jax.tree.map(jnp.asarray, model)
    model["s1"] = model["s2"] = shared
    if w_shape is not None:
        model["w"] = jnp.asarray(values[4 : 4 + int(np.prod(w_shape))]).reshape(w_shape)
    spec = jax.tree.map(lambda _: True, model)
    spec["c"] = False
    p, re_ = sciflat.destructure(model, spec)
    assert len(p) == 3 + (0 if w_shape is None else int(np.prod(w_shape)))
    evaluate = jacobian.evaluation(_residuals, re_, tuple, "forward")
    f, jac = jax.jit(evaluate)(p, [T])
    reference = _plain_jacobian(_residuals, re_, p, T)
    plain = jax.jit(lambda p: _residuals(re_(p), T))(p)
    np.testing.assert_array_equal(f, plain)
    np.testing.assert_allclose(jac, reference, rtol=1e-14, atol=1e-14)


def _arithmetic(fn, *args) -> int:
    """The elementwise arithmetic of `fn`'s optimised XLA program: the number of
    entries its multiplications, additions, ... compute (each once: XLA removes
    the repeated primal computations)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    ops = "multiply|add|subtract|divide|exponential|negate"
    total = 0
    for shape in re.findall(rf"= f64\[([0-9,]*)\]\S* (?:{ops})\(", text):
        total += int(np.prod([int(d) for d in shape.split(",") if d]))
    return total


def test_each_array_is_differentiated_on_its_own():
    """Gpufit's 2-D Gaussian of five scalars: the Jacobian's program computes no
    product with a zero tangent (`jax.jacfwd` of `p` carries five tangents, zeros
    but one, through every operation): less than half of `jacfwd`'s arithmetic,
    and the same Jacobian."""
    xy = np.stack(np.meshgrid(np.arange(5.0), np.arange(5.0))).reshape(2, -1)
    xy = jnp.asarray(xy)

    def spot(m, xy):
        r2 = (xy[0] - m["x0"]) ** 2 + (xy[1] - m["y0"]) ** 2
        return m["a"] * jnp.exp(-r2 / (2 * m["s"] ** 2)) + m["b"]

    model = dict(a=10.0, b=1.0, s=1.0, x0=2.0, y0=2.0)
    p, re_ = sciflat.destructure(jax.tree.map(jnp.asarray, model))
    evaluate = jacobian.evaluation(spot, re_, tuple, "forward")
    by_arrays = _arithmetic(lambda p: evaluate(p, [xy]), p)
    at_once = _arithmetic(jax.jacfwd(lambda p: spot(re_(p), xy)), p)
    assert 0 < by_arrays < 0.5 * at_once
    np.testing.assert_allclose(
        evaluate(p, [xy])[1], _plain_jacobian(spot, re_, p, xy), rtol=1e-14
    )


def test_many_arrays_and_reverse_mode_keep_jacfwd_and_vjp():
    """Above `MAX_ARRAYS` arrays, forward mode is one `jacfwd` of `p` (a program per
    array would compile the residuals that many times); reverse mode is unchanged.
    Both give the same Jacobian."""
    model = {f"k{i:02d}": float(i + 1) for i in range(jacobian.MAX_ARRAYS + 1)}

    def residuals(m, t):
        return sum(v * jnp.exp(-0.1 * v * t) for v in m.values())

    p, re_ = sciflat.destructure(jax.tree.map(jnp.asarray, model))
    reference = _plain_jacobian(residuals, re_, p, T)
    for mode in ("forward", "reverse"):
        _, jac = jacobian.evaluation(residuals, re_, tuple, mode)(p, [T])
        np.testing.assert_allclose(jac, reference, rtol=1e-13, atol=1e-15)


def test_a_device_fit_of_a_tied_model_reports_the_jacobian_of_p():
    """From the user's side: the fit's Jacobian at its solution (`raw.jac`) is
    `jax.jacfwd`'s of the flat vector, for a model whose amplitude is one array used
    in two places."""
    t = np.linspace(0.0, 3.0, 12)
    amp = jnp.asarray(2.0)
    model = dict(a1=amp, a2=amp, k=jnp.asarray(0.5), w=jnp.asarray([0.1, 0.2]))

    def residuals(m, t, y):
        return m["a1"] * jnp.exp(-m["k"] * t) + m["a2"] * m["w"][0] * t + m["w"][1] - y

    y = 3.0 * np.exp(-0.7 * t) + 0.3 * t + 0.05
    fit = sciflat.least_squares(residuals, model, args=(t, y), method="device")
    assert fit.status == "converged"
    _, re_ = sciflat.destructure(model)
    expected = jax.jacfwd(lambda p: residuals(re_(p), t, y))(jnp.asarray(fit.p))
    np.testing.assert_allclose(fit.raw.jac, expected, rtol=1e-12)


def test_an_infinite_partial_stays_in_its_own_column():
    """`sqrt(b)` at `b = 0`: its derivative in `b` is infinite. `jax.jacfwd` of `p`
    multiplies it by the zero tangent of `a`'s direction, `0 · inf`, and gives NaN
    in `a`'s column; differentiated on its own, `a`'s column is `t`."""

    def residuals(m, t):
        return m["a"] * t + jnp.sqrt(m["b"])

    p, re_ = sciflat.destructure(dict(a=jnp.asarray(2.0), b=jnp.asarray(0.0)))
    _, jac = jacobian.evaluation(residuals, re_, tuple, "forward")(p, [T])
    np.testing.assert_array_equal(jac[:, 0], T)
    assert np.all(np.isinf(jac[:, 1]))
    assert np.all(np.isnan(_plain_jacobian(residuals, re_, p, T)[:, 0]))


def test_residuals_with_a_loop_keep_one_pass_of_every_direction():
    """An ODE solved by a loop (Euler's steps here; Diffrax's and `BDF`'s solves are
    while loops): a pass per array would run the loop once per array, as XLA cannot
    merge loops. The Jacobian's program holds one loop, and `jacfwd`'s Jacobian."""

    def residuals(m, t):
        def step(_, y):
            return y + 0.01 * (-m["k"] * y + m["b"])

        y = jax.lax.fori_loop(0, 50, step, m["a"] * jnp.ones_like(t))
        return y * t

    model = jax.tree.map(jnp.asarray, dict(a=1.0, b=0.3, k=2.0))
    p, re_ = sciflat.destructure(model)
    evaluate = jacobian.evaluation(residuals, re_, tuple, "forward")
    text = str(jax.make_jaxpr(lambda p: evaluate(p, [T]))(p))
    assert text.count(" while[") + text.count(" scan[") == 1
    np.testing.assert_allclose(
        evaluate(p, [T])[1], _plain_jacobian(residuals, re_, p, T), rtol=1e-13
    )
