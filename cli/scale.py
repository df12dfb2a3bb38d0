"""`diloco scale`: parse, one call into ``diloco.launcher.scale`` (through ``Run.scale``), render.

Grows or shrinks a live elastic run (launched with ``--max-replicas``): new replicas join at the next round from the
latest committed one; leaving ones are drained after their last round (counted), exit 0 and are not relaunched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from diloco.cli.errors import command
from diloco.cli.render import FormatOpt, OutputFormat, emit

if TYPE_CHECKING:
    from rich.console import Console


def _render(console: Console, report: Any) -> None:
    if report.before == report.after:
        console.print(f"run {report.run_id} already has {len(report.after)} replica(s): nothing to do")
        return
    line = f"run {report.run_id}: {len(report.before)} -> {len(report.after)} replica(s)"
    if report.added:
        line += f"; started rank(s) {', '.join(map(str, report.added))}: they join at the next round"
    if report.leaving:
        line += (f"; rank(s) {', '.join(map(str, report.leaving))} leave after their last round (counted), "
                 "drained")
    console.print(line)


def scale(
    run: Annotated[str, typer.Argument(help="Run id, a unique part of one (e.g. its 8-character suffix), or "
                                            "'latest'.", metavar="RUN", show_default=False)],
    replicas: Annotated[str | None, typer.Option("--replicas", help="The replicas the run should have: N, or +K / "
                                                 "-K more or fewer.", metavar="N|+K|-K", show_default=False)] = None,
    part: Annotated[str | None, typer.Option("--part", help="A run split over backends: the part that starts the "
                                             "new replicas, by its backend (sagemaker) or index (1); "
                                             "BACKEND:+K also says how many.", metavar="BACKEND[:+K]",
                                             show_default=False)] = None,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Grow or shrink a live elastic run (launched with --max-replicas). New replicas adopt the latest committed
    model and join at the next round; leaving replicas (the highest ranks) contribute to their last round, then
    exit 0, drained. Bounded by the run's --min-replicas and --max-replicas.

    \b
    Examples:
      diloco scale 7c98 --replicas 4
      diloco scale 7c98 --replicas +2
      diloco scale 7c98 --replicas=-1
      diloco scale 7c98 --part sagemaker:+2     # a mixed run: 2 more on its SageMaker part
    """
    from diloco.errors import ConfigError
    from diloco.launcher.run import Run
    from diloco.launcher.runs import RunRegistry

    registry = RunRegistry()
    view = Run(registry.resolve(run), registry=registry)
    change: str | None = None
    if part is not None:
        part, _, change = part.partition(":")
    if replicas is not None and change:
        raise ConfigError(f"--replicas {replicas} and --part {part}:{change} both say how many",
                          hint="give the count once: --part BACKEND:+K, or --part BACKEND --replicas +K")
    count = replicas or change
    if not count:
        raise ConfigError("--replicas: required", hint="pass --replicas N, +K or -K (or --part BACKEND:+K)")
    report = view.scale(count, part=part or None)
    emit(report, fmt, lambda console: _render(console, report))


def register(app: typer.Typer, epilog: str) -> None:
    """Add ``scale`` to ``app``."""
    app.command("scale", epilog=epilog)(command(scale))
