"""The PINN example: its reference, its points, its runs (the default one whole)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sciflat
from helpers import load_example as load


@pytest.fixture(scope="module")
def pinn():
    return load("pinn", "train.py")


def test_pinn_reference_is_cole_hopf(pinn):
    x = np.linspace(-1, 1, 2001)
    # The initial condition, and quadrature converged (100 nodes agree with 200).
    np.testing.assert_allclose(
        pinn.reference(x, [0.0])[:, 0], -np.sin(np.pi * x), atol=1e-14
    )
    t = np.array([0.3, 0.7])
    np.testing.assert_allclose(
        pinn.reference(x, t, 100), pinn.reference(x, t), atol=1e-10
    )
    # Burgers' equation by finite differences, where the solution is smooth (t = 0.2).
    dt, h = 1e-5, x[1] - x[0]
    u = pinn.reference(x, [0.2 - dt, 0.2, 0.2 + dt])
    u_t = (u[:, 2] - u[:, 0]) / (2 * dt)
    u_x = np.gradient(u[:, 1], h)
    residual = u_t + u[:, 1] * u_x - pinn.NU * np.gradient(u_x, h)
    assert np.abs(residual[2:-2]).max() < 1e-3 * np.abs(u_t).max()


def test_pinn_learns_float32_then_float64_and_plots(pinn, tmp_path):
    # Adam (`sciflat.fit`), then SciPy's L-BFGS-B (`sciflat.minimize`) on the same p in
    # float32, then on in float64 from the same point by `p.astype` (the dtype rule).
    run = pinn.main(
        width=8,
        depth=2,
        n_u=100,
        n_f=300,
        adam_steps=100,
        steps=200,
        optimizer="lbfgs-b",
        dtype="float32-then-float64",
        out=str(tmp_path),
        progress=False,
    )
    adam, first, second = run["stages"]
    assert adam["stage"] == "Adam"
    assert (first["stage"], second["stage"]) == ("L-BFGS-B float32", "L-BFGS-B float64")
    assert run["p"].dtype == jnp.float64
    # Each stage goes on from where the one before stopped, and improves on it.
    assert second["loss"] < first["loss"] < adam["loss"] < run["history"][0]
    assert not run["diverged"]
    assert run["loss"] < run["history"][0] / 5
    assert run["error"] < 0.7  # u = 0 would be 1.0
    assert (tmp_path / "burgers.png").stat().st_size > 10_000


def test_pinn_xavier_init_and_input_scaling(pinn):
    model = pinn.new_pinn(20, 3, key=jax.random.key(0))
    for layer in model.mlp.layers:
        fan_out, fan_in = layer.weight.shape
        std = np.sqrt(2 / (fan_in + fan_out))
        w = np.asarray(layer.weight)
        assert np.all(layer.bias == 0) and np.abs(w).max() <= 2 * std
        if w.size >= 400:  # a normal truncated at 2σ has standard deviation 0.880σ
            assert abs(w.std() / (0.880 * std) - 1) < 0.15
    # The data's corners reach the network as (±1, ±1).
    for (x, t), z in [((-1.0, 0.0), (-1, -1)), ((1.0, 0.99), (1, 1))]:
        expected = model.mlp(jnp.asarray(z, jnp.float32))
        np.testing.assert_allclose(model(jnp.float32(x), jnp.float32(t)), expected)


def test_pinn_paper_settings_yield_to_the_ones_given(pinn):
    # `--paper --steps 10000` runs 10,000 steps, not the paper's 50,000.
    assert pinn.settings(True) == pinn.PAPER and pinn.settings(False) == pinn.DEFAULT
    chosen = pinn.settings(True, steps=10_000, n_f=None, optimizer="bfgs")
    assert chosen == {**pinn.PAPER, "steps": 10_000, "optimizer": "bfgs"}
    assert list(chosen) == list(pinn.DEFAULT)  # main unpacks them in this order


def test_pinn_points_are_the_originals(pinn):
    (xf, tf), (xu, tu, u) = pinn.make_points(100, 500, seed=0, dtype=jnp.float64)
    assert len(xf) == 500 + 456 and len(xu) == 100  # boundary points are collocated
    np.testing.assert_allclose(
        u, pinn.reference(np.asarray(xu), [0.0])[:, 0] * (tu == 0)
    )
    assert np.all((tu == 0) | (np.abs(xu) == 1))  # each is an initial or boundary point
    assert xf.min() >= -1 and xf.max() <= 1 and tf.min() >= 0 and tf.max() <= 0.99


def test_pinn_bfgs_runs_and_reports(pinn):
    # Optimistix's BFGS on the flat vector (the example's `--optimizer bfgs`), in
    # float64. Going on in float64 from a float32 stage is the same stage loop for
    # every optimiser: the L-BFGS-B test above runs it (a float32 BFGS stage here,
    # another Optimistix loop to compile, took this test from 12 s to 30 s).
    run = pinn.main(
        width=8,
        depth=2,
        n_f=200,
        steps=150,
        optimizer="bfgs",
        dtype="float64",
        report_every=50,
        out=None,
        progress=False,
    )
    (stage,) = run["stages"]
    assert stage["stage"] == "BFGS float64" and stage["steps"] == 150
    assert run["p"].dtype == jnp.float64
    assert stage["loss"] < run["history"][0] / 5  # from the start
    assert run["error"] < 0.7  # u = 0 would be 1.0
    # The error is reported every 50 evaluations, at cumulative counts.
    assert [s for s, _ in run["errors"]][:3] == [50, 100, 150]


def test_pinn_record_configuration_runs(pinn, tmp_path):
    # The default run's path (`python examples/pinn/train.py`: `record(**QUICK)`) at
    # tiny size: Adam, then SSBroyden in chunks with RAD in between; the error is
    # reported after Adam and after each chunk, and falls; a plot is saved. The
    # default itself (about 60 s alone, twice that beside the other test process) is
    # measured in examples/pinn/README.md: 2.3e-4 / 3.3e-4 / 1.8e-4 for seeds 0-2.
    run = pinn.record(
        steps=60,
        every=20,
        adam_steps=20,
        width=8,
        depth=2,
        n_f=300,
        n_ic=50,
        n_bc=50,
        out=str(tmp_path),
        progress=False,
    )
    assert run["iterations"] == 60 and run["p"].dtype == jnp.float64
    steps, errors = zip(*run["errors"], strict=True)
    assert steps == (0, 20, 40, 60, 80)
    assert errors[-1] < errors[1] < 1.0
    assert (tmp_path / "burgers.png").stat().st_size > 10_000


def test_pinn_rad_draws_where_the_residual_is_large(pinn):
    # |r| = 100 for x > 0, 0 elsewhere: with k = 1, c = 1 the weight |r|/mean|r| + c is
    # 3 for x > 0 and 1 elsewhere, so 3/4 of the draws fall there; none leave the domain.
    rng = np.random.default_rng(0)
    residuals = lambda x, t: jnp.where(x > 0, 100.0, 0.0)
    x, t = pinn.rad(residuals, rng, 500, pool=5000)
    assert len(x) == 500 and abs((np.asarray(x) > 0).mean() - 0.75) < 0.05
    assert x.min() >= -1 and x.max() <= 1 and t.min() >= 0 and t.max() <= 0.99


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (two short trainings)
def test_pinn_compare_precision_runs_both_settings(pinn):
    # What benchmarks/gpu_check.py runs on a GPU (there with BFGS, whose float32 run the
    # test above covers; here SciPy's L-BFGS-B, which compiles no loop); on the CPU
    # float32 products are full float32 at either setting, so the two trainings are
    # the same to the bit.
    rows = pinn.compare_precision(
        steps=30, repeats=2, width=8, depth=2, n_f=100, optimizer="lbfgs-b"
    )
    default, highest = rows
    assert (default["setting"], highest["setting"]) == ("default", "highest")
    assert default["error"] == highest["error"] and default["loss"] == highest["loss"]
    assert default["eval_ms"] > 0 and highest["eval_ms"] > 0


def test_pinn_loss_stays_float64(pinn):
    points = pinn.make_points(10, 20, seed=0, dtype=jnp.float64)
    p, re = sciflat.destructure(
        pinn.new_pinn(8, 2, key=jax.random.key(0)), dtype=jnp.float64
    )
    sciflat.assert_dtypes(lambda p, data: pinn.loss_fn(re(p), data), p, points)
