"""`import sciflat` loads only what `destructure` needs; the fits load theirs on use."""

import ast
import pathlib
import subprocess
import sys

import pytest

import sciflat


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


def _internal_imports() -> dict[str, set[str]]:
    """Every `sciflat._x` module and the sciflat modules it imports, anywhere in its
    body: at the top, inside a function, or under `if TYPE_CHECKING:`."""
    root = pathlib.Path(sciflat.__file__).parent
    graph = {}
    for path in root.glob("_*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:  # from ._x import y
                    found.add(node.module.split(".")[0])
                else:  # from . import _x
                    found.update(alias.name for alias in node.names)
        graph[path.stem] = found
    return graph


def test_the_modules_import_each_other_without_circles():
    # Layers point one way (CONTRIBUTING.md, "Layout"): a lower module never imports
    # a higher one, not even inside a function or for a type.
    graph = _internal_imports()
    state: dict[str, str] = {}

    def visit(module, trail):
        if state.get(module) == "done":
            return
        if state.get(module) == "open":
            cycle = [*trail[trail.index(module) :], module]
            raise AssertionError("import circle: " + " -> ".join(cycle))
        state[module] = "open"
        for other in sorted(graph.get(module, ())):
            visit(other, [*trail, module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])
