"""The ``diloco`` command line: parse, load config, one call into ``diloco.orchestrate``, render.

Data goes to stdout (a table, or JSON with ``-o json``), narration and progress to stderr. Exit codes (also in
``diloco --help``): 0 all replicas succeeded, 1 a replica failed, 2 usage or config error (nothing launched),
4 cancelled, 124 timeout, 130 interrupted. Heavy modules (torch, boto3, kubernetes) are imported only inside
the commands that need them, so ``diloco --help`` starts fast.
"""

import os
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from diloco.cli import exit_codes
from diloco.cli.errors import command
from diloco.cli.render import FormatOpt, OutputFormat, emit, say
from diloco.errors import ConfigError, error_line

EPILOG = ("Exit codes: 0 all replicas succeeded, 1 a replica failed, 2 usage or config error (nothing launched), "
          "4 cancelled, 124 timeout, 130 interrupted. Set DILOCO_DEBUG=1 for tracebacks, DILOCO_HOME for where "
          "runs are recorded (default ~/.diloco).")

app = typer.Typer(
    name="diloco",
    help="Train one model with DiLoCo across N independent replica jobs that meet only through an object store."
         "\n\n\b\nExamples:\n"
         "  diloco launch --config configs/local.yaml    # the 4-replica demo, live table until it ends\n"
         "  diloco launch -n 2 --steps 400 --sync-every 50 --detach\n"
         "  diloco status --watch                        # RUN defaults to the latest run\n"
         "  diloco logs -f                               # Ctrl-C stops following, never the run\n"
         "  diloco collect -o json                       # check the weights agree, write the model",
    epilog=EPILOG,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text is literal: "[r0]" stays "[r0]"
    context_settings={"help_option_names": ["-h", "--help"]},
)

RunArg = Annotated[str | None, typer.Argument(help="Run id, a unique part of one (e.g. its 4-hex suffix), or "
                                                       "'latest' (default).", metavar="RUN", show_default=False)]


# ------------------------------------------------------------------------------------------------ helpers
def _registry() -> Any:
    from diloco.runs import RunRegistry

    return RunRegistry()


def _view(run: str | None) -> Any:
    from diloco.orchestrate import RunView

    registry = _registry()
    return RunView(registry.resolve(run), registry=registry)


def _outcome_code(report: Any, timed_out: bool) -> int:
    from diloco.executors.base import RunState

    if timed_out:
        return exit_codes.TIMEOUT
    if report.state == RunState.SUCCEEDED:
        return exit_codes.FAILED if report.weights_identical is False else exit_codes.OK
    if report.state == RunState.CANCELLED:
        return exit_codes.CANCELLED
    return exit_codes.FAILED


def _print_run(report: Any, fmt: OutputFormat) -> None:
    from diloco.cli.views import render_run

    emit(report, fmt, lambda console: render_run(console, report))


def _explain_failures(report: Any) -> None:
    from diloco.cli.views import failure_lines

    for line in failure_lines(report, report.run_id):
        say(line)


def _wait(view: Any, *, timeout_s: float | None, fail_fast: bool) -> Any:
    """Wait on the run with progress on stderr; returns ``(report, timed_out)``."""
    from diloco.cli.progress import RunProgress

    interval = float(view.record.config.get("store", {}).get("poll_interval_s", 1.0))
    with RunProgress(view.record.run_id) as progress:
        def stopping(failed: Any, survivors: list[int]) -> None:
            if survivors:
                progress.note(f"replica {failed.rank} failed; stopping replica(s) "
                              f"{', '.join(map(str, survivors))}: they cannot finish without it")

        return view.wait(timeout_s=timeout_s, poll_interval_s=min(max(interval, 0.2), 2.0),
                         on_update=progress.update, on_fail_fast=stopping, fail_fast=fail_fast)


