"""`import sciflat` loads only what `destructure` needs; the fits load theirs on use."""

import subprocess
import sys

import pytest


PROBE = """
import sys
import sciflat
heavy = ("optax", "scipy.optimize", "tqdm", "diffrax")
print(sorted(m for m in heavy if m in sys.modules))
sciflat.fit, sciflat.minimize, sciflat.least_squares
print(sorted(m for m in heavy if m in sys.modules))
"""


@pytest.mark.slow  # a fresh interpreter importing JAX: seconds
def test_import_sciflat_loads_no_integration_until_used():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "[]"
    assert out[1] == "['optax', 'scipy.optimize']"  # tqdm: when a bar is shown


def test_lazy_names_are_the_real_functions():
    import sciflat
    from sciflat._fit import fit
    from sciflat._scipy_least_squares import least_squares
    from sciflat._scipy_minimize import minimize

    assert (sciflat.fit, sciflat.minimize, sciflat.least_squares) == (
        fit,
        minimize,
        least_squares,
    )
    assert {"fit", "minimize", "least_squares"} <= set(dir(sciflat))
    with pytest.raises(AttributeError, match="no attribute 'fitt'"):
        sciflat.fitt  # noqa: B018
