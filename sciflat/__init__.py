import importlib
import importlib.metadata
import typing

from ._audit.api import assert_dtypes as assert_dtypes, audit_dtypes as audit_dtypes
from ._audit.report import DtypeReport as DtypeReport, Finding as Finding
from ._diffrax import VectorField as VectorField, vector_field as vector_field
from ._fitting.band import Band as Band, band as band
from ._fitting.hessian import hessian_uncertainty as hessian_uncertainty
from ._fitting.plot import plot_fit as plot_fit
from ._fitting.programs import clear_caches as clear_caches
from ._fitting.result import FitResult as FitResult
from ._fitting.uncertainty import Uncertainty as Uncertainty
from ._flatten import Restructure as Restructure, destructure as destructure
from ._io import load as load, save as save
from ._petab.benchmarks import petab_benchmark as petab_benchmark
from ._transforms import (
    Interval as Interval,
    Log as Log,
    Positive as Positive,
    Transform as Transform,
    unwrap as unwrap,
)


# The fits load Optax, `scipy.optimize` and tqdm: imported on first use, so that
# `import sciflat` costs only what `destructure` needs (CONTRIBUTING.md has the figures).
if typing.TYPE_CHECKING:
    from ._device.batch import (
        BatchResult as BatchResult,
        MinpackQR as MinpackQR,
        NormalEquations as NormalEquations,
        least_squares_batch as least_squares_batch,
    )
    from ._multistart import (
        MultiStartResult as MultiStartResult,
        multistart as multistart,
    )
    from ._optax.fit import fit as fit
    from ._petab.bdf import BDF as BDF
    from ._petab.hierarchical import HierarchicalProblem as HierarchicalProblem
    from ._petab.problem import (
        PetabProblem as PetabProblem,
        ReactionODE as ReactionODE,
        StageChord as StageChord,
        petab_problem as petab_problem,
    )
    from ._petab.rosenbrock import Rodas5P as Rodas5P
    from ._profile import (
        Profile as Profile,
        ProfileInterval as ProfileInterval,
        ProfileResult as ProfileResult,
        profile as profile,
    )
    from ._scipy.least_squares import least_squares as least_squares
    from ._scipy.minimize import minimize as minimize
    from ._solver.quasi_newton import (
        QuasiNewtonState as QuasiNewtonState,
        quasi_newton as quasi_newton,
    )

_LAZY = {
    "BatchResult": "._device.batch",
    "MinpackQR": "._device.batch",
    "NormalEquations": "._device.batch",
    "least_squares_batch": "._device.batch",
    "fit": "._optax.fit",
    "least_squares": "._scipy.least_squares",
    "minimize": "._scipy.minimize",
    "multistart": "._multistart",
    "MultiStartResult": "._multistart",
    # PEtab: python-libsbml, SymPy, PyYAML and Diffrax (the `petab` extra).
    "petab_problem": "._petab.problem",
    "PetabProblem": "._petab.problem",
    "HierarchicalProblem": "._petab.hierarchical",
    "ReactionODE": "._petab.problem",
    "StageChord": "._petab.problem",
    "Rodas5P": "._petab.rosenbrock",
    "BDF": "._petab.bdf",
    "profile": "._profile",
    "Profile": "._profile",
    "ProfileInterval": "._profile",
    "ProfileResult": "._profile",
    "quasi_newton": "._solver.quasi_newton",
    "QuasiNewtonState": "._solver.quasi_newton",
}


def __getattr__(name: str) -> typing.Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'sciflat' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = importlib.metadata.version("sciflat")
