"""The neural ODE example at tiny size: it learns, plots, shards, stays in p.dtype."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sciflat
from helpers import ROOT, json_on_host_devices, load_example as load


NODE_TINY = dict(
    steps=60,
    width=16,
    batch=8,
    n_train=32,
    n_test=8,
    n_times=10,
    lr=1e-2,
    progress=False,
)

NODE_FILE = str(ROOT / "examples" / "neural_ode" / "train.py")

# The runs in a child process with 4 forced host devices: XLA_FLAGS must be set before
# jax is imported, which this process did long ago.
_NODE_CHILD = f"""
import importlib.util, json, sys
import numpy as np
spec = importlib.util.spec_from_file_location("node", {NODE_FILE!r})
node = importlib.util.module_from_spec(spec)
spec.loader.exec_module(node)
import jax
out = sys.argv[1]
runs = {{
    name: node.main(shard=shard, out=out if not shard else None, **{NODE_TINY!r})
    for name, shard in [("plain", False), ("sharded", True)]
}}
# A learning rate of 50 makes the field explode (the same sizes: the data's solve is
# compiled already).
diverging = node.main(**{{**{NODE_TINY!r}, "steps": 6, "lr": 50.0, "out": None}})
keep = ("initial_loss", "final_loss", "test_error", "diverged", "plot")
replicate, split = node.sharding(True)
shards = [s.data.shape for s in split(np.zeros((8, 10, 2))).addressable_shards]
print(json.dumps({{"devices": jax.device_count(), "shards": shards,
                  **{{k: {{f: r[f] for f in keep}} for k, r in runs.items()}},
                  "diverging": diverging["diverged"],
                  "history": [list(map(float, r["history"])) for r in runs.values()]}}))
"""


@pytest.fixture(scope="module")
def node_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("neural_ode")
    return json_on_host_devices(_NODE_CHILD, out, timeout=300)


def test_neural_ode_learns_and_plots(node_runs):
    run = node_runs["plain"]
    assert not run["diverged"]
    assert run["final_loss"] < run["initial_loss"] / 5
    # The pendulum's trajectories are O(1); a field that learned nothing is ~100% off.
    assert run["test_error"] < 0.5
    assert pathlib.Path(run["plot"]).stat().st_size > 10_000


def test_neural_ode_sharded_over_4_devices_matches(node_runs):
    assert node_runs["devices"] == 4
    assert node_runs["shards"] == [[2, 10, 2]] * 4  # each device holds a quarter batch
    plain, sharded = node_runs["plain"], node_runs["sharded"]
    # Same batches, same arithmetic per trajectory; only the sum over the batch is
    # split over devices, so the results agree to rounding.
    np.testing.assert_allclose(
        node_runs["history"][1], node_runs["history"][0], rtol=1e-9
    )
    np.testing.assert_allclose(sharded["final_loss"], plain["final_loss"], rtol=1e-9)
    np.testing.assert_allclose(sharded["test_error"], plain["test_error"], rtol=1e-9)


def test_neural_ode_reports_divergence(node_runs):
    # A learning rate of 50 makes the field explode: the solver fails, the loss is
    # non-finite, `fit` stops, and the script's exit status would be 1.
    assert node_runs["diverging"] is True


def test_neural_ode_loss_stays_float64():
    node = load("neural_ode", "train.py")
    ts = jnp.linspace(0.0, 1.0, 5)  # float64: x64 is on in the suite
    ys = jax.random.normal(jax.random.key(0), (4, 5, 2))
    model32 = node.VectorField(8, 1, key=jax.random.key(1))
    p, re = sciflat.destructure(model32, dtype=jnp.float64)
    batch = (ys, jnp.asarray(3))  # trajectories, and how many times to fit so far
    loss = lambda p, batch, ts: node.loss_fn(re(p), batch, ts)
    sciflat.assert_dtypes(loss, p, batch, ts)
