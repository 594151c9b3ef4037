"""The PEtab example (Boehm et al. 2014): the published fit, and two starts fitted."""

import pathlib

import jax
import numpy as np

from helpers import load_example as load


def test_boehm_example_reproduces_the_published_fit_and_fits(tmp_path, caplog):
    boehm = load("parameter_estimation", "boehm.py")
    run = boehm.main(starts=1, seed=0, out=str(tmp_path))
    np.testing.assert_allclose(run["llh_nominal"], boehm.AMICI_LLH, rtol=1e-6)
    # One start (multistart itself is tested in test_multistart.py): it improved on
    # where it began, and the best has standard errors.
    problem = run["problem"]
    starts = problem.sample_starts(1, seed=0)
    begun = [float(problem.llh(s)) for s in starts]
    assert all(a > b for a, b in zip(run["llhs"], begun, strict=True))
    assert run["llh_best"] == max(run["llhs"])
    assert np.isfinite(run["best"].uncertainty.stderr).any()
    # A second call reuses the compiled Hessian (it was a new `jax.jit` at each call,
    # 14 s of compilation each on this problem).
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        again = problem.uncertainty(run["best"])
    compiled = [r.getMessage() for r in caplog.records]
    assert not [m for m in compiled if m.startswith("Compiling")], compiled
    np.testing.assert_array_equal(
        again.uncertainty.covariance, run["best"].uncertainty.covariance
    )
    for path in run["plots"]:
        assert pathlib.Path(path).stat().st_size > 10_000
