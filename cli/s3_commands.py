"""`diloco smoke` and `diloco doctor`: parse, one call into ``diloco.smoke``/``diloco.doctor``, render.

Both print their checks as a table (or ``-o json``, the same pydantic report) on stdout, narration on stderr,
and exit 0 only when no check failed (1 otherwise, 2 for bad input such as a malformed S3 URI).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from diloco.cli import exit_codes
from diloco.cli.errors import command
from diloco.cli.render import FormatOpt, OutputFormat, emit, say

if TYPE_CHECKING:
    from rich.console import Console

S3Opt = Annotated[str | None, typer.Option(
    "--s3", help="s3://bucket/prefix to use (else the config's s3:// store.rendezvous, else $DILOCO_S3_URI).",
    metavar="URI", show_default=False)]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML run config (see configs/).",
                                                   metavar="FILE", show_default=False)]

_STATUS_STYLE = {"pass": "green", "fail": "bold red", "warn": "yellow", "skip": "dim"}


def _checks_table(console: Console, checks: list[Any], title: str) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    table.add_column("fix", overflow="fold")
    for c in checks:
        status = c.status.value
        table.add_row(c.name, f"[{_STATUS_STYLE[status]}]{status}[/]", _literal(c.detail), _literal(c.fix or ""))
    console.print(table)


def _literal(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _render_smoke(console: Console, report: Any) -> None:
    from rich.table import Table

    _checks_table(console, report.checks, f"diloco smoke: {report.replicas} replica(s) via {report.uri}")
    if report.round_stats:
        table = Table(title="per round (slowest rank; bytes summed over ranks)", title_justify="left")
        for col in ("round", "seconds", "sync s", "bytes written", "bytes read"):
            table.add_column(col, justify="right")
        for r in report.round_stats:
            table.add_row(str(r.round), f"{r.seconds:.2f}", f"{r.sync_s:.2f}", f"{r.bytes_written:,}",
                          f"{r.bytes_read:,}")
        console.print(table)
    verdict = "PASSED" if report.ok else "FAILED"
    console.print(f"smoke {verdict} in {report.seconds:.1f}s" + (f"; logs kept in {report.log_dir}"
                                                                  if report.log_dir else ""), markup=False)


def smoke(
    s3: S3Opt = None,
    replicas: Annotated[int, typer.Option("--replicas", "-n", help="Number of local replica processes.", metavar="N")] = 2,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the smoke's store prefix (and logs) afterwards.")
                    ] = False,
    config: ConfigOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Give up after this many seconds (exit 124).", metavar="SECONDS")] = 600.0,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Run a tiny DiLoCo job on local replicas through a store (S3 with --s3, else a temporary file:// one)
    and check rounds, bitwise-identical final weights, per-round time and bytes.

    Exits 0 when every check passed, 1 when one failed, 124 when the replicas did not finish within --timeout.

    \b
    Examples:
      diloco smoke                                 # file:// store in a temporary directory, ~10 s
      diloco smoke --s3 s3://my-bucket/diloco -n 4 # the same through S3, as cloud replicas would meet
      diloco smoke -o json | jq .ok
    """
    from diloco.s3 import resolve_s3_uri
    from diloco.smoke import run_smoke

    rendezvous = None
    if config is not None:
        from diloco.config import resolve_config

        rendezvous = resolve_config(config).store.rendezvous
    uri = resolve_s3_uri(s3, rendezvous)
    report = run_smoke(s3_uri=uri, replicas=replicas, keep=keep, timeout_s=timeout, progress=say)
    emit(report, fmt, lambda console: _render_smoke(console, report))
    if not report.ok:
        raise typer.Exit(exit_codes.TIMEOUT if report.timed_out else exit_codes.FAILED)


def doctor(
    backend: Annotated[str | None, typer.Option("--backend", "-b", help="local, sagemaker or eks (default: the "
                                                   "config's, else local).", show_default=False)] = None,
    s3: S3Opt = None,
    config: ConfigOpt = None,
    role: Annotated[str | None, typer.Option("--role", help="SageMaker execution role ARN (else the config's "
                                                "backend.role_arn).", show_default=False)] = None,
    image: Annotated[str | None, typer.Option("--image", help="Training image URI (else the config's).",
                                                 show_default=False)] = None,
    namespace: Annotated[str | None, typer.Option("--namespace", help="Kubernetes namespace (eks).",
                                                     show_default=False)] = None,
    context: Annotated[str | None, typer.Option("--context", help="kubeconfig context (eks).",
                                                   show_default=False)] = None,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Check what a launch on the backend needs (the local Python environment and run directory; credentials,
    region, S3 access and conditional writes, the SageMaker role and its bucket access, logs, the image,
    Kubernetes), each failure with its fix. Reads only, except a few probe objects it writes under the prefix
    and the run directory, and deletes. Exits 0 when no check failed, 1 otherwise.

    \b
    Examples:
      diloco doctor                                # the local backend
      diloco doctor --backend local --s3 s3://my-bucket/diloco
      diloco doctor -c configs/sagemaker.yaml
    """
    from diloco.doctor import resolve_inputs, run_doctor

    ctx = resolve_inputs(backend=backend, s3_uri=s3, config_path=str(config) if config else None, role_arn=role,
                         image_uri=image, namespace=namespace, kube_context=context)
    report = run_doctor(ctx)
    emit(report, fmt, lambda console: _checks_table(console, report.checks, f"diloco doctor: {report.backend}"
                                                    + (f", {report.s3_uri}" if report.s3_uri else "")))
    if not report.ok:
        failed = sum(1 for c in report.checks if c.status.value == "fail")
        say(f"{failed} check(s) failed; see the fix column")
        raise typer.Exit(exit_codes.FAILED)


def register(app: typer.Typer, epilog: str) -> None:
    """Add ``smoke`` and ``doctor`` to ``app``."""
    app.command("smoke", epilog=epilog)(command(smoke))
    app.command("doctor", epilog=epilog)(command(doctor))
