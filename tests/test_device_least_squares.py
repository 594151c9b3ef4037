"""The device fit (`least_squares(method="device")`) and batches of it.

References in each test: NIST's certified values, MINPACK (`method="lm"`, SciPy's
`leastsq`) on the same problem, the single fit for every member of a batch, a closed
form. Compilations are shared through module fixtures (one single-fit and one batch
program of Misra1a); each whole-fit compilation costs seconds, so those tests are in
the slow tier and the fast tier keeps the refusals and the algorithm's pieces.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sciflat
from helpers import float_dtypes_in_jaxpr, json_on_host_devices
from sciflat._device import least_squares as dls
from sciflat._solver import lm as _lm


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_reader():
    spec = importlib.util.spec_from_file_location(
        "nist", ROOT / "benchmarks" / "nist.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nist = _load_reader()
PROBLEMS = {p.name: p for p in nist.problems()}
MISRA = PROBLEMS["Misra1a"]
K = 12


def _values(result, problem):
    return np.array([float(result.model[b]) for b in problem.names])


def _stderr(result, problem):
    return np.array([float(result.stderr[b]) for b in problem.names])


@pytest.fixture(scope="module")
def replicates():
    """Misra1a's data with noise, K times: dataset 3 has a NaN, start 5 is inf, and
    the starts vary, so the fits stop after different numbers of evaluations."""
    rng = np.random.default_rng(0)
    ys = MISRA.y + 0.1 * rng.standard_normal((K, len(MISRA.y)))
    ys[3, 2] = np.nan
    starts = np.array(MISRA.starts[0]) * rng.uniform(0.5, 2.0, (K, 2))
    starts[5, 0] = np.inf
    return ys, starts


def _misra_batch(ys, **kwargs):
    return sciflat.least_squares_batch(
        MISRA.residuals,
        MISRA.start(1),
        args=(MISRA.x,),
        batch_args=(ys,),
        progress=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def batch(replicates):
    ys, starts = replicates
    return _misra_batch(ys, starts=starts)


def _single(y, start, **kwargs):
    model = dict(zip(MISRA.names, map(float, start), strict=True))
    return sciflat.least_squares(
        MISRA.residuals, model, args=(MISRA.x, y), progress=False, **kwargs
    )


@pytest.mark.slow  # compiles the whole fit: 2-4 s on 2 quiet cores
def test_misra1a_equals_minpack_and_nist():
    for start in (1, 2):
        ours = nist.fit(MISRA, start, method="device")
        theirs = nist.fit(MISRA, start, method="lm")
        assert ours.status == "converged", ours.message
        assert "method: device" in ours.message
        np.testing.assert_allclose(ours.p, theirs.p, rtol=1e-9)
        np.testing.assert_allclose(
            ours.uncertainty.stderr, theirs.uncertainty.stderr, rtol=1e-7
        )
        assert abs(ours.n_evaluations - theirs.raw.nfev) <= 1  # the same algorithm
        np.testing.assert_allclose(_values(ours, MISRA), MISRA.certified, rtol=1e-6)
        np.testing.assert_allclose(
            _stderr(ours, MISRA), MISRA.certified_stderr, rtol=1e-4
        )
        assert ours.chisqr == pytest.approx(MISRA.certified_rss, rel=1e-8)
        assert len(ours.history) == ours.n_steps and ours.history[-1] == ours.loss
        assert ours.raw.nfev == ours.n_evaluations and ours.raw.success
        assert "[[Variables]]" in str(ours)
        # `raw` as SciPy's: the residuals, Jacobian and gradient at the fitted `x`.
        raw, x = ours.raw, np.asarray(ours.p)
        np.testing.assert_array_equal(raw.x, x)
        r = lambda x: MISRA.residuals({"b1": x[0], "b2": x[1]}, MISRA.x, MISRA.y)
        np.testing.assert_allclose(raw.fun, r(x), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(raw.jac, jax.jacfwd(r)(x), rtol=1e-12)
        # At the minimum `Jᵀ f` cancels: to rounding of the sum of its terms' sizes.
        scale = np.abs(raw.jac).T @ np.abs(raw.fun)
        assert np.all(np.abs(raw.grad - raw.jac.T @ raw.fun) <= 1e-14 * scale)
        assert raw.optimality == np.max(np.abs(raw.grad)) and raw.cost == ours.loss
        assert raw.grad.shape == x.shape and raw.fun.shape == MISRA.y.shape


@pytest.fixture(scope="module")
def nist_fits():
    return {
        (name, s): (nist.fit(p, s, method="device"), nist.fit(p, s, method="lm"))
        for name, p in PROBLEMS.items()
        for s in (1, 2)
    }


@pytest.mark.slow  # a compilation per problem: ~3 s each on 2 quiet cores
@pytest.mark.parametrize("start", [1, 2])
@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_nist_certified_digits_and_minpack(nist_fits, name, start):
    problem = PROBLEMS[name]
    ours, minpack = nist_fits[name, start]
    assert ours.success, ours.message
    value_digits = [
        nist.digits(v, c)
        for v, c in zip(_values(ours, problem), problem.certified, strict=True)
    ]
    stderr_digits = [
        nist.digits(s, c)
        for s, c in zip(_stderr(ours, problem), problem.certified_stderr, strict=True)
    ]
    assert min(value_digits) >= 6, value_digits
    assert min(stderr_digits) >= 4, stderr_digits
    assert ours.chisqr == pytest.approx(problem.certified_rss, rel=1e-6)
    # MINPACK on the same problem: the same minimum, about the same evaluations (a
    # QR + SVD in place of a pivoted QR and Givens rotations rounds differently).
    np.testing.assert_allclose(ours.p, minpack.p, rtol=1e-6)
    np.testing.assert_allclose(
        ours.uncertainty.stderr, minpack.uncertainty.stderr, rtol=1e-5
    )
    assert abs(ours.n_evaluations - minpack.raw.nfev) <= 3


@pytest.mark.slow  # a batch program per problem: 5-15 s each on 2 loaded cores
@pytest.mark.parametrize("name", ["DanWood", "Gauss1", "Lanczos3", "Misra1b"])
def test_nist_through_the_batch_from_both_starts(nist_fits, name):
    """The batch's default algorithm (the normal equations, MINPACK's steps where
    they are ill-conditioned) on NIST's problems from both starts at once: the
    certified digits, and the single device fit's (MINPACK's QR) minimum."""
    problem = PROBLEMS[name]
    batch = sciflat.least_squares_batch(
        problem.residuals,
        problem.start(1),
        args=(problem.x, problem.y),
        starts=np.array(problem.starts),
        progress=False,
    )
    for start in (1, 2):
        i = start - 1
        single, _ = nist_fits[name, start]
        assert batch.status[i] == "converged", batch.message[i]
        digits = [
            nist.digits(v, c)
            for v, c in zip(batch.p[i], problem.certified, strict=True)
        ]
        stderr = [
            nist.digits(v, c)
            for v, c in zip(batch.stderr_flat[i], problem.certified_stderr, strict=True)
        ]
        assert min(digits) >= 6 and min(stderr) >= 4, (start, digits, stderr)
        np.testing.assert_allclose(batch.p[i], single.p, rtol=1e-6)
        np.testing.assert_allclose(
            batch.stderr_flat[i], single.uncertainty.stderr, rtol=1e-5
        )


@pytest.mark.slow  # compiles the whole fit: 2-4 s on 2 quiet cores
def test_batch_equals_single_fits_and_finished_fits_are_not_moved(batch, replicates):
    """The default algorithm (the normal equations): each fit equals the same fit
    run alone (a batch of one) to the bit, and MINPACK's single device fit (QR) to
    the digits the data determine, with about its evaluations."""
    ys, starts = replicates
    assert len(batch) == K and batch.p.shape == (K, 2)
    ok = [i for i in range(K) if i not in (3, 5)]
    # The fits stop at different turns: the early ones were carried, unchanged.
    assert len({int(batch.n_evaluations[i]) for i in ok}) > 1
    for i in ok:
        alone = _misra_batch(ys[i : i + 1], starts=starts[i : i + 1])
        np.testing.assert_array_equal(batch.p[i], alone.p[0])
        np.testing.assert_array_equal(batch.n_evaluations[i], alone.n_evaluations[0])
        np.testing.assert_allclose(batch.stderr_flat[i], alone.stderr_flat[0], 1e-12)
        single = _single(ys[i], starts[i], method="device")
        assert batch.status[i] == single.status == "converged"
        np.testing.assert_allclose(batch.p[i], single.p, rtol=1e-8, atol=0)
        assert abs(batch.n_evaluations[i] - single.n_evaluations) <= 1
        np.testing.assert_allclose(
            batch.stderr_flat[i], single.uncertainty.stderr, rtol=1e-8
        )
        assert batch.loss[i] == pytest.approx(single.loss, rel=1e-10)
        fit = batch[i]
        assert fit.status == "converged" and float(fit.model["b1"]) == batch.p[i, 0]
        np.testing.assert_allclose(fit.uncertainty.stderr, batch.stderr_flat[i])
    assert batch.model["b1"].shape == (K,)
    np.testing.assert_allclose(batch.stderr["b2"], batch.stderr_flat[:, 1])


@pytest.mark.slow  # a batch program for 1,000 slots: 2-3 s
def test_a_large_batch_equals_its_single_fits():
    # XLA reduces a batch of 1,000 in another order than one vector, and contracts
    # a product and an add into an FMA in one and not the other: with `jnp.sum` and
    # `@` in the loop, 66 of 334 fits ended more than 1e-10 from their single fits
    # (up to 1.5e-8, some after another number of evaluations). `_lm._sum` fixes
    # the order of every sum in the loop.
    # MINPACK's algorithm (`MinpackQR`), whose fits equal the single device fit.
    rng = np.random.default_rng(1)
    ys = MISRA.y + 0.1 * rng.standard_normal((1000, len(MISRA.y)))
    batch = _misra_batch(ys, algorithm=sciflat.MinpackQR())
    for i in range(0, 1000, 7):
        single = _single(ys[i], MISRA.starts[0], method="device")
        assert batch.n_evaluations[i] == single.n_evaluations, i
        np.testing.assert_allclose(batch.p[i], single.p, rtol=1e-10, atol=0)


@pytest.mark.slow  # a batch program for 100 slots: 2-4 s
def test_a_wide_batch_equals_its_fits_alone_to_the_bit():
    """The default algorithm in a pool of 100 slots: each fit equals its batch of
    one to the bit (with 64 slots or more, XLA's reduction of `JᵀJ` over Misra1a's
    14 residuals added in another order than for one: fits 2e-10 apart)."""
    rng = np.random.default_rng(4)
    ys = MISRA.y + 0.1 * rng.standard_normal((100, len(MISRA.y)))
    starts = np.array(MISRA.starts[0]) * rng.uniform(0.5, 2.0, (100, 2))
    batch = _misra_batch(ys, starts=starts)
    for i in (0, 31, 64, 99):
        alone = _misra_batch(ys[i : i + 1], starts=starts[i : i + 1])
        np.testing.assert_array_equal(batch.p[i], alone.p[0])
        np.testing.assert_array_equal(batch.n_evaluations[i], alone.n_evaluations[0])


@pytest.mark.slow  # a batch program for 256 slots: 3-5 s
def test_the_end_of_a_batch_evaluates_only_the_slots_of_running_fits():
    """Once at most an eighth of the slots hold running fits (the queue used up),
    only those are evaluated: counted, the slots evaluated in all turns are far
    fewer than every slot at every turn. Five slow fits (far starts)
    queued last keep the batch running long after the others; each of them, and
    fits that ended before, equal their batch of one to the bit."""
    from sciflat._device import batch as batch_module

    rng = np.random.default_rng(5)
    k, size = 300, 256
    ys = MISRA.y + 0.1 * rng.standard_normal((k, len(MISRA.y)))
    starts = np.tile(np.array(MISRA.starts[1]), (k, 1))
    starts[-5:] = np.array(MISRA.starts[0]) * [[0.2, 1.0]]  # far: many evaluations
    work = []
    run_pool = batch_module._run_pool

    def counted(*args, **kwargs):
        host, how = run_pool(*args, **kwargs)
        work.append(host["work"])
        return host, how

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch_module, "_run_pool", counted)
        batch = _misra_batch(ys, starts=starts, chunk_size=size)
    (done,) = work
    assert done["slots"] == size
    nfev = batch.n_evaluations
    assert nfev[-5:].min() > 2 * np.median(nfev[:-5])  # the slow fits end last
    # Every evaluation is one slot of one turn; every slot at every turn would be
    # `turns * size` (26 turns here: about 10 with the pool full, 16 with the five
    # slow fits evaluated in 32 rows, 0.46 of that).
    assert nfev.sum() <= done["evaluated"] < 0.6 * done["turns"] * size
    for i in (0, 150, k - 5, k - 1):
        alone = _misra_batch(ys[i : i + 1], starts=starts[i : i + 1])
        np.testing.assert_array_equal(batch.p[i], alone.p[0])
        np.testing.assert_array_equal(batch.n_evaluations[i], alone.n_evaluations[0])


@pytest.mark.slow  # compiles the whole fit: 2-4 s on 2 quiet cores
def test_failed_fits_are_reported_by_index(batch, replicates):
    assert batch.failed == [3, 5]
    assert batch.status[3] == batch.status[5] == "nonfinite"
    assert "non-finite at the start" in batch.message[3]
    assert np.isnan(batch.loss[3]) and np.isnan(batch.stderr_flat[5]).all()
    np.testing.assert_array_equal(batch.p[5], replicates[1][5])  # kept its start
    text = str(batch)
    assert f"{K} fits: {K - 2} converged, 2 not" in text
    assert "nonfinite (2): fits 3, 5" in text
    best = batch.best_index
    assert batch.converged[best]
    assert batch.loss[best] == np.nanmin(np.where(batch.converged, batch.loss, np.nan))


def test_batches_of_other_structure_are_clear_errors(replicates):
    ys, _ = replicates
    fit = lambda **kw: sciflat.least_squares_batch(
        MISRA.residuals, MISRA.start(1), progress=False, **kw
    )
    with pytest.raises(ValueError, match=r"differ in structure.*batch_args\[1\]"):
        fit(batch_args=[(MISRA.x, ys[0]), (MISRA.x[:5], ys[1][:5])])
    with pytest.raises(ValueError, match="differ in structure: the leading axes"):
        fit(batch_args=(np.tile(MISRA.x, (3, 1)), ys))
    with pytest.raises(ValueError, match=r"differ in structure: `starts\[1\]`"):
        fit(args=(MISRA.x, MISRA.y), starts=[{"b1": 1.0, "b2": 1.0}, {"b1": 1.0}])
    with pytest.raises(ValueError, match=r"shape \(K, 2\)"):
        fit(args=(MISRA.x, MISRA.y), starts=np.ones((3, 3)))
    with pytest.raises(ValueError, match="4 starts but 12 datasets"):
        fit(args=(MISRA.x,), batch_args=(ys,), starts=np.ones((4, 2)))
    with pytest.raises(ValueError, match="no leading batch axis"):
        fit(batch_args=(np.float64(1.0),))


def test_what_the_device_fit_refuses():
    data = (MISRA.x, MISRA.y)
    with pytest.raises(ValueError, match="does not take bounds"):
        nist.fit(MISRA, 1, method="device", bounds={"b1": (0.0, None)})
    with pytest.raises(TypeError, match="cannot call `callback`"):
        nist.fit(MISRA, 1, method="device", callback=lambda *a: None)
    with pytest.raises(TypeError, match=r"\['loss'\]"):
        nist.fit(MISRA, 1, method="device", loss="soft_l1")
    with pytest.raises(ValueError, match="at least as many residuals"):
        sciflat.least_squares(
            lambda m, x, y: m["a"] * x[:1] - y[:1] + m["b"],
            {"a": 1.0, "b": 2.0},
            args=data,
            method="device",
        )


@pytest.mark.slow  # compiles the whole fit: 2-4 s on 2 quiet cores
def test_a_nonfinite_trial_step_is_shrunk_not_a_stop():
    """log(b) = log(0.01) from b = 1: the Gauss–Newton step goes to b < 0 (NaN
    residuals). The device fit treats it as a failed step, as MINPACK on the SciPy
    path does (issue 23, item 11), and both converge to the closed form b = 0.01."""
    residuals = lambda m, c: jnp.log(m["b"]) - c
    c = jnp.full(3, jnp.log(0.01))
    ours = sciflat.least_squares(residuals, {"b": 1.0}, args=(c,), method="device")
    lm = sciflat.least_squares(residuals, {"b": 1.0}, args=(c,), method="lm")
    for fit in (ours, lm):
        assert fit.status == "converged", fit.message
        assert float(fit.model["b"]) == pytest.approx(0.01, rel=1e-10)


@pytest.mark.slow  # two batch programs (normal equations, then MinpackQR): ~8 s
def test_a_batch_reruns_ill_conditioned_fits_with_minpack_qr():
    """`y = (a + b) x`: `J̃ᵀJ̃` is singular, its Cholesky has a zero pivot, so the
    default algorithm hands the fits to MINPACK's steps (QR and SVD), which find the
    determined `a + b` as the SciPy path does and name the undetermined direction."""
    x = np.linspace(0.0, 1.0, 9)
    ys = 3.0 * x + 0.01 * np.sin(7 * x + np.arange(3)[:, None])
    residuals = lambda m, x, y: (m["a"] + m["b"]) * x - y
    model = {"a": 1.0, "b": 0.5}
    batch = sciflat.least_squares_batch(
        residuals, model, args=(x,), batch_args=(ys,), progress=False
    )
    rerun = "run again with MinpackQR: its normal equations were ill-conditioned"
    assert all(rerun in batch.message[i] for i in range(3)), batch.message
    for i in range(3):
        lm = sciflat.least_squares(residuals, model, args=(x, ys[i]), method="lm")
        assert batch.status[i] == "converged"
        assert batch.p[i].sum() == pytest.approx(
            float(lm.model["a"] + lm.model["b"]), rel=1e-12
        )
        assert batch.unidentifiable[i] == lm.uncertainty.unidentifiable


@pytest.mark.slow  # two batch programs of a new model, ~5 s on 2 loaded cores
def test_reruns_of_any_count_share_a_program():
    """The rerun's pool is padded to a power of two: a batch that reruns 3 fits and
    one that reruns 4 trace one `MinpackQR` program (each count its own before), and
    a fit's rerun gives the same bits in both."""
    from sciflat._device import batch as b

    x = np.linspace(0.0, 1.0, 9)
    ys = 3.0 * x + 0.01 * np.sin(7 * x + np.arange(8)[:, None])
    # Where `s` is 0 the two columns are equal (singular normal equations).
    residuals = lambda m, x, y, s: m["a"] * x + m["b"] * (s * x**2 + x) - y
    traced, original = [], b._build

    def build(pool, *args):
        fit = original(pool, *args)

        def counted(*a):
            traced.append(type(pool.algorithm).__name__)  # once per trace
            return fit(*a)

        return counted

    run = lambda s: sciflat.least_squares_batch(
        residuals,
        {"a": 1.0, "b": 0.5},
        args=(x,),
        batch_args=(ys, np.array(s, float)),
        progress=False,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(b, "_build", build)
        three = run([0, 0, 0, 1, 1, 1, 1, 1])
        four = run([0, 0, 0, 0, 1, 1, 1, 1])
    # Each rerun fit's own message says so, and only theirs.
    said = lambda batch: [i for i, m in enumerate(batch.message) if "MinpackQR" in m]
    assert said(three) == [0, 1, 2] and said(four) == [0, 1, 2, 3]
    assert traced.count("MinpackQR") == 1, traced
    np.testing.assert_array_equal(four.p[:3], three.p[:3])


@pytest.mark.slow  # compiles the whole fit of a new model: 2-4 s
def test_a_rank_deficient_fit_names_what_the_data_do_not_determine():
    """`y = (a + b) x`: only `a + b` is determined. The device fit computes the
    covariance on the device when the Jacobian has full rank; here the host computes
    it as the SciPy path does, naming the undetermined direction."""
    x = np.linspace(0.0, 1.0, 9)
    y = 3.0 * x + 0.01 * np.sin(7 * x)
    residuals = lambda m, x, y: (m["a"] + m["b"]) * x - y
    model = {"a": 1.0, "b": 0.5}
    ours = sciflat.least_squares(residuals, model, args=(x, y), method="device")
    lm = sciflat.least_squares(residuals, model, args=(x, y), method="lm")
    assert ours.status == "converged", ours.message
    assert float(ours.model["a"] + ours.model["b"]) == pytest.approx(
        float(lm.model["a"] + lm.model["b"]), rel=1e-12
    )
    assert ours.uncertainty.unidentifiable == lm.uncertainty.unidentifiable
    assert "['a']" in ours.uncertainty.unidentifiable[0]
    assert "['b']" in ours.uncertainty.unidentifiable[0]
    assert np.isnan(ours.uncertainty.covariance).all()
    for fit in (ours, lm):
        assert "(m = 9 residuals, n = 1 determined parameters)" in fit.uncertainty.scale


@pytest.mark.slow  # one more compilation (data of another length), ~2 s
def test_a_second_device_fit_sees_its_own_data():
    """The data go to the device with each call: NumPy data changed in place between
    two fits is read anew, and data of another length is another program whose
    result has that many residuals."""
    y = MISRA.y.copy()
    first = _single(y, MISRA.starts[0], method="device")
    y *= 1.1  # in place: the same array object
    again = _single(y, MISRA.starts[0], method="device")
    fresh = _single(MISRA.y * 1.1, MISRA.starts[0], method="device")
    np.testing.assert_array_equal(again.p, fresh.p)
    assert float(again.model["b1"]) == pytest.approx(1.1 * float(first.model["b1"]))
    short = sciflat.least_squares(
        MISRA.residuals,
        MISRA.start(1),
        args=(MISRA.x[:10], MISRA.y[:10]),
        method="device",
    )
    reference = sciflat.least_squares(
        MISRA.residuals, MISRA.start(1), args=(MISRA.x[:10], MISRA.y[:10]), method="lm"
    )
    assert short.n_data == 10 and short.raw.fun.shape == (10,)
    assert short.raw.jac.shape == (10, 2)
    np.testing.assert_allclose(short.p, reference.p, rtol=1e-8)
    np.testing.assert_allclose(
        short.uncertainty.covariance, reference.uncertainty.covariance, rtol=1e-6
    )


def test_the_program_computes_in_float64_only():
    model = {"b1": jnp.asarray(1.0), "b2": jnp.asarray(1.0)}
    _, re = sciflat.destructure(model, dtype=jnp.float64)
    leaves, rebuild = sciflat._fitting.problem.split_args((MISRA.x, MISRA.y))
    opts, _ = dls.options({}, 2, "test")
    for mode in ("forward", "reverse"):
        fn = dls._build(dls.DeviceFit(5), MISRA.residuals, re, rebuild, mode)
        start = dls.packed_start(np.array(MISRA.starts[0]), opts)
        jaxpr = jax.make_jaxpr(fn)(start, leaves)
        assert float_dtypes_in_jaxpr(jaxpr) == {"float64"}


def _decay(m, x, y):
    return m["a"] * jnp.exp(-m["k"] * x) - y


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_device_fits_compute_in_the_dtype_of_p(dtype):
    """The single device fit's and the batch's programs (both algorithms), traced for
    a model in `dtype`: the dtype auditor finds no operation in another dtype."""
    model = {"a": jnp.asarray(1.0, dtype), "k": jnp.asarray(0.5, dtype)}
    x = np.linspace(0.0, 3.0, 12).astype(dtype)
    y = (2.0 * np.exp(-0.7 * x)).astype(dtype)
    _, re = sciflat.destructure(model)
    assert dls.fit_dtype(model) == dtype
    leaves, rebuild = sciflat._fitting.problem.split_args((x, y))
    opts, _ = dls.options({}, 2, "test", dtype)
    assert all(np.asarray(v).dtype == dtype for v in opts)
    start = dls.packed_start(np.array([1.0, 0.5]), opts)
    single = dls._build(dls.DeviceFit(5), _decay, re, rebuild, "forward")
    sciflat.assert_dtypes(lambda s, a: single(s, a)["host"], start, leaves, grad=False)
    from sciflat._device import batch as b

    k = 4
    ids, counts = np.arange(k, dtype=np.int32), np.array([k], np.int32)
    x0s = np.tile(np.array([1.0, 0.5], dtype), (k, 1))
    shared, rebuild = sciflat._fitting.problem.split_args((x,))
    ys = [np.tile(y, (k, 1))]
    for algorithm in (sciflat.NormalEquations(), sciflat.MinpackQR()):
        pool = b._Pool(1, 1, algorithm)
        states = b._empty_states(k, 2, 12, dtype, algorithm)
        both = lambda leaves: (*rebuild(leaves[:1]), *leaves[1:])
        fit = b._build(pool, _decay, re, both, "forward")
        run = lambda x0s, ys, fit=fit, states=states: tuple(
            jax.tree.leaves(
                fit(
                    b._Slots(states, -1 - ids, ys),
                    x0s,
                    ids,
                    counts,
                    np.bool_(True),
                    opts,
                    [*shared, *ys],
                )
            )
        )
        sciflat.assert_dtypes(run, x0s, ys, grad=False)


@pytest.mark.slow  # two batch programs in float32, ~10 s on 2 loaded cores
def test_a_float32_batch_gives_float32_fits_near_float64():
    """A float32 model: float32 fits (`p`, standard errors), MINPACK's minimum to
    float32's digits, and float64 data is a clear error rather than a silent cast."""
    rng = np.random.default_rng(0)
    x = np.linspace(0.0, 3.0, 20)
    ys = 2.0 * np.exp(-0.7 * x) + 0.01 * rng.standard_normal((6, 20))
    model32 = {"a": jnp.float32(1.0), "k": jnp.float32(0.5)}
    fit32 = sciflat.least_squares_batch(
        _decay,
        model32,
        args=(x.astype(np.float32),),
        batch_args=(ys.astype(np.float32),),
        progress=False,
    )
    fit64 = sciflat.least_squares_batch(
        _decay, {"a": 1.0, "k": 0.5}, args=(x,), batch_args=(ys,), progress=False
    )
    assert fit32.p.dtype == fit32.stderr_flat.dtype == np.float32
    assert fit32.converged.all() and fit64.converged.all()
    np.testing.assert_allclose(fit32.p, fit64.p, rtol=1e-4)
    np.testing.assert_allclose(fit32.stderr_flat, fit64.stderr_flat, rtol=1e-2)
    with pytest.raises(TypeError, match=r"float64.*float32 here"):
        sciflat.least_squares_batch(
            _decay,
            model32,
            args=(x,),
            batch_args=(ys.astype(np.float32),),
            progress=False,
        )


@pytest.mark.slow  # a single fit and a batch compiled in float32: seconds
def test_float32_device_fits_run_with_jax_64_bit_mode_off(x64_off):
    """JAX's default (64-bit mode off, as on most GPUs): a float32 model's device fit
    and batch run, give float32 fits, and equal the same float32 fits made with the
    mode on; the SciPy methods, which need float64, still say how to turn it on."""
    rng = np.random.default_rng(1)
    x = np.linspace(0.0, 3.0, 20, dtype=np.float32)
    ys = (2.0 * np.exp(-0.7 * x) + 0.01 * rng.standard_normal((3, 20))).astype(
        np.float32
    )
    model = {"a": jnp.float32(1.0), "k": jnp.float32(0.5)}

    def both():
        single = sciflat.least_squares(
            _decay, model, args=(x, ys[0]), method="device", progress=False
        )
        batch = sciflat.least_squares_batch(
            _decay, model, args=(x,), batch_args=(ys,), progress=False
        )
        return single, batch

    single, batch = both()
    with jax.enable_x64(True):
        single64, batch64 = both()  # the same float32 fits, the mode on
    assert single.p.dtype == batch.p.dtype == batch[0].p.dtype == np.float32
    assert batch.converged.all() and single.status == "converged"
    np.testing.assert_allclose(single.p, single64.p, rtol=1e-6)
    np.testing.assert_allclose(batch.p, batch64.p, rtol=1e-6)
    np.testing.assert_allclose(batch.stderr_flat, batch64.stderr_flat, rtol=1e-4)
    np.testing.assert_allclose(batch.p[0], single.p, rtol=1e-5)
    with pytest.raises(TypeError, match="jax_enable_x64"):
        sciflat.least_squares(_decay, model, args=(x, ys[0]), progress=False)


def test_what_a_float32_device_fit_refuses_before_it_compiles(x64_off):
    """With JAX's 64-bit mode off, an `x0` wider than the model's float32 is refused
    (it would be rounded), and an `algorithm` that is not one of the two records is
    named, both before anything is traced."""
    model = {"a": jnp.float32(1.0), "k": jnp.float32(0.5)}
    x = np.linspace(0.0, 1.0, 4, dtype=np.float32)
    run = lambda **kw: sciflat.least_squares(
        _decay, model, args=(x, x), method="device", progress=False, **kw
    )
    with pytest.raises(
        TypeError, match=r"`x0`\)\) has dtype float64, but JAX.s 64-bit mode is off"
    ):
        run(x0=np.array([1.0, 0.5]))
    with pytest.raises(TypeError, match=r"`algorithm` must be .*got 'qr'"):
        sciflat.least_squares_batch(
            _decay, model, args=(x,), batch_args=(x[None],), algorithm="qr"
        )


def test_lmpar_meets_the_radius_as_minpack_asks():
    """Moré's parameter: `||D p|| = delta` to 10% when the Gauss–Newton step is
    longer than the radius (else `par = 0` and the Gauss–Newton step)."""
    s = jnp.array([3.0, 0.5, 1e-3])
    g = jnp.array([1.0, -2.0, 0.3])
    lmpar = jax.jit(_lm._lmpar, static_argnums=4)  # one compilation for every delta
    for delta in (0.01, 0.5, 2.0, 1e6):
        par, a = lmpar(s, g, jnp.asarray(delta), jnp.asarray(0.0), 10)
        gauss_newton = g / s
        if np.linalg.norm(gauss_newton) <= 1.1 * delta:
            assert float(par) == 0.0
            np.testing.assert_allclose(a, gauss_newton)
        else:
            assert abs(float(jnp.linalg.norm(a)) - delta) <= 0.1 * delta
            np.testing.assert_allclose(a, s * g / (s**2 + par), rtol=1e-12)


@pytest.mark.parametrize("m", [12, 80])
def test_the_batch_keeps_of_an_evaluation_what_minpack_reads_of_it(m):
    """`normal.moments`, from which the batch's normal equations and MINPACK's tests
    come (it carries no Jacobian from turn to turn): `JᵀJ`, `Jᵀf` and
    `lm._measure`'s norms, cosine and finiteness of each slot, against NumPy and
    `lm._measure` on each slot alone; a NaN or an inf anywhere is not finite, a
    finite square that overflows is (as `lm._measure`)."""
    from sciflat._solver import normal as _normal

    rng = np.random.default_rng(0)
    k, n = 5, 3
    jac = rng.standard_normal((k, m, n))
    f = rng.standard_normal((k, m))
    jac[1, 4, 2], f[2, 7], jac[3, 0, 0] = np.nan, np.inf, 1e200
    measure, g, a = jax.jit(_normal.moments)(jnp.asarray(f), jnp.asarray(jac))
    lower = np.tril_indices(n)
    for i in range(k):
        alone = _lm._measure(jnp.asarray(f[i]), jnp.asarray(jac[i]))
        assert bool(measure.ok[i]) == bool(alone.ok) == (i not in (1, 2))
        if i in (1, 2):
            continue
        np.testing.assert_allclose(measure.fnorm[i], alone.fnorm, rtol=1e-14)
        if i == 3:  # the overflowing square: finite all the same, its norm huge
            assert float(measure.cols[i, 0]) >= float(alone.cols[0]) > 1e150
            continue
        np.testing.assert_allclose(measure.cols[i], alone.cols, rtol=1e-14)
        np.testing.assert_allclose(measure.gnorm[i], alone.gnorm, rtol=1e-13)
        np.testing.assert_allclose(g[i], jac[i].T @ f[i], rtol=1e-12, atol=1e-13)
        gram = jac[i].T @ jac[i]
        np.testing.assert_allclose(a[i], gram[lower], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("m", [14, 25, 121])
def test_a_slot_keeps_the_same_bits_in_a_batch_of_any_width(m):
    """`normal.moments` of one slot alone and of the same slot among 200: the same
    bits (a fit of a batch equals its batch of one). XLA's own reduction over the
    residuals added 14 or 25 terms in another order for one slot than for many."""
    from sciflat._solver import normal as _normal

    rng = np.random.default_rng(1)
    jac = jnp.asarray(rng.standard_normal((200, m, 5)))
    f = jnp.asarray(rng.standard_normal((200, m)))
    moments = jax.jit(_normal.moments)
    wide = moments(f, jac)
    for i in (0, 57, 199):
        alone = moments(f[i : i + 1], jac[i : i + 1])
        for w, a in zip(jax.tree.leaves(wide), jax.tree.leaves(alone), strict=True):
            np.testing.assert_array_equal(np.asarray(w)[i], np.asarray(a)[0])


def test_the_moments_are_one_pass_over_the_jacobian():
    """`normal.moments` sums what a fit keeps of an evaluation in one reduction over
    the residuals, the products fused into it: no loop over chunks, no copy of the
    Jacobian (a concatenation with `f`, a padding, a slice of each chunk: 40 % of a
    turn of the 11 x 11 spots), and only the `(n + 1) (n + 2) / 2` sums it reads."""
    from sciflat._solver import normal as _normal

    k, m, n = 4, 121, 5
    f, jac = jnp.ones((k, m)), jnp.ones((k, m, n))
    jaxpr = jax.make_jaxpr(_normal.moments)(f, jac).jaxpr
    names = [e.primitive.name for e in jaxpr.eqns]
    for absent in ("while", "concatenate", "pad", "dynamic_slice", "dot_general"):
        assert absent not in names
    (reduce,) = [e for e in jaxpr.eqns if e.primitive.name == "reduce"]
    assert len(reduce.outvars) == (n + 1) * (n + 2) // 2
    assert all(v.aval.shape == (k,) for v in reduce.outvars)


@pytest.mark.slow  # two batch programs of 80 residuals, ~6 s on 2 loaded cores
def test_a_batch_of_many_residuals_equals_its_single_fits():
    """The batch sums `JᵀJ` over the residuals in one reduction (`normal.moments`):
    with 80 residuals (above `lm._sum`'s 64 in order) each fit of a batch still
    equals the same fit run alone (a batch of one) to the bit, and MINPACK's single
    device fit to the digits the data determine."""
    rng = np.random.default_rng(3)
    x = np.linspace(0.0, 4.0, 80)
    ys = 2.0 * np.exp(-0.7 * x) + 0.05 * rng.standard_normal((6, 80))
    starts = np.array([1.0, 0.5]) * rng.uniform(0.5, 2.0, (6, 2))
    run = lambda ys, starts: sciflat.least_squares_batch(
        _decay,
        {"a": 1.0, "k": 0.5},
        args=(x,),
        batch_args=(ys,),
        starts=starts,
        progress=False,
    )
    batch = run(ys, starts)
    assert len({int(e) for e in batch.n_evaluations}) > 1
    for i in (0, 3, 5):
        alone = run(ys[i : i + 1], starts[i : i + 1])
        np.testing.assert_array_equal(batch.p[i], alone.p[0])
        np.testing.assert_array_equal(batch.n_evaluations[i], alone.n_evaluations[0])
        single = sciflat.least_squares(
            _decay,
            dict(zip("ak", map(float, starts[i]), strict=True)),
            args=(x, ys[i]),
            method="device",
            progress=False,
        )
        np.testing.assert_allclose(batch.p[i], single.p, rtol=1e-8)
        np.testing.assert_allclose(
            batch.stderr_flat[i], single.uncertainty.stderr, rtol=1e-6
        )


@pytest.mark.slow  # another compilation (the batch of starts), ~3 s
def test_multistart_with_the_device_method_is_one_batch():
    x = jnp.linspace(0.0, 6.0, 60)
    y = jnp.sin(3.3 * x)
    residuals = lambda m, x, y: jnp.sin(m["w"] * x) - y
    starts = np.linspace(0.5, 5.0, 8)[:, None]
    ours = sciflat.multistart(
        sciflat.least_squares,
        residuals,
        {"w": 1.0},
        starts,
        args=(x, y),
        method="device",
    )
    minpack = sciflat.multistart(
        sciflat.least_squares,
        residuals,
        {"w": 1.0},
        starts,
        args=(x, y),
        method="lm",
    )
    assert "batch of 8" in ours.best.message
    assert float(ours.best.model["w"]) == pytest.approx(3.3, rel=1e-9)
    for a, b in zip(ours.results, minpack.results, strict=True):
        assert a.status == b.status
        np.testing.assert_allclose(a.p, b.p, rtol=1e-7)
    with pytest.raises(ValueError, match="does not take bounds"):
        sciflat.multistart(
            sciflat.least_squares,
            residuals,
            {"w": 1.0},
            4,
            args=(x, y),
            bounds={"['w']": (0.5, 5.0)},
            method="device",
        )


@pytest.mark.slow  # a compilation for the chunk's shape and one with a transform
def test_chunks_and_transforms_equal_the_whole_batch(batch, replicates):
    ys, starts = replicates
    calls = []

    class Bar:
        def update(self, n):
            calls.append(n)

        def close(self):
            pass

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sciflat._device.batch, "progress_bar", lambda **kw: Bar())
        chunked = _misra_batch(ys, starts=starts, chunk_size=2)
        one_slot = _misra_batch(ys, starts=starts, chunk_size=1)
    # Two slots for twelve fits: each slot takes the next fit when its own ends, in
    # one call of the program (the host collects the twelve at once). One slot: the
    # program is called once per `_QUEUE` fits, the last fit of the first call
    # running on in the second. Every fit as in the whole batch, to the bit.
    queue = sciflat._device.batch._QUEUE
    assert queue < K
    assert calls == [K, queue - 1, K - queue + 1]
    for other in (chunked, one_slot):
        assert other.status == batch.status
        np.testing.assert_array_equal(other.n_evaluations, batch.n_evaluations)
        np.testing.assert_array_equal(other.p, batch.p)
        np.testing.assert_allclose(other.stderr_flat, batch.stderr_flat, rtol=1e-10)
    # A transform: standard errors of the constrained value, as the SciPy path's.
    model = {"b1": sciflat.Positive(250.0), "b2": 5e-4}
    on_values = sciflat.least_squares_batch(
        MISRA.residuals,
        model,
        args=(MISRA.x,),
        batch_args=(ys[:2],),
        progress=False,
    )
    lm = _single_model(model, ys[1])
    np.testing.assert_allclose(
        on_values.stderr_flat[1], lm.uncertainty.stderr, rtol=1e-6
    )


def _single_model(model, y):
    return sciflat.least_squares(
        MISRA.residuals, model, args=(MISRA.x, y), method="lm", progress=False
    )


_SHARDED = """
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
jax.config.update("jax_enable_x64", True)
sys.path.insert(0, "benchmarks")
import nist
import sciflat
p = nist.read("Misra1a")
ys = p.y + 0.1 * np.random.default_rng(1).standard_normal((2002, len(p.y)))
ys[3, 2] = np.nan
run = lambda shard: sciflat.least_squares_batch(
    p.residuals, p.start(1), args=(p.x,), batch_args=(ys,), shard=shard,
    progress=False)
a, b = run(True), run(False)
# A residual that calls LAPACK itself (an LU solve, 8 x 8): batched, its two triangular
# solves held both threads of XLA's pool and hung even on one device; its slots
# run one at a time.
A = 3 * np.eye(8) + 0.1 * np.random.default_rng(2).standard_normal((8, 8))
solved = lambda m, y: jnp.linalg.solve(A + 0.01 * jnp.outer(m["v"], m["v"]), m["v"]) - y
yl = np.random.default_rng(3).standard_normal((4000, 8))
lin = lambda shard: sciflat.least_squares_batch(
    solved, {"v": np.zeros(8)}, batch_args=(yl,), shard=shard, progress=False,
    algorithm=sciflat.MinpackQR())
la, lb = lin(True), lin(False)
lone = sciflat.least_squares(solved, {"v": np.zeros(8)}, args=(yl[17],),
                             method="device")
print(json.dumps({"devices": jax.device_count(), "status": [a.status, b.status],
                  "lapack": [la.p[17].tolist(), lb.p[17].tolist(),
                             np.asarray(lone.p).tolist(), int(la.converged.sum())],
                  "p": [a.p.tolist(), b.p.tolist()],
                  "stderr": [np.nan_to_num(a.stderr_flat).tolist(),
                             np.nan_to_num(b.stderr_flat).tolist()],
                  "nfev": [a.n_evaluations.tolist(), b.n_evaluations.tolist()]}))
"""


@pytest.mark.slow  # a fresh interpreter with 4 CPU devices, two compilations
def test_sharded_over_four_devices_equals_unsharded():
    # 2,002 fits, ~500 a device: jaxlib 0.10 splits batches of LAPACK calls this
    # large over XLA's thread pool, which hung the sharded program until its
    # decompositions ran one matrix at a time (`_lm.one_at_a_time`). At this size the
    # batch also reduced its norms in another order than at 10 fits, which left the
    # sharded fits 1e-8 from the unsharded ones until `_lm._sum`.
    out = json_on_host_devices(_SHARDED, timeout=120)
    assert out["devices"] == 4
    assert out["status"][0] == out["status"][1] and out["status"][0][3] == "nonfinite"
    # 2,002 fits over 4 devices: padded to 2,004, the padding dropped.
    assert len(out["p"][0]) == 2002
    np.testing.assert_allclose(out["p"][0], out["p"][1], rtol=1e-10)
    np.testing.assert_allclose(out["stderr"][0], out["stderr"][1], rtol=1e-10)
    assert out["nfev"][0] == out["nfev"][1]
    sharded, unsharded, single, converged = out["lapack"]
    assert converged == 4000
    np.testing.assert_allclose(sharded, single, rtol=1e-10)
    np.testing.assert_allclose(unsharded, single, rtol=1e-10)
