"""`sciflat.vector_field`: Diffrax differentiates with respect to `p`, in `p.dtype`.

Each solve compiles a Diffrax loop (seconds on CPU), so the matrix is kept small: every
solver with the default adjoint, every other adjoint with Tsit5, one float32 solve; the
references are closed forms (y' = (A - k I) y -> expm((A - k I) t) y0 with k a
`sciflat.Positive`; y' = a - b y -> a / b) or `jax.grad` of the same solve on the
plain pytree.
"""

import functools as ft
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import optax
import pytest

import sciflat
from helpers import foreign_float_ops


T1, DT = 1.0, 0.05
A0 = np.array([[-0.5, 1.0], [-1.0, -0.3]])
Y0 = np.array([1.0, 0.5])


class Linear(eqx.Module):
    """y' = (A - k I) y, the decay `k` a `sciflat.Positive`: the field sees k itself."""

    A: jax.Array
    k: Any

    def __call__(self, t, y, args):
        return self.A @ y - self.k * y


K0 = 0.4  # the decay; `Positive` stores its softplus inverse, K0_RAW
K0_RAW = np.log(np.expm1(K0))


def linear(dtype=jnp.float64) -> Linear:
    return Linear(jnp.asarray(A0, dtype), sciflat.Positive(jnp.asarray(K0, dtype)))


def closed_form_loss(A, raw, y0):
    # y(T) = expm((A - softplus(raw) I) T) y0, differentiable in A and the raw decay.
    k = jax.nn.softplus(raw)
    return jnp.sum((jsl.expm((A - k * jnp.eye(2)) * T1) @ y0) ** 2)


def closed_form_value_and_grad(y0):
    """The value and the gradient in `p`'s layout (A's entries, then k's raw value)."""
    value, (g_a, g_raw) = jax.value_and_grad(closed_form_loss, (0, 1))(
        jnp.asarray(A0), jnp.asarray(K0_RAW), y0
    )
    return value, jnp.concatenate([g_a.ravel(), g_raw[None]])


@ft.cache
def solve_grad(solver_name: str, adjoint_name: str, dtype_name: str, args: str = "p"):
    """Value and gradient of sum(y(T)^2) w.r.t. `p`, jitted once per combination
    (forward mode for `ForwardMode`, reverse mode for the others)."""
    dtype = jnp.dtype(dtype_name)
    _, re = sciflat.destructure(linear(dtype))
    term = diffrax.ODETerm(sciflat.vector_field(re))
    solver = getattr(diffrax, solver_name)()
    adjoint = getattr(diffrax, adjoint_name)()
    tol = 1e-10 if dtype == jnp.float64 else 1e-6
    controller = diffrax.PIDController(rtol=tol, atol=tol)

    def loss(p, y0):
        t0, t1, dt0 = (jnp.asarray(x, dtype) for x in (0.0, T1, DT))
        sol = diffrax.diffeqsolve(
            term,
            solver,
            t0,
            t1,
            dt0,
            y0,
            args=p if args == "p" else re(p),
            adjoint=adjoint,
            stepsize_controller=controller,
            max_steps=4096,
        )
        return jnp.sum(sol.ys[-1] ** 2)

    if adjoint_name == "ForwardMode":
        both = lambda p, y0: (loss(p, y0), jax.jacfwd(loss)(p, y0))
        return loss, jax.jit(both)
    return loss, jax.jit(jax.value_and_grad(loss))


