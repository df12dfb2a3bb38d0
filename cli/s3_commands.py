"""`diloco smoke` and `diloco doctor`: parse, one call into ``diloco.launcher.smoke``/``diloco.launcher.doctor``, render.

Both print their checks as a table (or ``-o json``, the same pydantic report) on stdout, narration on stderr,
and exit 0 only when no check failed (1 otherwise, 2 for bad input such as a malformed S3 URI).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from diloco.cli import exit_codes
from diloco.cli.errors import command
from diloco.cli.model_flags import BackendFlagsCommand, given_backend_flags
from diloco.cli.render import FormatOpt, OutputFormat, emit, say

if TYPE_CHECKING:
    from rich.console import Console

S3Opt = Annotated[str | None, typer.Option(
    "--s3", help="s3://bucket/prefix to use (else the config's s3:// store.rendezvous, else $DILOCO_S3_URI).",
    metavar="URI", show_default=False)]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML run config (see configs/).",
                                                   metavar="FILE", show_default=False)]

_STATUS_STYLE = {"pass": "green", "fail": "bold red", "warn": "yellow", "skip": "dim"}


def _complete_backends(incomplete: str) -> list[str]:
    from diloco.executors import backend_names

    return [name for name in backend_names() if name.startswith(incomplete)]


def _checks_table(console: Console, checks: list[Any], title: str) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    table.add_column("fix", overflow="fold")
    for c in checks:
        status = c.status.value
        table.add_row(c.name, Text(status, style=_STATUS_STYLE[status]), c.detail, c.fix or "")  # printed literally
    console.print(table)


def _render_smoke(console: Console, report: Any) -> None:
    from rich.table import Table

    from diloco.launcher.smoke import format_usd

    _checks_table(console, report.checks, f"diloco smoke: {report.replicas} replica(s) on {report.backend} via "
                                          f"{report.uri}")
    if report.round_stats:
        table = Table(title="per round (slowest rank; bytes summed over ranks)", title_justify="left")
        for col in ("round", "seconds", "sync s", "bytes written", "bytes read"):
            table.add_column(col, justify="right")
        for r in report.round_stats:
            table.add_row(str(r.round), f"{r.seconds:.2f}", f"{r.sync_s:.2f}", f"{r.bytes_written:,}",
                          f"{r.bytes_read:,}")
        console.print(table)
    if report.billable_s is not None:
        cost = f"; estimated cost {format_usd(report.cost_usd)}" if report.cost_usd is not None else ""
        source = f" ({report.cost_source})" if report.cost_source else ""
        console.print(f"billable: {report.billable_s:g} s over {report.replicas} replica(s){cost}{source}",
                      markup=False)
    verdict = "PASSED" if report.ok else "FAILED"
    console.print(f"smoke {verdict} in {report.seconds:.1f}s" + (f"; logs kept in {report.log_dir}"
                                                                  if report.log_dir else ""), markup=False)


def smoke(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option("--backend", "-b", help="Where the replicas run (default: the "
                                                   "config's, else local processes).", metavar="NAME",
                                                   show_default=False, autocompletion=_complete_backends)] = None,
    s3: S3Opt = None,
    config: ConfigOpt = None,
    replicas: Annotated[int, typer.Option("--replicas", "-n", help="Number of replicas.", metavar="N")] = 2,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Run it even though it costs money (the backend bills "
                                         "for it); without it such a smoke only says how much and exits 2.")
                   ] = False,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the smoke's store prefix (and logs) afterwards.")
                    ] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Give up after this many seconds (exit 124); also "
                                              "each replica's own time limit.", metavar="SECONDS")] = 600.0,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Run a tiny DiLoCo job (2 replicas of the built-in trainer, 4 steps, 2 rounds) on a backend through a store
    (S3 with --s3, else a temporary file:// one where the replicas can reach it) and check that every replica
    succeeded, that every round met in the store and that the final weights are bitwise identical; prints per-round
    time and bytes, and the billable time and estimated cost where the backend bills.

    A smoke that would cost money refuses to start without --yes and says how much it expects (exit 2).

    \b
    Examples:
      diloco smoke                                 # local processes, file:// store in a temporary directory
      diloco smoke --s3 s3://my-bucket/diloco -n 4 # the same through S3, as cloud replicas would meet
      diloco smoke --backend sagemaker --s3 s3://sagemaker-my-bucket/smoke --role ARN --yes
      diloco smoke -o json | jq .ok
    """
    from diloco.launcher.smoke import resolve_target, run_smoke

    target = resolve_target(config_path=config, backend=backend, s3=s3, backend_flags=given_backend_flags(ctx))
    report = run_smoke(s3_uri=target.s3_uri, backend=target.backend, replicas=replicas, keep=keep, yes=yes,
                       timeout_s=timeout, progress=say)
    emit(report, fmt, lambda console: _render_smoke(console, report))
    if not report.ok:
        raise typer.Exit(exit_codes.TIMEOUT if report.timed_out else exit_codes.FAILED)


