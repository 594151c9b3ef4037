"""Per-leaf transforms: `p` is unconstrained, the loss sees constrained values, and
standard errors are those of the constrained values (delta method)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sciflat


def lsq(residuals, model, args=(), **kwargs):
    return sciflat.least_squares(residuals, model, args=args, progress=False, **kwargs)


X = jnp.linspace(0.1, 3.0, 25)
Y = 2.5 * jnp.exp(-0.7 * X) + 0.02 * jnp.asarray(
    np.random.default_rng(1).standard_normal(25)
)


def decay(m, x, y):
    return m["a"] * jnp.exp(-m["k"] * x) - y


@pytest.fixture(scope="module")
def plain():
    return lsq(decay, {"a": 1.0, "k": 1.0}, (X, Y))


@pytest.mark.parametrize(
    "make",
    [
        lambda v: sciflat.Positive(v),
        lambda v: sciflat.Log(v),
        lambda v: sciflat.Interval(v, 0.0, 10.0),
    ],
    ids=["positive", "log", "interval"],
)
@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_transformed_fit_has_the_values_and_standard_errors_of_the_plain_one(
    plain, make
):
    # A reparametrisation moves neither the minimum nor (delta method, exact at the
    # minimum for least squares) the standard errors of the constrained values.
    res = lsq(decay, {"a": make(1.0), "k": make(1.0)}, (X, Y))
    values = sciflat.unwrap(res.model)
    for name in ("a", "k"):
        assert float(values[name]) == pytest.approx(float(plain.model[name]), rel=1e-7)
        assert float(res.stderr[name]) == pytest.approx(
            float(plain.stderr[name]), rel=1e-5
        )
    np.testing.assert_allclose(res.correlation, plain.correlation, rtol=1e-5)
    assert "delta method" in res.uncertainty.scale
    text = str(res)
    assert f"k:  {float(values['k']): .8g} +/- " in text


def test_constructors_store_the_inverse_and_unwrap_gives_the_value():
    for t, v in [
        (sciflat.Positive(np.array([0.5, 3.0])), [0.5, 3.0]),
        (sciflat.Log(1e-3), 1e-3),
        (sciflat.Interval(0.25, 0.0, 1.0), 0.25),
    ]:
        np.testing.assert_allclose(t.value, v, rtol=1e-12)
    model = {"k": sciflat.Positive(2.0), "c": jnp.asarray(1.0)}
    assert float(sciflat.unwrap(model)["k"]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="outside its domain"):
        sciflat.Positive(-1.0)
    with pytest.raises(ValueError, match="lower < upper"):
        sciflat.Interval(0.5, 1.0, 0.0)


def test_unbounded_methods_respect_the_constraint():
    # The data want a negative slope; the positive parameter goes to the boundary
    # instead, with BFGS (no bounds), `lm` and Adam.
    x = jnp.linspace(0.0, 1.0, 10)
    loss = lambda m, x: jnp.sum((m["s"] * x + x) ** 2)
    start = {"s": sciflat.Positive(1.0)}
    res = sciflat.minimize(loss, start, args=(x,), method="BFGS", progress=False)
    assert 0 < float(sciflat.unwrap(res.model)["s"]) < 1e-3
    res = lsq(lambda m, x: m["s"] * x + x, start, (x,), method="lm")
    assert 0 < float(sciflat.unwrap(res.model)["s"]) < 1e-3
    res = sciflat.fit(
        loss, start, optax.adam(0.1), steps=300, args=(x,), progress=False
    )
    assert 0 < float(sciflat.unwrap(res.model)["s"]) < 0.05


def test_hessian_uncertainty_of_transformed_values(plain):
    sse = lambda m, x, y: jnp.sum(decay(m, x, y) ** 2)
    start = {"a": sciflat.Log(1.0), "k": sciflat.Log(1.0)}
    res = sciflat.minimize(
        sse, start, args=(X, Y), options=dict(gtol=1e-12), progress=False
    )
    res = sciflat.hessian_uncertainty(res, sse, args=(X, Y), scale="sse", n_data=25)
    # The Hessian includes the residuals' curvature, J^T J does not: close, not equal.
    for name in ("a", "k"):
        assert float(res.stderr[name]) == pytest.approx(
            float(plain.stderr[name]), rel=2e-2
        )


def test_frozen_transform_is_left_alone():
    model = {"a": sciflat.Positive(2.5), "k": sciflat.Positive(0.7)}
    res = lsq(decay, model, (X, Y), filter_spec={"a": True, "k": False})
    assert res.stderr["k"] is None and len(res.p) == 1
    assert float(sciflat.unwrap(res.model)["k"]) == pytest.approx(0.7)
    assert jax.tree.structure(res.model) == jax.tree.structure(model)


def tied_decay(m, x, y):
    return m["a"] * jnp.exp(-m["k"] * x) + 0.2 * m["b"] - y


def test_a_tied_transform_is_constrained_once_in_report_and_standard_errors():
    # One `Positive` node used for "a" and "b": the reference is the same fit with
    # one plain parameter in both places. Softplus was applied once per path.
    pos = sciflat.Positive(1.0)
    tied = {"a": pos, "b": pos, "k": sciflat.Positive(1.0)}
    untied = lambda m, x, y: tied_decay({"a": m["a"], "b": m["a"], "k": m["k"]}, x, y)
    res = lsq(tied_decay, tied, (X, Y))
    ref = lsq(untied, {"a": 1.0, "k": 1.0}, (X, Y))
    values = sciflat.unwrap(res.model)
    assert float(values["a"]) == pytest.approx(float(ref.model["a"]), rel=1e-7)
    for name, ref_name in (("a", "a"), ("b", "a"), ("k", "k")):
        assert float(res.stderr[name]) == pytest.approx(
            float(ref.stderr[ref_name]), rel=1e-5
        )
    assert f"a:  {float(values['a']): .8g} +/- " in str(res)
    # The Hessian route: minimize + hessian_uncertainty, tied and transformed against
    # plain (equal at the minimum, where the gradient term of the chain rule is 0).
    sse_tied = lambda m, x, y: jnp.sum(tied_decay(m, x, y) ** 2)
    sse_plain = lambda m, x, y: jnp.sum(untied(m, x, y) ** 2)
    opts = dict(options=dict(gtol=1e-12), progress=False)
    h_tied = sciflat.minimize(sse_tied, tied, args=(X, Y), **opts)
    h_ref = sciflat.minimize(sse_plain, {"a": 1.0, "k": 1.0}, args=(X, Y), **opts)
    kw = dict(args=(X, Y), scale="sse", n_data=len(X))
    h_tied = sciflat.hessian_uncertainty(h_tied, sse_tied, **kw)
    h_ref = sciflat.hessian_uncertainty(h_ref, sse_plain, **kw)
    for name, ref_name in (("a", "a"), ("b", "a"), ("k", "k")):
        assert float(h_tied.stderr[name]) == pytest.approx(
            float(h_ref.stderr[ref_name]), rel=1e-4
        )


def test_a_vector_transform_is_labelled_by_its_own_path_in_the_report():
    # `a.raw[0]` was printed beside the constrained value; the reference is the same
    # fit with a plain array, whose report reads `a[0]`, `a[1]`.
    f = lambda m, x, y: m["a"][0] * jnp.exp(-m["a"][1] * x) - y
    res = lsq(f, {"a": sciflat.Positive(np.array([1.0, 1.0]))}, (X, Y))
    ref = lsq(f, {"a": jnp.array([1.0, 1.0])}, (X, Y))
    values = np.asarray(sciflat.unwrap(res.model)["a"])
    np.testing.assert_allclose(values, ref.model["a"], rtol=1e-7)
    text = str(res)
    assert ".raw" not in text
    for i in range(2):
        assert f"a[{i}]:  {values[i]: .8g} +/- " in text
        assert f"a[{i}]:" in str(ref)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64])
def test_a_transform_keeps_the_dtype_of_its_value(dtype):
    # bfloat16/float16 values were stored as float32, so `p` of a bfloat16 model came
    # out float32. The reference: the same model without the transform.
    value = jnp.asarray([0.25, 2.0], dtype)
    plain, _ = sciflat.destructure({"a": value})
    for node in (
        sciflat.Positive(value),
        sciflat.Log(value),
        sciflat.Interval(value, 0.0, 10.0),
    ):
        assert node.raw.dtype == dtype and node.value.dtype == dtype
        p, _ = sciflat.destructure({"a": node})
        assert p.dtype == plain.dtype == dtype
        eps = float(jnp.finfo(dtype).eps)
        np.testing.assert_allclose(
            np.asarray(node.value, np.float64),
            np.asarray(value, np.float64),
            rtol=4 * eps,
        )


def test_the_delta_method_is_one_compiled_program_kept_per_structure(caplog):
    # Standard errors of constrained values need d value / d raw. Run eagerly, each op
    # of that `jvp` compiled on its own on a first fit (1.6 s of 2.6 s with two
    # transforms); it is one compiled program, kept for the next fit of that
    # structure. Shapes no other test uses (7 entries), so no eager op is cached.
    x = jnp.linspace(0.0, 1.0, 11)
    noise = jnp.asarray(np.random.default_rng(3).standard_normal((2, 11))) * 0.01
    y = jnp.stack([2.0 * x, 0.5 * x]) + noise
    res = lambda m, x, y: jnp.concatenate(
        [m["k"] * x - y[0], m["b"] * x - y[1], m["w"] - 1.0]
    )
    start = lambda k, b: {"k": k, "b": b, "w": jnp.ones(5)}
    model = start(sciflat.Positive(jnp.asarray(0.5)), sciflat.Interval(0.3, 0.0, 1.0))
    eager = lambda: [
        m
        for m in (r.getMessage() for r in caplog.records)
        if m.startswith(("Compiling jit(scatter", "Compiling jit(softplus"))
    ]
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        first = lsq(res, model, args=(x, y))
        assert eager() == []
    second = lsq(res, model, args=(x, y))
    np.testing.assert_array_equal(
        first.uncertainty.covariance, second.uncertainty.covariance
    )
    # The reference: the same fit without transforms. At an interior optimum the
    # delta method gives the plain fit's standard errors of k and b.
    plain = lsq(res, start(jnp.asarray(0.5), jnp.asarray(0.3)), args=(x, y))
    for name in ("k", "b"):
        np.testing.assert_allclose(first.stderr[name], plain.stderr[name], rtol=1e-7)
        np.testing.assert_allclose(
            sciflat.unwrap(first.model)[name], plain.model[name], rtol=1e-9
        )
