"""``docs/output-schema.json`` is the whole schema: every command that prints ``-o json`` has its entry, and what
``rm``, ``prune`` and ``plot`` really print on real runs validates against it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer
from support.cli_runs import RealRuns, run_cli

from diloco.cli.main import app

#: One worker runs this module: its module-scoped run (or server) is then started once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_cli_schema")

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "output-schema.json").read_text())


def json_commands() -> list[str]:
    """Every command that takes ``-o/--format``."""
    group = typer.main.get_command(app)
    return sorted(name for name, cmd in group.commands.items()  # type: ignore[attr-defined]
                  if any("--format" in getattr(p, "opts", ()) for p in cmd.params))


def validate(payload: Any, entry: str) -> None:
    jsonschema.validate(payload, {**SCHEMA, "$ref": f"#/$defs/{entry}"})


def test_every_command_with_json_output_has_its_schema_entry() -> None:
    printed_by = SCHEMA.get("x-printed-by", {})
    commands = json_commands()
    assert {"rm", "prune", "plot", "status", "logs"} <= set(commands)
    for name in commands:
        assert name in printed_by, f"docs/output-schema.json says nothing of what `diloco {name} -o json` prints"
        assert printed_by[name] in SCHEMA["$defs"], printed_by[name]
        assert name in SCHEMA["$defs"][printed_by[name]]["description"]
    assert set(printed_by) - set(commands) <= {"launch --dry-run"}, printed_by


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealRuns]:
    real = RealRuns(tmp_path_factory.mktemp("schema") / "home")
    try:
        yield real
    finally:
        real.close()


def test_real_rm_prune_and_plot_json_validates_against_the_schema(real_runs: RealRuns, tmp_path: Path) -> None:
    finished = real_runs.finished()
    going = real_runs.detached("slow", "-k", "step_s=0.5")
    home = real_runs.home

    plot = run_cli("plot", finished, "--output", str(tmp_path), "-o", "json", home=home)
    assert plot.returncode == 0, plot.stderr
    validate(json.loads(plot.stdout), SCHEMA["x-printed-by"]["plot"])

    pruned = run_cli("prune", "--older-than", "0s", "--dry-run", "-o", "json", home=home)
    report = json.loads(pruned.stdout)
    assert {r["run_id"] for r in report["runs"]} == {finished, going} and report["dry_run"] is True, report
    validate(report, SCHEMA["x-printed-by"]["prune"])

    removed = run_cli("rm", finished, going, "-o", "json", home=home)
    assert removed.returncode == 1, removed.stderr  # the run still going is kept
    report = json.loads(removed.stdout)
    assert [r["removed"] for r in report["runs"]] == [True, False] and report["runs"][1]["reason"], report
    validate(report, SCHEMA["x-printed-by"]["rm"])