# An explicit and an implicit solver with the default adjoint (the implicit one also
# differentiates the field in `y`, for its Newton steps), every other adjoint with
# Tsit5; `args=p` and `args=re(p)` (the way docs/diffrax.md teaches): the transform is
# unwrapped in each. (Another explicit Runge–Kutta solver reaches the field the same
# way as Tsit5: its case would test Diffrax, not sciflat.)
@pytest.mark.parametrize(
    "solver, adjoint, args",
    [
        ("Tsit5", "RecursiveCheckpointAdjoint", "p"),
        ("Kvaerno5", "RecursiveCheckpointAdjoint", "p"),
        ("Tsit5", "BacksolveAdjoint", "p"),
        ("Tsit5", "DirectAdjoint", "p"),
        ("Tsit5", "BacksolveAdjoint", "model"),  # args=re(p): through `re`, outside
        ("Tsit5", "ForwardMode", "model"),
    ],
)
@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_gradient_matches_closed_form_float64(solver, adjoint, args):
    p, _ = sciflat.destructure(linear())
    y0 = jnp.asarray(Y0)
    value, grad = solve_grad(solver, adjoint, "float64", args)[1](p, y0)
    ref_value, ref_grad = closed_form_value_and_grad(y0)
    assert grad.dtype == p.dtype == jnp.float64
    np.testing.assert_allclose(value, ref_value, rtol=1e-8)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-8)


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_float32_solve_stays_float32():
    p, _ = sciflat.destructure(linear(jnp.float32))
    y0 = jnp.asarray(Y0, jnp.float32)
    loss, value_and_grad = solve_grad("Tsit5", "RecursiveCheckpointAdjoint", "float32")
    value, grad = value_and_grad(p, y0)
    assert value.dtype == grad.dtype == jnp.float32
    ref_value, ref_grad = closed_form_value_and_grad(jnp.asarray(Y0))
    np.testing.assert_allclose(value, ref_value, rtol=1e-4)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-3, atol=1e-4)
    assert (
        foreign_float_ops(jax.make_jaxpr(jax.grad(loss))(p, y0).jaxpr, jnp.float32)
        == []
    )


def test_bfloat16_vector_field_and_gradient_stay_bfloat16():
    # Only the field: Diffrax's own time stepping is not reliable in bfloat16 (an Euler
    # solve over [0, 1] with dt 0.125 takes 5 steps, not 8), so no bfloat16 solve.
    bf16 = jnp.bfloat16
    p, re = sciflat.destructure(linear(bf16))
    y = jnp.asarray(Y0, bf16)
    # Not `jnp.sum`: JAX accumulates bfloat16 sums in float32 on purpose.
    f = lambda p: (lambda d: d[0] ** 2 + d[1] ** 2)(sciflat.vector_field(re)(0.5, y, p))
    value, grad = jax.value_and_grad(f)(p)
    field = lambda A, raw: (A - jax.nn.softplus(raw) * jnp.eye(2)) @ Y0
    ref_value, (g_a, g_raw) = jax.value_and_grad(
        lambda A, raw: jnp.sum(field(A, raw) ** 2), (0, 1)
    )(jnp.asarray(A0), jnp.asarray(K0_RAW))
    assert value.dtype == grad.dtype == bf16
    np.testing.assert_allclose(np.float64(value), ref_value, rtol=1e-2)
    ref_grad = np.append(np.ravel(g_a), g_raw)
    np.testing.assert_allclose(np.float64(grad), ref_grad, rtol=2e-2, atol=2e-2)
    assert foreign_float_ops(jax.make_jaxpr(jax.grad(f))(p).jaxpr, bf16) == []


@pytest.mark.parametrize("adjoint", ["RecursiveCheckpointAdjoint", "BacksolveAdjoint"])
def test_gradient_jaxpr_has_no_float_op_in_another_dtype(adjoint):
    p, _ = sciflat.destructure(linear())
    loss, _ = solve_grad("Tsit5", adjoint, "float64")
    jaxpr = jax.make_jaxpr(jax.grad(loss))(p, jnp.asarray(Y0)).jaxpr
    assert foreign_float_ops(jaxpr, jnp.float64) == []


