"""The ``diloco`` command line: parse, load config, one call into ``diloco.launcher.orchestrate``, render.

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
from diloco.cli.errors import command
from diloco.cli.help_texts import ENVIRONMENT, TOP_EPILOG
from diloco.cli.render import FormatOpt, OutputFormat, emit, say, to_jsonable
from diloco.cli.waiting import (
    explain_failures as _explain_failures,
)
from diloco.cli.waiting import (
    outcome_code as _outcome_code,
)
from diloco.cli.waiting import (
    print_run as _print_run,
)
from diloco.cli.waiting import (
    run_registry as _registry,
)
from diloco.cli.waiting import (
    view_of as _view,
)
from diloco.cli.waiting import (
    wait as _wait,
)
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


def _complete_backends(incomplete: str) -> list[str]:
    from diloco.executors import backend_names

    return [name for name in backend_names() if name.startswith(incomplete)]


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
@app.command(epilog=EPILOG)
@command
def launch(
    replicas: Annotated[int | None, typer.Option("--replicas", "-n", help="Number of replicas.",
                                                    metavar="N", show_default=False)] = None,
    backend: Annotated[str | None, typer.Option("--backend", "-b", help="Where replicas run (local, sagemaker, "
                                                   "eks, or an installed third-party backend).", metavar="NAME",
                                                   show_default=False, autocompletion=_complete_backends)] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML run config (see configs/).",
                                                   metavar="FILE", show_default=False)] = None,
    steps: Annotated[int | None, typer.Option(help="Inner steps per replica (train.steps).",
                                                 metavar="N", show_default=False)] = None,
    sync_every: Annotated[int | None, typer.Option(help="Inner steps per outer round (train.sync_every).",
                                                      metavar="H", show_default=False)] = None,
    mode: Annotated[str | None, typer.Option(help="sync (DiLoCo rounds) or async (rank 0 is a master applying "
                                                  "deltas as they arrive) (train.mode).", metavar="MODE",
                                             show_default=False)] = None,
    trainer: Annotated[str | None, typer.Option(help="Trainer function, module:fn (train.trainer).",
                                                   metavar="MODULE:FN", show_default=False)] = None,
    trainer_kwargs: Annotated[list[str] | None, typer.Option(
        "--trainer-kwargs", "-k", help="key=value for the trainer (repeatable; values parsed as YAML).",
        metavar="KEY=VALUE", show_default=False)] = None,
    rendezvous: Annotated[str | None, typer.Option(help="Store URI the replicas meet in; {run_id} expands.",
                                                      metavar="URI", show_default=False)] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Wall-clock limit per replica, seconds "
                                                   "(timeout_s; default 86400 = one day).", metavar="SECONDS",
                                                   show_default=False)] = None,
    allreduce: Annotated[str | None, typer.Option(help="How rounds are averaged: gather or sharded "
                                                       "(store.allreduce).", metavar="STRATEGY",
                                                  show_default=False)] = None,
    compression: Annotated[str | None, typer.Option(help="Pseudo-gradient wire format: none, bf16, int8 or int4 "
                                                         "(store.compression).", metavar="FORMAT",
                                                    show_default=False)] = None,
    min_replicas: Annotated[int | None, typer.Option("--min-replicas", help="Commit a round whose deadline passed "
                                                     "with at least K contributions (min_replicas; default: "
                                                     "every round needs every replica).", metavar="K",
                                                     show_default=False)] = None,
    procs_per_replica: Annotated[int | None, typer.Option("--procs-per-replica", help="Local processes per "
                                                          "replica, data-parallel over its devices "
                                                          "(train.procs_per_replica; default: every GPU, 1 on "
                                                          "CPU).", metavar="K", show_default=False)] = None,
    tensorboard: Annotated[str | None, typer.Option(help="Also write metrics as TensorBoard events to DIR "
                                                         "(metrics.tensorboard).", metavar="DIR",
                                                    show_default=False)] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="dotted.key=value config override "
                                                      "(repeatable; applied last).", metavar="KEY=VALUE",
                                                      show_default=False)] = None,
    gpu: Annotated[str | None, typer.Option(help="Accelerator per replica, e.g. A10G (backends that place "
                                                 "replicas).", metavar="TYPE", show_default=False,
                                            rich_help_panel="Backend")] = None,
    image: Annotated[str | None, typer.Option(help="Container image (container backends).", metavar="URI",
                                               show_default=False, rich_help_panel="Backend")] = None,
    role: Annotated[str | None, typer.Option(help="Execution role ARN (backends that assume one).", metavar="ARN",
                                              show_default=False, rich_help_panel="Backend")] = None,
    region: Annotated[str | None, typer.Option(help="Cloud region (default: AWS_REGION, AWS_DEFAULT_REGION, the profile's).", metavar="REGION",
                                                show_default=False, rich_help_panel="Backend")] = None,
    instance_type: Annotated[str | None, typer.Option(help="Instance type per replica.", metavar="TYPE",
                                                       show_default=False, rich_help_panel="Backend")] = None,
    namespace: Annotated[str | None, typer.Option(help="Kubernetes namespace.", metavar="NS", show_default=False,
                                                   rich_help_panel="Backend")] = None,
    context: Annotated[str | None, typer.Option(help="kubeconfig context.", metavar="NAME", show_default=False,
                                                 rich_help_panel="Backend")] = None,
    spot: Annotated[bool | None, typer.Option("--spot/--no-spot", help="Preemptible (spot) capacity.",
                                               show_default=False, rich_help_panel="Backend")] = None,
    keep_alive: Annotated[int | None, typer.Option(help="Keep instances warm this long after a job (warm pools).",
                                                    metavar="SECONDS", show_default=False,
                                                    rich_help_panel="Backend")] = None,
    source_dir: Annotated[Path | None, typer.Option(help="Your code, shipped to every replica (backends without "
                                                         "a ready image).", metavar="DIR", show_default=False,
                                                     rich_help_panel="Backend")] = None,
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
    max_restarts: Annotated[int | None, typer.Option("--max-restarts", min=0, help="Start a killed or lost "
                                                     "replica again up to N times (it rejoins at its peers' "
                                                     "round; on EKS the Job's per-index retry); 0 never "
                                                     "(max_restarts; default 3).", metavar="N",
                                                     show_default=False)] = None,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Launch a DiLoCo run and (unless --detach) wait for it with live progress, then print the summary.

    Precedence: defaults < --config YAML < flags < --trainer-kwargs < --set. Invalid settings fail before
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
    from diloco.executors import require_launchable
    from diloco.launcher.config import backend_kind, merge_sources, validate
    from diloco.launcher.orchestrate import RunView, plan_run, preflight
    from diloco.launcher.orchestrate import launch as launch_run

    flags = {"replicas": replicas, "backend": backend, "train.steps": steps, "train.sync_every": sync_every,
             "train.mode": mode, "train.trainer": trainer, "store.rendezvous": rendezvous, "gpu": gpu, "timeout_s": timeout,
             "store.allreduce": allreduce, "store.compression": compression, "min_replicas": min_replicas,
             "train.procs_per_replica": procs_per_replica, "metrics.tensorboard": tensorboard,
             "max_restarts": max_restarts}
    backend_flags = {"image": image, "role": role, "region": region, "instance_type": instance_type,
                     "namespace": namespace, "context": context, "spot": spot, "keep_alive": keep_alive,
                     "source_dir": str(source_dir) if source_dir is not None else None}
    registry = _registry()  # a DILOCO_HOME that is a file fails here, even for --dry-run
    data = merge_sources(config, flags, set_, trainer_kwargs, backend_flags)
    require_launchable(backend_kind(data))  # a backend not shipped yet fails before anything else
    cfg = validate(data)

    if dry_run:
        from diloco.cli.views import render_plan

        _, plan = plan_run(preflight(cfg))
        _announce_plan(plan)
        for note in plan.notes:
            say(f"note: {note}")
        if fmt == OutputFormat.yaml:  # the backend's own requests, e.g. a Job manifest for `kubectl apply -f -`
            import yaml

            sys.stdout.write(yaml.safe_dump_all(to_jsonable(plan.requests), sort_keys=False))
            return
        emit(plan, fmt, lambda console: render_plan(console, plan))
        return

    record, backend_impl = launch_run(cfg, registry, force=force, on_plan=_announce_plan)
    run_id = record.run_id
    say(f"launched {run_id}: {record.replicas} replica(s) on {record.backend}, meeting at "
        f"{record.rendezvous_uri}")
    view = RunView(record, backend_impl, registry=registry)
    if detach:
        say(f"  watch:   diloco watch {run_id}   (waits, relaunching failed replicas)\n"
            f"  status:  diloco status {run_id}\n  logs:    diloco logs {run_id} -f\n"
            f"  collect: diloco collect {run_id}\n  cancel:  diloco cancel {run_id}")
        emit(view.report(with_stderr=False), fmt, lambda console: console.print(run_id))
        return

    on_ctrl_c = "cancels the run" if cancel_on_interrupt else "stops waiting, the run keeps going"
    say(f"waiting (Ctrl-C {on_ctrl_c}); logs: diloco logs {run_id} -f")
    from diloco.cli.watch import wait_and_summarize

    wait_and_summarize(view, fmt=fmt, fail_fast=fail_fast, max_restarts=cfg.max_restarts,
                       cancel_on_interrupt=cancel_on_interrupt)


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
    view = _view(run)
    if not watch:
        _print_run(view.report(trends=True), fmt)
        return
    try:
        report, _ = _wait(view, timeout_s=None, fail_fast=False)
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
    view = _view(run)
    ranks = _parse_ranks(replica, view.record.replicas)
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
        for record in view.log_lines(ranks=ranks, follow=follow, tail_n=tail_n):
            out.write(line(record) + "\n")
            printed += 1
            if follow:
                out.flush()
        out.flush()
        if not printed:  # say why nothing came, on stderr, so a pipe still gets only log lines
            why = "it has not been submitted" if view.handle is None else \
                "its replicas have written nothing yet, or the backend no longer has their logs"
            say(f"no log lines for run {view.record.run_id}: {why}")
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
    output: Annotated[str | None, typer.Option("--output", help="Where to write the model: a file, or a "
                                                  "directory (an existing one, or any path ending in /) to "
                                                  "write <run_id>.safetensors in; missing directories are "
                                                  "created (default: the current directory).", metavar="PATH",
                                                  show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing model file.")] = False,
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
    if timeout is not None and timeout <= 0:
        raise ConfigError(f"--timeout: must be > 0 seconds (got {timeout:g})")
    view = _view(run)
    run_id = view.record.run_id
    target = _model_target(output, run_id, force)
    try:
        report, timed_out = _wait(view, timeout_s=timeout, fail_fast=fail_fast, output=target, collect=True)
    except KeyboardInterrupt:
        say(f"stopped waiting; run {run_id} keeps running")
        raise typer.Exit(exit_codes.INTERRUPTED) from None
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
    raise typer.Exit(_outcome_code(report, False))


def _model_target(output: str | None, run_id: str, force: bool) -> str:
    """Where collect writes the model, checked before waiting (``diloco.launcher.output_path``: a directory gets
    ``<run_id>.safetensors``, missing directories are created at the write); an existing file needs ``--force``."""
    from diloco.launcher.output_path import resolve_output

    path = resolve_output(output, f"{run_id}.safetensors")
    if os.path.exists(path) and not force:
        raise ConfigError(f"--output: {path} already exists", hint="pass --force to overwrite it, or choose another "
                                                                     "path")
    return path


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

    view = _view(run)
    run_id = view.record.run_id
    before = view.status()
    if before.terminal:
        say(f"run {run_id} already finished; nothing to cancel")
        report = view.report(before, with_stderr=False)
    else:
        say(f"cancelling run {run_id} ...")
        try:
            status = view.cancel()
            report = view.wait(poll_interval_s=0.2)[0] if wait else view.report(status, with_stderr=False)
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
    from diloco.launcher.orchestrate import summarize_runs

    summaries = summarize_runs(_registry())
    emit({"runs": summaries}, fmt, lambda console: render_runs(console, summaries))


from diloco.cli import s3_commands  # noqa: E402 - registers `smoke` and `doctor` on the app

s3_commands.register(app, EPILOG)

from diloco.cli import housekeeping as housekeeping_commands  # noqa: E402 - registers `rm` and `prune`

housekeeping_commands.register(app, EPILOG)

from diloco.cli import plot as plot_commands  # noqa: E402 - registers `plot`

plot_commands.register(app, EPILOG)

from diloco.cli import watch as watch_commands  # noqa: E402 - registers `watch` (launch's waiting, for a detached run)

watch_commands.register(app, EPILOG)

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
        sys.exit(exit_codes.INTERRUPTED)
    except errors.ClickException as exc:
        error_line(exc.format_message())
        sys.exit(exc.exit_code)
    sys.exit(rv if isinstance(rv, int) else exit_codes.OK)


if __name__ == "__main__":
    main()
