"""One-call accelerator check: placement, the dtype rule, TF32, and the benchmarks.

Run it on a machine with a GPU (or TPU) whenever one is available; it also runs on the
CPU, where it says so and what the placement check then means.

    python benchmarks/gpu_check.py              # about 5 minutes on a GPU
    python benchmarks/gpu_check.py --no-bench   # the checks only (seconds)

1. Placement: eager `re(p)` on a concrete `p` leaves every rebuilt array on `p`'s device,
   with device-to-host transfers forbidden (`jax.transfer_guard_device_to_host`), and
   agrees with the NumPy split; first-call and warm times of the device path and of the
   host round trip it replaces.
2. The dtype rule: `re(p.astype(d))` gives every floating leaf `d`, and the gradient of a
   loss through it is in `d`, for float16, bfloat16, float32 (and float64 with x64).
3. TF32: the error of a float32 forward pass and matmul against float64, at JAX's default
   matmul precision and at "highest" (on an Ampere+ GPU the default may use TF32).
4. The flat vector's cost per step (`bench_node_step.py`, `bench_core.py`), each in a child
   process with a time limit, so one slow part cannot take the whole run.
5. Issue 14: the float32 PINN trained at DEFAULT and at HIGHEST matmul precision
   (`examples/pinn/train.py --compare-precision`): error, loss, time, and the cost of
   one loss-and-gradient evaluation under each; in a child process, time-limited.
6. Issue 19: many fits as one program (`bench_many_fits.py --many`): Misra1a
   replicates and Gpufit's 2-D Gaussian spot for K = 1,000 ... 1,000,000 on the
   device (fits per second, beside Gpufit's published figures), the loops of lmfit
   and of the SciPy path on the host's CPU for the ratio; then one small fit on the
   device (`--single`); each in a child process, time-limited.
7. Issue 20: a short record configuration (Kiyani et al. 2025: 4 x 20, RAD, Adam, then
   SSBroyden, float64; `train.py --record --adam-steps 500 --steps 2000`), and the
   per-iteration benchmark against Optimistix's BFGS (`bench_quasi_newton.py`); each in
   a child process, time-limited. float64 on a GPU is slow: the figure is what counts.

Exits non-zero when a check (1-3) fails.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


jax.config.update("jax_enable_x64", True)

import sciflat  # noqa: E402
import sciflat._flatten as flatten  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))
FAILED: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        FAILED.append(what)


def _time(f, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def placement(device) -> None:
    print("\n## 1. Placement of eager re(p)")
    on_cpu = device.platform == "cpu"
    if on_cpu:
        print(
            "  CPU backend: host and device memory are the same, so re(p) splits p with "
            "NumPy (no copy to speak of); the accelerator path is forced below to check it."
        )
    models = {
        "MLP 1024x4 (5.2M params)": eqx.nn.MLP(
            1024, 1024, 1024, 4, key=jax.random.key(0), dtype=jnp.float32
        ),
        "1000 leaves of shape (8,)": [jnp.full(8, float(i)) for i in range(1000)],
        "100 leaves of shapes (8 + i,)": [jnp.ones(8 + i) for i in range(100)],
    }
    real_on_host = flatten._on_host
    print("  | model | path | first call | warm (median of 5) |")
    print("  |---|---|---:|---:|")
    for name, model in models.items():
        p, re = sciflat.destructure(model)
        p = jax.device_put(p, device)
        results = {}
        for path, on_host in [("device", False), ("host", True)]:
            flatten._on_host = lambda q, on_host=on_host: on_host
            try:
                guard = "disallow" if path == "device" else "allow"
                with jax.transfer_guard_device_to_host(guard):
                    first = _time(re, p)
                    warm = statistics.median(_time(re, p) for _ in range(5))
                    results[path] = re(p)
            finally:
                flatten._on_host = real_on_host
            print(f"  | {name} | {path} | {first * 1e3:.0f} ms | {warm * 1e3:.2f} ms |")
        arrays = jax.tree.leaves(eqx.filter(results["device"], eqx.is_array))
        check(
            all(x.devices() == {device} for x in arrays),
            f"{name}: every rebuilt array on {device}",
        )
        same = jax.tree.map(
            lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
            eqx.filter(results["device"], eqx.is_array),
            eqx.filter(results["host"], eqx.is_array),
        )
        check(all(jax.tree.leaves(same)), f"{name}: device and host paths agree")


def dtype_rule(device) -> None:
    print("\n## 2. The dtype rule")
    model = eqx.nn.MLP(4, 2, 16, 2, key=jax.random.key(1))
    p, re = sciflat.destructure(model)
    x = jnp.linspace(-1, 1, 4)
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64):
        q = jax.device_put(p.astype(dtype), device)
        floats = jax.tree.leaves(eqx.filter(re(q), eqx.is_inexact_array))
        loss = jax.jit(
            lambda q: (lambda y: y[0] * y[0] + y[1] * y[1])(re(q)(x.astype(q.dtype)))
        )
        value, grad = jax.value_and_grad(loss)(q)
        check(
            all(f.dtype == dtype for f in floats)
            and value.dtype == grad.dtype == dtype
            and grad.devices() == {device},
            f"{np.dtype(dtype).name}: leaves, loss and gradient in {np.dtype(dtype).name}",
        )


def tf32(device) -> None:
    print("\n## 3. float32 matmuls: default precision vs 'highest'")
    a = jax.random.normal(jax.random.key(2), (1024, 1024), jnp.float64)
    b = jax.random.normal(jax.random.key(3), (1024, 1024), jnp.float64)
    ref = np.asarray(a @ b)
    model = eqx.nn.MLP(256, 256, 256, 3, key=jax.random.key(4))
    p, re = sciflat.destructure(model)
    xs = jax.random.normal(jax.random.key(5), (64, 256))
    ref_mlp = np.asarray(jax.vmap(re(p))(xs))
    a32, b32 = (jax.device_put(v.astype(jnp.float32), device) for v in (a, b))
    p32, xs32 = (jax.device_put(v.astype(jnp.float32), device) for v in (p, xs))
    errs = {}
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(precision):
            mm = np.asarray(jax.jit(jnp.matmul)(a32, b32), np.float64)
            out = np.asarray(
                jax.jit(lambda q, x: jax.vmap(re(q))(x))(p32, xs32), np.float64
            )
        errs[precision] = (
            np.max(np.abs(mm - ref)) / np.max(np.abs(ref)),
            np.max(np.abs(out - ref_mlp)) / np.max(np.abs(ref_mlp)),
        )
        print(
            f"  {precision:8s}: matmul rel. error {errs[precision][0]:.1e}, "
            f"MLP through re(p) rel. error {errs[precision][1]:.1e}"
        )
    tf32_used = errs["default"][0] > 10 * errs["highest"][0]
    print(
        f"  the default precision {'uses TF32 (or lower)' if tf32_used else 'is full float32'} here"
    )
    check(errs["highest"][0] < 1e-5, "'highest' gives full float32 matmuls")


def benchmarks(limit_s: int) -> None:
    print("\n## 4. The flat vector's cost per step (bench_node_step, bench_core)")
    runs = [
        [
            "bench_node_step.py",
            "--dtypes",
            "float32",
            "float64",
            "--batches",
            "256",
            "--repeats",
            "7",
        ],
        [
            "bench_core.py",
            "--leaves",
            "1000",
            "--distinct",
            "100",
            "--batches",
            "1",
            "256",
            "--repeats",
            "10",
            "--eager-ravel-max",
            "0",
        ],
    ]
    for run in runs:
        _child(os.path.join(HERE, run[0]), run[1:], limit_s)


def precision_pinn(limit_s: int) -> None:
    print("\n## 5. The float32 PINN at DEFAULT and HIGHEST matmul precision")
    train = os.path.join(HERE, "..", "examples", "pinn", "train.py")
    _child(train, ["--compare-precision", "--steps", "2000"], limit_s)


def many_fits(limit_s: int) -> None:
    print("\n## 6. Many fits as one program")
    bench = os.path.join(HERE, "bench_many_fits.py")
    ks = ["1000", "10000", "100000", "1000000"]
    _child(bench, ["--many", "--ks", *ks, "--loop", "50"], 2 * limit_s)
    _child(bench, ["--single", "--repeats", "5"], limit_s)


def record_pinn(limit_s: int) -> None:
    print("\n## 7. A short record configuration: SSBroyden on the PINN")
    train = os.path.join(HERE, "..", "examples", "pinn", "train.py")
    args = ["--record", "--adam-steps", "500", "--steps", "2000", "--out", ""]
    _child(train, args, limit_s)
    _child(os.path.join(HERE, "bench_quasi_newton.py"), ["--repeats", "3"], limit_s)


def _child(script: str, args: list[str], limit_s: int) -> None:
    """`python script *args` with a time limit, its output printed."""
    print(f"\n$ python {os.path.relpath(script)} {' '.join(args)}", flush=True)
    try:
        out = subprocess.run(
            [sys.executable, script, *args],
            capture_output=True,
            text=True,
            timeout=limit_s,
        )
        print(out.stdout + out.stderr[-2000:], flush=True)
    except subprocess.TimeoutExpired as e:
        partial = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        print(f"{partial}\n(stopped after {limit_s} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-bench", action="store_true", help="skip parts 4 to 7")
    parser.add_argument(
        "--bench-limit", type=int, default=150, help="seconds per benchmark"
    )
    args = parser.parse_args()
    device = jax.devices()[0]
    backend = jax.default_backend()
    print(f"jax {jax.__version__}, backend {backend}, devices {jax.devices()}")
    if backend == "cpu":
        print("No accelerator: this run checks the script and the CPU figures only.")
    placement(device)
    dtype_rule(device)
    tf32(device)
    if not args.no_bench:
        benchmarks(args.bench_limit)
        precision_pinn(2 * args.bench_limit)
        many_fits(args.bench_limit)
        record_pinn(2 * args.bench_limit)
    print(f"\n{len(FAILED)} check(s) failed" + (f": {FAILED}" if FAILED else ""))
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
