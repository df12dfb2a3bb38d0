"""The package's dependencies point one way: cli -> launcher -> executors -> store and the shared basics, and the
replica side never reaches the launcher side, a backend or the CLI.

The graph comes from the source (``tests/support/import_graph.py``), function-level imports included, so a violation
hidden inside a function fails here as well. A new layer rule is one line in ``RULES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from support.import_graph import Edge, Module, build, cycles, describe_cycle, within

LAUNCHER, CLI, EXECUTORS = "diloco.launcher", "diloco.cli", "diloco.executors"
FORMATS = "diloco.formats"
SUBPACKAGES = ("diloco.store", "diloco.collectives", "diloco.replica", "diloco.trainers", FORMATS, LAUNCHER, CLI,
               EXECUTORS)


def is_shared_basic(name: str) -> bool:
    """``diloco`` itself and its top-level modules (errors, envvars, defaults, ..., the public paths)."""
    return name == "diloco" or (name.count(".") == 1 and not any(within(name, p) for p in SUBPACKAGES))


def is_replica_side(name: str) -> bool:
    replica = ("diloco.replica", "diloco.collectives", "diloco.trainers", "diloco.store", FORMATS)
    return is_shared_basic(name) or any(within(name, p) for p in replica)


@dataclass(frozen=True)
class Rule:
    """Modules for which ``applies(source)`` holds never import a module inside one of ``forbidden``."""

    name: str
    applies: Callable[[str], bool]
    forbidden: tuple[str, ...]

    def broken_by(self, edge: Edge) -> bool:
        return self.applies(edge.source) and any(within(edge.target, p) for p in self.forbidden)


RULES = (
    Rule("the replica side never imports the launcher, a backend or the CLI", is_replica_side,
         (LAUNCHER, CLI, EXECUTORS)),
    Rule("the backends and their contract never import the launcher or the CLI",
         lambda name: within(name, EXECUTORS), (LAUNCHER, CLI)),
    Rule("only the CLI imports the CLI", lambda name: not within(name, CLI), (CLI,)),
    Rule("the store imports neither the collectives, the replica side nor the trainers",
         lambda name: within(name, "diloco.store"), ("diloco.collectives", "diloco.replica", "diloco.trainers")),
    Rule("the wire formats are pure arithmetic and settings: they import none of the rest of diloco",
         lambda name: within(name, FORMATS), ("diloco.store", "diloco.collectives", "diloco.replica",
                                              "diloco.trainers")),
)

#: The graph is built once, by the one worker that runs this file (parsing every module takes over a second: not
#: something each worker should pay while collecting).
pytestmark = pytest.mark.xdist_group("architecture")


@dataclass(frozen=True)
class Graph:
    modules: dict[str, Module]
    edges: list[Edge]


@pytest.fixture(scope="module")
def graph() -> Graph:
    return Graph(*build())


def test_the_graph_sees_function_level_and_relative_imports(graph: Graph) -> None:
    """The builder finds what the rules need: a function-level import (``diloco.report`` imports the metrics
    writer inside the function) and the backends' imports of their contract."""
    arrows = {(edge.source, edge.target) for edge in graph.edges}
    assert ("diloco", "diloco.replica.metrics") in arrows
    assert ("diloco.executors.local", "diloco.executors.base") in arrows
    assert {"diloco.executors.kubernetes.backend", "diloco.cli.main", "diloco.store"} <= set(graph.modules)


def test_no_import_cycle(graph: Graph) -> None:
    found = cycles(graph.edges)
    assert not found, "import cycles (module (file:line of its import of the next) -> ...):\n" + "\n".join(
        describe_cycle(chain) for chain in found
    )


def test_no_two_modules_import_each_other(graph: Graph) -> None:
    """Two modules that import each other share one concept between them, whichever way each arrow runs (at import,
    in a function, or only for an annotation): one of them should own it, or a third. A back-reference for
    typing is a protocol declared on the side that needs it."""
    arrows: dict[tuple[str, str], Edge] = {}
    for edge in graph.edges:
        arrows.setdefault((edge.source, edge.target), edge)
    pairs = sorted(f"{a} ({edge.where()}) <-> {b} ({arrows[(b, a)].where()})"
                   for (a, b), edge in arrows.items() if a < b and (b, a) in arrows)
    assert not pairs, "modules that import each other:\n" + "\n".join(pairs)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_layer_rule(rule: Rule, graph: Graph) -> None:
    broken = [edge for edge in graph.edges if rule.broken_by(edge)]
    assert not broken, f"rule broken: {rule.name}\n" + "\n".join(
        f"{edge.where()}: {edge.source} imports {edge.target}" for edge in broken
    )


def test_a_violating_import_is_named_with_its_line_and_rule() -> None:
    """The checks themselves can fail: a replica-side arrow to the launcher breaks the first rule, and two
    modules importing each other (at run time) are a cycle; a typing-only arrow back closes none."""
    bad = Edge("diloco.replica.outer", "diloco.launcher.config", "diloco/replica/outer.py", 7)
    assert [rule.name for rule in RULES if rule.broken_by(bad)] == [RULES[0].name]
    back = Edge("diloco.launcher.config", "diloco.replica.outer", "diloco/launcher/config.py", 3)
    [chain] = cycles([bad, back])
    assert describe_cycle(chain) == ("diloco.launcher.config (diloco/launcher/config.py:3) -> "
                                     "diloco.replica.outer (diloco/replica/outer.py:7) -> diloco.launcher.config")
    typed = Edge(back.source, back.target, back.path, back.line, typing_only=True)
    assert cycles([bad, typed]) == []
