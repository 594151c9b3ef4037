"""Multi-start: the best of several starts, compiled once."""

import jax.numpy as jnp
import numpy as np
import pytest

import sciflat


X = jnp.linspace(0.0, 6.0, 60)
Y = jnp.sin(3.3 * X)


def make_residuals(traces):
    def residuals(m, x, y):
        traces.append(1)  # runs at trace time only
        return jnp.sin(m["w"] * x) - y

    return residuals


def test_sampled_starts_find_the_global_minimum_with_one_compile():
    single, many = [], []
    # From w = 1 alone the fit stops in a local minimum.
    alone = sciflat.least_squares(
        make_residuals(single), {"w": 1.0}, args=(X, Y), progress=False
    )
    assert abs(float(alone.model["w"]) - 3.3) > 0.1
    runs = sciflat.multistart(
        sciflat.least_squares,
        make_residuals(many),
        {"w": 1.0},
        12,
        args=(X, Y),
        bounds={"['w']": (0.5, 5.0)},
    )
    assert len(runs.results) == 12 and runs.starts.shape == (12, 1)
    assert runs.starts[0, 0] == 1.0 and np.all(
        (runs.starts >= 0.5) & (runs.starts <= 5.0)
    )
    assert float(runs.best.model["w"]) == pytest.approx(3.3, rel=1e-8)
    assert runs.best.loss == min(r.loss for r in runs.results if r.success)
    # Twelve fits traced no more often than one (fewer if a cache already has it).
    assert 0 < len(single) and len(many) <= len(single)
    assert "12 starts" in str(runs) and "[[Variables]]" in str(runs)


def test_given_starts_as_models_and_as_vectors():
    residuals = make_residuals([])
    loss = lambda m, x, y: jnp.sum(residuals(m, x, y) ** 2)
    runs = sciflat.multistart(
        sciflat.minimize, loss, {"w": 1.0}, [{"w": 1.0}, {"w": 3.0}], args=(X, Y)
    )
    assert float(runs.best.model["w"]) == pytest.approx(3.3, rel=1e-6)
    assert runs.starts.tolist() == [[1.0], [3.0]] and len(runs.results) == 2
    vectors = sciflat.multistart(
        sciflat.least_squares,
        residuals,
        {"w": 1.0},
        np.array([[3.0], [1.0]]),
        args=(X, Y),
    )
    assert vectors.best is vectors.results[0]


def test_sampling_needs_finite_bounds_and_starts_of_the_model_structure():
    residuals = make_residuals([])
    with pytest.raises(ValueError, match="both bounds finite"):
        sciflat.multistart(sciflat.least_squares, residuals, {"w": 1.0}, 3, args=(X, Y))
    with pytest.raises(ValueError, match=r"`starts\[1\]` does not have the model's"):
        sciflat.multistart(
            sciflat.least_squares,
            residuals,
            {"w": 1.0},
            [{"w": 1.0}, {"v": 2.0}],
            args=(X, Y),
        )


def test_optax_fit_runs_every_start_in_one_vmapped_call_as_fit_would():
    import optax

    loss = lambda m, x, y: jnp.mean((jnp.sin(m["w"] * x) - y) ** 2)
    starts = [{"w": 1.0}, {"w": 3.0}, {"w": 3.5}]
    runs = sciflat.multistart(
        sciflat.fit,
        loss,
        {"w": 1.0},
        starts,
        args=(X, Y),
        optimizer=optax.adam(0.05),
        steps=200,
    )
    assert len(runs.results) == 3 and runs.best is not runs.results[0]
    assert float(runs.best.model["w"]) == pytest.approx(3.3, rel=1e-3)
    # The reference: sciflat.fit itself from each start.
    for start, got in zip(starts, runs.results, strict=True):
        want = sciflat.fit(
            loss,
            {"w": jnp.asarray(start["w"])},
            optax.adam(0.05),
            steps=200,
            args=(X, Y),
            progress=False,
        )
        np.testing.assert_allclose(got.p, want.p, rtol=1e-10)
        np.testing.assert_allclose(got.history, want.history, rtol=1e-10)
    with pytest.raises(TypeError, match="needs `optimizer=` and `steps=`"):
        sciflat.multistart(sciflat.fit, loss, {"w": 1.0}, starts, args=(X, Y))