def test_the_walker_sees_a_hidden_float32_op():
    # The walker must be able to fail: a model that computes in float32 inside.
    f = lambda p: jnp.sum(jnp.sin(p.astype(jnp.float32)).astype(jnp.float64))
    jaxpr = jax.make_jaxpr(jax.grad(f))(jnp.ones(3))
    assert any("float32" in op for op in foreign_float_ops(jaxpr.jaxpr, jnp.float64))


class Decay(eqx.Module):
    a: jax.Array
    b: jax.Array

    def __call__(self, t, y, args):
        return self.a - self.b * y


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_implicit_adjoint_at_steady_state():
    # y' = a - b y has the steady state a / b: d/da = 1/b, d/db = -a/b^2.
    model = Decay(jnp.asarray(2.0), jnp.asarray(4.0))
    p, re = sciflat.destructure(model)
    term = diffrax.ODETerm(sciflat.vector_field(re))

    @jax.jit
    @jax.value_and_grad
    def steady(p):
        sol = diffrax.diffeqsolve(
            term,
            diffrax.Kvaerno5(),
            0.0,
            jnp.inf,
            0.1,
            jnp.asarray(0.0),
            args=p,
            event=diffrax.Event(diffrax.steady_state_event()),
            adjoint=diffrax.ImplicitAdjoint(),
            stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-10),
            max_steps=1024,
        )
        return sol.ys[-1]

    value, grad = steady(p)
    assert grad.dtype == jnp.float64
    np.testing.assert_allclose(value, 0.5, rtol=1e-8)
    np.testing.assert_allclose(grad, [1 / 4, -2 / 16], rtol=1e-6)


#
# Universal differential equation: known physics + network, one `p`, ties, float32 init.
#


class UDE(eqx.Module):
    """Lotka–Volterra prey growth and predator death known, interaction learned.

    The network's hidden layer is used twice (a tie), and it is built in float32.
    """

    alpha: jax.Array
    delta: jax.Array
    hidden: eqx.nn.Linear
    hidden_again: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.alpha = jnp.asarray(1.5, jnp.float32)
        self.delta = jnp.asarray(1.0, jnp.float32)
        self.hidden = eqx.nn.Linear(4, 4, key=k1)
        self.hidden_again = self.hidden
        self.out = eqx.nn.Linear(4, 2, key=k2)

    def __call__(self, t, y, args):
        h = jnp.tanh(self.hidden(jnp.concatenate([y, y])))
        net = self.out(jnp.tanh(self.hidden_again(h)))
        physics = jnp.stack([self.alpha * y[0], -self.delta * y[1]])
        return physics + 0.1 * net


def _solve_ys(term, args, y0):
    sol = diffrax.diffeqsolve(
        term,
        diffrax.Tsit5(),
        0.0,
        1.0,
        0.1,
        y0,
        args=args,
        saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 5)),
    )
    return jnp.sum(sol.ys**2)


#
# Signatures and the dtype rule, checked on the vector field itself (no solve).
#


class ByY(eqx.Module):
    w: jax.Array

    def __call__(self, y):
        return -self.w * y


class ByTY(eqx.Module):
    w: jax.Array

    def __call__(self, t, y):
        return -self.w * y * t


class ByTYArgs(eqx.Module):
    w: jax.Array

    def __call__(self, t, y, args):
        return -self.w * y + (0.0 if args is None else args["forcing"])


@pytest.mark.parametrize(
    "model, signature, extra, expected",
    [
        (ByY(jnp.asarray(2.0)), "y", None, -6.0),
        (ByTY(jnp.asarray(2.0)), "t,y", None, -3.0),
        (ByTYArgs(jnp.asarray(2.0)), "t,y,args", None, -6.0),
        (ByTYArgs(jnp.asarray(2.0)), "t,y,args", {"forcing": 1.0}, -5.0),
    ],
)
def test_signatures(model, signature, extra, expected):
    p, re = sciflat.destructure(model)
    f = sciflat.vector_field(re, signature)
    args = p if extra is None else (p, extra)
    out = f(jnp.asarray(0.5), jnp.asarray(3.0), args)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, expected)


