"""Neural ODE: learn the dynamics of a damped pendulum from its trajectories.

An Equinox MLP is the vector field of an ODE solved by Diffrax; Optax trains the one
flat vector `p` that sciflat makes of it (`sciflat.fit`). The network is initialised in
float32, as Equinox does, and trained in float64: `destructure(model, dtype=float64)`
gives a float64 `p`, and `re(p)` computes every layer in float64 (the dtype rule).

Run it (about a minute on 2 CPU cores):

    python examples/neural_ode/train.py
    python examples/neural_ode/train.py --steps 3000 --width 64 --batch 64

With several JAX devices (a GPU box, or
`XLA_FLAGS=--xla_force_host_platform_device_count=4` on a CPU) `--shard` splits each
batch across the devices and replicates `p`; the result is the same.
"""

import argparse
import os
import sys
import time

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import sciflat


OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "outputs")  # plots

jax.config.update("jax_enable_x64", True)  # float64 exists only with 64-bit mode on

#
# The system to learn, and its data.
#

DAMPING = 0.25


def pendulum(t, y, args):
    """θ'' = -sin θ - DAMPING θ': a damped nonlinear oscillator, y = (θ, θ')."""
    theta, omega = y[..., 0], y[..., 1]
    return jnp.stack([omega, -jnp.sin(theta) - DAMPING * omega], axis=-1)


def solve(field, ts, y0, *, rtol, atol, throw=True):
    """The trajectory of `dy/dt = field(t, y, None)` from `y0`, saved at `ts` (with
    `throw=False`, a failed solve gives `inf` after the failure instead of an error)."""
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        diffrax.Tsit5(),
        ts[0],
        ts[-1],
        None,
        y0,
        saveat=diffrax.SaveAt(ts=ts),
        stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
        max_steps=4096,
        throw=throw,
    )
    return sol.ys


def make_data(n_traj, *, n_times, t_end, key, dtype):
    """`n_traj` trajectories from random initial conditions, solved to high accuracy."""
    ts = jnp.linspace(0.0, t_end, n_times, dtype=dtype)
    y0 = jax.random.uniform(key, (n_traj, 2), dtype, minval=-1.0, maxval=1.0)
    y0 = y0 * jnp.array([2.0, 1.0], dtype)  # θ in [-2, 2], θ' in [-1, 1]
    ys = jax.vmap(lambda y: solve(pendulum, ts, y, rtol=1e-10, atol=1e-10))(y0)
    return np.asarray(ts), np.asarray(ys)


#
# The model: an MLP vector field, and the loss.
#


class VectorField(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, width, depth, *, key):
        # tanh rather than softplus: as accurate here, and float64 tanh is cheap on
        # CPU while float64 softplus is not (docs/benchmarks_examples.md).
        self.mlp = eqx.nn.MLP(
            2, 2, width, depth, activation=jnp.tanh, dtype=jnp.float32, key=key
        )

    def __call__(self, t, y, args):
        return self.mlp(y)


RTOL, ATOL = 1e-4, 1e-6  # tolerances of the learned ODE (the benchmark uses them too)


def predict(model, ts, y0):
    """Trajectories of the learned ODE from a batch of initial conditions. A field that
    training made explosive gives `inf`, so a non-finite loss, which stops `fit`."""
    solve_one = lambda y: solve(model, ts, y, rtol=RTOL, atol=ATOL, throw=False)
    return jax.vmap(solve_one)(y0)


# Compiled once per model structure and data shapes: a second `main` of the same sizes
# (another learning rate, sharded or not) reuses it.
predict_jit = eqx.filter_jit(predict)


def loss_fn(model, batch, ts):
    """Mean squared error of trajectories started from the data's first points, on the
    first `n` times only: the horizon grows during training, inside one compiled step."""
    ys, n = batch
    horizon = jnp.minimum(ts, ts[n - 1])  # times past the horizon are solved to it...
    pred = predict(model, horizon, ys[:, 0])
    keep = (jnp.arange(len(ts)) < n)[None, :, None]  # ... and left out of the loss
    return jnp.sum(jnp.where(keep, pred - ys, 0) ** 2) / (n * ys[:, 0].size)


#
# Training: Optax on the flat vector, the time horizon grown from 10% to 100%.
#


def batches(ys, size, stages, *, seed, put=lambda x: x):
    """Random minibatches of trajectories, each with the number of times to fit:
    `(horizon, share)` in `stages` gives `share` of the steps on `horizon` of the times."""
    rng, n_times = np.random.default_rng(seed), ys.shape[1]
    for horizon, n_steps in stages:
        n = np.int64(max(2, round(horizon * n_times)))
        for _ in range(n_steps):
            yield put(ys[rng.choice(len(ys), size, replace=False)]), n


def sharding(shard):
    """(replicate, split): where to put the model and each batch."""
    if not shard:
        return (lambda x: x), (lambda x: x)
    # A 1-D mesh of every device: the batch is split along it, everything else is
    # replicated, and jit runs each device on its part and sums the gradient.
    mesh = jax.make_mesh(
        (jax.device_count(),), ("batch",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    spec = jax.sharding.PartitionSpec
    replicated = jax.sharding.NamedSharding(mesh, spec())
    split = jax.sharding.NamedSharding(mesh, spec("batch"))

    return (lambda model: put(model, replicated)), (lambda x: jax.device_put(x, split))


def put(model, where):
    """`jax.device_put` for the arrays of a model (its functions stay as they are)."""
    arrays, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, where), static)


