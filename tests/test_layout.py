"""The layout's promises (issue 33, docs/architecture.md): no import cycle among kvslim's modules, counting imports
inside functions (scripts/import_cycles.py); no module over 500 lines (C sources and tests aside); transformers'
Cache API imported by the cache adapters only. Read from the source: nothing of kvslim is imported here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "kvslim"
SCRIPT = ROOT / "scripts" / "import_cycles.py"
MAX_LINES = 500


#: The only modules that import transformers' Cache API (transformers.cache_utils): the cache adapters, and
#: compat, which names its classes per transformers release.
CACHE_API_MODULES = {
    "cache/adapter.py",
    "cache/layer_adapter.py",
    "cache/static_adapter.py",
    "cache/ragged.py",
    "cache/paged_adapter.py",
    "compat.py",
}


def _cycles() -> tuple[int, set[tuple[str, ...]]]:
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode in (0, 1), run.stderr
    found = set()
    for line in run.stdout.splitlines():
        assert line.startswith("cycle: "), line
        mods = line.removeprefix("cycle: ").split(" -> ")
        assert mods[0] == mods[-1], line
        found.add(tuple(mods[:-1]))
    assert (run.returncode == 1) == bool(found), run.stdout  # exit 1 exactly when a cycle is printed
    return run.returncode, found


def test_import_cycles_script_finds_a_cycle(tmp_path):
    """The script can fail: a two-module cycle through a function-level import is found; one under
    ``if TYPE_CHECKING:`` is not an import that runs."""
    pkg = tmp_path / "src" / "kvslim"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n")
    (pkg / "d.py").write_text("from .c import z\n")
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import import_cycles
    finally:
        sys.path.remove(str(SCRIPT.parent))
    graph = import_cycles.edges(import_cycles.modules(tmp_path / "src"))
    assert import_cycles.cycles(graph) == [("kvslim.a", "kvslim.b")]
    assert {t for t, _ in graph["kvslim.c"]} == set()


def test_no_import_cycle():
    """scripts/import_cycles.py finds none and exits 0 (the three of issue 33 were cache <-> positions,
    cache <-> promptcache and attention -> ragged -> cache -> attention)."""
    rc, found = _cycles()
    assert rc == 0 and not found, f"import cycles: {sorted(found)}"


def _line_counts() -> dict[str, int]:
    return {
        str(p.relative_to(SRC)): len(p.read_text(encoding="utf-8").splitlines())
        for p in sorted(SRC.rglob("*.py"))
    }


def test_no_module_over_500_lines():
    long = {name: n for name, n in _line_counts().items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_cache_package_modules_are_short_and_say_what_they_do_not_know():
    """Every module of the cache package is under the limit and has a module docstring that says what it
    does not know (STYLE.md: "a module docstring that says what the module does *not* know")."""
    for path in sorted((SRC / "cache").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert len(text.splitlines()) <= MAX_LINES, path.name
        doc = ast.get_docstring(ast.parse(text))
        assert doc, f"{path.name} has no module docstring"
        if path.name != "__init__.py":
            assert "knows nothing" in doc or "does not know" in doc, f"{path.name}: say what it does not know"


def test_only_the_cache_adapters_import_transformers_cache_api():
    importers = set()
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.startswith("transformers.cache_utils") for n in names):
                importers.add(str(path.relative_to(SRC)))
    assert importers == CACHE_API_MODULES
