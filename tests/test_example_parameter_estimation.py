"""The Lotka–Volterra parameter-estimation example at tiny size."""

import jax
import jax.numpy as jnp
import pytest

import sciflat
from helpers import load_example as load


@pytest.fixture(scope="module")
def lotka():
    return load("parameter_estimation", "fit.py")


def test_parameter_estimation_recovers_rates(lotka, tmp_path):
    run = lotka.main(
        n_obs=21,
        ude_width=4,
        ude_adam_steps=20,
        ude_steps=20,
        out=str(tmp_path),
        progress=False,
    )
    assert not run["diverged"]
    for method in ("lsq_rel_error", "minimize_rel_error"):
        assert max(run[method].values()) < 0.05, (method, run[method])
    # The true rates are within 4 standard errors of the least-squares estimate.
    for name, true in lotka.TRUE_RATES.items():
        estimate = float(getattr(run["least_squares"].model, name))
        assert (
            0 < run["stderr"][name] < 0.1
            and abs(estimate - true) < 4 * run["stderr"][name]
        )
    # The UDE at this tiny size only has to have learned something.
    assert run["ude"].loss < run["ude_initial_mse"] / 10
    assert (tmp_path / "lotka_volterra.png").stat().st_size > 10_000


def test_parameter_estimation_losses_stay_float64(lotka):
    ts, ys = jnp.linspace(0.0, 1.0, 5), jnp.ones((5, 2))
    p, re = sciflat.destructure(lotka.LotkaVolterra(1.0, 1.0, 2.0, 1.0))
    # The rates' loss is differentiated in forward mode (`diffrax.ForwardMode`): audit
    # that gradient itself.
    grad = lambda p, ts, ys: jax.jacfwd(lambda q: lotka.mse(re(q), ts, ys))(p)
    sciflat.assert_dtypes(grad, p, ts, ys, grad=False)
    ude = lotka.UDE(1.0, 2.0, 4, key=jax.random.key(0))  # a float32 MLP inside
    p, re = sciflat.destructure(ude, dtype=jnp.float64)
    sciflat.assert_dtypes(lambda p, ts, ys: lotka.ude_mse(re(p), ts, ys), p, ts, ys)
