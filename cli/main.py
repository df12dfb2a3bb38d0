"""The ``diloco`` command line: parse, load config, one call into ``diloco.launcher.api``, render.

Data goes to stdout (a table, or JSON with ``-o json``), narration and progress to stderr. Exit codes of the
commands that wait on a run (each command's ``--help`` lists its own, from ``help_texts``): 0 all replicas
succeeded, 1 a replica failed, 2 usage or config error (nothing launched), 3 launch refused by the service,
cluster or store (nothing launched or left), 4 cancelled, 5 succeeded with
replicas left behind (--min-replicas), 124 timeout, 130 interrupted. Heavy modules (torch,
boto3, kubernetes) are imported only inside the commands that need them, so ``diloco --help`` starts fast.
"""

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from diloco.cli import exit_codes
from diloco.cli.errors import command, forget_interrupt_in_exec
from diloco.cli.evaluation import HfOpt
from diloco.cli.evaluation import hf_target as _hf_target
from diloco.cli.evaluation import write_hf as _write_hf
from diloco.cli.help_texts import ENVIRONMENT, TOP_EPILOG
from diloco.cli.model_flags import LaunchCommand, given_backend_flags, given_run_flags
from diloco.cli.render import FormatOpt, OutputFormat, emit, say, to_jsonable
from diloco.cli.watch import NotifyCostOpt, NotifyOpt, ServeHostOpt, ServeLingerOpt, ServeOpt
from diloco.cli.watch import explain_failures as _explain_failures
from diloco.cli.watch import interrupted as _interrupted
from diloco.cli.watch import outcome_code as _outcome_code
from diloco.cli.watch import print_run as _print_run
from diloco.cli.watch import run_of as _run
from diloco.cli.watch import run_registry as _registry
from diloco.cli.watch import view_of as _view
from diloco.cli.watch import wait as _wait
from diloco.errors import ConfigError, error_line

#: Every command's help ends with its own exit codes (``help_texts.apply``, after the commands are registered).
EPILOG = ENVIRONMENT

app = typer.Typer(
    name="diloco",
    help="Train one model with DiLoCo across N independent replica jobs that meet only through an object store."
         "\n\n\b\nExamples:\n"
         "  diloco launch --config configs/local.yaml    # the 4-replica demo, live table until it ends\n"
         "  diloco launch -n 2 --steps 400 --sync-every 50 --detach\n"
         "  diloco status --watch                        # RUN defaults to the latest run\n"
         "  diloco logs -f                               # Ctrl-C stops following, never the run\n"
         "  diloco collect -o json                       # check the weights agree, write the model",
    epilog=TOP_EPILOG,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text is literal: "[r0]" stays "[r0]"
    context_settings={"help_option_names": ["-h", "--help"]},
)

def _complete_run_ids(incomplete: str) -> list[str]:
    """Shell completion of run ids (``diloco status <TAB>``): the recorded runs, newest first."""
    try:
        ids = _registry().ids()
    except Exception:  # noqa: BLE001 - completion must never print a traceback into the shell
        return []
    return [i for i in reversed(ids) if incomplete in i] + (["latest"] if "latest".startswith(incomplete) else [])


RunArg = Annotated[str | None, typer.Argument(help="Run id, a unique part of one (e.g. its 8-character suffix), or "
                                                       "'latest' (default).", metavar="RUN", show_default=False,
                                              autocompletion=_complete_run_ids)]


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            sys.stdout.write(f"diloco {version('diloco')}\n")
        except PackageNotFoundError:
            sys.stdout.write("diloco (not installed as a package)\n")
        raise typer.Exit(exit_codes.OK)


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", "-V", help="Print the version and exit.", is_eager=True,
                                          callback=_version)] = False,
) -> None:
    """Train one model with DiLoCo across N independent replica jobs that meet only through an object store."""


# ------------------------------------------------------------------------------------------------ helpers
def _announce_plan(plan: Any) -> None:
    """What a launch should know before anything is created: the backend's warnings and the estimated cost."""
    for warning in plan.warnings:
        say(f"warning: {warning}")
    if plan.cost is not None:
        say(f"estimated cost: {plan.cost.detail}")


