"""How the CLI waits on a run and ends the command: live progress while waiting, the summary, why replicas
failed, what to do next, and the exit code. ``launch`` (after submitting), ``status --watch`` and ``watch`` share
these, so each is written once here and imported by both ``diloco.cli.main`` and ``diloco.cli.watch``.
"""

from __future__ import annotations

from typing import Any, NoReturn

import typer

from diloco.cli import exit_codes
from diloco.cli.render import OutputFormat, emit, say


def run_registry() -> Any:
    from diloco.launcher.runs import RunRegistry

    return RunRegistry()


def run_of(run: str | None) -> Any:
    """The run a command names (``diloco.launcher.api.Run``), through the Python API the commands are a layer on."""
    from diloco.launcher import api

    return api.get_run(run, registry=run_registry())


def view_of(run: str | None) -> Any:
    return run_of(run)


def outcome_code(report: Any, timed_out: bool, *, weights_checked: bool = True) -> int:
    """0 only when every replica succeeded and (for launch and collect) the final weights were checked and
    agree: a model that could not be checked is not "every check passed". A ``--min-replicas`` run that succeeded
    without some replicas (``left_behind``: they failed for good) exits 5: its model is whole, the run was not."""
    from diloco.executors.base import RunState

    if timed_out or report.timed_out:
        return exit_codes.TIMEOUT
    if report.state == RunState.SUCCEEDED:
        if weights_checked and not report.weights_identical:
            return exit_codes.FAILED
        return exit_codes.LEFT_BEHIND if report.left_behind else exit_codes.OK
    if report.state == RunState.CANCELLED:
        return exit_codes.CANCELLED
    return exit_codes.FAILED


#: Warnings already shown by this process (a live table re-reads the metrics every poll; say each once).
_SHOWN_WARNINGS: set[str] = set()


def show_warnings(report: Any) -> None:
    for warning in report.warnings:
        if warning not in _SHOWN_WARNINGS:
            _SHOWN_WARNINGS.add(warning)
            say(f"warning: {warning}")


def print_run(report: Any, fmt: OutputFormat) -> None:
    from diloco.cli.views import render_run

    show_warnings(report)
    emit(report, fmt, lambda console: render_run(console, report))
    relaunch_hint(report)


def relaunch_hint(report: Any) -> None:
    """A run that is "running" with a dead replica awaiting its relaunch: say who brings it back (on stderr)."""
    if not report.awaiting_relaunch:
        return
    ranks = ", ".join(map(str, report.awaiting_relaunch))
    say(f"replica(s) {ranks} died and can rejoin (restarts left): a waiting `diloco launch` or `diloco watch` "
        f"relaunches them; if none is waiting, run: diloco watch {report.run_id}")


def explain_failures(report: Any) -> None:
    from diloco.cli.views import failure_lines

    for line in failure_lines(report, report.run_id):
        say(line)


def wait(view: Any, *, timeout_s: float | None, fail_fast: bool, output: str | None = None,
          collect: bool = False, max_restarts: int = 0) -> Any:
    """Wait on the run with progress on stderr (``Run.wait``; with ``collect``, ``Run.collect``: check the
    weights and write the model to ``output`` unless it is None); returns ``(report, timed_out)``."""
    from diloco.cli.progress import RunProgress
    from diloco.cli.views import failure_why
    from diloco.launcher import api

    with RunProgress(view.record.run_id) as progress:
        def stopping(failed: Any, survivors: list[int]) -> None:
            if survivors:  # the cause now, not only in the summary: the survivors' stop can take a while
                progress.note(f"replica {failed.rank} failed ({failure_why(failed)}); stopping replica(s) "
                              f"{', '.join(map(str, survivors))}: they cannot finish without it")

        def update(report: Any) -> None:
            for warning in report.warnings:
                if warning not in _SHOWN_WARNINGS:
                    _SHOWN_WARNINGS.add(warning)
                    progress.note(f"warning: {warning}")
            progress.update(report)

        def relaunching(rank: int, attempt: int, reason: str) -> None:
            progress.note(f"replica {rank} failed ({reason}); relaunching it (restart {attempt} of {max_restarts})")

        def retried(rank: int, attempt: int, reason: str) -> None:
            progress.note(f"replica {rank} preempted ({reason}); {backend_retrier(view)} brings it back "
                          f"(restart {attempt})")

        options = {"timeout_s": timeout_s, "on_update": update, "on_fail_fast": stopping, "fail_fast": fail_fast,
                   "max_restarts": max_restarts, "on_relaunch": relaunching, "on_retried": retried}
        run = view
        try:  # the output was checked before waiting (``_model_target``): here it is only written
            report = run.collect(output, force=True, **options) if collect else run.wait(**options)
        except api.RunWaitTimeout as exc:
            return exc.report, True
        return report, False


def backend_retrier(view: Any) -> str:
    """Who brings a replica back when its backend does (the backend's ``retrier``: the cluster's Job on EKS, the
    service on SageMaker)."""
    from diloco.executors import backend_class

    try:
        return backend_class(view.record.backend).retrier
    except Exception:  # noqa: BLE001 - a backend this install cannot load: say it plainly
        return "its backend"


def state_now(view: Any) -> tuple[Any, list[int]]:
    """The run's state as it stands and the replicas still running (``(None, [])`` if the backend cannot be read
    now): what a Ctrl-C message should speak of, since the run may have ended while the command waited."""
    try:
        status = view.replica_status()
        return view.final_state or view.judge(status), [s.rank for s in status.replicas if not s.state.is_terminal]
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 - a second Ctrl-C, or a backend that does not answer
        return None, []


def interrupted(view: Any, cancel: bool) -> NoReturn:
    """Ctrl-C while waiting: say what the run is doing now (it may have ended meanwhile: then there is nothing to
    cancel and it does not "keep running"), cancel it only when asked to (``--cancel-on-interrupt``); exit 130."""
    run_id = view.record.run_id
    state, running = state_now(view)
    if state is not None and state.is_terminal and not (cancel and running):
        if state.value == "succeeded":
            next_step = f"check its weights and write the model: diloco collect {run_id}"
        elif running:
            next_step = (f"replica(s) {', '.join(map(str, running))} still run (they cannot finish): "
                         f"diloco cancel {run_id}")
        else:
            next_step = f"its summary: diloco status {run_id}"
        say(f"stopped waiting; run {run_id} has ended ({state.value}){', nothing to cancel' if cancel else ''}.\n"
            f"  {next_step}")
    elif cancel:
        say(f"interrupted: cancelling run {run_id} (--cancel-on-interrupt)")
        view.cancel()
        say(f"run {run_id} cancelled")
    else:
        say(f"stopped waiting; run {run_id} keeps running.\n  watch it (and relaunch failed replicas): diloco watch {run_id}\n"
            f"  stop it:  diloco cancel {run_id}")
    raise typer.Exit(exit_codes.INTERRUPTED)