def _interrupted(view: Any, cancel: bool) -> NoReturn:
    run_id = view.record.run_id
    if cancel:
        say(f"interrupted: cancelling run {run_id} (--cancel-on-interrupt)")
        view.cancel()
        say(f"run {run_id} cancelled")
    else:
        say(f"stopped waiting; run {run_id} keeps running.\n  watch it: diloco status {run_id} --watch\n"
            f"  stop it:  diloco cancel {run_id}")
    raise typer.Exit(exit_codes.INTERRUPTED)


def _parse_ranks(text: str | None, world_size: int) -> list[int] | None:
    if text is None:
        return None
    ranks = []
    for part in text.split(","):
        part = part.strip().lstrip("r")
        if not part.isdigit():
            raise ConfigError(f"--replica: expected replica numbers like 0,2 (got {text!r})")
        if int(part) >= world_size:
            raise ConfigError(f"--replica: replica {part} does not exist (the run has replicas 0-{world_size - 1})")
        ranks.append(int(part))
    return sorted(set(ranks))


# ------------------------------------------------------------------------------------------------ commands
@app.command(epilog=EPILOG)
@command
def launch(
    replicas: Annotated[int | None, typer.Option("--replicas", "-n", help="Number of replicas.",
                                                    metavar="N", show_default=False)] = None,
    backend: Annotated[str | None, typer.Option("--backend", "-b", help="local, sagemaker or eks.",
                                                   metavar="NAME", show_default=False)] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML run config (see configs/).",
                                                   metavar="FILE", show_default=False)] = None,
    steps: Annotated[int | None, typer.Option(help="Inner steps per replica (train.steps).",
                                                 metavar="N", show_default=False)] = None,
    sync_every: Annotated[int | None, typer.Option(help="Inner steps per outer round (train.sync_every).",
                                                      metavar="H", show_default=False)] = None,
    trainer: Annotated[str | None, typer.Option(help="Trainer function, module:fn (train.trainer).",
                                                   metavar="MODULE:FN", show_default=False)] = None,
    trainer_kwargs: Annotated[list[str] | None, typer.Option(
        "--trainer-kwargs", "-k", help="key=value for the trainer (repeatable; values parsed as YAML).",
        metavar="KEY=VALUE", show_default=False)] = None,
    rendezvous: Annotated[str | None, typer.Option(help="Store URI the replicas meet in; {run_id} expands.",
                                                      metavar="URI", show_default=False)] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="dotted.key=value config override "
                                                      "(repeatable; applied last).", metavar="KEY=VALUE",
                                                      show_default=False)] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return after submitting; print the run id.")
                      ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be launched; launch nothing.")
                       ] = False,
    cancel_on_interrupt: Annotated[bool, typer.Option(help="Ctrl-C cancels the run instead of only detaching.")
                                   ] = False,
    fail_fast: Annotated[bool, typer.Option(help="Stop the other replicas as soon as one fails.")] = True,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Launch a DiLoCo run and (unless --detach) wait for it with live progress, then print the summary.

    Precedence: defaults < --config YAML < flags < --trainer-kwargs < --set. Invalid settings fail before
    anything starts (exit 2). Ctrl-C stops waiting; the run keeps going unless --cancel-on-interrupt.

    \b
    Examples:
      diloco launch --config configs/local.yaml --steps 200 --sync-every 50
      diloco launch -n 4 --trainer mypkg.train:train -k lr=3e-4 --steps 1000 --sync-every 100
      diloco launch -c configs/local.yaml --set train.trainer_kwargs.n_embd=32 --detach
      diloco launch -c configs/local.yaml --dry-run -o json   # the exact per-replica requests
    """
    from diloco.config import backend_kind, merge_sources, validate
    from diloco.executors import require_available
    from diloco.orchestrate import RunView, add_weights_verdict, check_trainer_importable, plan_run
    from diloco.orchestrate import launch as launch_run

    flags = {"replicas": replicas, "backend": backend, "train.steps": steps, "train.sync_every": sync_every,
             "train.trainer": trainer, "store.rendezvous": rendezvous}
    data = merge_sources(config, flags, set_, trainer_kwargs)
    require_available(backend_kind(data))  # a backend not shipped yet fails before anything else
    cfg = validate(data)
    check_trainer_importable(cfg)

    if dry_run:
        from diloco.cli.views import render_plan

        _, plan = plan_run(cfg)
        emit(plan, fmt, lambda console: render_plan(console, plan))
        return

    registry = _registry()
    record, executor = launch_run(cfg, registry)
    run_id = record.run_id
    say(f"launched {run_id}: {record.world_size} replica(s) on {record.backend}, meeting at "
        f"{record.rendezvous_uri}")
    if detach:
        say(f"  status:  diloco status {run_id} --watch\n  logs:    diloco logs {run_id} -f\n"
            f"  collect: diloco collect {run_id}\n  cancel:  diloco cancel {run_id}")
        emit({"run_id": run_id, "backend": record.backend, "rendezvous_uri": record.rendezvous_uri,
              "replicas": record.handles}, fmt, lambda console: console.print(run_id))
        return

    on_ctrl_c = "cancels the run" if cancel_on_interrupt else "stops waiting, the run keeps going"
    say(f"waiting (Ctrl-C {on_ctrl_c}); logs: diloco logs {run_id} -f")
    view = RunView(record, executor, registry=registry)
    try:
        report, timed_out = _wait(view, timeout_s=None, fail_fast=fail_fast)
    except KeyboardInterrupt:
        _interrupted(view, cancel_on_interrupt)
    add_weights_verdict(view, report)
    _print_run(report, fmt)
    _explain_failures(report)
    if report.state.value == "succeeded":
        say(f"write the model with: diloco collect {run_id}")
    raise typer.Exit(_outcome_code(report, timed_out))


@app.command(epilog=EPILOG)
@command
def status(
    run: RunArg = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Follow until the run ends.")] = False,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Show a run's replicas: state, step, round, losses, throughput, and why a replica failed.

    Exits 0 once it has shown the run; with --watch it follows the run to its end and exits with the run's
    outcome (0 succeeded, 1 failed, 4 cancelled; Ctrl-C: 130, the run is unaffected).

    \b
    Examples:
      diloco status                  # the latest run
      diloco status 7c98 --watch     # a run by any unique part of its id
      diloco status -o json | jq -r '.replicas[] | "\\(.rank) \\(.state) \\(.step)"'
    """
    view = _view(run)
    if not watch:
        _print_run(view.report(), fmt)
        return
    try:
        report, _ = _wait(view, timeout_s=None, fail_fast=False)
    except KeyboardInterrupt:
        say("stopped watching; the run is unaffected")
        raise typer.Exit(exit_codes.INTERRUPTED) from None
    _print_run(report, fmt)
    _explain_failures(report)
    raise typer.Exit(_outcome_code(report, False))


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
) -> None:
    """Print the replicas' output merged in time order, each line prefixed [r<replica>]. Ctrl-C never cancels.

    \b
    Examples:
      diloco logs                    # everything so far, latest run
      diloco logs -f                 # then follow until the run ends (Ctrl-C stops following only)
      diloco logs 7c98 -r 1 --tail 50
      diloco logs | grep -i error
    """
    from diloco.logstream import format_record

    if tail_n is not None and tail_n < 0:
        raise ConfigError(f"--tail: must be >= 0 (got {tail_n})")
    view = _view(run)
    ranks = _parse_ranks(replica, view.record.world_size)
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    palette = ["36", "33", "35", "32", "34", "31"]

    def prefix(rank: int) -> str:
        tag = f"[r{rank}]"
        return f"\x1b[{palette[rank % len(palette)]}m{tag}\x1b[0m" if color else tag

    out = sys.stdout
    try:
        for record in view.log_lines(ranks=ranks, follow=follow, tail_n=tail_n):
            out.write(format_record(record, prefix) + "\n")
            if follow:
                out.flush()
        out.flush()
    except KeyboardInterrupt:
        say(f"stopped following; run {view.record.run_id} is unaffected")
        raise typer.Exit(exit_codes.INTERRUPTED) from None


