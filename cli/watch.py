"""``diloco watch RUN``: wait on a detached run exactly as ``launch`` waits on the run it starts.

Why a command of its own: ``launch --detach`` returns at once, and nothing then relaunches a replica that is killed or
preempted; ``status --watch`` only observes. ``watch`` is the launcher's waiting half for a run started elsewhere (or
by a ``launch`` whose terminal went away): the same live progress, the same relaunch of failed replicas with
``--max-restarts`` and backoff (``diloco.launcher.run.Run.wait``), the same summary, weights check and exit
code. Ctrl-C stops watching and never the run.

A run that has ended (succeeded, failed, cancelled), or can no longer finish, is never relaunched into: ``watch``
prints its summary and exits with its code at once. Relaunches follow the run's own ``--max-restarts`` (recorded at
launch); ``watch --max-restarts N`` given explicitly changes the run's setting.

``wait_and_summarize`` is the one function that waits on a run and ends the command the way ``launch`` does; a
``launch`` that does not detach is the same thing after submitting.
"""

from typing import Annotated, Any, NoReturn

import typer

from diloco.cli import waiting
from diloco.cli.errors import command
from diloco.cli.render import FormatOpt, OutputFormat, say


def wait_and_summarize(view: Any, *, fmt: OutputFormat, fail_fast: bool, max_restarts: int,
                       cancel_on_interrupt: bool = False) -> NoReturn:
    """Wait on the run with live progress, relaunching failed replicas (up to ``max_restarts`` each), then print
    the summary and exit with ``launch``'s code: 0 only when every replica succeeded and the final weights agree.

    Ctrl-C stops waiting (``launch --cancel-on-interrupt`` cancels instead) and exits 130.
    """
    try:
        report, timed_out = waiting.wait(view, timeout_s=None, fail_fast=fail_fast, collect=True, max_restarts=max_restarts)
    except KeyboardInterrupt:
        waiting.interrupted(view, cancel_on_interrupt)
    summarize(view, report, timed_out, fmt=fmt)


def summarize_ended(view: Any, *, fmt: OutputFormat) -> NoReturn:
    """The summary of a run that has ended, as ``launch`` printed it, and its exit code; nothing is waited on,
    relaunched or stopped (the weights of a succeeded run are checked, as ``launch`` did)."""
    try:  # no timeout: an ended run is read, never waited on
        report = view.collect(None, fail_fast=False, max_restarts=0)
    except KeyboardInterrupt:
        waiting.interrupted(view, False)
    summarize(view, report, False, fmt=fmt)


def summarize(view: Any, report: Any, timed_out: bool, *, fmt: OutputFormat) -> NoReturn:
    """Print a waited-on run's summary, why replicas failed, what to do next, and exit with launch's code."""
    run_id = view.record.run_id
    waiting.print_run(report, fmt)
    waiting.explain_failures(report)
    if report.state.value == "succeeded" and report.weights_identical:
        say(f"write the model with: diloco collect {run_id}")
    elif report.state.value == "succeeded" and report.weights_identical is None:
        say(f"the final weights could not be checked: {report.weights_detail}")
    elif report.weights_identical is False:
        say(f"the replicas' final weights disagree: {report.weights_detail}")
    raise typer.Exit(waiting.outcome_code(report, timed_out))


def watch(
    run: Annotated[str | None, typer.Argument(help="Run id, a unique part of one (e.g. its 8-character suffix), or "
                                                   "'latest' (default).", metavar="RUN", show_default=False)] = None,
    max_restarts: Annotated[int | None, typer.Option(
        "--max-restarts", min=0, show_default=False, metavar="N",
        help="Relaunch a failed replica up to N times in all (it rejoins at its peers' round); 0 never. Default: "
             "the run's own launch --max-restarts. Given, it becomes the run's setting.")] = None,
    fail_fast: Annotated[bool, typer.Option(help="Stop the other replicas as soon as one fails for good.")] = True,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Wait on a run (e.g. one launched with --detach) as launch does: live progress, relaunch of failed or
    preempted replicas, then the summary and launch's exit code. Ctrl-C stops watching, never the run.

    A run that has ended gets its summary and its exit code at once; one that can no longer finish (cancelled,
    or a replica failed for good) has its remaining replicas stopped first. Nothing is relaunched into either.

    \b
    Examples:
      diloco watch                      # the latest run; relaunches as its launch --max-restarts says
      diloco watch 7c98 --max-restarts 5 -o json
      diloco launch -c configs/local.yaml --detach && diloco watch
    """
    view = waiting.view_of(run)
    run_id = view.record.run_id
    try:  # from here on, Ctrl-C at any moment only stops watching
        ended = view.final_state
        if ended is None:
            status = view.replica_status()
            judged = view.judge(status)
            ended = judged if judged.is_terminal and status.terminal else None
        if ended is not None:
            say(f"run {run_id} has already ended ({ended.value}); its summary:")
            summarize_ended(view, fmt=fmt)
        if max_restarts is not None and max_restarts != view.max_restarts:
            view.set_max_restarts(max_restarts)
            say(f"run {run_id}: a replica is now relaunched up to {max_restarts} time(s) (--max-restarts)")
        say(f"watching {run_id} (Ctrl-C stops watching, the run keeps going); logs: diloco logs {run_id} -f")
        wait_and_summarize(view, fmt=fmt, fail_fast=fail_fast, max_restarts=view.max_restarts)
    except KeyboardInterrupt:
        waiting.interrupted(view, False)


def register(app: typer.Typer, epilog: str) -> None:
    """Add ``watch`` to the CLI (its waiting helpers are ``launch``'s own, in ``diloco.cli.waiting``)."""
    app.command(epilog=epilog)(command(watch))
