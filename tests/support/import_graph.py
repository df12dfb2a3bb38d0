"""The import graph of the installed package, read from the source with ``ast`` (nothing is imported).

Every import counts, module-level and function-level alike: a function-level import is still an arrow, and a
cycle or a forbidden arrow hidden inside a function breaks the layering the same way once that function runs.
``from a import b`` is an arrow to ``a.b`` when ``a.b`` is a module, else to ``a``; importing a module is also an
arrow to each package above it outside the importer's own, since Python runs that package's ``__init__`` first
(``from diloco.collectives.topk import X`` runs ``diloco/collectives/__init__.py``). Relative imports are resolved against the importing module.
An import under ``if TYPE_CHECKING:`` is an arrow marked ``typing_only``: it counts for the layer rules (the
annotation still depends on the other side) but not for cycles, because it never runs.

The source folders map onto the installed names the way setup.py installs them: ``diloco/`` is ``diloco``,
``executors/`` is ``diloco.executors`` and ``cli/`` is ``diloco.cli``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE_ROOTS: Mapping[str, str] = {"diloco": "diloco", "executors": "diloco.executors", "cli": "diloco.cli"}


@dataclass(frozen=True)
class Edge:
    """One import statement's arrow: ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int
    typing_only: bool = False

    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


def discover(repo: Path = REPO) -> dict[str, Module]:
    """Every module of the package by its installed name."""
    modules: dict[str, Module] = {}
    for folder, package in SOURCE_ROOTS.items():
        root = repo / folder
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join((package, *parts))
            modules[name] = Module(name, path, is_package)
    return modules


def _resolve_relative(module: Module, level: int, name: str | None) -> str:
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _known(target: str, modules: Mapping[str, Module]) -> str | None:
    """The longest prefix of ``target`` that is one of our modules (``diloco.store.objects.Store`` -> the
    module); None for a third-party or standard-library import."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, typing_only: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``node`` (function bodies included), with whether it sits under
    ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, typing_only
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), True)
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), typing_only)
        else:
            yield from _imports(child, typing_only)


def edges_of(module: Module, modules: Mapping[str, Module], repo: Path = REPO) -> Iterator[Edge]:
    tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
    path = str(module.path.relative_to(repo))
    for node, typing_only in _imports(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _resolve_relative(module, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                # ``from a import b``: the arrow goes to the module ``a.b`` if there is one, else to ``a``.
                targets.append(full if full in modules else base)
        for target in targets:
            known = _known(target, modules)
            if known is None or known == module.name:
                continue
            yield Edge(module.name, known, path, node.lineno, typing_only)
            for package in _parents_run(module.name, known, modules):
                yield Edge(module.name, package, path, node.lineno, typing_only)


def _parents_run(source: str, target: str, modules: Mapping[str, Module]) -> Iterator[str]:
    """The packages whose ``__init__`` importing ``target`` runs first (``a.b.c`` runs ``a`` and ``a.b``), less
    those ``source`` is inside (already running when it runs) and the top package (run by every import)."""
    parts = target.split(".")
    for end in range(2, len(parts)):
        package = ".".join(parts[:end])
        if modules.get(package) is not None and modules[package].is_package and not within(source, package):
            yield package


def build(repo: Path = REPO) -> tuple[dict[str, Module], list[Edge]]:
    """All modules and every import arrow between them."""
    modules = discover(repo)
    edges = {edge: None for module in modules.values() for edge in edges_of(module, modules, repo)}
    return modules, list(edges)


def cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One shortest cycle through each strongly connected component with more than one module (typing-only
    arrows left out), as the chain of arrows that closes it (Tarjan for the components, then a breadth-first search inside each)."""
    graph: dict[str, dict[str, Edge]] = {}
    for edge in edges:
        if not edge.typing_only:
            graph.setdefault(edge.source, {}).setdefault(edge.target, edge)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                strongconnect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: set[str] = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)

    found: list[list[Edge]] = []
    for component in components:
        start = min(component)
        previous: dict[str, Edge] = {}
        frontier = [start]
        while frontier and start not in previous:
            nxt_frontier: list[str] = []
            for node in frontier:
                for target, edge in sorted(graph.get(node, {}).items()):
                    if target in component and target not in previous:
                        previous[target] = edge
                        nxt_frontier.append(target)
            frontier = nxt_frontier
        chain: list[Edge] = []
        node = start
        while True:
            edge = previous[node]
            chain.append(edge)
            node = edge.source
            if node == start:
                break
        found.append(list(reversed(chain)))
    return found


def describe_cycle(chain: list[Edge]) -> str:
    """``a (a.py:3) -> b (b.py:9) -> a``: each module with the line where it imports the next."""
    steps = [f"{edge.source} ({edge.where()})" for edge in chain]
    return " -> ".join([*steps, chain[0].source])


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")