@app.command(epilog=EPILOG)
@command
def collect(
    run: RunArg = None,
    timeout: Annotated[float | None, typer.Option(help="Give up waiting after this many seconds (exit 124; "
                                                     "the run continues).", metavar="SECONDS",
                                                     show_default=False)] = None,
    output: Annotated[Path | None, typer.Option("--output", help="Where to write the model "
                                                   "(default ./<run_id>.safetensors).", metavar="PATH",
                                                   show_default=False)] = None,
    fail_fast: Annotated[bool, typer.Option(help="Stop the other replicas as soon as one fails.")] = True,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Wait for the run, check every replica's final weights are identical, print the final metrics and write
    the agreed model.

    \b
    Examples:
      diloco collect                                  # latest run, writes ./<run_id>.safetensors
      diloco collect 7c98 --output model.safetensors
      diloco collect --timeout 3600 -o json           # exit 124 if it has not ended within an hour
    """
    from diloco.orchestrate import add_weights_verdict, write_model

    if timeout is not None and timeout <= 0:
        raise ConfigError(f"--timeout: must be > 0 seconds (got {timeout:g})")
    view = _view(run)
    run_id = view.record.run_id
    try:
        report, timed_out = _wait(view, timeout_s=timeout, fail_fast=fail_fast)
    except KeyboardInterrupt:
        say(f"stopped waiting; run {run_id} keeps running")
        raise typer.Exit(exit_codes.INTERRUPTED) from None
    if timed_out:
        _print_run(report, fmt)
        running = [r.rank for r in report.replicas if not r.state.is_terminal]
        say(f"timed out after {timeout:g}s waiting for replica(s) {', '.join(map(str, running))}; "
            f"the run continues (diloco cancel {run_id} stops it)")
        raise typer.Exit(exit_codes.TIMEOUT)
    tensors, meta = add_weights_verdict(view, report)
    if tensors is not None and report.weights_identical:
        report.model_path = write_model(str(output or Path.cwd() / f"{run_id}.safetensors"), tensors, meta, run_id)
    elif report.state.value == "succeeded" and report.weights_identical is None:
        say(f"no model written: {report.weights_detail}")
    _print_run(report, fmt)
    _explain_failures(report)
    if report.weights_identical is False:
        say(f"the replicas' final weights disagree: {report.weights_detail}")
    raise typer.Exit(_outcome_code(report, False))


@app.command(epilog=EPILOG)
@command
def cancel(run: RunArg = None, fmt: FormatOpt = OutputFormat.table) -> None:
    """Stop every replica of a run (SIGTERM, then SIGKILL after the grace period on the local backend).

    Idempotent: cancelling a finished run does nothing. Commands waiting on the run then exit 4.

    \b
    Examples:
      diloco cancel          # the latest run
      diloco cancel 7c98
    """
    from diloco.cli.views import render_cancel

    view = _view(run)
    run_id = view.record.run_id
    before = view.statuses()
    if all(s.state.is_terminal for s in before):
        say(f"run {run_id} already finished; nothing to cancel")
        statuses = before
    else:
        say(f"cancelling run {run_id} ...")
        statuses = view.cancel()
        view.report(statuses, with_stderr=False)  # caches the final state in the registry
    emit({"run_id": run_id, "replicas": statuses}, fmt, lambda console: render_cancel(console, run_id, statuses))


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
    from diloco.orchestrate import summarize_runs

    summaries = summarize_runs(_registry())
    emit({"runs": summaries}, fmt, lambda console: render_runs(console, summaries))


from diloco.cli import s3_commands  # noqa: E402 - registers `smoke` and `doctor` on the app

s3_commands.register(app, EPILOG)


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
        sys.exit(exit_codes.INTERRUPTED)
    except errors.ClickException as exc:
        error_line(exc.format_message())
        sys.exit(exc.exit_code)
    sys.exit(rv if isinstance(rv, int) else exit_codes.OK)


if __name__ == "__main__":
    main()
