"""Time per iteration: `sciflat.quasi_newton` (SSBroyden, BFGS) against Optimistix's BFGS
on the same loss, the PINN example's default (8 x 20 tanh network, 3,021 parameters,
4,000 + 456 collocation points, float64).

Each variant runs `--steps` iterations from the same point in one compiled call; all
are compiled first, then called in turn `--repeats` times (interleaved); medians.
An Optimistix step is one evaluation, accepted or not (backtracking Armijo); an
iteration of `quasi_newton` is one accepted step (strong Wolfe, usually one
evaluation). Both are reported, per accepted iteration and per evaluation.

    python benchmarks/bench_quasi_newton.py [--steps 20] [--repeats 5]
"""

import argparse
import importlib.util
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx

import sciflat


jax.config.update("jax_enable_x64", True)
ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_pinn():
    path = ROOT / "examples" / "pinn" / "train.py"
    spec = importlib.util.spec_from_file_location("pinn_train", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main(steps=20, repeats=5, warm=50):
    pinn = load_pinn()
    cfg = pinn.DEFAULT
    points = pinn.make_points(cfg["n_u"], cfg["n_f"], seed=0, dtype=jnp.float64)
    model = pinn.new_pinn(cfg["width"], cfg["depth"], key=jax.random.key(0))
    p, re = sciflat.destructure(model, dtype=jnp.float64)
    fn = lambda p, points: pinn.loss_fn(re(p), points)
    # From a point `warm` BFGS iterations in, where the loss is no longer the start's.
    p = sciflat.quasi_newton(fn, p, args=(points,), method="bfgs", max_steps=warm).p

    def ours(method):
        def run():
            r = sciflat.quasi_newton(
                fn, p, args=(points,), method=method, max_steps=steps
            )
            jax.block_until_ready(r.p)
            return r.n_steps, r.n_evaluations - 1  # less the evaluation at the start

        return run

    solver = optx.BFGS(rtol=0.0, atol=0.0)
    aux_fn = lambda p, points: fn(p, points)

    def optimistix():
        sol = optx.minimise(
            aux_fn, solver, p, args=points, max_steps=steps, throw=False
        )
        jax.block_until_ready(sol.value)
        return int(sol.state.num_accepted_steps), int(sol.stats["num_steps"])

    variants = {
        "optimistix.BFGS": optimistix,
        "quasi_newton bfgs": ours("bfgs"),
        "quasi_newton ssbroyden": ours("ssbroyden"),
    }
    counts = {name: run() for name, run in variants.items()}  # compiled
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            t0 = time.perf_counter()
            counts[name] = run()
            times[name].append(time.perf_counter() - t0)
    print(
        f"{len(re)} parameters, {steps} steps per call, median of {repeats}, "
        f"{jax.devices()[0].device_kind}"
    )
    print(
        "| variant | iterations | evaluations | ms / iteration | ms / evaluation "
        "| ratio / iteration |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    ref = None
    for name, (its, evals) in counts.items():
        t = float(np.median(times[name]))
        per_it, per_eval = 1e3 * t / max(its, 1), 1e3 * t / max(evals, 1)
        ref = per_it if ref is None else ref
        print(
            f"| {name} | {its} | {evals} | {per_it:.1f} | {per_eval:.1f} | "
            f"{per_it / ref:.2f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    main(**vars(parser.parse_args()))
