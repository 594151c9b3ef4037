import importlib.metadata

from ._flatten import destructure as destructure, Restructure as Restructure


__version__ = importlib.metadata.version("sciflat")
