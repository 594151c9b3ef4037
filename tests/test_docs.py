"""The docs cannot rot: the site builds strictly, every public name is in the API pages,
and every ```python block of every page runs, top to bottom, one namespace per page.

Each page runs in its own process, so a page that turns on 64-bit mode cannot change
what the next page computes. To keep that cheap, one runner process imports JAX and the
libraries once and then forks a fresh child per page (no JAX backend is started before
the fork, so the children are as clean as a new interpreter). Run it by hand with
`python tests/test_docs.py docs/ties.md` to see a page's output.
"""

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# Every Markdown page whose code a reader may copy: the site, the READMEs, the guide.
PAGES = (
    sorted(DOCS.rglob("*.md"))
    + [p for p in (ROOT / "README.md", ROOT / "CONTRIBUTING.md") if p.exists()]
    + sorted(ROOT.glob("examples/*/README.md"))
)
PAGE_TIMEOUT_S = int(os.environ.get("DOCS_PAGE_TIMEOUT_S", 120))

_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n]*)\n"
    r"(?P<body>.*?)"
    r"^(?P=indent)(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_PYTHONISH = ("py", "python", "python3", "pycon", "ipython", "{.python", "{.py")


def code_blocks(text: str) -> list[tuple[str, int, str]]:
    """Every fenced block as `(info string, first line of code, dedented code)`."""
    blocks = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start("body")) + 1
        body = textwrap.dedent(m["body"]) if m["indent"] else m["body"]
        blocks.append((m["info"].strip(), line, body))
    return blocks


def python_blocks(text: str) -> list[tuple[int, str]]:
    return [(line, body) for info, line, body in code_blocks(text) if info == "python"]


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


#
# The runner: one process, one fork per page.
#


def _run_page(page: Path) -> dict:
    """In the forked child: run the page's blocks in one namespace, in order."""
    import warnings

    # As in the test suite: a docs snippet that warns is a bug.
    warnings.simplefilter("error")
    namespace = {"__name__": "__main__"}
    blocks = python_blocks(page.read_text())
    for number, (line, body) in enumerate(blocks, start=1):
        # Pad with blank lines so a traceback points at the page's own line numbers.
        code = compile("\n" * (line - 1) + body, str(page), "exec")
        try:
            exec(code, namespace)
        except BaseException:
            return {
                "ok": False,
                "block": number,
                "line": line,
                "error": traceback.format_exc(limit=-8),
            }
    return {"ok": True, "blocks": len(blocks)}


def _fork_and_run(page: Path, workdir: Path) -> dict:
    log, result_file, here = (
        workdir / f"{page.stem}.{x}" for x in ("log", "json", "d")
    )
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            here.mkdir()
            os.chdir(here)  # files a page writes land in a scratch folder
            fd = os.open(log, os.O_WRONLY | os.O_CREAT)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import signal

            signal.alarm(PAGE_TIMEOUT_S)
            result = _run_page(page)
            result_file.write_text(json.dumps(result))
            code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    seconds = time.perf_counter() - start
    output = log.read_text()[-3000:] if log.exists() else ""
    if result_file.exists():
        result = json.loads(result_file.read_text())
    elif os.WIFSIGNALED(status) and os.WTERMSIG(status) == 14:  # SIGALRM
        result = {"ok": False, "error": f"timed out after {PAGE_TIMEOUT_S} s"}
    else:
        result = {"ok": False, "error": f"the page's process died (status {status})"}
    return {
        **result,
        "page": _rel(page),
        "seconds": round(seconds, 2),
        "output": output,
    }


def run_pages(pages: list[Path]) -> list[dict]:
    os.environ.pop("JAX_ENABLE_X64", None)  # every page starts in JAX's default mode
    os.environ.setdefault("MPLBACKEND", "Agg")
    # Imported once here, before any JAX backend exists, and inherited by each fork.
    import equinox  # noqa: F401
    import jax  # noqa: F401
    import numpy  # noqa: F401
    import scipy.optimize  # noqa: F401

    import sciflat  # noqa: F401

    # (and what `sciflat.petab_problem` imports: petab's tables and linter, with
    # scipy.stats and pandas, ~3 s of each PEtab page's run otherwise)
    for name in ("optax", "diffrax", "matplotlib.pyplot", "petab.v1.lint", "sympy"):
        __import__(name)
    results = []
    for page in pages:
        with tempfile.TemporaryDirectory() as tmp:
            results.append(_fork_and_run(page, Path(tmp)))
    return results


if __name__ == "__main__":
    # `python tests/test_docs.py PAGE...` runs pages and prints one JSON result per line.
    pages = [Path(p).resolve() for p in sys.argv[1:]] or PAGES
    for result in run_pages(pages):
        print(json.dumps(result), flush=True)
    sys.exit(0)


#
# The tests.
#

import pytest  # noqa: E402  (the runner above must not need pytest)


# docs/scaling.md runs on 4 emulated devices (below), where its recipe means something.
ON_FOUR_DEVICES = DOCS / "scaling.md"


def _code(page: Path) -> list[str]:
    return [body for _, body in python_blocks(page.read_text())]


def _same_code_as() -> dict[Path, Path]:
    """Each page whose Python blocks are, block for block, an earlier page's
    (README.md repeats docs/index.md's): that page's run is its run."""
    first: dict[tuple[str, ...], Path] = {}
    same = {}
    for page in PAGES:
        code = tuple(_code(page))
        if code and code in first:
            same[page] = first[code]
        first.setdefault(code, page)
    return same


SAME_CODE = _same_code_as()


def users_environment() -> dict[str, str]:
    """This process's environment without the XLA flags the suite compiles its own
    programs with (tests/conftest.py): the pages compile as a reader's do."""
    env = dict(os.environ)
    if env.get("XLA_FLAGS") == env.pop("SCIFLAT_SUITE_XLA_FLAGS", None):
        env.pop("XLA_FLAGS", None)
    return env


@pytest.fixture(scope="module")
def page_results() -> dict[str, dict]:
    pages = [p for p in PAGES if p != ON_FOUR_DEVICES and p not in SAME_CODE]
    proc = subprocess.run(
        [sys.executable, __file__, *map(str, pages)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=users_environment(),
        timeout=PAGE_TIMEOUT_S * len(pages) + 60,
    )
    assert proc.returncode == 0, f"the docs runner crashed:\n{proc.stderr[-3000:]}"
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return {r["page"]: r for r in results}


# Slow: every page's snippets compile and run (~30 s of CPU in all). CI runs it; the
# strict build and the API check below stay in the fast tier.
@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if p != ON_FOUR_DEVICES], ids=_rel)
def test_page_code_runs(page, page_results):
    # A page with another's code, to the character, passes or fails with that page.
    result = page_results[_rel(SAME_CODE.get(page, page))]
    if not result["ok"]:
        where = f"{_rel(page)}"
        if "block" in result:
            where += f", python block {result['block']} (line {result['line']})"
        pytest.fail(
            f"{where} failed:\n{result['error']}\n--- page output ---\n"
            f"{result['output']}",
            pytrace=False,
        )


