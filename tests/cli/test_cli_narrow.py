"""Tables on a narrow terminal, through the real CLI on real local runs, piped as ``COLUMNS=80 diloco ... | cat``:
the run id and the state are never cut, the least important columns are dropped instead of squeezing every column
with ellipses, and a footer names the ones dropped. Also: ``rm`` of a run still going names the command that stops
it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.cli_runs import RealRuns, run_cli

#: One worker runs this module: its module-scoped run (or server) is then started once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_cli_narrow")

HIDDEN = re.compile(r"^columns hidden: (?P<names>.+); widen the terminal or use -o json$")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """One finished run, one whose replica 1 failed while replica 0 still runs, one still running."""
    real = RealRuns(tmp_path_factory.mktemp("narrow") / "home")
    try:
        finished = real.finished()
        failing = real.detached("crash_at_rank", "-k", "wait_s=900")
        running = real.detached("slow", "-k", "step_s=0.5")
        real.wait_for_replica_state(failing, 1, "failed")
        real.wait_for_replica_state(running, 0, "running")
        yield {"home": real.home, "finished": finished, "failing": failing, "running": running}
    finally:
        real.close()


def _table(stdout: str) -> tuple[list[str], list[str], list[str]]:
    """(header names, the table's lines, hidden column names) of the one table in ``stdout``; the footer naming
    the hidden columns may wrap onto more lines."""
    lines = stdout.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.strip() and set(line.strip()) == {"─"})
    header = [name for name in re.split(r"\s{2,}", lines[rule - 1].strip()) if name]
    end = rule + 1
    while end < len(lines) and len(lines[end]) == len(lines[rule]):  # Rich pads every row to the table's width
        end += 1
    footer = ""
    if end < len(lines) and lines[end].startswith("columns hidden:"):
        for line in lines[end:]:
            footer = f"{footer} {line}".strip()
            if footer.endswith("-o json"):
                break
    match = HIDDEN.match(footer)
    assert match is not None or not footer, footer
    return header, lines[rule - 1:end], match["names"].split(", ") if match else []


COMMANDS = {
    "runs": ["runs"],
    "status-failing": ["status", "{failing}"],
    "status-running": ["status", "{running}"],
    "rm": ["rm", "--dry-run", "{finished}", "{failing}", "{running}"],
    "prune": ["prune", "--older-than", "0s", "--dry-run"],
    "cancel-finished": ["cancel", "{finished}"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_narrow_tables_keep_run_id_and_state_whole_and_name_the_columns_they_drop(
        runs: dict[str, str], command: str) -> None:
    home = Path(runs["home"])
    args = [a.format(**runs) for a in COMMANDS[command]]
    wide = run_cli(*args, home=home, columns=250)  # the whole table: every column, every value
    wide_header, wide_rows, wide_hidden = _table(wide.stdout)
    assert not wide_hidden and "…" not in wide.stdout, wide.stdout
    state_at = wide_header.index("state")
    expected = {cells(row)[0]: cells(row)[state_at] for row in wide_rows[2:]}
    assert len(expected) >= 2, wide.stdout

    for columns in (80, 60):
        narrow = run_cli(*args, home=home, columns=columns)
        assert "internal error" not in narrow.stderr, narrow.stderr
        if args[0] in ("status", "runs", "cancel"):  # plain status exits 0 once it has shown the run, failed or not
            assert narrow.returncode == 0, narrow.stderr
        assert "…" not in narrow.stdout, narrow.stdout  # dropped, never squeezed with ellipses
        header, rows, hidden = _table(narrow.stdout)
        assert max(len(line) for line in rows) <= columns, narrow.stdout
        assert header[0] == wide_header[0] and "state" in header, narrow.stdout  # never dropped
        assert set(header) | set(hidden) == set(wide_header) and not set(header) & set(hidden), narrow.stdout
        assert [name for name in wide_header if name in header] == header  # the same reading order
        for key, state in expected.items():
            row = next((cells(line) for line in rows if cells(line)[0] == key), None)
            assert row is not None, f"no row starts with the whole {key!r}:\n{narrow.stdout}"
            assert row[header.index("state")] == state, narrow.stdout


def cells(line: str) -> list[str]:
    """A table row's cells: the table separates them by at least two spaces, a cell holds at most one."""
    return re.split(r"\s{2,}", line.strip())


def test_status_at_80_columns_drops_the_least_important_columns_first(runs: dict[str, str]) -> None:
    result = run_cli("status", runs["finished"], home=Path(runs["home"]), columns=80)
    header, _, hidden = _table(result.stdout)
    assert {"replica", "state", "step", "round", "train loss", "eval loss"} <= set(header), result.stdout
    assert hidden and "restarts" in hidden and "step" not in hidden, result.stdout


@pytest.mark.parametrize("which", ["failing", "running"])
def test_rm_of_a_run_still_going_names_the_command_that_stops_it(runs: dict[str, str], which: str) -> None:
    run_id, home = runs[which], Path(runs["home"])
    result = run_cli("rm", run_id, home=home)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if f"diloco cancel {run_id}" in line]
    assert len(lines) == 1 and lines[0].endswith(f"diloco cancel {run_id}"), result.stderr
    assert "not removed" in lines[0] and "not ended" in lines[0], result.stderr
    assert run_cli("status", run_id, home=home).returncode == 0  # its record is still there


def test_a_run_id_wider_than_the_terminal_folds_onto_more_lines_whole_never_cut() -> None:
    """Below the narrowest width the essential columns need, their values fold (all characters kept) rather
    than end in an ellipsis; everything droppable has gone and the footer says so."""
    import io

    from rich.console import Console

    from diloco.cli.tables import Column, fitted_table

    run_id = "diloco-20261201-093000-7c98aa11"
    columns = (Column("run", essential=True), Column("state", essential=True), Column("created"))
    out = io.StringIO()
    Console(file=out, width=24, no_color=True).print(
        fitted_table(columns, [{"run": run_id, "state": "succeeded", "created": "2026-12-01 09:30:00"}], width=24))
    text = out.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 24, text
    rows = [line for line in text.splitlines()[2:] if line.strip()]
    rows = rows[:next(i for i, line in enumerate(rows) if line.startswith("columns hidden:"))]
    assert "".join(line.split()[0] for line in rows) == run_id, text
    assert "succeeded" in text and "columns hidden: created" in " ".join(text.split()), text
