"""End to end: the gradient is in `p.dtype`, nothing computes in another dtype, and
the values match a float64 reference, for every model, `p` dtype and path.

Each case (1) checks the gradient's dtype, (2) audits the whole traced computation
with `sciflat.assert_dtypes` and (3) compares values against `jax.grad` of the plain
pytree model (leaves rounded to `p.dtype`, then computed in float64; tied uses summed)
with a tolerance set by `p.dtype`. Tracing is cheap and runs for every case; Diffrax
solves are executed for one case only, since each one compiles for seconds.
"""

import functools as ft

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
import scipy.optimize

import sciflat
from helpers import EdgeModels


F32, F64, BF16 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(jnp.bfloat16)
TOL = {F64: 1e-11, F32: 2e-5, BF16: 6e-2}  # relative to the largest entry
MODELS = [
    "mlp_float32",
    "mixed_precision",
    "frozen",
    "tied_identity",
    "shared_transposed",
    "complex_leaf",
]
# jnp.sum of bfloat16 accumulates in float32 on purpose and casts back (its transpose
# broadcasts in float32): allow that, and only that; a float32 matmul or elementwise
# op is still a finding.
BF16_ALLOW = [
    ("reduce_sum", "float32"),
    ("broadcast_in_dim", "float32"),
    ("convert_element_type", "float32"),
]


class Frozen(eqx.Module):
    lin: eqx.nn.Linear
    scale: jax.Array  # a float32 leaf that is not trained

    def __call__(self, x):
        return self.scale * jnp.tanh(self.lin(x))


@ft.cache
def model_case(name: str):
    """(model, input, filter_spec) for a model name."""
    if name == "frozen":
        lin = eqx.nn.Linear(3, 2, dtype=jnp.float32, key=jax.random.key(1))
        model = Frozen(lin, jnp.array([0.5, -2.0], jnp.float32))
        spec = eqx.tree_at(
            lambda m: m.scale, jax.tree.map(lambda _: True, model), False
        )
        return model, jnp.array([0.3, -1.0, 2.0]), spec
    model, x = EdgeModels()[name]  # (every model built once, at the first)
    return model, x, True


def loss(model, x):
    return jnp.sum(jnp.square(model(x)))


def _cast(tree, dtype):
    def cast(x):
        if not eqx.is_inexact_array(x):
            return x
        if jnp.iscomplexobj(x):
            return x.astype(jnp.complex128 if dtype == F64 else jnp.complex64)
        return x.astype(dtype)

    return jax.tree.map(cast, tree)


def reference(loss_of_model, model, re, dtype, *args):
    """Value and flat gradient of the plain pytree model, its leaves rounded to
    `dtype` and then computed in float64; gradients of tied uses summed."""
    m64 = _cast(_cast(model, dtype), F64)
    value, grads = eqx.filter_value_and_grad(loss_of_model)(m64, *args)
    return float(value), flat_gradient(grads, re)


def flat_gradient(grads, re) -> np.ndarray:
    """A plain pytree gradient laid out like `p`, the uses of a tied array summed."""
    flat = np.zeros(len(re))
    for path, g in jtu.tree_flatten_with_path(grads)[0]:
        key = jtu.keystr(path)
        if key in re.paths:
            g = np.asarray(g)
            # A complex leaf is (real parts, imaginary parts) in `p`; JAX's gradient
            # of a real loss with respect to z = a + ib is dL/da - i dL/db.
            if np.iscomplexobj(g):
                g = np.concatenate([g.real.ravel(), -g.imag.ravel()])
            flat[re.slice(key)] += g.ravel()
    return flat


def assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.max(np.abs(want), initial=0.0), 1e-30)
    assert np.max(np.abs(got - want), initial=0.0) <= TOL[dtype] * scale, (got, want)


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        (line,) = [i + 1 for i, s in enumerate(f) if s.rstrip().endswith(marker)]
    return line


def _setup(name, dtype):
    model, x, spec = model_case(name)
    p, re = sciflat.destructure(model, spec, dtype=dtype)
    return model, x.astype(dtype), spec, p, re


#
# Plain loss: float32, float64 and bfloat16
#


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_plain_loss(name, dtype):
    if dtype == BF16 and name == "complex_leaf":
        with pytest.raises(TypeError, match="no complex counterpart"):
            _setup(name, dtype)
        return
    model, x, _, p, re = _setup(name, dtype)
    f = lambda p, x: loss(re(p), x)
    report = sciflat.assert_dtypes(f, p, x, allow=BF16_ALLOW if dtype == BF16 else ())
    value, grad = report.out
    assert (value.dtype, grad.dtype, grad.shape) == (dtype, dtype, p.shape)
    value, grad = jax.jit(jax.value_and_grad(f))(p, x)
    assert grad.dtype == dtype
    ref_value, ref_grad = reference(loss, model, re, dtype, x.astype(F64))
    assert_close(value, ref_value, dtype)
    assert_close(grad, ref_grad, dtype)


