"""How the CLI waits on a run and ends the command, and ``diloco watch RUN``, the command that does only that.

Waiting: live progress while waiting, the summary, why replicas failed, what to do next, and the exit code.
``launch`` (after submitting), ``status --watch``, ``collect`` and ``watch`` share these, so each is written once
here. A waiting ``launch`` or ``watch`` can also serve a read-only status page of the run (``--serve PORT``,
``diloco.launcher.status_page``) and post its events to a webhook (``--notify URL``, ``diloco.launcher.notify``):
both are fed the report of every poll (``Observers``), the same report ``status -o json`` prints.

Why ``watch`` is a command of its own: ``launch --detach`` returns at once, and nothing then relaunches a replica
that is killed or preempted; ``status --watch`` only observes. ``watch`` is the launcher's waiting half for a run
started elsewhere (or by a ``launch`` whose terminal went away): the same live progress, the same relaunch of failed
replicas with ``--max-restarts`` and backoff (``diloco.launcher.run.Run.wait``), the same summary,
weights check and exit code. Ctrl-C stops watching and never the run.

A run that has ended (succeeded, failed, cancelled), or can no longer finish, is never relaunched into: ``watch``
prints its summary and exits with its code at once. Relaunches follow the run's own ``--max-restarts`` (recorded at
launch); ``watch --max-restarts N`` given explicitly changes the run's setting.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, NoReturn

import typer

from diloco.cli import exit_codes
from diloco.cli.errors import command
from diloco.cli.render import SCHEMA_VERSION, FormatOpt, OutputFormat, emit, say, to_jsonable
from diloco.errors import ConfigError


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
         collect: bool = False, max_restarts: int = 0, observers: Observers | None = None) -> Any:
    """Wait on the run with progress on stderr (``Run.wait``; with ``collect``, ``Run.collect``: check the
    weights and write the model to ``output`` unless it is None); returns ``(report, timed_out)``. ``observers``
    (the status page, the notifier) see every report polled."""
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
            if observers is not None:
                observers.update(report)

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


# ------------------------------------------------------------------------------------------ page and notifications
ServeOpt = Annotated[int | None, typer.Option(
    "--serve", min=0, max=65535, metavar="PORT", show_default=False, rich_help_panel="Status page and notifications",
    help="Serve a read-only status page of the run at http://127.0.0.1:PORT/ (JSON at /status.json, the same as "
         "status -o json) while waiting; 0 picks a free port.")]
ServeHostOpt = Annotated[str, typer.Option(
    "--serve-host", metavar="HOST", rich_help_panel="Status page and notifications",
    help="Address the status page listens on; anything but loopback makes it reachable from the network "
         "(it has no login; it shows the run's report only).")]
ServeLingerOpt = Annotated[float, typer.Option(
    "--serve-linger", min=0, metavar="SECONDS", rich_help_panel="Status page and notifications",
    help="Keep serving the final page this long after the run ended (Ctrl-C ends it sooner).")]
NotifyOpt = Annotated[str | None, typer.Option(
    "--notify", metavar="URL", show_default=False, rich_help_panel="Status page and notifications",
    help="Post the run's events to this Slack-compatible webhook: a replica failed or was relaunched, a round "
         "stalled past the run's store.timeout_s, the estimated cost crossed --notify-cost, the run ended.")]
NotifyCostOpt = Annotated[float | None, typer.Option(
    "--notify-cost", min=0, metavar="USD", show_default=False, rich_help_panel="Status page and notifications",
    help="With --notify: announce once when the run's estimated cost reaches USD.")]


def report_json(report: Any) -> dict[str, Any]:
    """A report exactly as ``-o json`` prints it (``schema_version`` first): what the page and webhook are fed."""
    payload = to_jsonable(report)
    return {"schema_version": SCHEMA_VERSION, **payload} if isinstance(payload, dict) else payload


class Observers:
    """The status page and the notifier of a waiting command, fed every report it polls; neither can stop the wait
    (a webhook that fails is one warning line)."""

    def __init__(self, *, serve: int | None = None, serve_host: str = "127.0.0.1", linger_s: float = 0.0,
                 notify: str | None = None, notify_cost: float | None = None) -> None:
        from diloco.launcher import notify as notifications

        if notify_cost is not None and notify is None:
            raise ConfigError("--notify-cost: needs --notify URL (where to post when the cost is crossed)")
        self.linger_s = linger_s
        self.notifier = notifications.Notifier(notify, warn=say) if notify is not None else None
        self.cost_usd = notify_cost
        self.snapshot: Any = None
        self.stall_s: float | None = None
        self.page: Any = None
        if serve is not None:  # bound now, so a busy port fails before anything is launched or waited on
            from diloco.launcher.status_page import StatusPage, is_loopback

            self.page = StatusPage(serve_host, serve)
            if not is_loopback(serve_host):
                say(f"warning: --serve-host {serve_host}: the status page is reachable from the network; it has no "
                    f"login (it shows the run's report only)")

    @property
    def active(self) -> bool:
        return self.page is not None or self.notifier is not None

    def start(self, view: Any) -> None:
        """Start serving, and learn the run's round deadline (its ``store.timeout_s``) for stall notices."""
        self.stall_s = view.record.policy.round_timeout_s
        if self.page is not None and not self.page.serving:
            try:
                self.page.history.seed(view.store, view.replicas)
            except Exception as exc:  # noqa: BLE001 - the chart then starts at this watch's first poll
                say(f"warning: the status page's chart starts now: the run's loss history could not be read ({exc})")
            self.page.start()
            say(f"status page: {self.page.url} (JSON: {self.page.url}status.json)")

    def update(self, report: Any, *, verdict: str | None = None, exit_code: int | None = None) -> None:
        from diloco.launcher import notify as notifications

        data, now = report_json(report), time.time()
        if self.page is not None:
            self.page.update(data, now)
        if self.notifier is not None:
            current = notifications.observe(self.snapshot, data, now)
            rules = notifications.Rules(cost_usd=self.cost_usd, stall_s=self.stall_s)
            self.notifier.send(notifications.events(self.snapshot, current, rules, verdict=verdict,
                                                    exit_code=exit_code))
            self.snapshot = current

    def finish(self, report: Any, code: int) -> None:
        """The command's last report: the "run ended" notice with its verdict, then the final page served for
        ``--serve-linger`` seconds (Ctrl-C ends that sooner, with the run's exit code all the same)."""
        if not self.active:
            return
        self.update(report, verdict=verdict_of(report, code), exit_code=code)
        if self.page is None:
            return
        try:
            if self.linger_s > 0:
                say(f"the run has ended; serving its final page at {self.page.url} for {self.linger_s:g}s "
                    f"(Ctrl-C ends it)")
                time.sleep(self.linger_s)
        except KeyboardInterrupt:
            pass
        finally:
            self.page.close()

    def close(self) -> None:
        if self.page is not None:
            self.page.close()


