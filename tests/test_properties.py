"""Property-based tests of the core over random models with random ties and dtypes."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import sciflat
from helpers import inexact_dtypes, random_models, run_on_host_devices


def _loss(model):
    # A different weight per position, so tied uses contribute different gradients.
    total = 0.0
    for k, (_, x) in enumerate(sorted(model.items())):
        total = total + (k + 1) * jnp.sum(jnp.abs(jnp.sin(x)) ** 2)
    return total


# Jitted, `re` an argument: one compilation per structure costs a fraction of tracing
# the gradient op by op (this test was the fast tier's slowest).
_grad = jax.jit(jax.grad(lambda p, re: _loss(re(p))))
_plain_grad = jax.jit(jax.grad(_loss))


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
@settings(max_examples=60, deadline=None)
@given(random_models(), st.sampled_from([np.float32, np.float64]))
def test_gradient_is_the_sum_over_tied_uses(case, dtype):
    model, spec, uses = case
    p, re = sciflat.destructure(model, spec, dtype=dtype)
    assert p.dtype == dtype
    grad = _grad(p, re)
    assert grad.dtype == p.dtype and grad.shape == p.shape
    # Reference: jax.grad on the plain pytree (every use a separate leaf, in p's dtype),
    # then the uses of each tied array summed.
    cast = {
        k: x.astype(jnp.complex128 if dtype == np.float64 else jnp.complex64)
        if jnp.iscomplexobj(x)
        else x.astype(dtype)
        for k, x in model.items()
    }
    plain = _plain_grad(cast)
    expected = np.zeros(len(p), dtype)
    for k in range(len(uses)):
        name = f"u{k}"
        if not spec[name]:
            continue
        g = plain[name]
        # JAX's gradient of a real loss w.r.t. z is conj(dL/dz*) convention: dL/dRe - i dL/dIm.
        parts = (
            [g.real.ravel(), -g.imag.ravel()] if jnp.iscomplexobj(g) else [g.ravel()]
        )
        expected[re.slice(f"['{name}']")] += np.concatenate(parts)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)


_A = jnp.ones(2)


@settings(max_examples=60, deadline=None)
@given(random_models(mixed_ties=True), st.sampled_from([np.float32, np.float64]))
# A mixed tie in both orders (frozen first, trainable first), every run.
@example(({"u0": _A, "u1": _A}, {"u0": False, "u1": True}, [0, 0]), np.float64)
@example(({"u0": _A, "u1": _A}, {"u0": True, "u1": False}, [0, 0]), np.float64)
def test_round_trip_and_dtype_rule(case, dtype):
    model, spec, uses = case
    trainable_in = {}  # array -> whether each of its uses is trainable
    for k, i in enumerate(uses):
        trainable_in.setdefault(i, set()).add(spec[f"u{k}"])
    mixed = any(len(flags) == 2 for flags in trainable_in.values())
    if mixed:  # a tie that is frozen in one use only is refused, naming a use
        with pytest.raises(
            ValueError, match="trainable everywhere or frozen everywhere"
        ):
            sciflat.destructure(model, spec, dtype=dtype)
        return
    p, re = sciflat.destructure(model, spec, dtype=dtype)
    rebuilt = re(p)
    real = {np.dtype(dtype)}
    cplx = {np.dtype(np.complex64 if dtype == np.float32 else np.complex128)}
    assert inexact_dtypes(rebuilt) <= real | cplx
    # Ties are kept, trainable and frozen ones alike, and only ties: one array per
    # array of the model.
    for k, i in enumerate(uses):
        for j in range(k):
            assert (rebuilt[f"u{k}"] is rebuilt[f"u{j}"]) == (uses[j] == i)
    q, _ = sciflat.destructure(rebuilt, spec)
    np.testing.assert_array_equal(q, p)
    for name, x in model.items():
        np.testing.assert_allclose(
            rebuilt[name], x, rtol=1e-3 if x.dtype == np.float16 else 1e-6
        )


@pytest.mark.slow  # a fresh interpreter with two emulated devices: seconds
def test_rebuilt_leaves_follow_p_onto_its_device():
    """Two forced host devices: `p` on the second, and `p` replicated over a mesh."""
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np, equinox as eqx, sciflat
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        cpu0, cpu1 = jax.devices()
        model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
        spec = eqx.tree_at(lambda m: m.layers[0].bias, jax.tree.map(lambda _: True, model), False)
        p, re = sciflat.destructure(model, spec)
        for q in (jax.device_put(p, cpu1), jax.device_put(p, cpu0)):
            devices = {x.devices().pop() for x in jax.tree.leaves(eqx.filter(re(q), eqx.is_array))}
            assert devices == q.devices(), (devices, q.devices())
        mesh = Mesh(np.array([cpu0, cpu1]), ("d",))
        q = jax.device_put(p, NamedSharding(mesh, P()))
        for x in jax.tree.leaves(eqx.filter(re(q), eqx.is_array)):
            assert x.sharding.is_fully_replicated and x.devices() == {cpu0, cpu1}
        print("ok")
        """
    )
    run_on_host_devices(code)