def _parse_ranks(text: str | None, replicas: int) -> list[int] | None:
    if text is None:
        return None
    ranks = []
    for part in text.split(","):
        part = part.strip().lstrip("r")
        if not part.isdigit():
            raise ConfigError(f"--replica: expected replica numbers like 0,2 (got {text!r})")
        if int(part) >= replicas:
            raise ConfigError(f"--replica: replica {part} does not exist (the run has replicas 0-{replicas - 1})")
        ranks.append(int(part))
    return sorted(set(ranks))


# ------------------------------------------------------------------------------------------------ commands
@app.command(epilog=EPILOG, cls=LaunchCommand)
@command
def launch(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML run config (see configs/).",
                                                   metavar="FILE", show_default=False)] = None,
    trainer_kwargs: Annotated[list[str] | None, typer.Option(
        "--trainer-kwargs", "-k", help="key=value for the trainer (repeatable; values parsed as YAML).",
        metavar="KEY=VALUE", show_default=False)] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="dotted.key=value config override "
                                                      "(repeatable; applied last).", metavar="KEY=VALUE",
                                                      show_default=False)] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return after submitting; print the run id.")
                      ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be launched; launch nothing.")
                       ] = False,
    force: Annotated[bool, typer.Option("--force", help="Launch even if the backend says it cannot hold the run "
                                                        "(local: more replicas than this machine's cores or memory "
                                                        "allow).")] = False,
    cancel_on_interrupt: Annotated[bool, typer.Option(help="Ctrl-C cancels the run instead of only detaching.")
                                   ] = False,
    fail_fast: Annotated[bool, typer.Option(help="Stop the other replicas as soon as one fails.")] = True,
    fmt: FormatOpt = OutputFormat.table,
    serve: ServeOpt = None,
    serve_host: ServeHostOpt = "127.0.0.1",
    serve_linger: ServeLingerOpt = 0.0,
    notify: NotifyOpt = None,
    notify_cost: NotifyCostOpt = None,
) -> None:
    """Launch a DiLoCo run and (unless --detach) wait for it with live progress, then print the summary.

    Precedence: defaults < --config YAML < flags < --trainer-kwargs < --set. The run flags and each backend's
    options come from the config models (a backend installed as a package brings its own). Invalid settings fail before
    anything starts (exit 2); a launch the service, cluster or store refuses (a quota, a missing bucket or
    namespace) exits 3, and like Ctrl-C during the submission it leaves nothing: what it started is stopped,
    what it wrote is removed. Ctrl-C after that stops waiting; the run keeps going unless --cancel-on-interrupt.

    \b
    Examples:
      diloco launch --config configs/local.yaml --steps 200 --sync-every 50
      diloco launch -n 4 --trainer mypkg.train:train -k lr=3e-4 --steps 1000 --sync-every 100
      diloco launch -c configs/local.yaml --set train.trainer_kwargs.n_embd=32 --detach
      diloco launch -c configs/local.yaml --dry-run -o json   # the exact per-replica requests
      diloco launch -c configs/eks.yaml --dry-run -o yaml     # the backend's requests as YAML documents
    """
    from diloco.launcher import api
    from diloco.launcher.config import merge_sources

    flags, backend_flags = given_run_flags(ctx), given_backend_flags(ctx)
    registry = _registry()  # a DILOCO_HOME that is a file fails here, even for --dry-run
    data = merge_sources(config, flags, set_, trainer_kwargs, backend_flags)
    cfg = api.resolve(data)  # a backend not shipped yet fails before anything else

    observers = _observers(detach or dry_run, serve=serve, serve_host=serve_host, linger_s=serve_linger,
                           notify=notify, notify_cost=notify_cost)
    if dry_run:
        from diloco.cli.views import render_plan

        plan = api.plan(cfg)
        _announce_plan(plan)
        for note in plan.notes:
            say(f"note: {note}")
        if fmt == OutputFormat.yaml:  # the backend's own requests, e.g. a Job manifest for `kubectl apply -f -`
            import yaml

            sys.stdout.write(yaml.safe_dump_all(to_jsonable(plan.requests), sort_keys=False))
            return
        emit(plan, fmt, lambda console: render_plan(console, plan))
        return

    run = api.launch(cfg, registry=registry, force=force, on_plan=_announce_plan)
    record, view = run.record, run
    run_id = record.run_id
    say(f"launched {run_id}: {record.replicas} replica(s) on {record.backend}, meeting at "
        f"{record.rendezvous_uri}")
    if detach:
        say(f"  watch:   diloco watch {run_id}   (waits, relaunching failed replicas)\n"
            f"  status:  diloco status {run_id}\n  logs:    diloco logs {run_id} -f\n"
            f"  collect: diloco collect {run_id}\n  cancel:  diloco cancel {run_id}")
        emit(run.status(with_stderr=False), fmt, lambda console: console.print(run_id))
        return

    on_ctrl_c = "cancels the run" if cancel_on_interrupt else "stops waiting, the run keeps going"
    say(f"waiting (Ctrl-C {on_ctrl_c}); logs: diloco logs {run_id} -f")
    from diloco.cli.watch import wait_and_summarize

    wait_and_summarize(view, fmt=fmt, fail_fast=fail_fast, max_restarts=cfg.max_restarts,
                       cancel_on_interrupt=cancel_on_interrupt, observers=observers)