def test_args_model_is_the_same_field_as_args_p():
    model = UDE(jax.random.key(0))
    p, re = sciflat.destructure(model, dtype=jnp.float64)
    y = jnp.asarray([1.0, 0.5])
    f = sciflat.vector_field(re)
    by_p = lambda p: f(0.3, y, p)
    by_model = lambda p: f(0.3, y, re(p))
    by_model_extra = lambda p: f(0.3, y, (re(p), None))
    np.testing.assert_allclose(by_model(p), by_p(p), rtol=1e-14)
    np.testing.assert_allclose(by_model_extra(p), by_p(p), rtol=1e-14)
    jac_p, jac_model = jax.jacrev(by_p)(p), jax.jacrev(by_model)(p)
    assert jac_model.dtype == jnp.float64
    np.testing.assert_allclose(jac_model, jac_p, rtol=1e-14)
    with pytest.raises(
        TypeError, match="`y` has dtype float32, but `p` has dtype float64"
    ):
        f(0.3, y.astype(jnp.float32), re(p))
    with pytest.raises(TypeError, match="`args` of `diffeqsolve` must be the model"):
        f(0.3, y, [p])


def test_a_model_as_args_with_two_float_dtypes_is_a_type_error():
    # The original float32 UDE with one leaf made float64: not something `re` builds.
    model = UDE(jax.random.key(0))
    model = eqx.tree_at(lambda m: m.alpha, model, jnp.asarray(1.5, jnp.float64))
    _, re = sciflat.destructure(model)
    with pytest.raises(
        TypeError, match=r"two dtypes: `.alpha` is float64 and `.delta` is float32"
    ):
        sciflat.vector_field(re)(0.3, jnp.ones(2, jnp.float64), model)


def test_a_tie_that_replaces_a_submodule_is_read_as_the_model():
    # `ties=` drops the whole second network from `p`; `re(p)` puts it back, so the
    # rebuilt model's structure is not the one `destructure` stored.
    class Two(eqx.Module):
        a: eqx.nn.MLP
        b: eqx.nn.MLP

        def __call__(self, t, y, args):
            return self.b(self.a(y))

    k1, k2 = jax.random.split(jax.random.key(2))
    model = Two(eqx.nn.MLP(2, 2, 4, 1, key=k1), eqx.nn.MLP(2, 2, 4, 1, key=k2))
    p, re = sciflat.destructure(model, ties=[(lambda m: m.b, lambda m: m.a)])
    f = sciflat.vector_field(re)
    y = jnp.asarray([0.3, -0.4])
    plain = Two(model.a, model.a)
    np.testing.assert_allclose(f(0.0, y, re(p)), plain(0.0, y, None), rtol=1e-14)
    np.testing.assert_allclose(f(0.0, y, (re(p), None)), f(0.0, y, p), rtol=1e-14)


def test_time_reaches_the_model_in_p_dtype():
    seen = []

    class Spy(eqx.Module):
        w: jax.Array

        def __call__(self, t, y):
            seen.append(t.dtype)
            return self.w * y

    p, re = sciflat.destructure(Spy(jnp.ones((), jnp.float32)))
    sciflat.vector_field(re, "t,y")(
        jnp.asarray(0.5, jnp.float64), jnp.ones((), jnp.float32), p
    )
    assert seen == [jnp.float32]


def _shape_of_solve(term, y0, p, dtype=None):
    t0, t1, dt0 = (
        (0.0, 1.0, 0.1) if dtype is None else (dtype(0.0), dtype(1.0), dtype(0.1))
    )
    solve = lambda p: (
        diffrax.diffeqsolve(term, diffrax.Tsit5(), t0, t1, dt0, y0, args=p).ys
    )
    return jax.eval_shape(solve, p)


