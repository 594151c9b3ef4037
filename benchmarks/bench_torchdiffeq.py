"""The neural ODE example's training step in JAX + Diffrax vs PyTorch + torchdiffeq.

Same model (the example's MLP vector field, 2 -> 32 -> 32 -> 2, the same weights: those
of the example after a short training run),
same data (the example's pendulum trajectories: a batch of 32, 40 times over 10 s), same
solver and tolerances (Dopri5 -- torchdiffeq has no Tsit5 -- with rtol 1e-4, atol 1e-6,
the batch solved as one ODE so both take the same steps) and the same gradient
(backpropagation through the solver's operations: Diffrax's default
`RecursiveCheckpointAdjoint` and torchdiffeq's `odeint`). Timed: one training step,
loss and gradient with respect to every weight, in float32 and float64, with softplus
and tanh activations, and with `softplus_f64`, a float64 softplus that avoids XLA's
slow float64 `log1p` on CPU (see docs/benchmarks_examples.md).

    pip install torch==2.13.0 torchdiffeq   # CPU build; not a dependency of sciflat
    python benchmarks/bench_torchdiffeq.py [--reps 15] [--batches 32 1024] [--threads 1]

All variants run in one process, interleaved, after compilation/warm-up; the table gives
medians and the ratio torchdiffeq time / JAX time (> 1: JAX is faster).
"""

import argparse
import importlib.util
import os
import pathlib
import platform
import sys
import time


# Both frameworks single-threaded, unless `--threads N`: on 2 shared, busy cores,
# PyTorch's two OpenMP threads made a step up to 80 times slower in bursts (a parallel
# region waits for a thread that another process has descheduled). XLA reads its flags
# when JAX starts, hence before the import.
THREADS = (
    int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 1
)
if THREADS == 1:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    )

import diffrax  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sciflat  # noqa: E402


jax.config.update("jax_enable_x64", True)
ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "node", ROOT / "examples/neural_ode/train.py"
)
node = importlib.util.module_from_spec(spec)
spec.loader.exec_module(node)

#
# A float64 softplus without `log1p`: XLA's float64 log/log1p on CPU is several times
# slower than its float32 one (and than PyTorch's), and softplus is little else.
#


def _log1p_unit(z):
    """log1p(z) for z in [0, 1]: 2 atanh(s), s = z / (2 + z) <= 1/3, by its series
    (18 terms: the next is below 1e-17). Multiplications and adds only: vectorised."""
    s = z / (2 + z)
    s2, acc = s * s, jnp.zeros_like(s)
    for k in range(17, -1, -1):
        acc = acc * s2 + 1.0 / (2 * k + 1)
    return 2 * s * acc


@jax.custom_jvp
def softplus_f64(x):
    """softplus(x) = max(x, 0) + log1p(exp(-|x|)), to within 2 ulp in float64."""
    return jnp.maximum(x, 0) + _log1p_unit(jnp.exp(-jnp.abs(x)))


@softplus_f64.defjvp
def _softplus_f64_jvp(primals, tangents):
    # The derivative is the logistic function: no need to differentiate the series.
    (x,), (t,) = primals, tangents
    return softplus_f64(x), t * jax.nn.sigmoid(x)


#
# JAX + Diffrax, through sciflat: `p` is Diffrax's `args`.
#

ACTIVATIONS = {
    "softplus": jax.nn.softplus,
    "tanh": jnp.tanh,
    "softplus_f64": softplus_f64,
}


class Batched(eqx.Module):
    """The example's MLP applied to every row of the state: one ODE for the batch."""

    mlp: eqx.nn.MLP

    def __call__(self, y):
        return jax.vmap(self.mlp)(y)


def jax_step(model, activation, dtype, ts, ys):
    mlp = eqx.tree_at(lambda m: m.activation, model.mlp, ACTIVATIONS[activation])
    p, re = sciflat.destructure(Batched(mlp), dtype=dtype)
    term = diffrax.ODETerm(sciflat.vector_field(re, "y"))
    ts, ys = jnp.asarray(ts, dtype), jnp.asarray(ys, dtype)

    def solve(p):
        return diffrax.diffeqsolve(
            term,
            diffrax.Dopri5(),
            ts[0],
            ts[-1],
            None,
            ys[:, 0],
            args=p,
            saveat=diffrax.SaveAt(ts=ts),
            stepsize_controller=diffrax.PIDController(rtol=node.RTOL, atol=node.ATOL),
            max_steps=4096,
        )

    def loss(p):
        return jnp.mean((jnp.swapaxes(solve(p).ys, 0, 1) - ys) ** 2)

    step = jax.jit(jax.value_and_grad(loss))
    n_steps = int(jax.jit(solve)(p).stats["num_steps"])
    return lambda: jax.block_until_ready(step(p)), n_steps


