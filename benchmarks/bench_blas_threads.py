"""Does `blas_threads="auto"` (one BLAS thread during a SciPy fit) slow down linear
algebra inside the user's own loss?

jaxlib's CPU LAPACK kernels (LU, Cholesky, eigh, ...) call the LAPACK that SciPy
bundles (OpenBLAS), so the limit that `sciflat.minimize` puts on SciPy's BLAS also
applies to them. Measured two ways, every variant in one process, interleaved, after
compilation, medians over `--repeats`:

1. a jitted `jnp.linalg.solve` of an `n`×`n` system, called inside and outside the
   same thread limit sciflat uses;
2. a whole `sciflat.minimize` fit whose loss solves an `n`×`n` system per call,
   `blas_threads="auto"` vs `None`.

    python benchmarks/bench_blas_threads.py            # n = 500
    python benchmarks/bench_blas_threads.py --n 1000 --repeats 9
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from threadpoolctl import ThreadpoolController


jax.config.update("jax_enable_x64", True)

import sciflat  # noqa: E402


def interleaved(fns: dict, repeats: int) -> dict:
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(n: int, repeats: int, iters: int) -> None:
    controller = ThreadpoolController()
    blas = [i for i in controller.info() if i["user_api"] == "blas"]
    print(f"jax {jax.__version__}; BLAS libraries: ", end="")
    print(", ".join(f"{i['internal_api']} {i['num_threads']} threads" for i in blas))
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(n, n)) + n * np.eye(n))
    b = jnp.asarray(rng.normal(size=n))

    # 1. One solve, with and without the limit.
    solve = jax.jit(jnp.linalg.solve)
    jax.block_until_ready(solve(a, b))

    def limited(fn):
        def run():
            with controller.limit(limits=1, user_api="blas"):
                return fn()

        return run

    calls = lambda: [jax.block_until_ready(solve(a, b)) for _ in range(10)]
    t = interleaved(
        {"default threads": calls, "1 BLAS thread": limited(calls)}, repeats
    )
    print(f"\n### `jnp.linalg.solve`, {n}×{n}, 10 calls (median ms)\n")
    print("| BLAS threads | ms | ratio |")
    print("| --- | ---: | ---: |")
    for k, v in t.items():
        print(f"| {k} | {v * 1e3:.1f} | {v / t['default threads']:.2f}× |")

    # 2. A whole fit whose loss solves an n×n system, (A + diag(w)) x = b, for a
    # fixed number of iterations (no tolerance stops it early).
    def loss(m, a, b):
        x = jnp.linalg.solve(a + jnp.diag(m["w"]), b)
        return jnp.sum((n * x - 1.0) ** 2)

    model = {"w": jnp.zeros(n)}
    options = {"maxiter": iters, "ftol": 0.0, "gtol": 0.0}
    fit = lambda threads: (
        lambda: sciflat.minimize(
            loss,
            model,
            args=(a, b),
            blas_threads=threads,
            options=options,
            progress=False,
        )
    )
    fits = {"blas_threads=None": fit(None), 'blas_threads="auto" (1)': fit("auto")}
    results = {k: f() for k, f in fits.items()}
    t = interleaved(fits, repeats)
    print(f"\n### `sciflat.minimize`, loss with an {n}×{n} solve, {iters} iterations\n")
    print("| variant | s | ratio | loss calls |")
    print("| --- | ---: | ---: | ---: |")
    for k, v in t.items():
        ratio = v / t["blas_threads=None"]
        print(f"| {k} | {v:.3f} | {ratio:.2f}× | {results[k].raw.nfev} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    main(args.n, args.repeats, args.iters)
