"""Precision beyond dtype: float32 products at DEFAULT precision (TF32 / bfloat16 passes
on GPUs and TPUs) are reported by the auditor, and every fit traces under
`jax.default_matmul_precision`, re-tracing when it changes."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sciflat


F32 = np.dtype(np.float32)
W = np.linspace(-1.0, 1.0, 9).reshape(3, 3)  # a constant, cast to p's dtype below


def _line(marker: str) -> int:
    """The line of this file that carries `marker` in a comment."""
    with open(__file__) as f:
        lines = f.read().splitlines()
    matches = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(marker)]
    assert len(matches) == 1, marker
    return matches[0]


def product(p, precision=None):
    return jnp.dot(W.astype(p.dtype), p, precision=precision)  # PRODUCT


def _at_product(report) -> list:
    return [
        f
        for f in report.precision
        if f.where.file == __file__ and f.where.line == _line("# PRODUCT")
    ]


def _n_products(fn, p) -> int:
    """The reference: every dot_general without a precision in the jaxpr of `fn`'s
    value and gradient, nested ones included, counted by hand."""

    def count(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            # (Diffrax asks for HIGHEST in its own products: not counted.)
            n += eqn.primitive.name == "dot_general" and not eqn.params["precision"]
            for v in eqn.params.values():
                for sub in v if isinstance(v, tuple | list) else (v,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        n += count(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        n += count(sub)
        return n

    return count(jax.make_jaxpr(jax.value_and_grad(fn))(p).jaxpr)


def _custom_vjp(p):
    @jax.custom_vjp
    def f(p):
        return product(p)

    f.defvjp(lambda p: (product(p), None), lambda _, ct: (product(ct),))
    return f(p)


def _diffrax(p):
    term = diffrax.ODETerm(lambda t, y, args: jnp.tanh(product(y)))
    t = lambda v: jnp.asarray(v, p.dtype)  # float64 times would promote the state
    sol = diffrax.diffeqsolve(
        term,
        diffrax.Tsit5(),
        t(0.0),
        t(1.0),
        t(0.25),
        p,
        stepsize_controller=diffrax.ConstantStepSize(),
    )
    assert sol.ys is not None
    return sol.ys[-1]


WRAPPERS = {
    "plain": product,
    "jit": lambda p: jax.jit(product)(p),
    "scan": lambda p: jax.lax.scan(lambda c, _: (product(c), None), p, length=3)[0],
    "cond": lambda p: jax.lax.cond(p[0] > 0, product, lambda q: q, p),
    "custom_vjp": _custom_vjp,
    "diffrax": _diffrax,
}
CASES = [
    pytest.param(k, marks=pytest.mark.slow) if k == "diffrax" else k for k in WRAPPERS
]


#
# The auditor
#


@pytest.mark.parametrize("wrapper", CASES)
def test_float32_products_at_default_precision_are_found_at_their_line(wrapper):
    loss = lambda p: jnp.sum(WRAPPERS[wrapper](p) ** 2)
    p = jnp.ones(3, jnp.float32)
    report = sciflat.audit_dtypes(loss, p)
    (found,) = _at_product(report)
    assert (found.kind, found.primitive, found.dtype) == (
        "precision",
        "dot_general",
        F32,
    )
    # Every product of the value and the gradient, nested ones too, and nothing else.
    assert sum(f.count for f in report.precision) == _n_products(loss, p) > 0
    assert all(f.where.file == __file__ for f in report.precision)


@pytest.mark.parametrize("wrapper", CASES)
def test_highest_precision_around_the_audit_clears_every_product(wrapper):
    loss = lambda p: jnp.sum(WRAPPERS[wrapper](p) ** 2)
    p = jnp.ones(3, jnp.float32)
    assert sciflat.audit_dtypes(loss, p).precision  # traced first at DEFAULT
    for setting in ("highest", "float32", "tensorfloat32"):
        with jax.default_matmul_precision(setting):
            report = sciflat.audit_dtypes(loss, p)
        assert report.precision == () and report.n_checked > 0, setting
    with jax.default_matmul_precision("bfloat16"):  # DEFAULT, by another name
        assert _at_product(sciflat.audit_dtypes(loss, p))


@pytest.mark.parametrize(
    "precision, found",
    [
        (None, True),
        ("default", True),
        (jax.lax.Precision.DEFAULT, True),
        ("highest", False),
        ("high", False),
        (("highest", "default"), False),  # XLA uses the higher of the two
        (jax.lax.DotAlgorithmPreset.F32_F32_F32, False),
        (jax.lax.DotAlgorithmPreset.DEFAULT, True),
    ],
)
def test_precision_per_call(precision, found):
    loss = lambda p: jnp.sum(product(p, precision))
    report = sciflat.audit_dtypes(loss, jnp.ones(3, jnp.float32))
    assert bool(_at_product(report)) == found


def test_float64_and_narrower_products_are_not_precision_findings():
    # JAX's setting is about 32-bit inputs: float64 products are float64 on GPUs.
    f = lambda p: jnp.sum(product(p) ** 2)
    assert sciflat.audit_dtypes(f, jnp.ones(3, jnp.float64)).precision == ()
    assert sciflat.audit_dtypes(f, jnp.ones(3, jnp.bfloat16)).precision == ()
    # ...while a float32 product inside a float64 loss is both a dtype finding and
    # a precision one.
    mixed = lambda p: jnp.sum(product(p.astype(jnp.float32)).astype(p.dtype))
    report = sciflat.audit_dtypes(mixed, jnp.ones(3))
    assert {f.primitive for f in report.findings} >= {"dot_general"}
    assert _at_product(report)


def test_complex64_products_and_convolutions_are_found():
    def conv(p):
        x = p.reshape(1, 1, -1)
        k = jnp.ones((1, 1, 2), p.dtype)
        return jax.lax.conv_general_dilated(x, k, (1,), "VALID")  # CONV

    report = sciflat.audit_dtypes(lambda p: jnp.sum(conv(p) ** 2), jnp.ones(4, F32))
    (found,) = [f for f in report.precision if f.where.line == _line("# CONV")]
    assert found.primitive == "conv_general_dilated" and found.count >= 2

    def cplx(p):
        z = (p + 1j * p).astype(jnp.complex64)
        return jnp.sum(jnp.abs(z @ z) ** 2)  # COMPLEX

    report = sciflat.audit_dtypes(cplx, jnp.ones(3, F32))
    (found,) = [f for f in report.precision if f.where.line == _line("# COMPLEX")]
    assert found.dtype == np.dtype(np.complex64)


def test_a_function_traced_earlier_is_read_as_traced_now():
    jitted = jax.jit(lambda p: jnp.sum(product(p) ** 2))
    p = jnp.ones(3, jnp.float32)
    jitted(p)  # compiled at DEFAULT precision
    with jax.default_matmul_precision("highest"):
        assert sciflat.audit_dtypes(jitted, p).precision == ()
    assert sciflat.audit_dtypes(jitted, p).precision


def test_report_text_raising_and_allowing():
    loss = lambda p: jnp.sum(product(p) ** 2)
    p = jnp.ones(3, jnp.float32)
    report = sciflat.audit_dtypes(loss, p)
    text = str(report)
    assert "nothing found" in text  # no dtype finding...
    assert "at DEFAULT precision" in text and "exact on CPU" in text  # ...but this
    assert 'jax.default_matmul_precision("highest")' in text
    assert f"test_precision.py:{_line('# PRODUCT')} (product)" in text
    # On CPU it is harmless, so tests raise only when asked; on GPU/TPU by default.
    assert report.raise_if_any() is report
    assert sciflat.assert_dtypes(loss, p).precision == report.precision
    with pytest.raises(TypeError, match="default_matmul_precision"):
        report.raise_if_any(precision=True)
    with pytest.raises(AssertionError, match=r"test_precision\.py:\d+ \(product\)"):
        sciflat.assert_dtypes(loss, p, precision=True)
    sciflat.assert_dtypes(loss, p, precision=False)
    with jax.default_matmul_precision("highest"):
        sciflat.assert_dtypes(loss, p, precision=True)
    # Only a function in `allow` allows a product: a dtype is no precision.
    assert sciflat.audit_dtypes(loss, p, allow=["float32"]).precision
    by_line = lambda f: f.kind == "precision" and f.where.line == _line("# PRODUCT")
    allowed = sciflat.audit_dtypes(loss, p, allow=[by_line])
    assert not _at_product(allowed) and allowed.allowed


def test_on_a_gpu_assert_dtypes_raises_by_default(monkeypatch):
    loss = lambda p: jnp.sum(product(p) ** 2)
    p = jnp.ones(3, jnp.float32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(AssertionError, match="DEFAULT precision"):
        sciflat.assert_dtypes(loss, p)
    sciflat.assert_dtypes(loss, p, precision=False)
    sciflat.assert_dtypes(lambda p: jnp.sum(product(p) ** 2), jnp.ones(3))  # float64


#
# The fits: each traces under the ambient setting, and re-traces when it changes.
#


class Linear(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        return x @ self.weight


X = np.linspace(0.0, 1.0, 12).reshape(4, 3)
Y = X @ np.array([0.5, -1.0, 2.0])


def _recording(seen: list):
    """A loss that records the default matmul precision in force while it is traced."""

    def residuals(model):
        seen.append(jax.config.jax_default_matmul_precision)
        return model(jnp.asarray(X, model.weight.dtype)) - Y

    return residuals, lambda model: jnp.mean(residuals(model) ** 2)


FITS = {
    "fit": lambda r, loss, m: sciflat.fit(
        loss, m, optax.adam(1e-2), steps=3, progress=False
    ),
    "minimize": lambda r, loss, m: sciflat.minimize(
        loss, m, progress=False, options=dict(maxiter=3)
    ),
    "least_squares": lambda r, loss, m: sciflat.least_squares(
        r, m, progress=False, max_nfev=3
    ),
}


@pytest.mark.parametrize(
    "which", [pytest.param("fit", marks=pytest.mark.slow), "minimize", "least_squares"]
)
def test_fits_trace_under_the_context_and_retrace_when_it_changes(which):
    seen: list = []
    residuals, loss = _recording(seen)
    model = Linear(jnp.zeros(3))
    done = set()
    for setting in [None, "highest", None]:
        seen.clear()
        with jax.default_matmul_precision(setting):
            result = FITS[which](residuals, loss, model)
        assert np.isfinite(result.loss)
        # Whatever was traced in this call saw this call's setting: nothing compiled
        # under another setting is reused...
        assert set(seen) <= {setting}, (which, setting, seen)
        # ...and a new setting is traced anew (a stale function would record nothing).
        assert seen or setting in done, (which, setting)
        done.add(setting)


def test_a_product_is_judged_by_the_dtype_it_computes_in():
    # float32 data times a float64 `p`: `dot_general` gets the operands as they are
    # and computes (and returns) float64, exact on a GPU too; it was listed as a
    # float32 product, so `assert_dtypes(..., precision=None)` failed a correct
    # program. The reference: the same product with the data cast to float64 first.
    x = jnp.asarray(np.linspace(0.0, 1.0, 12).reshape(3, 4), jnp.float32)
    mixed = lambda p: jnp.sum(x @ p.reshape(4, 4))
    cast = lambda p: jnp.sum(x.astype(p.dtype) @ p.reshape(4, 4))
    p = jnp.ones(16)
    eqns = jax.make_jaxpr(mixed)(p).eqns
    (dot,) = [e for e in eqns if e.primitive.name == "dot_general"]
    assert {np.dtype(v.aval.dtype) for v in dot.invars} == {F32, np.dtype(np.float64)}
    assert dot.outvars[0].aval.dtype == jnp.float64
    for f in (mixed, cast):
        assert sciflat.audit_dtypes(f, p).precision == ()
        sciflat.assert_dtypes(f, p, precision=True)  # what `None` does on a GPU
    # A float32 product is still one: float32 data times a float32 `p`.
    assert sciflat.audit_dtypes(mixed, p.astype(jnp.float32)).precision != ()
