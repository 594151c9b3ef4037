"""NIST StRD nonlinear regression: certified values and standard errors.

The eight lower-difficulty problems (`tests/data/nist_strd/`), from both of NIST's
starting points, with `least_squares`' defaults: every parameter to >= 6 significant
digits and every standard error to >= 4, against NIST's certified values.
"""

import importlib.util
import pathlib

import numpy as np
import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_reader():
    spec = importlib.util.spec_from_file_location(
        "nist", ROOT / "benchmarks" / "nist.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nist = _load_reader()
PROBLEMS = {p.name: p for p in nist.problems()}


def test_reader_reads_every_part_of_a_file():
    misra = PROBLEMS["Misra1a"]
    assert misra.names == ("b1", "b2")
    assert misra.starts == ((500.0, 0.0001), (250.0, 0.0005))
    assert misra.certified == (2.3894212918e02, 5.5015643181e-04)
    assert misra.certified_stderr == (2.7070075241e00, 7.2668688436e-06)
    assert misra.certified_rss == 1.2455138894e-01
    assert misra.x.shape == misra.y.shape == (14,)
    assert (misra.x[0], misra.y[0], misra.x[-1], misra.y[-1]) == (
        77.6,
        10.07,
        760.0,
        81.78,
    )
    # A formula over two lines, and the certified point reproduces the certified RSS.
    gauss = PROBLEMS["Gauss1"]
    assert gauss.formula.count("exp") == 3 and len(gauss.names) == 8
    for p in PROBLEMS.values():
        r = np.asarray(
            p.residuals(dict(zip(p.names, p.certified, strict=True)), p.x, p.y)
        )
        assert np.sum(r**2) == pytest.approx(p.certified_rss, rel=1e-6), p.name


@pytest.fixture(scope="module")
def fits():
    """Every problem from both starts, once (fits of one problem share a compile)."""
    return {(name, s): nist.fit(p, s) for name, p in PROBLEMS.items() for s in (1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("start", [1, 2])
@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_certified_values_and_standard_errors(fits, name, start):
    problem, result = PROBLEMS[name], fits[name, start]
    assert result.success, result.message
    values = [float(result.model[b]) for b in problem.names]
    stderr = [float(result.stderr[b]) for b in problem.names]
    value_digits = [
        nist.digits(v, c) for v, c in zip(values, problem.certified, strict=True)
    ]
    stderr_digits = [
        nist.digits(s, c) for s, c in zip(stderr, problem.certified_stderr, strict=True)
    ]
    assert min(value_digits) >= 6, (values, problem.certified)
    assert min(stderr_digits) >= 4, (stderr, problem.certified_stderr)
    assert result.chisqr == pytest.approx(problem.certified_rss, rel=1e-6)


@pytest.mark.parametrize("method", ["lm", "trf"])
def test_no_residual_call_beyond_scipys(method):
    """The loss history needs the cost at each accepted point: it is taken from the
    calls SciPy made (MINPACK asks for the Jacobian at the accepted point after
    trying another), not from one more residual call."""
    result = nist.fit(PROBLEMS["Misra1a"], 1, method=method)
    assert result.status == "converged"
    # SciPy counts a call it served from its cache; sciflat counts the calls it made.
    assert result.n_evaluations <= result.raw.nfev
    assert len(result.history) == result.n_steps >= result.raw.njev - 1
