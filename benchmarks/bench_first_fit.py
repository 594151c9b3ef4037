"""The first `sciflat.least_squares` fit of a problem in a fresh process: compilation.

Times the first fit of three NIST StRD problems (from Start 1) in this process, and the
second fit of each (the compiled functions reused). With `--cache DIR`, JAX's persistent
compilation cache is on (every compiled function kept, however small), so running the
script twice shows what a later run of the same program pays:

    python benchmarks/bench_first_fit.py
    python benchmarks/bench_first_fit.py --cache /tmp/jax-cache   # twice
    python benchmarks/bench_first_fit.py --method device          # the device fit
"""

import argparse
import pathlib
import sys
import time

import jax


jax.config.update("jax_enable_x64", True)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import nist  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", help="JAX's persistent compilation cache directory")
    parser.add_argument("--method", default="auto", help="`least_squares`' method")
    args = parser.parse_args(argv)
    if args.cache:
        jax.config.update("jax_compilation_cache_dir", args.cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    problems = {p.name: p for p in nist.problems()}
    print(f"persistent cache: {args.cache or 'off'}; method: {args.method}")
    for name in ("Misra1a", "Chwirut2", "DanWood"):
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fit = nist.fit(problems[name], 1, method=args.method)
            jax.block_until_ready(fit.p)
            times.append(time.perf_counter() - t0)
        print(
            f"{name}: first fit {1e3 * times[0]:.0f} ms, second {1e3 * times[1]:.1f} ms"
        )


if __name__ == "__main__":
    main()
