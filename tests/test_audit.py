"""The dtype auditor: what it finds, where it says it is, what it lets through."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sciflat


F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
W32 = np.arange(9.0, dtype=np.float32).reshape(3, 3) / 10  # a float32 constant


def _line(marker: str) -> int:
    """The line of this file that carries `marker` in a comment."""
    with open(__file__) as f:
        lines = f.read().splitlines()
    matches = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(marker)]
    assert len(matches) == 1, marker
    return matches[0]


def planted(p):
    h = p.astype(jnp.float32)  # NARROW
    return (W32 @ h).astype(p.dtype)  # PLANTED


def _at(report, line: int, kind=None, primitive=None) -> list:
    return [
        f
        for f in report.findings
        if f.where.line == line
        and f.where.file == __file__
        and (kind is None or f.kind == kind)
        and (primitive is None or f.primitive == primitive)
    ]


def _custom_jvp(p):
    @jax.custom_jvp
    def f(p):
        return planted(p)

    f.defjvp(lambda primals, tangents: (f(*primals), planted(*tangents)))
    return f(p)


def _custom_vjp(p):
    @jax.custom_vjp
    def f(p):
        return planted(p)

    f.defvjp(lambda p: (planted(p), None), lambda _, ct: (planted(ct),))
    return f(p)


WRAPPERS = {
    "jit": lambda p: jax.jit(planted)(p),
    "scan": lambda p: jax.lax.scan(lambda c, _: (planted(c), None), p, length=4)[0],
    "cond": lambda p: jax.lax.cond(p[0] > 0, planted, lambda q: q, p),
    "custom_jvp": _custom_jvp,
    "custom_vjp": _custom_vjp,
    "checkpoint": lambda p: jax.checkpoint(planted)(p),
    "nested": lambda p: jax.jit(
        lambda q: jax.lax.cond(True, jax.checkpoint(planted), planted, q)
    )(p),
}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_finds_planted_float32_matmul_at_its_line(wrapper, grad):
    loss = lambda p: jnp.sum(WRAPPERS[wrapper](p))
    report = sciflat.audit_dtypes(loss, jnp.ones(3), grad=grad)
    assert report.expected == F64
    (matmul,) = _at(report, _line("# PLANTED"), "op", "dot_general")
    assert matmul.dtype == F32 and matmul.source is None and matmul.count >= 1
    (narrow,) = _at(report, _line("# NARROW"), "narrow")
    assert (narrow.source, narrow.dtype, narrow.primitive) == (
        F64,
        F32,
        "convert_element_type",
    )
    # Nothing is blamed on JAX's own files, and every finding is about float32.
    assert all(f.where.file == __file__ for f in report.findings)
    assert all(F32 in (f.source, f.dtype) for f in report.findings)


def test_while_loop_is_walked():
    def loss(p):
        body = lambda c: (planted(c[0]), c[1] + 1)
        return jnp.sum(jax.lax.while_loop(lambda c: c[1] < 3, body, (p, 0))[0])

    report = sciflat.audit_dtypes(loss, jnp.ones(3), grad=False)  # no reverse mode
    assert _at(report, _line("# PLANTED"), "op", "dot_general")


def test_counts_ops_in_the_jaxpr():
    def loss(p):
        h = p.astype(jnp.float32)
        for _ in range(3):
            h = W32 @ h  # THREE MATMULS
        # In a loop body an op is in the jaxpr once, however often it runs.
        h = jax.lax.fori_loop(0, 5, lambda i, h: W32 @ h, h)  # ONE MATMUL
        return jnp.sum(h).astype(p.dtype)  # ONE SUM

    report = sciflat.audit_dtypes(loss, jnp.ones(3), grad=False)
    assert [f.count for f in _at(report, _line("# THREE MATMULS"))] == [3]
    assert [f.count for f in _at(report, _line("# ONE MATMUL"))] == [1]
    (total, widen) = sorted(_at(report, _line("# ONE SUM")), key=lambda f: f.kind)
    assert (total.primitive, total.dtype, total.count) == ("reduce_sum", F32, 1)
    assert (widen.kind, widen.source, widen.dtype, widen.count) == (
        "widen",
        F32,
        F64,
        1,
    )
    # The gradient adds the transposed matmuls: W32.T @ ct for each forward one.
    with_grad = sciflat.audit_dtypes(loss, jnp.ones(3))
    assert [f.count for f in _at(with_grad, _line("# THREE MATMULS"), "op")] == [6]


def test_widening_data_is_fine_widening_a_computed_value_is_not():
    x32 = jnp.linspace(0, 1, 3, dtype=jnp.float32)

    def loss(p, x):
        data = p * x.astype(p.dtype)  # float32 data brought up: lossless, not a finding
        computed = jnp.sin(x).astype(p.dtype)  # COMPUTED IN FLOAT32
        return jnp.sum(data + computed)

    report = sciflat.audit_dtypes(loss, jnp.ones(3), x32)
    kinds = sorted((f.kind, f.primitive) for f in report.findings)
    assert kinds == [("op", "sin"), ("widen", "convert_element_type")]
    assert all(f.where.line == _line("# COMPUTED IN FLOAT32") for f in report.findings)
    # The same data closed over as a constant, and reshaped first, is still data.
    clean = sciflat.audit_dtypes(
        lambda p: jnp.sum(p * x32.reshape(3, 1).T[0]), jnp.ones(3)
    )
    assert not clean and clean.n_checked > 0


def test_weak_typed_scalars_and_integer_index_arithmetic_are_not_findings():
    def loss(p):
        i = (jnp.arange(3) * 2 + 1) % 3  # integer index arithmetic
        q = p[i] * 2.0 + 1  # Python scalars are weak: they take p's dtype
        q = jnp.where(q > 0.5, q, -q) / len(p)
        return jnp.sum(q**2) + jnp.argmax(q) + jnp.sin(3.0)

    p32 = jnp.ones(3, jnp.float32)  # x64 is on: a bare 3.0 is a weak float64
    report = sciflat.audit_dtypes(loss, p32)
    assert not report.findings, str(report)
    # A strong float64 scalar is a finding: the test above can fail.
    strong = sciflat.audit_dtypes(lambda p: jnp.sum(p * jnp.float64(2.0)), p32)
    assert {(f.kind, f.primitive, f.dtype) for f in strong.findings} == {
        ("widen", "convert_element_type", F64),  # p promoted to float64
        ("op", "mul", F64),
        ("op", "reduce_sum", F64),
        ("narrow", "convert_element_type", F32),  # the gradient, back to p's dtype
    }


def test_complex_counterpart_is_fine_other_complex_is_not():
    z64 = jnp.array([1 + 2j, 3 - 1j], jnp.complex64)
    fine = lambda p: jnp.sum(jnp.abs(p * (1j * p)) ** 2)
    assert not sciflat.audit_dtypes(fine, jnp.ones(2))
    mixed = sciflat.audit_dtypes(lambda p: jnp.sum(jnp.abs(z64 * z64) * p), jnp.ones(2))
    assert {(f.kind, f.primitive, f.dtypes) for f in mixed.findings} == {
        ("op", "mul", "complex64"),
        ("op", "abs", "float32"),
        ("widen", "convert_element_type", "float32 -> float64"),
    }


def test_equinox_layers_are_blamed_on_the_calling_line():
    lin = eqx.nn.Linear(3, 3, dtype=jnp.float32, key=jax.random.key(0))
    loss = lambda p: jnp.sum(lin(p.astype(jnp.float32)))  # EQX CALL
    report = sciflat.audit_dtypes(loss, jnp.ones(3))
    assert {f.where.line for f in report.findings} == {_line("# EQX CALL")}
    assert {"dot_general", "add"} <= {f.primitive for f in report.findings}


def test_allow_list():
    loss = lambda p: jnp.sum(planted(p))
    p = jnp.ones(3)
    full = sciflat.audit_dtypes(loss, p)
    assert not sciflat.audit_dtypes(loss, p, allow=["float32"])
    assert not sciflat.audit_dtypes(loss, p, allow=[jnp.float32])
    only_matmul = sciflat.audit_dtypes(loss, p, allow=[("dot_general", "float32")])
    assert {f.primitive for f in only_matmul.findings} == {"convert_element_type"}
    assert {f.primitive for f in only_matmul.allowed} == {"dot_general"}
    assert len(only_matmul.findings) + len(only_matmul.allowed) == len(full.findings)
    by_line = sciflat.audit_dtypes(
        loss, p, allow=[lambda f: f.where.line == _line("# PLANTED")]
    )
    assert {f.where.line for f in by_line.findings} == {_line("# NARROW")}
    # Narrowing is reported even for data: rounding a float64 constant loses digits.
    c64 = jnp.linspace(0, 1, 3, dtype=jnp.float64)
    rounds = lambda p: jnp.sum(p * c64.astype(p.dtype))
    p32 = jnp.ones(3, jnp.float32)
    (narrow,) = sciflat.audit_dtypes(rounds, p32).findings
    assert (narrow.kind, narrow.source, narrow.dtype) == ("narrow", F64, F32)
    allowed = sciflat.audit_dtypes(
        rounds, p32, allow=[("convert_element_type", "float64")]
    )
    assert not allowed and len(allowed.allowed) == 1
    # bfloat16 allowed does not allow float32.
    assert len(sciflat.audit_dtypes(loss, p, allow=["bfloat16"])) == len(full)
    with pytest.raises(TypeError, match="allow"):
        sciflat.audit_dtypes(loss, p, allow=[("dot_general",)])
    with pytest.raises(TypeError, match="allow"):
        sciflat.audit_dtypes(loss, p, allow=["not-a-dtype"])


def test_tracing_only_nothing_runs():
    def explode(x):
        raise AssertionError("the audited function was executed")

    def loss(p):
        h = jax.pure_callback(explode, jax.ShapeDtypeStruct(p.shape, p.dtype), p)
        jax.debug.callback(explode, h)
        return jnp.sum(jnp.sin(h.astype(jnp.float32)))  # HUGE

    huge = jax.ShapeDtypeStruct((10**11,), jnp.float64)  # 800 GB if it ran
    report = sciflat.audit_dtypes(loss, huge, grad=False)
    assert {f.primitive for f in report.findings} == {
        "convert_element_type",
        "sin",
        "reduce_sum",
    }
    assert report.out.shape == () and report.out.dtype == F32


def test_report_table_and_errors():
    loss = lambda p: jnp.sum(planted(p))
    report = sciflat.audit_dtypes(loss, jnp.ones(3))
    text = str(report)
    assert "expected float64" in text and "dot_general" in text
    assert "float64 -> float32" in text
    assert f"test_audit.py:{_line('# PLANTED')} (planted)" in text
    with pytest.raises(TypeError, match="dot_general"):
        report.raise_if_any()
    with pytest.raises(AssertionError, match=r"test_audit\.py:\d+ \(planted\)"):
        sciflat.assert_dtypes(loss, jnp.ones(3))
    clean = sciflat.assert_dtypes(lambda p: jnp.sum(p**2), jnp.ones(3))
    assert clean.raise_if_any() is clean and "nothing found" in str(clean)
    value, grad = clean.out
    assert (value.dtype, grad.dtype, grad.shape) == (F64, F64, (3,))


def test_expected_dtype():
    tree = {"a": jnp.ones(2, jnp.float32), "b": jnp.ones(2, jnp.float64)}
    loss = lambda t: jnp.sum(t["a"]) + jnp.sum(t["b"])
    with pytest.raises(TypeError, match="expect"):
        sciflat.audit_dtypes(loss, tree)
    report = sciflat.audit_dtypes(loss, tree, expect=jnp.float64)
    assert {f.dtypes for f in report.findings} == {"float32", "float32 -> float64"}
    with pytest.raises(TypeError, match="`expect`"):
        sciflat.audit_dtypes(loss, tree, expect=jnp.int32)
    # An explicit expectation overrides p.dtype: a float32 p is then all findings.
    p32 = sciflat.audit_dtypes(
        lambda p: jnp.sum(p * p), jnp.ones(2, jnp.float32), expect="float64"
    )
    assert {f.primitive for f in p32.findings} >= {"mul", "reduce_sum"}


def test_constants_stay_data_inside_scan_while_and_cond():
    c32 = jnp.linspace(0, 1, 3, dtype=jnp.float32)

    def loss(p, n):
        q = jax.lax.scan(lambda q, _: (q * c32.astype(q.dtype), None), p, length=3)[0]
        q = jax.lax.fori_loop(0, n, lambda i, q: q * c32.T.astype(q.dtype), q)  # while
        q = jax.lax.cond(n > 1, lambda q: q * c32.astype(q.dtype), lambda q: q, q)
        return jnp.sum(q)

    assert not sciflat.audit_dtypes(loss, jnp.ones(3), 2, grad=False)

    # Data moved around inside a jit, a cond or a checkpoint is still data outside it.
    def moved(p):
        c = jax.jit(jax.checkpoint(lambda c: c[::-1].reshape(3, 1)))(c32)
        c = jax.lax.cond(p[0] > 0, lambda c: c.T, lambda c: c.T, c)
        return jnp.sum(p * c.astype(p.dtype))

    assert not sciflat.audit_dtypes(moved, jnp.ones(3))
    computed_in_jit = lambda p: jnp.sum(p * jax.jit(jnp.exp)(c32).astype(p.dtype))
    assert {
        f.kind for f in sciflat.audit_dtypes(computed_in_jit, jnp.ones(3)).findings
    } == {
        "op",
        "widen",
    }

    def computed(p):  # the same in the loop body, from a float32 computation
        body = lambda q, _: (q * jnp.sin(c32).astype(q.dtype), None)  # SIN IN SCAN
        return jnp.sum(jax.lax.scan(body, p, length=3)[0])

    report = sciflat.audit_dtypes(computed, jnp.ones(3), grad=False)
    assert {(f.kind, f.primitive) for f in report.findings} == {
        ("op", "sin"),
        ("widen", "convert_element_type"),
    }
    assert {f.where.line for f in report.findings} == {_line("# SIN IN SCAN")}


def test_p_can_be_a_whole_model():
    # A model with functions (activations) among its leaves.
    mlp = eqx.nn.MLP(3, 2, 4, 1, dtype=jnp.float32, key=jax.random.key(0))
    loss = lambda model, x: jnp.sum(model(x) ** 2)  # MODEL LOSS
    report = sciflat.assert_dtypes(loss, mlp, jnp.ones(3, jnp.float32))
    value, grads = report.out
    assert value.dtype == F32 and grads.layers[0].weight.dtype == F32
    found = sciflat.audit_dtypes(loss, mlp, jnp.ones(3))  # float64 data: promotes
    assert {f.where.line for f in found.findings} >= {_line("# MODEL LOSS")}
    assert F64 in {f.dtype for f in found.findings}


def test_64_bit_p_without_x64_is_refused(x64_off):
    p = np.ones(3)  # a NumPy float64 array: JAX would trace it as float32
    with pytest.raises(TypeError, match="jax_enable_x64"):
        sciflat.audit_dtypes(lambda p: jnp.sum(p**2), p)
    with pytest.raises(TypeError, match="jax_enable_x64"):
        sciflat.audit_dtypes(lambda p: jnp.sum(p**2), jnp.ones(3), expect="float64")
    assert not sciflat.audit_dtypes(lambda p: jnp.sum(p**2), np.ones(3, np.float32))


#
# Property: on random chains of ops, each wrapped at random in jit / scan / cond /
# checkpoint, a float32 stretch planted anywhere is found exactly: one narrowing at
# its start, one float32 op per op inside it, one widening at its end.
#

_OPS = {
    "sin": jnp.sin,
    "tanh": jnp.tanh,
    "mul": lambda x: x * x,
    "add": lambda x: x + 1.5,
}
_WRAPS = {
    "none": lambda f, x, pred: f(x),
    "jit": lambda f, x, pred: jax.jit(f)(x),
    "scan": lambda f, x, pred: jax.lax.scan(lambda c, _: (f(c), None), x, length=2)[0],
    "cond": lambda f, x, pred: jax.lax.cond(pred, f, lambda y: y, x),
    "checkpoint": lambda f, x, pred: jax.checkpoint(f)(x),
}


@settings(max_examples=30, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(sorted(_OPS)), st.sampled_from(sorted(_WRAPS))),
        min_size=1,
        max_size=6,
    ),
    data=st.data(),
)
def test_planted_float32_stretch_is_found_exactly(steps, data):
    start = data.draw(st.integers(0, len(steps)), label="start")
    stop = data.draw(st.integers(start, len(steps)), label="stop")

    def chain(p):
        x, pred = p, p[0] > 0
        for i, (op, wrap) in enumerate(steps):
            if i == start:
                x = x.astype(jnp.float32)
            if i == stop:
                x = x.astype(p.dtype)
            x = _WRAPS[wrap](_OPS[op], x, pred)
        if stop == len(steps):
            x = x.astype(p.dtype)
        return jnp.sum(x)

    report = sciflat.audit_dtypes(chain, jnp.ones(3), grad=False)
    inside = [op for op, _ in steps[start:stop]]
    want = {("op", _OPS_PRIMITIVE[op], "float32"): inside.count(op) for op in inside}
    if start < len(steps):  # else nothing was planted
        want[("narrow", "convert_element_type", "float64 -> float32")] = 1
        want[("widen", "convert_element_type", "float32 -> float64")] = 1
    got = {}
    for f in report.findings:
        key = (f.kind, f.primitive, f.dtypes)
        got[key] = got.get(key, 0) + f.count
    assert got == want, str(report)


_OPS_PRIMITIVE = {"sin": "sin", "tanh": "tanh", "mul": "mul", "add": "add"}


# What docs/audit.md tells bfloat16 users to allow for jnp.sum and jnp.mean.
BF16_SUM = [
    ("reduce_sum", "float32"),
    ("broadcast_in_dim", "float32"),
    ("convert_element_type", "float32"),
]
BF16_MEAN = [*BF16_SUM, ("div", "float32")]


def test_documented_bfloat16_allowances_cover_sum_and_mean():
    p = jnp.ones(8, jnp.bfloat16)
    total = lambda p: jnp.sum(p**2)
    mean = lambda p: jnp.mean(p**2)
    # Both accumulate in float32 on purpose; without an allowance, that is reported.
    assert sciflat.audit_dtypes(total, p) and sciflat.audit_dtypes(mean, p)
    sciflat.assert_dtypes(total, p, allow=BF16_SUM)
    sciflat.assert_dtypes(mean, p, allow=BF16_MEAN)
    # The mean divides by the count in float32 too: the sum's list is not enough.
    (div,) = sciflat.audit_dtypes(mean, p, allow=BF16_SUM).findings
    assert (div.primitive, div.dtype) == ("div", F32)
    # And the allowances do not hide a float32 computation of the user's own.
    own = lambda p: jnp.mean(p.astype(jnp.float32) ** 2).astype(p.dtype)
    report = sciflat.audit_dtypes(own, p, allow=BF16_MEAN)
    assert "integer_pow" in {f.primitive for f in report.findings}