def verdict_of(report: Any, code: int) -> str:
    """The run's outcome in the words of its exit code, for the "run ended" notice."""
    words = {exit_codes.OK: "every replica succeeded and the final weights agree",
             exit_codes.FAILED: "failed", exit_codes.CANCELLED: "cancelled", exit_codes.TIMEOUT: "timed out",
             exit_codes.LEFT_BEHIND: f"succeeded without replica(s) {', '.join(map(str, report.left_behind))}"}
    detail = words.get(code, report.state.value)
    if code == exit_codes.FAILED:
        failed = [f"replica {r.rank}" + (f" ({r.reason})" if r.reason else "") for r in report.failed]
        if failed:
            detail += ": " + ", ".join(failed)
        elif report.weights_identical is False:
            detail += ": the replicas' final weights disagree"
        elif report.state.value == "succeeded":
            detail += ": the final weights could not be checked"
    return f"{report.state.value} (exit {code}), {detail}"


def wait_and_summarize(view: Any, *, fmt: OutputFormat, fail_fast: bool, max_restarts: int,
                       cancel_on_interrupt: bool = False, observers: Observers | None = None) -> NoReturn:
    """Wait on the run with live progress, relaunching failed replicas (up to ``max_restarts`` each), then print
    the summary and exit with ``launch``'s code: 0 only when every replica succeeded and the final weights agree.
    ``observers`` (``--serve``, ``--notify``) see every poll and the final report.

    Ctrl-C stops waiting (``launch --cancel-on-interrupt`` cancels instead) and exits 130.
    """
    if observers is not None:
        observers.start(view)
    try:
        report, timed_out = wait(view, timeout_s=None, fail_fast=fail_fast, collect=True, max_restarts=max_restarts,
                                 observers=observers)
    except KeyboardInterrupt:
        if observers is not None:
            observers.close()
        interrupted(view, cancel_on_interrupt)
    summarize(view, report, timed_out, fmt=fmt, observers=observers)