def doctor(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option("--backend", "-b", help="Backend name (default: the config's, else "
                                                   "local).", metavar="NAME", show_default=False)] = None,
    s3: S3Opt = None,
    config: ConfigOpt = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="The launch's --gpu (eks: lists the nodes that would "
                                            "take a replica).", show_default=False)] = None,
    procs_per_replica: Annotated[int | None, typer.Option("--procs-per-replica", min=1, help="The launch's "
                                                          "--procs-per-replica (GPUs per replica).",
                                                          show_default=False)] = None,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Check what a launch on the backend needs (the local Python environment and run directory; credentials,
    region, S3 access and conditional writes, the SageMaker role and its bucket access, logs, the image,
    Kubernetes), each failure with its fix. Reads only, except a few probe objects it writes under the prefix
    and the run directory, and deletes.

    \b
    Examples:
      diloco doctor                                # the local backend
      diloco doctor --backend local --s3 s3://my-bucket/diloco
      diloco doctor -c configs/sagemaker.yaml
    """
    from diloco.launcher.doctor import resolve_inputs, run_doctor

    options = _doctor_options(backend, config, given_backend_flags(ctx))
    ctx = resolve_inputs(backend=backend, s3_uri=s3, config_path=str(config) if config else None, options=options,
                         gpu=gpu, procs_per_replica=procs_per_replica)
    report = run_doctor(ctx)
    emit(report, fmt, lambda console: _checks_table(console, report.checks, f"diloco doctor: {report.backend}"
                                                    + (f", {report.s3_uri}" if report.s3_uri else "")))
    if not report.ok:
        failed = sum(1 for c in report.checks if c.status.value == "fail")
        say(f"{failed} check(s) failed; see the fix column")
        raise typer.Exit(exit_codes.FAILED)


def _doctor_options(backend: str | None, config: Path | None, given: dict[str, Any]) -> dict[str, Any]:
    """The backend flags given, as the config fields of the backend the doctor checks (the flag's, else the
    config's, else the default); one that backend does not take is refused as on ``launch``. A run split over
    backends gets its parts (``--part``, else the config's) with each flag in the parts that take it."""
    from diloco.executors import config_type
    from diloco.launcher.config import backend_kind, load_yaml

    if not given:
        return {}
    data = load_yaml(config) if config is not None else {}
    kind = backend or backend_kind(data)
    section = data.get("backend") if isinstance(data.get("backend"), dict) and backend_kind(data) == kind else {}
    return config_type(kind).apply_flags(kind, {k: v for k, v in section.items() if k != "kind"}, given)


def register(app: typer.Typer, epilog: str) -> None:
    """Add ``smoke`` and ``doctor`` to ``app``; their backend options come from every registered backend."""
    app.command("smoke", epilog=epilog, cls=BackendFlagsCommand)(command(smoke))
    app.command("doctor", epilog=epilog, cls=BackendFlagsCommand)(command(doctor))
