"""`diloco rm` and `diloco prune`: parse, one call into ``diloco.launcher.housekeeping``, render.

Both print one row per run considered (a table, or ``-o json``: the same pydantic report) on stdout and a one-line
summary on stderr. A run that has not ended is never removed: ``rm`` of one exits 1 and says how to stop it;
``prune`` lists it as kept and goes on. ``--dry-run`` removes nothing and shows what would go.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from diloco.cli import exit_codes
from diloco.cli.errors import command
from diloco.cli.render import FormatOpt, OutputFormat, emit, say
from diloco.cli.tables import Column

if TYPE_CHECKING:
    from rich.console import Console

DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print what would be removed; remove nothing.")]


def fmt_bytes(n: int) -> str:
    """``512 B``, ``4.2 kB``, ``3.8 MB``, ``1.2 GB`` (decimal units, as ``du --si`` and cloud consoles show)."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def _action(run: Any, dry_run: bool) -> str:
    if run.removed:
        return "would remove" if dry_run else "removed"
    return "kept"


#: The table of ``rm`` and ``prune``, in reading order.
COLUMNS = (Column("run", essential=True), Column("created"), Column("state", essential=True),
           Column("action", essential=True), Column("store objects", "right"), Column("store bytes", "right"),
           Column("why kept", wrap=True))
#: Most important first: a narrow terminal drops them from the end (the run id already says when it was created;
#: why a run was kept is also said on stderr).
PRIORITY = ("run", "state", "action", "store bytes", "why kept", "store objects", "created")


def _render(console: Console, report: Any, empty: str) -> None:
    from diloco.cli.tables import fitted_table
    from diloco.cli.views import fmt_time, state_text

    if not report.runs:
        console.print(empty)
        return
    rows = [{"run": run.run_id or run.rendezvous_uri, "created": fmt_time(run.created_at) if run.created_at else "-",
             "state": state_text(run.state.value), "action": _action(run, report.dry_run),
             "store objects": str(run.store_objects) if run.removed else "-",
             "store bytes": fmt_bytes(run.store_bytes) if run.removed else "-", "why kept": run.reason or ""}
            for run in report.runs]
    console.print(fitted_table(COLUMNS, rows, width=console.width, priority=PRIORITY))


def _narrate(report: Any) -> None:
    """The summary line, what was left behind, and how to stop a run that was kept because it is going."""
    verb = "would remove" if report.dry_run else "removed"
    for run in report.runs:
        who = f"run {run.run_id}" if run.run_id else run.rendezvous_uri
        for warning in run.warnings:
            say(f"{who}: {warning}")
        if run.removed and run.store_kept:
            shown = ", ".join(run.store_kept[:3]) + (" ..." if len(run.store_kept) > 3 else "")
            say(f"{who}: {len(run.store_kept)} object(s) under {run.rendezvous_uri} were not written "
                f"by diloco and were left alone ({shown})")
        if not run.removed and run.record_path and (run.going or not run.state.is_terminal):
            # still going, whatever state it reads as (one failed replica makes it "failed" while the others run)
            say(f"{who} is still going ({run.reason or run.state.value}): not removed; stop it first with: "
                f"diloco cancel {run.run_id}")
        elif not run.removed:  # also a prefix without a record here: its reason says what to do
            say(f"{who}: not removed: {run.reason}")
    if report.removed or report.kept:
        say(f"{verb} {report.removed} run(s), {fmt_bytes(report.store_bytes)} of store objects"
            + (f"; kept {report.kept}" if report.kept else "") + (" (dry run: nothing removed)" if report.dry_run
                                                                  else ""))


def rm(
    runs: Annotated[list[str] | None, typer.Argument(help="Run ids, unique parts of them (e.g. the 8-character suffix), "
                                                          "or 'latest'.", metavar="RUN", show_default=False)] = None,
    prefix: Annotated[list[str] | None, typer.Option("--prefix", help="A run's store prefix (its rendezvous URI) "
                                                     "to remove even without a record here (repeatable).",
                                                     metavar="URI", show_default=False)] = None,
    dry_run: DryRunOpt = False,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Remove runs that have ended: their record, their logs and run directory, and their objects under the run's
    rendezvous prefix (file:// or s3://; nothing outside that prefix).

    A run still pending, running or cancelling is never removed: it is listed as kept and the exit code is 1
    (stop it first with diloco cancel RUN). Every RUN is looked up before anything is removed, so a typo
    removes nothing (exit 2).

    --prefix URI removes what lies under a run's prefix without a record here (a launch whose own clean-up could
    not reach the store, a run recorded on another machine): all of it when the prefix's run.json names a run
    that its backend no longer sees going, only the store layout's keys without a run.json. A prefix of a run
    recorded here is removed through its record.

    \b
    Examples:
      diloco rm 7c98                   # one run, by any unique part of its id
      diloco rm 7c98 a1b2 --dry-run    # what would go, and how many bytes of store objects
      diloco rm latest -o json
      diloco rm --prefix s3://my-bucket/diloco/diloco-20261201-093000-7c98
    """
    from diloco.errors import ConfigError
    from diloco.launcher.housekeeping import remove_runs

    if not runs and not prefix:
        raise ConfigError("rm: nothing to remove", hint="give a RUN (see diloco runs) or --prefix URI")
    report = remove_runs(runs or [], dry_run=dry_run, prefixes=prefix or [])
    emit(report, fmt, lambda console: _render(console, report, "nothing to remove"))
    _narrate(report)
    if report.kept:
        raise typer.Exit(exit_codes.FAILED)


def prune(
    older_than: Annotated[str, typer.Option("--older-than", help="Remove runs that ended more than this long ago "
                                                                 "(30m, 12h, 7d, 2w).", metavar="AGE",
                                            show_default=False)],
    dry_run: DryRunOpt = False,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Remove every recorded run that ended more than AGE ago (by its last replica's end, else its creation time):
    its record, logs and store objects, as diloco rm does. Runs still going are listed as kept and left alone.

    \b
    Examples:
      diloco prune --older-than 7d --dry-run   # what would go
      diloco prune --older-than 12h
      diloco prune --older-than 2w -o json | jq -r '.runs[] | select(.removed) | .run_id'
    """
    from diloco.launcher.housekeeping import parse_duration, prune_runs

    seconds = parse_duration(older_than, field="--older-than")
    report = prune_runs(seconds, dry_run=dry_run)
    emit(report, fmt, lambda console: _render(console, report, f"nothing to prune: no run ended more than "
                                                                f"{older_than} ago"))
    _narrate(report)
    if any(not run.removed and run.state.is_terminal and not run.going for run in report.runs):
        raise typer.Exit(exit_codes.FAILED)


def register(app: typer.Typer, epilog: str) -> None:
    """Add ``rm`` and ``prune`` to ``app``."""
    app.command("rm", epilog=epilog)(command(rm))
    app.command("prune", epilog=epilog)(command(prune))
