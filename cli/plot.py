"""`diloco plot`: parse, one call into ``diloco.launcher.plot``, render.

Writes the run's training curves as a PNG (train and eval loss per replica against inner step and wall time, outer
rounds marked) and prints what it drew on stdout (a table, or ``-o json``). Works while the run is still going:
run it again to redraw. Needs matplotlib (the ``plot`` extra), imported only when the command runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from diloco.cli.errors import command
from diloco.cli.render import FormatOpt, OutputFormat, emit, say

if TYPE_CHECKING:
    from rich.console import Console


def _render(console: Console, report: Any) -> None:
    console.print(f"wrote {report.path}: {len(report.ranks)} replica(s), {report.train_points} train and "
                  f"{report.eval_points} eval point(s), {report.rounds} outer round(s)")


def plot(
    run: Annotated[str | None, typer.Argument(help="Run id, a unique part of one (e.g. its 8-character suffix), or "
                                                   "'latest' (default).", metavar="RUN", show_default=False)] = None,
    output: Annotated[str | None, typer.Option("--output", help="Where to write the PNG: a file, or a directory "
                                                  "(an existing one, or any path ending in /) to write "
                                                  "<run_id>-curves.png in; missing directories are created "
                                                  "(default: the current directory). An existing file is "
                                                  "replaced.", metavar="PATH",
                                                  show_default=False)] = None,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Draw a run's training curves into a PNG: train and eval loss per replica against inner step and wall time,
    with the outer rounds marked. Works for a finished run and for one still training (run it again to redraw).

    \b
    Examples:
      diloco plot                          # latest run, writes ./<run_id>-curves.png
      diloco plot 7c98 --output curves.png
      diloco plot -o json | jq -r .path
    """
    from diloco.launcher.plot import plot_run
    from diloco.launcher.run import Run
    from diloco.launcher.runs import RunRegistry

    registry = RunRegistry()
    view = Run(registry.resolve(run), registry=registry)
    from diloco.errors import DilocoError

    states: dict[int, str] | None
    try:  # the legend says each rank's real state, as its backend reports it
        states = {r.rank: r.state.value for r in view.replica_status().replicas}
    except (DilocoError, ImportError, OSError) as exc:  # the backend cannot be asked now: the store still plots
        states = None
        say(f"warning: replica states unknown ({exc}); the legend marks only replicas with no final row")
    report = plot_run(view.store, view.record.replicas, view.record.run_id, output, states=states)
    for warning in report.warnings:
        say(warning)
    emit(report, fmt, lambda console: _render(console, report))


def register(app: typer.Typer, epilog: str) -> None:
    """Add ``plot`` to ``app``."""
    app.command("plot", epilog=epilog)(command(plot))
