import importlib.metadata

from ._audit import assert_dtypes as assert_dtypes, audit_dtypes as audit_dtypes
from ._audit_report import DtypeReport as DtypeReport, Finding as Finding
from ._diffrax import VectorField as VectorField, vector_field as vector_field
from ._flatten import Restructure as Restructure, destructure as destructure
from ._io import load as load, save as save
from ._least_squares import least_squares as least_squares
from ._multistart import MultiStartResult as MultiStartResult, multistart as multistart
from ._optax import fit as fit
from ._report import plot_fit as plot_fit
from ._result import FitResult as FitResult
from ._scipy import minimize as minimize
from ._transforms import (
    Interval as Interval,
    Log as Log,
    Positive as Positive,
    Transform as Transform,
    unwrap as unwrap,
)
from ._uncertainty import (
    Uncertainty as Uncertainty,
    hessian_uncertainty as hessian_uncertainty,
)


__version__ = importlib.metadata.version("sciflat")
