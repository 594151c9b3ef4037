import importlib
import importlib.metadata
import typing

from ._audit import assert_dtypes as assert_dtypes, audit_dtypes as audit_dtypes
from ._audit_report import DtypeReport as DtypeReport, Finding as Finding
from ._diffrax import VectorField as VectorField, vector_field as vector_field
from ._flatten import Restructure as Restructure, destructure as destructure
from ._hessian import hessian_uncertainty as hessian_uncertainty
from ._io import load as load, save as save
from ._plot import plot_fit as plot_fit
from ._result import FitResult as FitResult
from ._scipy_programs import clear_caches as clear_caches
from ._transforms import (
    Interval as Interval,
    Log as Log,
    Positive as Positive,
    Transform as Transform,
    unwrap as unwrap,
)
from ._uncertainty import Uncertainty as Uncertainty


# The fits load Optax, `scipy.optimize` and tqdm: imported on first use, so that
# `import sciflat` costs only what `destructure` needs (CONTRIBUTING.md has the figures).
if typing.TYPE_CHECKING:
    from ._batch import (
        BatchResult as BatchResult,
        least_squares_batch as least_squares_batch,
    )
    from ._fit import fit as fit
    from ._multistart import (
        MultiStartResult as MultiStartResult,
        multistart as multistart,
    )
    from ._petab_problem import (
        PetabProblem as PetabProblem,
        ReactionODE as ReactionODE,
        petab_problem as petab_problem,
    )
    from ._quasi_newton import (
        QuasiNewtonState as QuasiNewtonState,
        quasi_newton as quasi_newton,
    )
    from ._scipy_least_squares import least_squares as least_squares
    from ._scipy_minimize import minimize as minimize

_LAZY = {
    "BatchResult": "._batch",
    "least_squares_batch": "._batch",
    "fit": "._fit",
    "least_squares": "._scipy_least_squares",
    "minimize": "._scipy_minimize",
    "multistart": "._multistart",
    "MultiStartResult": "._multistart",
    # PEtab: python-libsbml, SymPy, PyYAML and Diffrax (the `petab` extra).
    "petab_problem": "._petab_problem",
    "PetabProblem": "._petab_problem",
    "ReactionODE": "._petab_problem",
    "quasi_newton": "._quasi_newton",
    "QuasiNewtonState": "._quasi_newton",
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