def test_each_optax_start_equals_fit_from_it_with_fits_stops_and_checks():
    # `multistart(sciflat.fit)` ran its own `lax.scan` loop: a start that turned
    # non-finite midway came back as p = [nan] with a NaN history, where `fit` stops
    # with the last finite point. Now the starts run `fit`'s own step and stops.
    import optax

    loss = lambda m: jnp.sqrt(m["w"]) + 0.0 * m["v"] ** 2
    starts = [{"w": 1.0, "v": 1.0}, {"w": 100.0, "v": 2.0}]
    opt = optax.sgd(0.5)
    runs = sciflat.multistart(
        sciflat.fit, loss, starts[0], starts, optimizer=opt, steps=6
    )
    statuses = []
    for start, got in zip(starts, runs.results, strict=True):
        model = {k: jnp.asarray(v) for k, v in start.items()}
        want = sciflat.fit(loss, model, opt, steps=6, progress=False)
        assert got.status == want.status and got.message == want.message
        assert got.n_steps == want.n_steps and got.success == want.success
        np.testing.assert_allclose(got.p, want.p, rtol=1e-12)
        np.testing.assert_allclose(got.history, want.history, rtol=1e-12)
        assert got.loss == pytest.approx(want.loss, rel=1e-12)
        statuses.append(got.status)
    assert statuses == ["nonfinite", "completed"]
    assert np.isfinite(runs.results[0].p).all() and runs.results[0].n_steps == 4
    assert runs.best is runs.results[1]  # the one that completed
    # fit's loss-output check: a float32 loss of a float64 `p` is refused the same way.
    cast = lambda m: jnp.sqrt(m["w"] + 0.0 * m["v"]).astype(jnp.float32)
    with pytest.raises(TypeError, match="something in the loss casts"):
        sciflat.multistart(sciflat.fit, cast, starts[0], starts, optimizer=opt, steps=2)


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_optax_lbfgs_runs_in_multistart_as_in_fit():
    # L-BFGS needs the loss itself (`value_fn`) and keeps value and gradient in its
    # state: the vmapped loop had neither. The reference: `fit` from each start.
    import optax

    loss = lambda m, x, y: jnp.mean((jnp.sin(m["w"] * x) - y) ** 2)
    starts = [{"w": 3.0}, {"w": 3.5}]
    runs = sciflat.multistart(
        sciflat.fit,
        loss,
        {"w": 3.0},
        starts,
        args=(X, Y),
        optimizer=optax.lbfgs(),
        steps=15,
    )
    for start, got in zip(starts, runs.results, strict=True):
        want = sciflat.fit(
            loss,
            {"w": jnp.asarray(start["w"])},
            optax.lbfgs(),
            steps=15,
            args=(X, Y),
            progress=False,
        )
        assert got.status == want.status == "completed"
        np.testing.assert_allclose(got.p, want.p, rtol=1e-10)
        np.testing.assert_allclose(got.history, want.history, rtol=1e-10)
    assert float(runs.best.model["w"]) == pytest.approx(3.3, rel=1e-6)


def test_a_non_finite_start_is_reported_per_start_and_the_others_are_fitted():
    # One NaN start made `least_squares` refuse, and the whole run failed without
    # naming the start. The reference: each fit alone from the finite starts. (A
    # start of `multistart(sciflat.fit)` that is or turns non-finite stops as `fit`
    # would: test_each_optax_start_equals_fit_from_it_with_fits_stops_and_checks.)
    residuals = make_residuals([])
    starts = np.array([[1.0], [np.nan], [3.0]])
    sse = lambda m, x, y: jnp.sum(residuals(m, x, y) ** 2)
    for fit, loss in ((sciflat.least_squares, residuals), (sciflat.minimize, sse)):
        runs = sciflat.multistart(fit, loss, {"w": 1.0}, starts, args=(X, Y))
        bad = runs.results[1]
        assert bad.status == "nonfinite" and not bad.success, fit
        assert "start 1 is non-finite in `['w']`" in bad.message
        assert runs.best is not bad
        for i in (0, 2):
            start = {"w": jnp.asarray(starts[i, 0])}
            alone = fit(loss, start, args=(X, Y), progress=False)
            np.testing.assert_allclose(runs.results[i].p, alone.p, rtol=1e-10)
