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
    from sciflat._optax.fit import fit
    from sciflat._scipy.least_squares import least_squares
    from sciflat._scipy.minimize import minimize

    assert (sciflat.fit, sciflat.minimize, sciflat.least_squares) == (
        fit,
        minimize,
        least_squares,
    )
    assert {"fit", "minimize", "least_squares"} <= set(dir(sciflat))
    with pytest.raises(AttributeError, match="no attribute 'fitt'"):
        sciflat.fitt  # noqa: B018


# The floors of the package, lowest first (CONTRIBUTING.md, "Layout"). The flat
# modules are the core; each folder is a wing. A module imports only from its own
# floor or below, and a wing never imports another wing of its floor.
FLOORS = (
    ("core",),
    ("_audit", "_fitting"),
    ("_solver",),
    ("_device", "_optax", "_petab"),
    ("_scipy",),
    ("front",),
)
FLOOR = {wing: level for level, wings in enumerate(FLOORS) for wing in wings}
FRONT = {"__init__", "_multistart", "_profile"}


WINGS = {path.name for path in pathlib.Path(sciflat.__file__).parent.glob("_*/")}


def _wing(module: str) -> str:
    """`_fitting.result` -> `_fitting`; a flat module is the core, or the front."""
    head = module.split(".")[0]
    if head in WINGS:
        return head
    return "front" if module in FRONT else "core"


def _internal_imports() -> dict[str, set[str]]:
    """Every sciflat module (`_flatten`, `_fitting.result`) and the sciflat modules it
    imports, anywhere in its body: at the top, inside a function, or under
    `if TYPE_CHECKING:`."""
    root = pathlib.Path(sciflat.__file__).parent
    graph = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        package = parts[:-1]
        name = ".".join(parts) if parts[-1] != "__init__" else ".".join(package)
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = list(package[: len(package) - (node.level - 1)])
            if node.module:  # from ..x.y import z: x.y, and x.y.z if a module
                base = [*base, *node.module.split(".")]
                found.add(".".join(base))
            found.update(".".join([*base, a.name]) for a in node.names)
        graph[name or "__init__"] = found
    return {
        m: {i for i in found if i in graph or "." not in i}
        for m, found in graph.items()
    }


def test_every_module_is_on_a_floor_and_imports_downwards():
    graph = _internal_imports()
    modules = set(graph)
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            assert other in modules, f"{module} imports {other}: not a sciflat module"
            low, high = _wing(other), _wing(module)
            assert FLOOR[low] <= FLOOR[high], f"{module} imports {other}, a floor up"
            if FLOOR[low] == FLOOR[high] and low != high:
                raise AssertionError(f"{module} imports {other}, a wing beside it")


def test_the_shared_layer_imports_no_backend():
    # `_fitting` is what every fit shares: it knows no SciPy, device, solver, Optax or
    # PEtab module, so any of them can change (or go) without touching the others.
    for module, imported in _internal_imports().items():
        if _wing(module) == "_fitting":
            assert {_wing(m) for m in imported} <= {"core", "_fitting"}, module


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