@pytest.mark.slow
def test_scaling_page_runs_on_four_devices():
    """The data-parallel recipe of docs/scaling.md, on 4 emulated CPU devices."""
    env = {
        **users_environment(),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
    }
    proc = subprocess.run(
        [sys.executable, __file__, str(ON_FOUR_DEVICES)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=PAGE_TIMEOUT_S + 60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["ok"], f"block {result.get('block')}:\n{result['error']}"
    assert "{'data': 4}" in result["output"], result["output"]


def test_the_pages_compile_with_xlas_defaults(monkeypatch):
    # The suite's own processes may compile with other XLA flags (tests/conftest.py);
    # the pages' runner drops those, and keeps flags a developer set.
    suite = "--xla_cpu_use_fusion_emitters=false"
    monkeypatch.setenv("XLA_FLAGS", suite)
    monkeypatch.setenv("SCIFLAT_SUITE_XLA_FLAGS", suite)
    env = users_environment()
    assert "XLA_FLAGS" not in env and "SCIFLAT_SUITE_XLA_FLAGS" not in env
    monkeypatch.delenv("SCIFLAT_SUITE_XLA_FLAGS")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/mine")
    assert users_environment()["XLA_FLAGS"] == "--xla_dump_to=/tmp/mine"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_python_block_runs(page):
    """No `python {skip}`-style fences, no ```py: a block is run, or it is not Python."""
    for info, line, _ in code_blocks(page.read_text()):
        first = info.split()[0].lower() if info else ""
        if first.startswith(_PYTHONISH) and info != "python":
            pytest.fail(
                f"{_rel(page)}:{line}: fence ```{info}: every Python block is executed, "
                "so write a plain ```python fence (and make it run), or ```text for "
                "output and other languages.",
                pytrace=False,
            )


def test_fences_are_found():
    """The block parser itself: indented blocks (admonitions, tabs) count too."""
    text = (
        "# T\n\n```python\nx = 1\n```\n\n!!! note\n\n    ```python\n    y = x + 1\n"
        "    ```\n\n```text\nnot code\n```\n"
    )
    assert python_blocks(text) == [(4, "x = 1\n"), (10, "y = x + 1\n")]


def public_names() -> set[str]:
    """The names `sciflat/__init__.py` exports, `__version__` aside."""
    tree = ast.parse((ROOT / "sciflat" / "__init__.py").read_text())
    names = set()
    # The fits are imported lazily: their names sit in an `if TYPE_CHECKING:` block.
    for node in [
        n for t in tree.body for n in (t.body if isinstance(t, ast.If) else [t])
    ]:
        if isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return {n for n in names if not n.startswith("_")}


def test_every_public_name_is_in_the_api_pages():
    import sciflat

    names = public_names()
    assert {"destructure", "Restructure", "FitResult"} <= names
    for name in names:
        assert hasattr(sciflat, name), name
    api_pages = [DOCS / "api.md", *sorted((DOCS / "api").glob("*.md"))]
    text = "\n".join(p.read_text() for p in api_pages if p.exists())
    documented = set(re.findall(r"^\s*::: sciflat\.(\w+)\s*$", text, re.MULTILINE))
    missing = sorted(names - documented)
    assert not missing, (
        f"public names missing from docs/api.md: {missing}; add a `::: sciflat.NAME` "
        "line for each."
    )
    unknown = sorted(documented - names)
    assert not unknown, (
        f"docs/api.md documents names sciflat does not export: {unknown}"
    )


def test_every_public_name_has_a_docstring():
    """A summary line for every public name, and an example for every function."""
    import inspect

    import sciflat

    for name in sorted(public_names()):
        obj = getattr(sciflat, name)
        doc = inspect.getdoc(obj) or ""
        assert doc.strip(), f"sciflat.{name} has no docstring"
        if inspect.isfunction(obj):
            assert "!!! Example" in doc, f"sciflat.{name}'s docstring has no example"


@pytest.mark.slow  # > 1.5 s on 2 quiet cores (CONTRIBUTING.md: the fast tier)
def test_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link, nav entry or API reference fails CI."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    problems = [
        line
        for line in proc.stderr.splitlines()
        if "WARNING" in line or "ERROR" in line
    ]
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(
        problems or proc.stderr.splitlines()[-30:]
    )
    assert (tmp_path / "api" / "index.html").exists()


def test_nav_lists_every_page():
    """A page left out of `nav` is built but unreachable: list every page."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    listed = set(re.findall(r"([\w/.-]+\.md)", nav))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages <= listed, f"pages not in mkdocs.yml's nav: {sorted(pages - listed)}"
    assert listed <= pages, f"nav entries with no page: {sorted(listed - pages)}"