def test_float32_y0_with_float64_p_is_a_type_error():
    p, re = sciflat.destructure(linear())
    term = diffrax.ODETerm(sciflat.vector_field(re))
    y0 = jnp.asarray(Y0, jnp.float32)
    with pytest.raises(
        TypeError, match=r"`y` has dtype float32, but `p` has dtype float64"
    ):
        _shape_of_solve(term, y0, p, jnp.float32)


def test_diffrax_promotes_y0_to_the_time_dtype_first():
    # The documented rule: Diffrax itself promotes `y0` with the dtype of the times
    # before any vector field sees it, so with Python-float times under x64 a float32
    # `y0` becomes float64 and the solve runs in float64, like `p` (never in float32).
    p, re = sciflat.destructure(linear())
    term = diffrax.ODETerm(sciflat.vector_field(re))
    assert _shape_of_solve(term, jnp.asarray(Y0, jnp.float32), p).dtype == jnp.float64


def test_float64_times_promoting_a_float32_state_is_a_type_error():
    # Diffrax promotes y0 to the dtype of the times: float32 p and y0 with float64
    # times would silently solve in float64; the message says why.
    p, re = sciflat.destructure(linear(jnp.float32))
    term = diffrax.ODETerm(sciflat.vector_field(re))
    with pytest.raises(TypeError, match=r"(?s)float64, but `p` has dtype float32.*t0"):
        _shape_of_solve(term, jnp.asarray(Y0, jnp.float32), p)


def test_model_output_in_another_dtype_is_a_type_error():
    class Sneaky(eqx.Module):
        w: jax.Array

        def __call__(self, t, y, args):
            return (self.w * y).astype(jnp.float32)

    p, re = sciflat.destructure(Sneaky(jnp.ones(2)))
    with pytest.raises(TypeError, match="output `dy/dt` has dtype float32"):
        sciflat.vector_field(re)(0.0, jnp.ones(2), p)


def test_bad_arguments():
    p, re = sciflat.destructure(ByY(jnp.asarray(1.0)))
    with pytest.raises(ValueError, match="`signature` must be one of"):
        sciflat.vector_field(re, "y,t")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="`re` must be the `Restructure`"):
        sciflat.vector_field(ByY(jnp.asarray(1.0)))  # pyright: ignore[reportArgumentType]
    f = sciflat.vector_field(re, "y")
    with pytest.raises(
        TypeError, match=r"(?s)`args` of `diffeqsolve` must be.*or the flat vector"
    ):
        f(0.0, jnp.ones(()), {"p": p})
    with pytest.raises(TypeError, match="tuple of length 3"):
        f(0.0, jnp.ones(()), (p, None, None))
    with pytest.raises(ValueError, match="length 1, got 2"):
        f(0.0, jnp.ones(()), jnp.ones(2))


def test_same_re_means_no_retrace():
    p, re = sciflat.destructure(ByY(jnp.asarray(1.0)))
    traces = []

    @eqx.filter_jit
    def rhs(term, y, p):
        traces.append(1)
        return term.vf(0.0, y, p)

    for _ in range(2):
        rhs(diffrax.ODETerm(sciflat.vector_field(re, "y")), jnp.ones(()), p)
    assert sciflat.vector_field(re) == sciflat.vector_field(re)
    assert hash(sciflat.vector_field(re)) == hash(sciflat.vector_field(re))
    assert len(traces) == 1


