"""Shared test utilities: reference comparisons, the edge-case models, the jaxpr scanner."""

import contextlib
import functools
import importlib.util
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
from hypothesis import strategies as st


def tree_allclose(a, b, rtol=1e-6, atol=1e-6) -> bool:
    """Same structure, and every array leaf of the same shape, dtype and close values
    (a float32 leaf is never "close" to a float64 one: the dtype rule is the point)."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    if ta != tb:
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array | np.ndarray):
            if (
                np.shape(x) != np.shape(y)
                or np.dtype(x.dtype) != np.dtype(getattr(y, "dtype", None))
                or not np.allclose(x, y, rtol=rtol, atol=atol)
            ):
                return False
        elif x != y:
            return False
    return True


def inexact_dtypes(tree) -> set:
    """The dtypes of every floating or complex array leaf."""
    return {
        np.dtype(x.dtype)
        for x in jax.tree.leaves(tree)
        if isinstance(x, jax.Array | np.ndarray)
        and jnp.issubdtype(x.dtype, jnp.inexact)
    }


class Tied(eqx.Module):
    """The seed-000 model: one layer used twice (`Model(d, d)` in Flux)."""

    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x):
        return self.a(x) + self.b(x)


class Mixed(eqx.Module):
    """float32 and float64 leaves, a frozen-by-type int leaf and a static field."""

    w32: jax.Array
    w64: jax.Array
    counts: jax.Array
    name: str = eqx.field(static=True, default="mixed")

    def __call__(self, x):
        return jnp.sum(self.w32 * x) + jnp.sum(self.w64 * x) + jnp.sum(self.counts)


class WithComplex(eqx.Module):
    z: jax.Array
    w: jax.Array

    def __call__(self, x):
        return jnp.sum(jnp.abs(self.z * x) ** 2) + jnp.sum(self.w * x)


class SharedTransposed(eqx.Module):
    """The seed's `W` and `W'`: an encoder weight reused, transposed, by the decoder."""

    shared: eqx.nn.Shared

    def __init__(self, n, m, key):
        k1, k2 = jax.random.split(key)
        enc = eqx.nn.Linear(n, m, key=k1, dtype=jnp.float32)
        dec = eqx.nn.Linear(m, n, key=k2, dtype=jnp.float32)
        where = lambda pair: pair[1].weight
        get = lambda pair: pair[0].weight.T
        self.shared = eqx.nn.Shared((enc, dec), where, get)

    def __call__(self, x):
        enc, dec = self.shared()
        return dec(jnp.tanh(enc(x)))


# The names of `edge_models()`, known without building them: a module can parametrize
# over them at collection (every worker collects every module) and build the models
# when a test asks (`EdgeModels`).
EDGE_NAMES = (
    "empty",
    "only_ints",
    "scalar_0d",
    "numpy_leaves",
    "mlp_float32",
    "tied_identity",
    "nested_tie",
    "shared_transposed",
    "mixed_precision",
    "complex_leaf",
)


class EdgeModels(Mapping):
    """`edge_models()`, built at the first lookup (2.4 s of eager operations)."""

    def __iter__(self):
        return iter(EDGE_NAMES)

    def __len__(self):
        return len(EDGE_NAMES)

    def __getitem__(self, name):
        return _edge_models()[name]


@functools.cache
def _edge_models():
    models = edge_models()
    assert tuple(models) == EDGE_NAMES
    return models


def edge_models():
    """Name -> (model, input) for every edge case the suite reuses."""
    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    lin = eqx.nn.Linear(1, 1, key=k1, dtype=jnp.float32)
    mlp32 = eqx.nn.MLP(3, 2, 8, 2, key=k2, dtype=jnp.float32)
    nested = eqx.nn.Sequential([lin, eqx.nn.Lambda(jnp.tanh), lin])
    return {
        "empty": ((), None),
        "only_ints": ({"n": jnp.arange(3)}, None),
        "scalar_0d": ({"a": jnp.asarray(2.0), "b": jnp.ones((2, 0))}, None),
        "numpy_leaves": ({"w": np.linspace(0, 1, 4), "i": np.arange(2)}, None),
        "mlp_float32": (mlp32, jnp.ones(3)),
        "tied_identity": (Tied(lin, lin), jnp.ones(1)),
        "nested_tie": (nested, jnp.ones(1)),
        "shared_transposed": (SharedTransposed(3, 2, k3), jnp.ones(3)),
        "mixed_precision": (
            Mixed(
                jnp.ones(2, jnp.float32), jnp.full(2, 0.5, jnp.float64), jnp.arange(2)
            ),
            jnp.ones(2),
        ),
        "complex_leaf": (
            WithComplex(jnp.array([1 + 2j, 3 - 1j], jnp.complex64), jnp.ones(2)),
            jnp.ones(2),
        ),
    }


#
# The one hypothesis strategy of random models
#

FLOATS = (np.float16, np.float32, np.float64)
SHAPES = st.lists(st.integers(0, 3), max_size=2).map(tuple)


@st.composite
def random_models(draw, dtypes=(*FLOATS, np.complex64), mixed_ties=False):
    """`(model, spec, uses)`: a dict of array leaves `u0, u1, ...` where position `k`
    holds array `uses[k]` (positions sharing an array are tied), and a `filter_spec`
    freezing some arrays. With `mixed_ties`, trainability is sometimes drawn per
    position, so that a tied array may be trainable in one use and frozen in another
    (which `destructure` refuses)."""
    n_arrays = draw(st.integers(1, 4))
    arrays = []
    for i in range(n_arrays):
        shape = draw(SHAPES)
        dtype = draw(st.sampled_from(dtypes))
        values = np.random.default_rng(i).normal(size=shape) * 2 + 0.5
        if np.issubdtype(dtype, np.complexfloating):
            values = values + 1j * values[::-1] if values.ndim else values + 0.5j
        arrays.append(jnp.asarray(values.astype(dtype)))
    uses = draw(st.lists(st.integers(0, n_arrays - 1), min_size=1, max_size=6))
    if mixed_ties and draw(st.booleans()):
        n = len(uses)
        frozen = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    else:
        per_array = draw(st.lists(st.booleans(), min_size=n_arrays, max_size=n_arrays))
        frozen = [per_array[i] for i in uses]
    model = {f"u{k}": arrays[i] for k, i in enumerate(uses)}
    spec = {f"u{k}": not frozen[k] for k in range(len(uses))}
    return model, spec, uses


#
# The one jaxpr scanner of the suite
#


def float_outputs(jaxpr) -> list[tuple[str, Any]]:
    """`(primitive, aval)` for every floating value any equation outputs, nested
    jaxprs (scan, cond, custom derivatives, pjit...) included: what a computation
    computes *in*. Takes a `ClosedJaxpr` (as `jax.make_jaxpr` returns) or a `Jaxpr`."""
    from jax.extend.core import jaxprs_in_params

    found, stack = [], [getattr(jaxpr, "jaxpr", jaxpr)]
    while stack:
        jaxpr = stack.pop()
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                dtype = getattr(var.aval, "dtype", None)
                if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
                    found.append((eqn.primitive.name, var.aval))
            stack.extend(jaxprs_in_params(eqn.params))
    return found


def float_dtypes_in_jaxpr(jaxpr) -> set[str]:
    """Names of the floating dtypes output by any equation, nested jaxprs included."""
    return {np.dtype(aval.dtype).name for _, aval in float_outputs(jaxpr)}


def foreign_float_ops(jaxpr, dtype) -> list[str]:
    """Every op producing a strongly typed float of another dtype than `dtype`.
    Weakly typed scalars (`~float64[]`, Python constants such as a step-size factor)
    are literals combined with `dtype` values in `dtype`, not computations on `p`."""
    return [
        f"{name}: {aval}"
        for name, aval in float_outputs(jaxpr)
        if aval.dtype != dtype and not aval.weak_type
    ]


#
# Several devices on one CPU
#


def _on_host_devices(code: str, args, n_devices: int, timeout: int):
    """`python -c code *args` in a fresh interpreter that sees `n_devices` CPU devices
    (the count is fixed when JAX starts, hence the subprocess), from the repository
    root; it must succeed."""
    import os
    import subprocess
    import sys

    flags = f"--xla_force_host_platform_device_count={n_devices}"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def run_on_host_devices(code: str, n_devices: int = 2) -> None:
    """Runs `code` on `n_devices` CPU devices (`_on_host_devices`); it must print
    "ok"."""
    out = _on_host_devices(code, (), n_devices, timeout=120)
    assert "ok" in out.stdout, out.stderr[-2000:]


def json_on_host_devices(
    code: str, *args, n_devices: int = 4, timeout: int = 600
) -> Any:
    """Runs `code` on `n_devices` CPU devices; the JSON its last line prints."""
    out = _on_host_devices(code, args, n_devices, timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])


#
# Small problems of the SciPy fits (tests/test_scipy*.py)
#


class Quad(eqx.Module):
    a: jax.Array
    b: jax.Array


C = jnp.asarray([0.5, -1.0, 2.0])


def quad_loss(m, c):
    # Minimum of the separable, strictly convex pieces: a* solves 2(a - c) + 0.4 a^3 = 0.
    return jnp.sum((m.a - c) ** 2) + (m.b - 2.0) ** 2 + 0.1 * jnp.sum(m.a**4)


def quad_model(dtype=jnp.float32):
    return Quad(jnp.ones(3, dtype), jnp.asarray(0.0, dtype))


def quad_minimum():
    a = np.asarray(
        [
            scipy.optimize.brentq(lambda a, c=c: 2 * (a - c) + 0.4 * a**3, -5, 5)
            for c in C
        ]
    )
    return a, 2.0


def _spy(monkeypatch, name):
    seen = {}
    real = getattr(scipy.optimize, name)

    def spy(fun, x0, **kwargs):
        seen.update(fun=fun, x0=np.copy(x0), **kwargs)
        return real(fun, x0, **kwargs)

    monkeypatch.setattr(scipy.optimize, name, spy)
    return seen


class TiedNet(eqx.Module):
    """Ties and a float32 initialisation: the gradient of the tied weight is summed."""

    tied: Tied
    scale: jax.Array

    def __call__(self, x):
        return self.scale * jnp.tanh(self.tied(x))


def tied_loss(m, x, y):
    return jnp.mean((jax.vmap(m)(x) - y) ** 2)


def exp_model():
    return {"amp": jnp.asarray(1.0), "rate": jnp.asarray(0.5)}


T = jnp.linspace(0.0, 2.0, 20)
Y = 3.0 * jnp.exp(-1.3 * T)


def exp_residuals(m, t, y):
    return m["amp"] * jnp.exp(-m["rate"] * t) - y


# Every trace JAX makes, from its monitoring events: counts what sciflat traces
# without putting a counter into the loss (whose closure is part of the cache key).
_EVENTS: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, _, **kw: _EVENTS.append(name)
)


@contextlib.contextmanager
def count_traces():
    start, seen = len(_EVENTS), []
    yield seen
    trace = "/jax/core/compile/jaxpr_trace_duration"
    seen.extend(e for e in _EVENTS[start:] if e == trace)


ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_example(name: str, file: str):
    """Import an example script from its path, as a user would run it."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / name / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- stiff test problems of the ODE solvers (Rodas5P, BDF) --


def forced_van_der_pol(t, y, args):
    # Non-autonomous, so the ∂f/∂t terms of the method are exercised too.
    return jnp.stack([y[1], 5.0 * (1 - y[0] ** 2) * y[1] - y[0] + jnp.sin(t)])


def robertson(t, y, args):
    a, b, c = y[0], y[1], y[2]
    return jnp.stack(
        [
            -0.04 * a + 1e4 * b * c,
            0.04 * a - 1e4 * b * c - 3e7 * b**2,
            3e7 * b**2,
        ]
    )


def tight(f, y0, ts):
    """Kvaerno5 with Newton's method at 1e-13, at the times `ts`: the reference."""
    import diffrax
    import optimistix as optx

    ts = jnp.asarray(ts, y0.dtype)
    solver = diffrax.Kvaerno5(root_finder=optx.Newton(rtol=1e-13, atol=1e-13))
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(f),
        solver,
        0.0,
        ts[-1],
        None,
        y0,
        saveat=diffrax.SaveAt(ts=ts),
        stepsize_controller=diffrax.PIDController(rtol=1e-13, atol=1e-13),
        max_steps=100_000,
    )
    assert sol.ys is not None
    return sol.ys
