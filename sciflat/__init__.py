import importlib.metadata

from ._flatten import destructure as destructure, Restructure as Restructure
from ._result import FitResult as FitResult


__version__ = importlib.metadata.version("sciflat")