#
# Optax: an adam step on `p`, audited; `sciflat.fit` run for one step
#


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_optax_adam_step(name, dtype):
    model, x, spec, p, re = _setup(name, dtype)
    lr = 1e-2
    opt = optax.adam(lr)

    def step(p, state, x):
        value, grad = jax.value_and_grad(lambda p: loss(re(p), x))(p)
        updates, state = opt.update(grad, state, p)  # OPTAX UPDATE
        return optax.apply_updates(p, updates), state, value

    # With x64 on, adam computes its scalar bias correction 1 - b**count in float64
    # (a Python float to the power of an int32 count) and rounds it to p's dtype.
    # That is Optax's, harmless, and allowed at that line only.
    update_line = _line_of("# OPTAX UPDATE")
    optax_scalars = lambda f: f.where.line == update_line and F64 in (f.dtype, f.source)
    report = sciflat.assert_dtypes(
        step, p, opt.init(p), x, grad=False, allow=[optax_scalars]
    )
    assert dtype == F64 or {f.primitive for f in report.allowed} == {
        "pow",
        "sub",
        "convert_element_type",
    }
    new_p, state, value = report.out
    assert new_p.dtype == dtype and value.dtype == dtype
    floats = {
        s.dtype for s in jax.tree.leaves(state) if jnp.issubdtype(s.dtype, jnp.inexact)
    }
    assert floats == {dtype}  # adam's moments

    result = sciflat.fit(
        loss,
        model,
        opt,
        steps=1,
        args=(x,),
        filter_spec=spec,
        dtype=dtype,
        progress=False,
    )
    assert result.p.dtype == dtype
    ref_value, g = reference(loss, model, re, dtype, x.astype(F64))
    assert_close(result.history[0], ref_value, dtype)
    # adam's first step: -lr * g / (|g| + eps), from the float64 reference gradient.
    want = np.asarray(p, F64) - lr * g / (np.abs(g) + 1e-8)
    assert_close(result.p - p, want - np.asarray(p, F64), dtype)


#
# SciPy: the value and gradient SciPy receives are float64
#


@pytest.mark.parametrize("name", MODELS)
def test_scipy_objective(name, monkeypatch):
    model, x, spec, p, re = _setup(name, F64)
    sciflat.assert_dtypes(lambda p, x: loss(re(p), x), p, x)
    seen = {}
    real_minimize = scipy.optimize.minimize

    def spy(fun, x0, *args, **kwargs):
        seen["x0"], seen["out"] = x0, fun(np.array(x0))
        return real_minimize(fun, x0, *args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "minimize", spy)
    result = sciflat.minimize(
        loss, model, args=(x,), filter_spec=spec, options={"maxiter": 2}, progress=False
    )
    value, grad = seen["out"]
    assert seen["x0"].dtype == F64 and np.asarray(value).dtype == F64
    assert isinstance(grad, np.ndarray) and grad.dtype == F64 and grad.shape == p.shape
    ref_value, ref_grad = reference(loss, model, re, F64, x)
    assert_close(value, ref_value, F64)
    assert_close(grad, ref_grad, F64)
    assert result.p.dtype == F64


@pytest.mark.parametrize("name", ["frozen", "tied_identity", "complex_leaf"])
def test_scipy_least_squares(name, monkeypatch):
    model, x, spec, p, re = _setup(name, F64)
    residuals = lambda model, x: jnp.ravel(model(x))
    sciflat.assert_dtypes(lambda p, x: residuals(re(p), x), p, x)
    seen = {}
    real_least_squares = scipy.optimize.least_squares

    def spy(fun, x0, *args, jac, **kwargs):
        seen["r"], seen["J"] = fun(np.array(x0)), jac(np.array(x0))
        return real_least_squares(fun, x0, *args, jac=jac, **kwargs)

    monkeypatch.setattr(scipy.optimize, "least_squares", spy)
    result = sciflat.least_squares(
        residuals, model, args=(x,), filter_spec=spec, max_nfev=2, progress=False
    )
    r, J = seen["r"], seen["J"]
    assert r.dtype == F64 and J.dtype == F64 and J.shape == (r.size, len(p))
    # J^T r is the gradient of 0.5 |r|^2: compare it with the plain pytree's.
    half_sq = lambda model, x: 0.5 * jnp.sum(residuals(model, x) ** 2)
    ref_value, ref_grad = reference(half_sq, model, re, F64, x)
    assert_close(0.5 * np.sum(r**2), ref_value, F64)
    assert_close(J.T @ r, ref_grad, F64)
    assert result.p.dtype == F64


#
# Diffrax through `sciflat.vector_field`: explicit and implicit solvers, checkpointed
# and backsolve adjoints. Traced for every case; executed for one.
#


class VF(eqx.Module):
    """dy/dt = -y/2 + tanh(sum(model(x (1 + y0)))): every model as a vector field."""

    model: eqx.Module

    def __call__(self, t, y, x):
        return -0.5 * y + jnp.tanh(jnp.sum(self.model(x * (1 + y[0]))))


