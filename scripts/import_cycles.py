"""Print every import cycle among kvslim's modules, counting imports inside functions; exit 1 if there is one.

    python scripts/import_cycles.py            # cycles of src/kvslim, one a line
    python scripts/import_cycles.py --edges    # also every import edge, "importer -> imported [line]"

Read from the source with :mod:`ast`, nothing is imported: every ``import`` and ``from ... import`` statement
counts, at module level or inside a function or method (a deferred import is still a dependency), except
those under ``if TYPE_CHECKING:`` (never run). ``from package import name`` is an edge to the submodule
``package.name`` when that is a module of the tree, else to ``package``. Imports by string
(``importlib.import_module``) are not seen. A cycle is printed as ``a -> b -> ... -> a``, starting at its
smallest module name; each elementary cycle once (at most --limit per strongly connected component).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "kvslim"


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of ``package`` under ``root`` (packages as their
    ``__init__``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def edges(mods: dict[str, Path]) -> dict[str, set[tuple[str, int]]]:
    """importer -> {(imported module, line)} over the modules of the tree (imports of other packages
    dropped)."""
    graph: dict[str, set[tuple[str, int]]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = name if is_pkg else name.rpartition(".")[0]  # the package relative imports start from
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base_parts = here.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            for target in targets:
                # `import a.b.c` depends on a.b.c; keep the longest prefix that is a module of the tree
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add((target, node.lineno))
    return graph


def _sccs(adj: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, iter(sorted(adj[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(adj[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _search(path: list[str], on_path: set[str], adj, allowed: set[str], found: set, budget: list[int]) -> None:
    """Depth-first: every simple path from ``path[0]`` through ``allowed`` back to it, extending ``path``."""
    for w in sorted(adj[path[-1]] & allowed):
        if budget[0] <= 0:
            return
        if w == path[0]:
            found.add(tuple(path))
            budget[0] -= 1
        elif w not in on_path:
            path.append(w)
            on_path.add(w)
            _search(path, on_path, adj, allowed, found, budget)
            on_path.discard(w)
            path.pop()


def cycles(graph: dict[str, set[tuple[str, int]]], limit: int = 100) -> list[tuple[str, ...]]:
    """Elementary cycles (each as modules, starting at its smallest name, without repeating it), at most
    ``limit`` per strongly connected component, sorted."""
    adj = {m: {t for t, _ in targets} for m, targets in graph.items()}
    found: set[tuple[str, ...]] = set()
    for comp in _sccs(adj):
        budget = [limit]
        for start in comp:  # cycles whose smallest module is `start`: search among larger ones only
            allowed = {m for m in comp if m >= start}
            _search([start], {start}, adj, allowed, found, budget)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every import edge too")
    parser.add_argument("--limit", type=int, default=100, help="most cycles printed per component")
    args = parser.parse_args(argv)
    graph = edges(modules())
    if args.edges:
        for name in sorted(graph):
            for target, line in sorted(graph[name]):
                print(f"{name} -> {target} [{line}]")
    found = cycles(graph, args.limit)
    for cyc in found:
        print("cycle: " + " -> ".join((*cyc, cyc[0])))
    print(f"{len(found)} import cycle(s) among {len(graph)} modules of {PACKAGE}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
