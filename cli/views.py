"""Human renderings (Rich tables) of the reports in ``diloco.orchestrate``; JSON output needs none of this."""

from __future__ import annotations

import datetime as _dt
import shlex
from typing import TYPE_CHECKING

from rich import box
from rich.table import Table
from rich.text import Text

from diloco.errors import ERROR_PREFIX

if TYPE_CHECKING:
    from rich.console import Console

    from diloco.executors.base import LaunchPlan, ReplicaStatus
    from diloco.orchestrate import ReplicaReport, RunReport, RunSummary

STATE_STYLES = {
    "succeeded": "green", "failed": "bold red", "cancelled": "yellow", "cancelling": "yellow",
    "running": "cyan", "pending": "dim", "preempted": "magenta", "unknown": "dim",
}


def state_text(state: str) -> Text:
    return Text(state, style=STATE_STYLES.get(state, ""))


def fmt_loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def fmt_num(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def fmt_step(rep: ReplicaReport) -> str:
    if rep.step is None:
        return "-"
    return f"{rep.step}/{rep.total_steps}" if rep.total_steps else str(rep.step)


def fmt_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _table(title: str | None = None) -> Table:
    """The one table style of the CLI: a rule under the header, no borders (easy to read, grep and paste)."""
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                 collapse_padding=True)


def replica_table(report: RunReport, *, title: str | None = None) -> Table:
    """Per replica: state, step/total, round, train/eval loss, tokens/s, seconds blocked in sync."""
    table = _table(title)
    for name, justify in (("replica", "right"), ("state", "left"), ("exit", "right"), ("step", "right"),
                          ("round", "right"), ("train loss", "right"), ("eval loss", "right"),
                          ("tok/s", "right"), ("sync s", "right")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for rep in report.replicas:
        table.add_row(
            f"r{rep.rank}", state_text(rep.state.value), "-" if rep.exit_code is None else str(rep.exit_code),
            fmt_step(rep), "-" if rep.round is None else str(rep.round), fmt_loss(rep.train_loss),
            fmt_loss(rep.eval_loss), fmt_num(rep.tokens_per_s), fmt_num(rep.sync_s, ".1f"),
        )
    return table


def render_run(console: Console, report: RunReport) -> None:
    """The status/summary view of one run."""
    header = Text.assemble(("run ", ""), (report.run_id, "bold"), ": ", state_text(report.state.value),
                           f"  ({report.world_size} replicas, {report.backend})")
    console.print(header)
    console.print(replica_table(report))
    if report.initial_eval_loss is not None and report.final_eval_loss is not None:
        console.print(f"eval loss: {report.initial_eval_loss:.3f} -> {report.final_eval_loss:.3f} "
                      f"(mean over replicas, before training -> latest)")
    if report.weights_identical is not None or report.weights_detail:
        verdict = {True: "identical", False: "DIFFERENT", None: "not checked"}[report.weights_identical]
        console.print(f"final weights: {verdict}: {report.weights_detail}")
    if report.model_path:
        console.print(f"model: {report.model_path}")
    by_reason: dict[str, list[str]] = {}  # "r0, r2: cancelled (stopped by SIGTERM)", not one line per replica
    for rep in report.replicas:
        if rep.reason and rep.state.value != "succeeded":
            by_reason.setdefault(rep.reason, []).append(f"r{rep.rank}")
    for reason, ranks in by_reason.items():
        console.print(f"{', '.join(ranks)}: {reason}")


def failure_why(rep: ReplicaReport) -> str:
    """The most telling one-line cause: the backend's reason unless it only restates the exit code (a time
    limit, a kill), else the replica's own ``diloco: error:`` line, else the last line of its stderr."""
    if rep.reason and not rep.reason.startswith("exited with code"):
        return rep.reason
    errors = [line for line in rep.stderr_tail if line.startswith(ERROR_PREFIX)]
    if errors:
        return errors[-1][len(ERROR_PREFIX):]
    return rep.stderr_tail[-1] if rep.stderr_tail else rep.reason or "no reason recorded"


def failure_lines(report: RunReport, run_ref: str) -> list[str]:
    """Which replica failed and why (exit code, last lines of its stderr), then what to do next."""
    lines: list[str] = []
    for rep in report.failed:
        code = "" if rep.exit_code is None else f" with exit code {rep.exit_code}"
        why = failure_why(rep)
        lines.append(f"replica {rep.rank} failed{code}: {why}")
        if [line for line in rep.stderr_tail if why not in line]:  # more than the line quoted above
            lines.append(f"  last lines of replica {rep.rank}'s stderr:")
            lines += [f"    {line}" for line in rep.stderr_tail]
    if lines:
        lines.append(f"full logs: diloco logs {run_ref} -r {report.failed[0].rank}")
        running = [str(r.rank) for r in report.replicas if not r.state.is_terminal]
        if running:
            lines.append(f"replica(s) {', '.join(running)} still running: they wait for the failed replica until "
                         f"store.timeout_s; stop them with: diloco cancel {run_ref}")
    return lines


def render_plan(console: Console, plan: LaunchPlan) -> None:
    """The dry run: what would be launched, per replica, and the fact that nothing was."""
    spec = plan.spec
    console.print(Text.assemble("dry run ", (spec.run_id, "bold"), f": {spec.n_replicas} replicas on ",
                                (plan.backend, "bold"), " (nothing launched)"))
    console.print(f"rendezvous: {spec.entrypoint_args.rendezvous_uri}")
    for replica in plan.replicas:
        req = replica.request
        console.print(Text(f"replica {replica.rank}:", style="bold"))
        if "argv" in req:
            console.print(f"  argv: {shlex.join(req['argv'])}")
            console.print("  env:  " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(req["env"].items())))
            console.print(f"  cwd:  {req['cwd']}")
            console.print(f"  logs: {req['log_dir']}")
        else:
            import json

            console.print(json.dumps(req, indent=2, default=str))


def render_runs(console: Console, runs: list[RunSummary]) -> None:
    if not runs:
        console.print("no runs yet: start one with `diloco launch`")
        return
    table = _table()
    for name in ("run", "created", "backend", "replicas", "state"):
        table.add_column(name, no_wrap=True)
    for r in runs:
        table.add_row(r.run_id, fmt_time(r.created_at), r.backend, str(r.replicas), state_text(r.state.value))
    console.print(table)


def render_cancel(console: Console, run_id: str, statuses: list[ReplicaStatus]) -> None:
    table = _table(f"run {run_id}")
    for name in ("replica", "state", "reason"):
        table.add_column(name)
    for s in statuses:
        table.add_row(f"r{s.rank}", state_text(s.state.value), s.reason or "")
    console.print(table)