def solve_loss(term, p, x, solver, adjoint, dtype):  # `p`: or `re(p)`, or None
    t = lambda v: jnp.asarray(v, dtype)  # Diffrax promotes y0 to the dtype of time
    rtol, atol = (1e-8, 1e-10) if dtype == F64 else (1e-4, 1e-6)
    sol = diffrax.diffeqsolve(
        term,
        solver,
        t(0.0),
        t(1.0),
        t(0.1),
        jnp.ones(2, dtype),
        args=(p, x),
        saveat=diffrax.SaveAt(t1=True),
        adjoint=adjoint,
        max_steps=64,
        stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
    )
    return jnp.sum(sol.ys**2)


# (solver, adjoint, models, p dtypes). An implicit solve takes seconds to trace, so it
# runs once, in float32: there the root finder's Python-float tolerances could
# promote; float64 Kvaerno5 is in test_diffrax.py.
SOLVES = {
    "tsit5-checkpoint": (
        diffrax.Tsit5(),
        diffrax.RecursiveCheckpointAdjoint(),
        MODELS,
        (F32, F64),
    ),
    "kvaerno5-checkpoint": (
        diffrax.Kvaerno5(),
        diffrax.RecursiveCheckpointAdjoint(),
        ["mlp_float32"],
        (F32,),
    ),
    "tsit5-backsolve": (
        diffrax.Tsit5(),
        diffrax.BacksolveAdjoint(),
        ["mlp_float32"],
        (F32, F64),
    ),
}
DIFFRAX_CASES = [
    pytest.param(
        solve,
        name,
        dtype,
        id=f"{solve}-{name}-{dtype}",
    )
    for solve, (_, _, names, dtypes) in SOLVES.items()
    for name in names
    for dtype in dtypes
]


def _ode_setup(name, dtype):
    model, x, spec = model_case(name)
    vf_spec = spec if spec is True else VF(spec)
    p, re = sciflat.destructure(VF(model), vf_spec, dtype=dtype)
    return model, x.astype(dtype), p, re


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
@pytest.mark.parametrize("solve, name, dtype", DIFFRAX_CASES)
def test_diffrax_solve(solve, name, dtype):
    solver, adjoint, *_ = SOLVES[solve]
    _, x, p, re = _ode_setup(name, dtype)
    term = diffrax.ODETerm(sciflat.vector_field(re))
    f = lambda p, x: solve_loss(term, p, x, solver, adjoint, dtype)
    report = sciflat.assert_dtypes(f, p, x)
    value, grad = report.out
    assert (value.dtype, grad.dtype, grad.shape) == (dtype, dtype, p.shape)


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("mlp_float32", F32),
        ("tied_identity", F64),
        ("frozen", F64),
    ],
    ids=str,
)
@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_diffrax_solve_model_as_args(name, dtype):
    # args=re(p) (what the docs teach): `re(p)` is rebuilt once, outside the solve, and
    # the model itself is Diffrax's args; the gradient still reaches `p` through `re`.
    solver, adjoint, *_ = SOLVES["tsit5-checkpoint"]
    _, x, p, re = _ode_setup(name, dtype)
    term = diffrax.ODETerm(sciflat.vector_field(re))
    f = lambda p, x: solve_loss(term, re(p), x, solver, adjoint, dtype)
    report = sciflat.assert_dtypes(f, p, x)
    value, grad = report.out
    assert (value.dtype, grad.dtype, grad.shape) == (dtype, dtype, p.shape)


@pytest.mark.parametrize("name", ["frozen"])
def test_diffrax_closure_over_re(name):
    # The same solve with `re(p)` in a plain closure (no adapter): the frozen float32
    # leaves enter the solve's loops as constants; cast to p's dtype inside them, they
    # are still inputs, not float32 computations.
    solver, adjoint, *_ = SOLVES["tsit5-checkpoint"]
    _, x, p, re = _ode_setup(name, F64)
    term = diffrax.ODETerm(lambda t, y, args: re(args[0])(t, y, args[1]))
    report = sciflat.assert_dtypes(
        lambda p, x: solve_loss(term, p, x, solver, adjoint, F64), p, x
    )
    assert report.out[1].dtype == F64


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_diffrax_values_match_plain_pytree():
    solver, adjoint, *_ = SOLVES["tsit5-checkpoint"]
    model, x, p, re = _ode_setup("tied_identity", F64)
    term = diffrax.ODETerm(sciflat.vector_field(re))
    # The reference: Diffrax on the plain model, `x` as its args, grad by Equinox.
    plain = lambda vf, x: solve_loss(
        diffrax.ODETerm(lambda t, y, args: vf(t, y, args[1])),
        None,
        x,
        solver,
        adjoint,
        F64,
    )

    @eqx.filter_jit
    def both(p, vf, x):
        ours = jax.value_and_grad(
            lambda p: solve_loss(term, p, x, solver, adjoint, F64)
        )(p)
        return ours, eqx.filter_value_and_grad(plain)(vf, x)

    (value, grad), (ref_value, ref_grads) = both(p, VF(_cast(model, F64)), x)
    assert grad.dtype == F64
    assert_close(value, ref_value, F64)
    assert_close(grad, flat_gradient(ref_grads, re), F64)