def summarize_ended(view: Any, *, fmt: OutputFormat, observers: Observers | None = None) -> NoReturn:
    """The summary of a run that has ended, as ``launch`` printed it, and its exit code; nothing is waited on,
    relaunched or stopped (the weights of a succeeded run are checked, as ``launch`` did)."""
    try:  # no timeout: an ended run is read, never waited on
        report = view.collect(None, fail_fast=False, max_restarts=0)
    except KeyboardInterrupt:
        interrupted(view, False)
    if observers is not None:
        observers.start(view)
    summarize(view, report, False, fmt=fmt, observers=observers)


def summarize(view: Any, report: Any, timed_out: bool, *, fmt: OutputFormat,
              observers: Observers | None = None) -> NoReturn:
    """Print a waited-on run's summary, why replicas failed, what to do next, and exit with launch's code (after
    the observers' last look: the "run ended" notice and the final page)."""
    run_id = view.record.run_id
    print_run(report, fmt)
    explain_failures(report)
    if report.state.value == "succeeded" and report.weights_identical:
        say(f"write the model with: diloco collect {run_id}")
    elif report.state.value == "succeeded" and report.weights_identical is None:
        say(f"the final weights could not be checked: {report.weights_detail}")
    elif report.weights_identical is False:
        say(f"the replicas' final weights disagree: {report.weights_detail}")
    code = outcome_code(report, timed_out)
    if observers is not None:
        observers.finish(report, code)
    raise typer.Exit(code)


def watch(
    run: Annotated[str | None, typer.Argument(help="Run id, a unique part of one (e.g. its 8-character suffix), or "
                                                   "'latest' (default).", metavar="RUN", show_default=False)] = None,
    max_restarts: Annotated[int | None, typer.Option(
        "--max-restarts", min=0, show_default=False, metavar="N",
        help="Relaunch a failed replica up to N times in all (it rejoins at its peers' round); 0 never. Default: "
             "the run's own launch --max-restarts. Given, it becomes the run's setting.")] = None,
    fail_fast: Annotated[bool, typer.Option(help="Stop the other replicas as soon as one fails for good.")] = True,
    fmt: FormatOpt = OutputFormat.table,
    serve: ServeOpt = None,
    serve_host: ServeHostOpt = "127.0.0.1",
    serve_linger: ServeLingerOpt = 0.0,
    notify: NotifyOpt = None,
    notify_cost: NotifyCostOpt = None,
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
      diloco watch --serve 8080 --notify https://hooks.slack.com/services/... --notify-cost 50
    """
    observers = Observers(serve=serve, serve_host=serve_host, linger_s=serve_linger, notify=notify,
                          notify_cost=notify_cost)  # a flag's mistake is said before the run is looked up
    view = view_of(run)
    run_id = view.record.run_id
    try:  # from here on, Ctrl-C at any moment only stops watching
        ended = view.final_state
        if ended is None:
            status = view.replica_status()
            judged = view.judge(status)
            ended = judged if judged.is_terminal and status.terminal else None
        if ended is not None:
            say(f"run {run_id} has already ended ({ended.value}); its summary:")
            summarize_ended(view, fmt=fmt, observers=observers)
        if max_restarts is not None and max_restarts != view.max_restarts:
            view.set_max_restarts(max_restarts)
            say(f"run {run_id}: a replica is now relaunched up to {max_restarts} time(s) (--max-restarts)")
        say(f"watching {run_id} (Ctrl-C stops watching, the run keeps going); logs: diloco logs {run_id} -f")
        wait_and_summarize(view, fmt=fmt, fail_fast=fail_fast, max_restarts=view.max_restarts,
                           observers=observers)
    except KeyboardInterrupt:
        observers.close()
        interrupted(view, False)


def register(app: typer.Typer, epilog: str) -> None:
    """Add ``watch`` to the CLI (its waiting helpers above are ``launch``'s own)."""
    app.command(epilog=epilog)(command(watch))