#
# PyTorch + torchdiffeq, the same weights.
#


def torch_step(model, activation, dtype, ts, ys):
    import torch
    import torchdiffeq

    tdtype = {jnp.float32: torch.float32, jnp.float64: torch.float64}[dtype]
    act = {"softplus": torch.nn.Softplus(), "tanh": torch.nn.Tanh()}[activation]
    layers = []
    for i, lin in enumerate(model.mlp.layers):
        torch_lin = torch.nn.Linear(lin.in_features, lin.out_features, dtype=tdtype)
        with torch.no_grad():
            torch_lin.weight.copy_(torch.from_numpy(np.array(lin.weight, np.float64)))
            torch_lin.bias.copy_(torch.from_numpy(np.array(lin.bias, np.float64)))
        layers += [torch_lin] + ([act] if i < len(model.mlp.layers) - 1 else [])
    net = torch.nn.Sequential(*layers)
    calls = [0]

    def field(t, y):
        calls[0] += 1
        return net(y)

    ts_t = torch.tensor(np.asarray(ts), dtype=tdtype)
    ys_t = torch.tensor(np.swapaxes(ys, 0, 1).copy(), dtype=tdtype)  # (time, batch, 2)
    kw = dict(rtol=node.RTOL, atol=node.ATOL, method="dopri5")

    def step():
        net.zero_grad()
        loss = torch.mean((torchdiffeq.odeint(field, ys_t[0], ts_t, **kw) - ys_t) ** 2)
        loss.backward()
        return loss

    with torch.no_grad():
        torchdiffeq.odeint(field, ys_t[0], ts_t, **kw)
    # Dopri5: 6 new evaluations per step (first-same-as-last), 2 to start.
    return step, (calls[0] - 2) // 6


#
# The table.
#


def main(reps=15, batches=(32, 1024)):
    ts, ys_all = node.make_data(
        max(batches), n_times=40, t_end=10.0, key=jax.random.key(0), dtype="float64"
    )
    # A freshly initialised field barely moves (a handful of solver steps); time the
    # work of training instead: the example's field after a short training run.
    print("Training the example briefly for a realistic vector field...")
    trained = node.main(steps=300, n_train=64, out=None, progress=False)["model"]
    try:
        import torch
        import torchdiffeq  # noqa: F401

        torch_version = torch.__version__
        torch.set_num_threads(THREADS)
    except ImportError:
        torch, torch_version = None, None
        print("torch/torchdiffeq not installed: timing JAX only.")
    variants = {}
    for batch in batches:
        ys = ys_all[:batch]
        for dtype in (jnp.float32, jnp.float64):
            for act in ("softplus", "softplus_f64", "tanh"):
                name = (batch, np.dtype(dtype).name, act)
                variants[(*name, "jax")] = jax_step(trained, act, dtype, ts, ys)
                if torch is not None and act != "softplus_f64":
                    variants[(*name, "torch")] = torch_step(trained, act, dtype, ts, ys)
    for fn, _ in variants.values():  # warm up (compiles JAX)
        fn()
        fn()
    times = {k: [] for k in variants}
    for _ in range(reps):
        for k, (fn, _) in variants.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}

    print(
        f"\njax {jax.__version__}, diffrax {diffrax.__version__}, torch {torch_version}"
    )
    print(
        f"{platform.machine()}, {os.cpu_count()} CPU cores, {THREADS} thread(s) per "
        f"framework, median of {reps} steps\n"
    )
    print(
        "| batch | dtype | activation | JAX+Diffrax ms/step | torchdiffeq ms/step "
        "| torch / JAX | solver steps (JAX, torch) |"
    )
    print("|---|---|---|---|---|---|---|")
    for batch, dtype, act, framework in variants:
        if framework != "jax":
            continue
        j, n_j = (
            med[(batch, dtype, act, "jax")],
            variants[(batch, dtype, act, "jax")][1],
        )
        key = (batch, dtype, act.replace("_f64", ""), "torch")
        t, n_t = med.get(key), variants[key][1] if key in variants else "-"
        cells = [f"{t:.1f}", f"{t / j:.2f}"] if t else ["-", "-"]
        print(
            f"| {batch} | {dtype} | {act} | {j:.1f} | {' | '.join(cells)} | {n_j}, {n_t} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 1024])
    parser.add_argument("--threads", type=int, default=1, help="per framework")
    args = vars(parser.parse_args())
    del args["threads"]  # read at import time, above
    main(**args)