def _observers(returns_at_once: bool, **options: Any) -> Any:
    """``launch``'s status page and notifier (``diloco.cli.watch.Observers``), checked and bound before anything
    is launched; they need a launch that waits."""
    from diloco.cli.watch import Observers

    if returns_at_once and (options["serve"] is not None or options["notify"] is not None):
        raise ConfigError("--serve/--notify: need a launch that waits (not --detach or --dry-run)",
                          hint="launch with --detach, then: diloco watch RUN --serve PORT --notify URL")
    return None if returns_at_once else Observers(**options)


@app.command(epilog=EPILOG)
@command
def status(
    run: RunArg = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Follow until the run ends.")] = False,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Show a run's replicas: state, step, round, losses, throughput, and why a replica failed.

    With --watch it follows the run to its end and exits with the run's outcome.

    \b
    Examples:
      diloco status                  # the latest run
      diloco status 7c98 --watch     # a run by any unique part of its id
      diloco status -o json | jq -r '.ranks[] | "\\(.rank) \\(.state) \\(.step)"'
    """
    found = _run(run)
    if not watch:
        _print_run(found.status(trends=True), fmt)
        return
    try:
        report, _ = _wait(found, timeout_s=None, fail_fast=False)
    except KeyboardInterrupt:
        say("stopped watching; the run is unaffected")
        raise typer.Exit(exit_codes.INTERRUPTED) from None
    _print_run(report, fmt)
    _explain_failures(report)
    raise typer.Exit(_outcome_code(report, False, weights_checked=False))


@app.command(epilog=EPILOG)
@command
def logs(
    run: RunArg = None,
    replica: Annotated[str | None, typer.Option("--replica", "-r", help="Only these replicas, e.g. 0,2.",
                                                   metavar="RANKS", show_default=False)] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the run ends.")
                      ] = False,
    tail_n: Annotated[int | None, typer.Option("--tail", help="Only the last N lines of each replica.",
                                                  metavar="N", show_default=False)] = None,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Print the replicas' output merged in time order, each line prefixed [r<replica>]. Ctrl-C never cancels.

    With -o json: one JSON object per line, {"rank", "time", "stream", "text"} (time in unix seconds; stream
    "out" or "err"), so it can be streamed into jq.

    \b
    Examples:
      diloco logs                    # everything so far, latest run
      diloco logs -f                 # then follow until the run ends (Ctrl-C stops following only)
      diloco logs 7c98 -r 1 --tail 50
      diloco logs | grep -i error
      diloco logs -o json | jq -r 'select(.stream == "err") | .text'
    """
    from diloco.executors.logstream import format_record

    if tail_n is not None and tail_n < 0:
        raise ConfigError(f"--tail: must be >= 0 (got {tail_n})")
    found = _run(run)
    ranks = _parse_ranks(replica, found.replicas)
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    palette = ["36", "33", "35", "32", "34", "31"]

    def prefix(rank: int) -> str:
        tag = f"[r{rank}]"
        return f"\x1b[{palette[rank % len(palette)]}m{tag}\x1b[0m" if color else tag

    def line(record: Any) -> str:
        if fmt == OutputFormat.json:
            return json.dumps({"rank": record.rank, "time": record.ts, "stream": record.stream, "text": record.text})
        return format_record(record, prefix)

    out = sys.stdout
    printed = 0
    try:
        for record in found.logs(ranks=ranks, follow=follow, tail=tail_n):
            out.write(line(record) + "\n")
            printed += 1
            if follow:
                out.flush()
        out.flush()
        if not printed:  # say why nothing came, on stderr, so a pipe still gets only log lines
            why = "it has not been submitted" if not found.submitted else \
                "its replicas have written nothing yet, or the backend no longer has their logs"
            say(f"no log lines for run {found.run_id}: {why}")
    except KeyboardInterrupt:
        say(f"stopped following; run {found.run_id} is unaffected")
        raise typer.Exit(exit_codes.INTERRUPTED) from None


@app.command(epilog=EPILOG)
@command
def collect(
    run: RunArg = None,
    timeout: Annotated[float | None, typer.Option(help="Give up waiting after this many seconds (exit 124; "
                                                     "the run continues).", metavar="SECONDS",
                                                     show_default=False)] = None,
    output: Annotated[str | None, typer.Option("--output", help="Where to write the model: a file, or a "
                                                  "directory (an existing one, or any path ending in /) to "
                                                  "write <run_id>.safetensors in; missing directories are "
                                                  "created (default: the current directory).", metavar="PATH",
                                                  show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing model file.")] = False,
    fail_fast: Annotated[bool, typer.Option(help="Stop the other replicas as soon as one fails.")] = True,
    fmt: FormatOpt = OutputFormat.table,
    hf: HfOpt = None,
) -> None:
    """Wait for the run, check every replica's final weights are identical, print the final metrics and write
    the agreed model.

    \b
    Examples:
      diloco collect                                  # latest run, writes ./<run_id>.safetensors
      diloco collect 7c98 --output model.safetensors
      diloco collect --timeout 3600 -o json           # exit 124 if it has not ended within an hour
      diloco collect 7c98 --hf ./hf-model             # also a save_pretrained directory (HF trainer runs)
    """
    if timeout is not None and timeout <= 0:
        raise ConfigError(f"--timeout: must be > 0 seconds (got {timeout:g})")
    view = _view(run)
    run_id = view.record.run_id
    target = _model_target(output, run_id, force)
    hf_dir = _hf_target(view, hf, force)
    try:
        report, timed_out = _wait(view, timeout_s=timeout, fail_fast=fail_fast, output=target, collect=True)
    except KeyboardInterrupt:
        _interrupted(view, False)  # the run may have ended meanwhile: then it does not "keep running"
    if timed_out:
        _print_run(report, fmt)
        running = [r.rank for r in report.ranks if not r.state.is_terminal]
        say(f"timed out after {timeout:g}s waiting for replica(s) {', '.join(map(str, running))}; "
            f"the run continues (diloco cancel {run_id} stops it)")
        raise typer.Exit(exit_codes.TIMEOUT)
    if report.state.value == "succeeded" and report.weights_identical is None:
        say(f"no model written: the final weights could not be checked: {report.weights_detail}")
    _print_run(report, fmt)
    _explain_failures(report)
    if report.weights_identical is False:
        say(f"the replicas' final weights disagree: {report.weights_detail}")
    _write_hf(view, report, hf_dir, force)
    raise typer.Exit(_outcome_code(report, False))


def _model_target(output: str | None, run_id: str, force: bool) -> str:
    """Where collect writes the model, checked before waiting (``diloco.launcher.output_path``: a directory gets
    ``<run_id>.safetensors``, missing directories are created at the write); an existing file needs ``--force``."""
    from diloco.launcher import api

    return api.model_target(output, run_id, force=force)


@app.command(epilog=EPILOG)
@command
def cancel(
    run: RunArg = None,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Wait until every replica has stopped.")] = True,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Stop every replica of a run (SIGTERM, then SIGKILL after the grace period on the local backend).

    The stop request is handed to the backend at once (on the local backend each replica's supervisor escalates
    to SIGKILL by itself), so Ctrl-C while waiting never leaves a replica running. Idempotent: cancelling a
    finished run does nothing; cancelling again escalates at once. Commands waiting on the run then exit 4.

    \b
    Examples:
      diloco cancel              # the latest run; waits until its replicas have stopped
      diloco cancel 7c98 --no-wait
    """
    from diloco.cli.views import render_cancel

    found = _run(run)
    run_id = found.run_id
    if found.has_ended():
        say(f"run {run_id} already finished; nothing to cancel")
        report = found.status(with_stderr=False)
    else:
        say(f"cancelling run {run_id} ...")
        try:
            report = found.cancel(wait=wait)
        except KeyboardInterrupt:
            say(f"stopped waiting; the replicas of {run_id} are being stopped all the same "
                f"(`diloco cancel {run_id}` again stops them at once)")
            raise typer.Exit(exit_codes.INTERRUPTED) from None
    emit(report, fmt, lambda console: render_cancel(console, report))


@app.command("runs", epilog=EPILOG)
@command
def runs_(fmt: FormatOpt = OutputFormat.table) -> None:
    """List recorded runs (under $DILOCO_HOME, default ~/.diloco), oldest first.

    \b
    Examples:
      diloco runs
      diloco runs -o json | jq -r '.runs[] | select(.state == "running") | .run_id'
    """
    from diloco.cli.views import render_runs
    from diloco.launcher import api

    summaries = api.list_runs(registry=_registry())
    emit({"runs": summaries}, fmt, lambda console: render_runs(console, summaries))


from diloco.cli import s3_commands  # noqa: E402 - registers `smoke` and `doctor` on the app

s3_commands.register(app, EPILOG)

from diloco.cli import housekeeping as housekeeping_commands  # noqa: E402 - registers `rm` and `prune`

housekeeping_commands.register(app, EPILOG)

from diloco.cli import plot as plot_commands  # noqa: E402 - registers `plot`

plot_commands.register(app, EPILOG)

from diloco.cli import watch as watch_commands  # noqa: E402 - registers `watch` (launch's waiting, for a detached run)

watch_commands.register(app, EPILOG)

from diloco.cli import evaluation as evaluation_commands  # noqa: E402 - registers `eval`

evaluation_commands.register(app, EPILOG)

from diloco.cli import scale as scale_commands  # noqa: E402 - registers `scale` (grow or shrink an elastic run)

scale_commands.register(app, EPILOG)

from diloco.cli import help_texts  # noqa: E402 - once every command is registered

help_texts.apply(app)  # each command's one-line summary and its own exit codes


# ------------------------------------------------------------------------------------------------ entry
def _click_exceptions() -> Any:
    """The exception classes of the click Typer runs on (recent Typer versions vendor their own copy)."""
    try:
        from typer._click import exceptions
    except ImportError:  # older Typer: the click package
        from click import exceptions
    return exceptions


def main(argv: list[str] | None = None) -> NoReturn:
    """Console-script entry: usage errors become one line (exit 2) instead of click's usage box."""
    errors = _click_exceptions()
    cmd = typer.main.get_command(app)
    try:
        rv = cmd.main(args=argv, prog_name="diloco", standalone_mode=False)
    except errors.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `diloco`: the help was asked for, in effect
            sys.stdout.write(exc.ctx.get_help() + "\n" if exc.ctx else "")
            sys.exit(exit_codes.OK)
        where = exc.ctx.command_path if exc.ctx else "diloco"
        error_line(f"{exc.format_message()} (see `{where} --help`)")
        sys.exit(exit_codes.USAGE)
    except typer.Abort:  # typer's own class (not in its vendored click's exceptions), or click's on older Typer
        sys.stderr.write("\ninterrupted\n")
        rv = exit_codes.INTERRUPTED
    except errors.ClickException as exc:
        error_line(exc.format_message())
        sys.exit(exc.exit_code)
    if rv == exit_codes.INTERRUPTED:
        forget_interrupt_in_exec()
    sys.exit(rv if isinstance(rv, int) else exit_codes.OK)


if __name__ == "__main__":
    main()
