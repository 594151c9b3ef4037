import os
import shutil
import subprocess
import sys
import tempfile

import hypothesis
import pytest


def _pin_worker_to_its_core() -> None:
    """Each pytest-xdist worker (and the processes it starts) on a core of its own.

    Two workers on two cores, each compiling with XLA's thread pool, run 5-12 % slower
    unpinned (two compiles side by side, one process per core against two free: 42.3 s
    against 44.7-48.3 s): threads of both processes thrash one another's caches and
    spin. Pinned before JAX starts its thread pools. Scheduling only: nothing a test
    computes changes."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if 1 < len(cpus) and workers <= len(cpus):
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


_pin_worker_to_its_core()


# XLA:CPU's older emitters for the fused kernels, in the tests' own processes: the same
# programs (XLA's passes, and LLVM's optimiser as by default) compiled in 0.53-0.88 of
# the time, run in 0.95-1.2 of it (benchmarks/bench_xla_emitters.py): the suite is
# compiling, 509 s against 344 s in all. The default emitters, which users get, can
# round the last bits of some functions differently (one ulp of tanh; a PEtab gradient
# 2e-12 relative), so what the users' compiler gives is checked too: every docs page
# runs with XLA's defaults (tests/test_docs.py drops the flags named by
# `SCIFLAT_SUITE_XLA_FLAGS`), as do the children that set XLA_FLAGS of their own (the
# neural ODE example's, the sharded fits'), and `SCIFLAT_TEST_XLA_DEFAULTS=1` runs the
# whole suite with them (CONTRIBUTING.md). Set only where this jaxlib knows the flag
# (an unknown one aborts the process) and the developer set no XLA_FLAGS; the workers
# inherit it.
SUITE_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false"


def _suite_codegen() -> None:
    if "XLA_FLAGS" in os.environ or os.environ.get("SCIFLAT_TEST_XLA_DEFAULTS"):
        return
    try:
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()",
            ],
            env={**os.environ, "XLA_FLAGS": SUITE_XLA_FLAGS, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):  # then XLA's defaults, slower
        return
    if probe.returncode == 0:
        os.environ["XLA_FLAGS"] = os.environ["SCIFLAT_SUITE_XLA_FLAGS"] = (
            SUITE_XLA_FLAGS
        )


_suite_codegen()

# JAX's persistent compilation cache, fresh for each run of the suite and shared by its
# processes (the pytest-xdist workers, the docs runner, the examples' children: they
# inherit the variable): a program compiled again by a later test -- a `fit` with a new
# optimiser object compiles its step anew -- is read back instead of built. JAX keys
# each entry by the whole compiled program, its options and the backend, so a hit is
# the program XLA would build. A developer's own cache directory is left as it is.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="sciflat-jax-")
    # Every program, the eager operations' too: each process (a docs page's, an
    # example's child) would otherwise compile them all again.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402  (after the cache settings, which JAX reads on import)


# The suite runs with 64-bit mode on, so float64 is available everywhere; the few tests
# about what happens without it ask for the `x64_off` fixture.
jax.config.update("jax_enable_x64", True)
# Also when a plugin imported JAX before this file set the variable.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


# In CI the property tests draw the same examples every run, so a CI failure can be
# reproduced from the log; a local run draws new ones (and keeps failures in
# `.hypothesis/`), which is how new failures are found.
hypothesis.settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")


@pytest.fixture
def x64_off():
    with jax.enable_x64(False):
        yield


# The example runs train real models (in subprocesses, too): seconds each, so their
# files (`test_example_*.py`, one per example) are in the slow tier. Marked here rather
# than in the files, which the examples' owners edit.
_SLOW_PREFIX = "test_example_"


# The files whose tests take longest (`--durations`, 2 cores: 50-130 s each), longest
# first. pytest-xdist hands whole files to its workers in collection order
# (`--no-loadscope-reorder` in pyproject.toml; by default it starts the files with
# the most tests first, which leaves the single-test examples to the end, one worker
# running them while the other waits): long files first, so both workers end
# together. The other files follow in their usual order. Only the order changes.
_LONGEST_FIRST = (
    "test_docs.py",
    "test_diffrax.py",
    "test_example_neural_ode.py",
    "test_example_boehm.py",
    "test_example_pinn.py",
    "test_example_parameter_estimation.py",
    "test_petab.py",
    "test_petab_hierarchical.py",
    "test_device_least_squares.py",
    "test_quasi_newton.py",
    "test_combinations.py",
    "test_dtype_matrix.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name.startswith(_SLOW_PREFIX):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


def pytest_unconfigure(config):
    # The process that made the cache removes it (an xdist worker has `workerinput`).
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
