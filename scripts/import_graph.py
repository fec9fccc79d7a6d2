"""The import graph of the roseinfer package, read from the source with ``ast``.

Every ``import X`` / ``from X import Y`` between roseinfer's own modules is an edge
``importer -> imported``; ``from pkg import name`` points at ``pkg.name`` when that is a
module, else at ``pkg``; relative imports are resolved. Each edge has a kind:

* ``module``: at module level (what runs on import);
* ``function``: inside a function or method body (a lazy import: still a dependency);
* ``type``: under ``if TYPE_CHECKING:`` (annotations only; never executed).

Cycles are strongly connected components of the graph of all three kinds
(docs/architecture.md, Layers): a lazy import is a real dependency, so moving an import
into a function does not break a circle; and a type named in an annotation is part of
its module's design, so a circle through one means the type lives in the wrong module.
``--runtime-only`` leaves ``type`` edges out, to see what Python itself would meet.

Run ``python -m scripts.import_graph`` to print the cycles (exit status 1 if any);
``tests/test_layering.py`` asserts there are none.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALL_KINDS = frozenset({"module", "function", "type"})
RUNTIME_KINDS = frozenset({"module", "function"})


@dataclass(frozen=True, slots=True)
class Edge:
    """One import of a roseinfer module by another."""

    importer: str
    imported: str
    kind: str  # "module" | "function" | "type"
    line: int


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``package_dir``."""
    names: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under ``node`` with the kind of the place it is in."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, kind
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), "type")
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), kind)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, "type" if kind == "type" else "function")
        else:
            yield from _walk(child, kind)


def _resolve_base(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
             known: Container[str]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in known:
                yield alias.name
        return
    base = _resolve_base(node, importer, is_package)
    for alias in node.names:
        full = f"{base}.{alias.name}"
        if full in known:
            yield full
        elif base in known:
            yield base


def edges(package_dir: Path = ROOT / "roseinfer") -> list[Edge]:
    """Every import between the package's own modules (self-imports left out), once per
    statement and target."""
    modules = module_names(package_dir)
    found: list[Edge] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, kind in _walk(tree, "module"):
            for target in _targets(node, name, is_package, modules):
                edge = Edge(name, target, kind, node.lineno)
                if target != name and edge not in found:
                    found.append(edge)
    return found


def graph(all_edges: Iterable[Edge], kinds: frozenset[str] = ALL_KINDS
          ) -> dict[str, set[str]]:
    """Adjacency sets of the edges of the given kinds."""
    adj: dict[str, set[str]] = {}
    for edge in all_edges:
        if edge.kind in kinds:
            adj.setdefault(edge.importer, set()).add(edge.imported)
            adj.setdefault(edge.imported, set())
    return adj


def cycles(adj: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(adj):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(adj[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(adj[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def describe(component: list[str], all_edges: Iterable[Edge],
             kinds: frozenset[str] = ALL_KINDS) -> list[str]:
    """The edges inside one cycle, one line each (importer:line -> imported, kind)."""
    members = set(component)
    return [f"  {e.importer}:{e.line} -> {e.imported} ({e.kind})"
            for e in sorted(all_edges, key=lambda e: (e.importer, e.line))
            if e.kind in kinds and e.importer in members and e.imported in members]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-only", action="store_true",
                        help="leave out the imports under `if TYPE_CHECKING:`")
    args = parser.parse_args(argv)
    kinds = RUNTIME_KINDS if args.runtime_only else ALL_KINDS
    all_edges = edges()
    found = cycles(graph(all_edges, kinds))
    for component in found:
        print(" <-> ".join(component))
        print("\n".join(describe(component, all_edges, kinds)))
    print(f"{len(found)} cycle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