@pytest.mark.slow  # three vmapped solves to compile: 137 s on the loaded 2-core machine
def test_vmapped_solves_with_re_p_match_the_plain_model():
    # The documented neural-ODE pattern: `args=re(p)` outside `vmap`; the gradient is
    # the plain pytree's (ties summed: the tied layer is in `p` once). (`args=p` is the
    # same field, value and Jacobian: `test_args_model_is_the_same_field_as_args_p`.)
    model = UDE(jax.random.key(1))
    p, re = sciflat.destructure(model, dtype=jnp.float64)
    y0s = jnp.asarray([[1.0, 0.5], [0.3, 0.2], [2.0, 1.0]])
    term = diffrax.ODETerm(sciflat.vector_field(re))
    batched = lambda args: jax.vmap(lambda y0: _solve_ys(term, args, y0))(y0s).sum()
    grad_model = jax.jit(jax.grad(lambda p: batched(re(p))))(p)
    plain = jax.tree.map(
        lambda x: x.astype(jnp.float64) if eqx.is_array(x) else x, model
    )
    plain_term = diffrax.ODETerm(lambda t, y, m: m(t, y, None))
    plain_grad = jax.jit(
        jax.grad(lambda m: jax.vmap(lambda y0: _solve_ys(plain_term, m, y0))(y0s).sum())
    )(plain)
    ref = np.zeros(len(re))
    for path, g in jax.tree_util.tree_flatten_with_path(plain_grad)[0]:
        ref[re.slice(jax.tree_util.keystr(path))] += np.ravel(g)
    assert grad_model.dtype == jnp.float64
    assert len(re) == 2 + (4 * 4 + 4) + (4 * 2 + 2)  # the tied layer once
    np.testing.assert_allclose(grad_model, ref, rtol=1e-10, atol=1e-12)


#
# Transforms in the fits: the loss sees constrained values (issue 23, item 13). The
# gradients through every adjoint, `Positive` included, are checked against the closed
# form above; here y' = -k y with k = Positive(...) is fitted to y = exp(-1.3 t).
#


class PositiveDecay(eqx.Module):
    k: Any  # a `sciflat.Positive`

    def __call__(self, t, y, args):
        return -self.k * y


DECAY_TS = jnp.linspace(0.0, 2.0, 9)
DECAY_YS = jnp.exp(-1.3 * DECAY_TS)  # k = 1.3
_, DECAY_RE = sciflat.destructure(PositiveDecay(sciflat.Positive(0.5)))
DECAY_TERM = diffrax.ODETerm(sciflat.vector_field(DECAY_RE))


def _decay_ys(args, adjoint: str):
    sol = diffrax.diffeqsolve(
        DECAY_TERM,
        diffrax.Tsit5(),
        0.0,
        2.0,
        0.1,
        jnp.asarray(1.0),
        args=args,
        saveat=diffrax.SaveAt(ts=DECAY_TS),
        stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-10),
        max_steps=64,  # 47 steps; a small bound is cheaper to compile and run
        adjoint=getattr(diffrax, adjoint)(),
    )
    return sol.ys


# Every fit with the default adjoint, and forward mode (the SciPy fits only).
@pytest.mark.parametrize(
    "how, adjoint",
    [
        ("least_squares", "RecursiveCheckpointAdjoint"),
        ("minimize", "RecursiveCheckpointAdjoint"),
        ("fit", "RecursiveCheckpointAdjoint"),
        ("minimize", "ForwardMode"),
    ],
)
@pytest.mark.slow  # a Diffrax solve to compile per fit: > 1.5 s on 2 quiet cores
def test_an_ode_with_a_positive_rate_fits_in_every_fit(how, adjoint):
    model = PositiveDecay(sciflat.Positive(0.5))
    residuals = lambda m, ys: _decay_ys(m, adjoint) - ys
    sse = lambda m, ys: jnp.sum(residuals(m, ys) ** 2)
    if how == "least_squares":
        result = sciflat.least_squares(
            residuals, model, args=(DECAY_YS,), progress=False
        )
    elif how == "minimize":
        result = sciflat.minimize(sse, model, args=(DECAY_YS,), progress=False)
    else:
        opt = optax.lbfgs()
        result = sciflat.fit(
            sse, model, opt, steps=30, args=(DECAY_YS,), progress=False
        )
    np.testing.assert_allclose(sciflat.unwrap(result.model).k, 1.3, rtol=1e-6)
