"""Seed 003 in JAX: a float32 network inside a float64 ODE solve.

In the Julia thread (NeuralPDE), training was float64 end to end to look at, yet the
network part of the gradient was computed in float32, because `re(p)` rebuilt the
network in its own dtype. The JAX port: a universal differential equation whose
parameters are a float32 Equinox MLP and a float64 rate. `ravel_pytree` makes one
float64 vector, but its `unravel` casts the MLP back to float32; the network then runs
in float32 (like Flux's `Dense`, it runs in its weights' dtype). Loss and gradient are
float64; only the auditor shows the float32 matmuls. Through `sciflat.destructure` the
same code computes in float64 throughout.
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import sciflat


F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
TSIT5 = diffrax.Tsit5()


class UDE(eqx.Module):
    mlp: eqx.nn.MLP
    rate: jax.Array

    def __call__(self, t, y, args):
        # As Flux's `Dense` does: the network computes in the dtype of its weights.
        dtype = self.mlp.layers[0].weight.dtype
        return -self.rate * y + self.mlp(y.astype(dtype)).astype(y.dtype)  # NETWORK


def solve_loss(ude: UDE, y0, solver=TSIT5):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(ude),
        solver,
        t0=0.0,
        t1=1.0,
        dt0=0.125,
        y0=y0,
        saveat=diffrax.SaveAt(t1=True),
        stepsize_controller=diffrax.ConstantStepSize(),
    )
    return jnp.sum(sol.ys**2)


def _network_line() -> int:
    with open(__file__) as f:
        (line,) = [i + 1 for i, s in enumerate(f) if s.rstrip().endswith("# NETWORK")]
    return line


@pytest.fixture(scope="module")
def setup():
    mlp = eqx.nn.MLP(
        2, 2, 8, 2, activation=jnp.tanh, dtype=jnp.float32, key=jax.random.key(3)
    )
    ude = UDE(mlp, jnp.asarray(0.5, jnp.float64))
    params, static = eqx.partition(ude, eqx.is_array)
    p_ravel, unravel = ravel_pytree(params)
    p_sci, re = sciflat.destructure(ude, dtype=jnp.float64)

    def loss_ravel(p, y0, solver=TSIT5):
        return solve_loss(eqx.combine(unravel(p), static), y0, solver)

    def loss_sciflat(p, y0, solver=TSIT5):
        return solve_loss(re(p), y0, solver)

    return dict(
        ude=ude,
        p_ravel=p_ravel,
        p_sci=p_sci,
        y0=jnp.array([1.0, -0.5]),
        loss_ravel=loss_ravel,
        loss_sciflat=loss_sciflat,
    )


def test_ravel_pytree_hides_float32_matmuls(setup):
    p, y0 = setup["p_ravel"], setup["y0"]
    assert p.dtype == F64
    report = sciflat.audit_dtypes(setup["loss_ravel"], p, y0)
    value, grad = report.out
    assert value.dtype == F64 and grad.dtype == F64  # everything looks float64...
    # ...but the network's matmuls run in float32, in the forward and reverse pass,
    # and the report says so at the line that calls the network.
    matmuls = [f for f in report.findings if f.primitive == "dot_general"]
    assert [(f.dtype, f.where.line) for f in matmuls] == [(F32, _network_line())]
    assert matmuls[0].count >= 2 * 3  # three layers, forward and transposed
    # unravel's casts: float64 -> float32 for the weights, float32 -> float64 for
    # their gradient, blamed on the user's line that calls unravel.
    narrows = [f for f in report.findings if f.kind == "narrow"]
    assert narrows and all((f.source, f.dtype) == (F64, F32) for f in narrows)
    assert {"loss_ravel"} <= {f.where.function.split(".")[-1] for f in narrows}
    assert all(F32 in (f.source, f.dtype) for f in report.findings)
    with pytest.raises(AssertionError, match="dot_general"):
        sciflat.assert_dtypes(setup["loss_ravel"], p, y0)


def test_sciflat_same_code_is_clean(setup):
    p, y0 = setup["p_sci"], setup["y0"]
    report = sciflat.assert_dtypes(setup["loss_sciflat"], p, y0)
    value, grad = report.out
    assert value.dtype == F64 and grad.dtype == F64 and grad.shape == p.shape
    assert report.n_checked > 100  # the whole solve was read, not just the loss


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_values_ravel_is_float32_accurate_sciflat_matches_float64_reference(setup):
    ude, y0 = setup["ude"], setup["y0"]
    ude64 = jax.tree.map(lambda x: x.astype(F64) if eqx.is_inexact_array(x) else x, ude)

    # The dtype story is not the solver's; Euler compiles fastest.
    solver = diffrax.Euler()

    @eqx.filter_jit
    def all_three(p_ravel, p_sci, ude64):
        reference = eqx.filter_value_and_grad(solve_loss)(ude64, y0, solver)
        ravel = jax.value_and_grad(setup["loss_ravel"])(p_ravel, y0, solver)
        sci = jax.value_and_grad(setup["loss_sciflat"])(p_sci, y0, solver)
        return reference, ravel, sci

    (ref_value, ref_grad), ravel, sci = all_three(
        setup["p_ravel"], setup["p_sci"], ude64
    )
    ref_flat = jnp.concatenate([g.ravel() for g in jax.tree.leaves(ref_grad)])
    assert ref_flat.shape == sci[1].shape == ravel[1].shape  # same leaf order
    np.testing.assert_allclose(sci[0], ref_value, rtol=1e-13)
    np.testing.assert_allclose(sci[1], ref_flat, rtol=1e-11, atol=1e-13)
    # The ravel path's gradient carries float32 rounding: wrong in the 8th digit,
    # which is what "a bit more janky" looked like in the seed.
    err = np.max(np.abs(ravel[1] - ref_flat)) / np.max(np.abs(ref_flat))
    assert 1e-10 < err < 1e-5