def main(
    *,
    steps=2000,
    width=32,
    depth=2,
    batch=32,
    n_train=256,
    n_test=64,
    n_times=40,
    t_end=10.0,
    stages=((0.1, 0.4), (1.0, 0.6)),
    lr=3e-3,
    dtype="float64",
    shard=False,
    out=OUT,
    seed=0,
    progress=True,
):
    """Trains, evaluates on held-out initial conditions, plots; returns a summary dict.

    For each `(horizon, share)` of `stages`, `share * steps` Adam steps are taken on the
    first `horizon` of every trajectory: the usual trick of growing the time horizon,
    so that training does not start by fitting long trajectories with a random field.
    The batches carry the horizon, so one compiled step serves every stage.
    """
    dtype = jnp.dtype(dtype)
    k_data, k_model = jax.random.split(jax.random.key(seed))
    # One set of trajectories: the first `n_train` to train on, the rest held out.
    ts, ys_all = make_data(
        n_train + n_test, n_times=n_times, t_end=t_end, key=k_data, dtype=dtype
    )
    ys, ys_test = ys_all[:n_train], ys_all[n_train:]
    if shard and batch % jax.device_count():
        raise ValueError(
            f"`batch` ({batch}) must divide over {jax.device_count()} devices"
        )

    # The dtype rule: a float32 network, one `dtype` vector, a model computing in it.
    model32 = VectorField(width, depth, key=k_model)
    p, re = sciflat.destructure(model32, dtype=dtype)
    model = re(p)
    print(
        f"{len(re)} parameters: initialised in {model32.mlp.layers[0].weight.dtype}, "
        f"trained in {p.dtype} (re(p) computes in {model.mlp.layers[0].weight.dtype}); "
        f"{jax.device_count()} device(s), shard={shard}"
    )

    # Predictions for train and test set in one compiled call, before and after.
    evaluate = lambda model: predict_jit(model, ts, ys_all[:, 0])
    initial_loss = float(np.mean((evaluate(model)[:n_train] - ys) ** 2))

    # `share * steps` steps on the first `horizon` of the times, for each stage; the
    # learning rate decays over each stage.
    stages = [(horizon, round(share * steps)) for horizon, share in stages]
    bounds = np.cumsum([n for _, n in stages])[:-1].tolist()
    schedule = optax.join_schedules(
        [optax.cosine_decay_schedule(lr, n, alpha=0.1) for _, n in stages], bounds
    )
    replicate, split = sharding(shard)
    t0 = time.perf_counter()
    result = sciflat.fit(
        loss_fn,
        replicate(model),
        optax.adam(schedule),
        steps=sum(n for _, n in stages),
        batches=batches(ys, batch, stages, seed=seed, put=split),
        args=(ts,),
        progress=progress,
    )
    train_time = time.perf_counter() - t0
    model, history = result.model, result.history
    if not result.success:
        print(result.message, file=sys.stderr)

    model = put(model, jax.devices()[0]) if shard else model
    pred = np.asarray(evaluate(model))
    final_loss = float(np.mean((pred[:n_train] - ys) ** 2))
    test_error = float(
        np.linalg.norm(pred[n_train:] - ys_test) / np.linalg.norm(ys_test)
    )
    # `fit` stops at a non-finite loss or gradient and returns the last finite point.
    diverged = result.status == "nonfinite" or not final_loss < initial_loss
    print(f"training loss (MSE, all times): {initial_loss:.3e} -> {final_loss:.3e}")
    print(
        f"test error (relative L2, {n_test} held-out initial conditions): {test_error:.3e}"
    )
    print(f"training took {train_time:.1f} s")
    plot = _plot(ys_test, pred[n_train:], history, stages, out) if out else None
    if diverged:
        print("Training DIVERGED (non-finite loss, or no decrease).", file=sys.stderr)
    return dict(
        model=model,
        history=history,
        initial_loss=initial_loss,
        final_loss=final_loss,
        test_error=test_error,
        diverged=diverged,
        plot=plot,
        train_time=train_time,
    )


def _plot(ys_test, pred, history, stages, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i in range(min(4, len(pred))):
        true, learned = ys_test[i], pred[i]
        ax1.plot(true[:, 0], true[:, 1], c=f"C{i}", label="true" if i == 0 else None)
        ax1.plot(*learned.T, "--", c=f"C{i}", label="learned" if i == 0 else None)
    ax1.set(
        xlabel="angle θ", ylabel="angular velocity θ'", title="Held-out trajectories"
    )
    ax1.legend()
    ax2.semilogy(history)
    # The loss is over the times of the current horizon: it jumps where that grows.
    start = 0
    for horizon, n_steps in stages:
        ax2.axvline(start, c="grey", lw=0.8, ls=":")
        ax2.annotate(
            f"first {horizon:.0%} of the times",
            (start, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            va="top",
            rotation=90,
            fontsize=8,
            color="grey",
        )
        start += n_steps
    ax2.set(
        xlabel="step",
        ylabel="training loss (MSE on the horizon's times)",
        title="Loss (horizon grown in stages)",
    )
    fig.tight_layout()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "neural_ode.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add(
        "--steps", type=int, default=2000, help="Adam steps (40%% on 10%% of the times)"
    )
    add("--width", type=int, default=32, help="hidden width of the MLP")
    add("--depth", type=int, default=2, help="hidden layers of the MLP")
    add("--batch", type=int, default=32, help="trajectories per step")
    add("--dtype", choices=["float32", "float64"], default="float64")
    add("--out", default=OUT, help="folder for the plot")
    add("--shard", action="store_true", help="split each batch over all JAX devices")
    add("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    result = main(**vars(_parse()))
    sys.exit(1 if result["diverged"] else 0)
