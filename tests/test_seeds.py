"""The seeds' examples, ported to JAX/Equinox: each test is named after what it proves."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import sciflat
from helpers import SharedTransposed, Tied, float_dtypes_in_jaxpr, inexact_dtypes


#
# Seed 000: "Parameter Sharing breaks destructure"
#


def _seed_model():
    d = eqx.nn.Linear(1, 1, key=jax.random.key(0), dtype=jnp.float32)
    return Tied(d, d), jnp.array([0.7])


def test_tied_layer_is_stored_once():
    model, _ = _seed_model()
    p, re = sciflat.destructure(model)
    assert p.shape == (2,)  # Flux: "Expected 2 params, got 3"
    assert len(re) == 2
    assert re.paths == (".a.weight", ".b.weight", ".a.bias", ".b.bias")


def test_tied_gradient_is_the_sum_of_both_uses():
    model, x = _seed_model()
    p, re = sciflat.destructure(model)
    grad = jax.grad(lambda p: jnp.sum(re(p)(x)))(p)
    # Reference: the gradient on the plain pytree, where the two uses are separate.
    g = jax.grad(lambda m: jnp.sum(m(x)))(model)
    expected = jnp.concatenate(
        [(g.a.weight + g.b.weight).ravel(), (g.a.bias + g.b.bias).ravel()]
    )
    assert grad.shape == p.shape
    np.testing.assert_allclose(grad, expected, rtol=1e-6)
    np.testing.assert_allclose(grad, [2 * x[0], 2.0], rtol=1e-6)


def test_ravel_pytree_has_the_seed_defect():
    # What sciflat fixes: ravel_pytree stores the tied layer twice.
    model, _ = _seed_model()
    flat, _ = ravel_pytree(eqx.filter(model, eqx.is_array))
    assert flat.shape == (4,)


def test_optimiser_steps_keep_the_tie():
    model, x = _seed_model()
    p, re = sciflat.destructure(model)
    opt = optax.adam(0.1)
    state = opt.init(p)
    loss = lambda p: jnp.sum(re(p)(x) ** 2)
    for _ in range(5):
        updates, state = opt.update(jax.grad(loss)(p), state, p)
        p = optax.apply_updates(p, updates)
    trained = re(p)
    assert trained.a.weight is trained.b.weight
    assert trained.a.bias is trained.b.bias
    assert not np.allclose(trained.a.weight, model.a.weight)  # it did train


def test_equal_gradients_do_not_create_false_ties():
    # Seed: "it's easy for two parameters to get the same gradient, e.g. f(x + y)".
    model = {"x": jnp.ones(2), "y": jnp.ones(2)}
    loss = lambda m: jnp.sum(jnp.sin(m["x"] + m["y"]))
    p, re = sciflat.destructure(model)
    grad = jax.grad(lambda p: loss(re(p)))(p)
    # Reference: the plain pytree's gradient, one entry per leaf (none summed).
    plain = jax.grad(loss)(model)
    np.testing.assert_allclose(grad, jnp.concatenate([plain["x"], plain["y"]]))
    np.testing.assert_allclose(grad, np.cos(2.0))  # equal: and still two parameters
    # A step on `x` alone leaves `y` where it was: two independent arrays.
    x = re.slice(lambda m: m["x"])
    stepped = re(p.at[x].add(grad[x]))
    assert stepped["x"] is not stepped["y"]
    np.testing.assert_array_equal(stepped["y"], model["y"])
    np.testing.assert_allclose(stepped["x"], 1 + np.cos(2.0))


def test_equal_values_are_not_a_tie():
    # Seed: value-like leaves hashing by content were merged. Two zero biases stay two.
    model = {
        "b1": jnp.zeros(3),
        "b2": jnp.zeros(3),
        "s1": np.float32(0.0),
        "s2": np.float32(0.0),
    }
    p, re = sciflat.destructure(model)
    assert p.shape == (8,)
    rebuilt = re(p + jnp.arange(8.0, dtype=p.dtype))
    assert not np.allclose(rebuilt["b1"], rebuilt["b2"])


def test_transposed_shared_weight_is_one_parameter():
    # Seed: "it will not notice that W and W' are the same data". eqx.nn.Shared does.
    model = SharedTransposed(3, 2, jax.random.key(1))
    p, re = sciflat.destructure(model)
    enc, dec = model.shared()
    assert p.size == enc.weight.size + enc.bias.size + dec.bias.size
    x = jnp.linspace(-1.0, 1.0, 3)
    grad = jax.grad(lambda p: jnp.sum(re(p)(x) ** 2))(p)

    def plain(enc_w, enc_b, dec_w, dec_b):
        return jnp.sum((dec_w @ jnp.tanh(enc_w @ x + enc_b) + dec_b) ** 2)

    g_ew, g_eb, g_dw, g_db = jax.grad(plain, argnums=(0, 1, 2, 3))(
        enc.weight, enc.bias, dec.weight, dec.bias
    )
    np.testing.assert_allclose(
        grad[re.slice(".shared.pytree[0].weight")], (g_ew + g_dw.T).ravel(), rtol=1e-5
    )
    np.testing.assert_allclose(
        grad[re.slice(".shared.pytree[0].bias")], g_eb, rtol=1e-5
    )
    np.testing.assert_allclose(
        grad[re.slice(".shared.pytree[1].bias")], g_db, rtol=1e-5
    )


#
# Seed 003: "Consistency in the type behavior of restructure"
#


def _float32_mlp():
    return eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(2), dtype=jnp.float32)


def test_float64_p_computes_in_float64_on_a_float32_model():
    model = _float32_mlp()
    p, re = sciflat.destructure(model, dtype=jnp.float64)
    assert inexact_dtypes(re(p)) == {np.dtype("float64")}
    assert re(p)(jnp.ones(2, jnp.float64)).dtype == jnp.float64


def test_float32_p_computes_in_float32_on_a_float64_model():
    # The other direction of the same rule: p decides, not the model.
    model = jax.tree.map(
        lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x,
        _float32_mlp(),
    )
    p, re = sciflat.destructure(model, dtype=jnp.float32)
    assert inexact_dtypes(re(p)) == {np.dtype("float32")}


def test_no_float32_op_in_the_float64_gradient():
    # The bug in JAX terms: a float64 loss and gradient with float32 ops in between.
    model = _float32_mlp()
    p, re = sciflat.destructure(model, dtype=jnp.float64)
    x = jnp.ones((5, 2), jnp.float64)
    loss = lambda p: jnp.mean(jax.vmap(re(p))(x) ** 2)
    assert float_dtypes_in_jaxpr(jax.make_jaxpr(jax.grad(loss))(p)) == {"float64"}


def test_ravel_pytree_keeps_float32_ops_inside_a_float64_gradient():
    # The same model through ravel_pytree: the flat vector is float32 and there is no way
    # to ask for float64, or (mixed models) it is float64 but unravels to float32.
    mixed = {"w32": jnp.ones(2, jnp.float32), "w64": jnp.ones(2, jnp.float64)}
    flat, unravel = ravel_pytree(mixed)
    assert flat.dtype == jnp.float64
    assert unravel(flat)["w32"].dtype == jnp.float32
    p, re = sciflat.destructure(mixed)
    assert p.dtype == jnp.float64 and re(p)["w32"].dtype == jnp.float64
