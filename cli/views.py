"""Human renderings (Rich tables) of the reports in ``diloco.launcher.reports``; JSON output needs none of this."""

from __future__ import annotations

import datetime as _dt
import shlex
from typing import TYPE_CHECKING

from rich.text import Text

from diloco.cli.tables import Column, FittedTable, fitted_table
from diloco.errors import ERROR_PREFIX

if TYPE_CHECKING:
    from rich.console import Console

    from diloco.executors.base import LaunchPlan
    from diloco.launcher.reports import ReplicaReport, RunReport, RunSummary

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


#: The replica table's columns, in reading order.
REPLICA_COLUMNS = (Column("replica", "right", essential=True), Column("state", essential=True),
                   Column("exit", "right"), Column("restarts", "right"), Column("step", "right"),
                   Column("round", "right"), Column("train loss", "right"), Column("eval loss", "right"),
                   Column("tok/s", "right"), Column("sync s", "right"))
#: Most important first: a narrow terminal drops them from the end of this list.
REPLICA_PRIORITY = ("replica", "state", "step", "round", "eval loss", "train loss", "tok/s", "sync s", "exit",
                    "restarts")


#: The column a run split over backends adds after the state: which backend runs the replica.
BACKEND_COLUMN = Column("backend")


def _cells(rep: ReplicaReport) -> dict[str, str | Text]:
    return {"replica": f"r{rep.rank}", "state": state_text(rep.state.value), "backend": rep.backend or "-",
            "exit": "-" if rep.exit_code is None else str(rep.exit_code), "restarts": str(rep.restarts),
            "step": fmt_step(rep),
            "round": "-" if rep.round is None else str(rep.round), "train loss": fmt_loss(rep.train_loss),
            "eval loss": fmt_loss(rep.eval_loss), "tok/s": fmt_num(rep.tokens_per_s),
            "sync s": fmt_num(rep.sync_s, ".1f")}


def _replica_priority(report: RunReport) -> list[str]:
    """``REPLICA_PRIORITY``, except that exit codes and restarts, once one is telling (a replica exited non-zero,
    one was relaunched), outrank the throughput columns."""
    telling = [name for name, show in (("exit", any(r.exit_code not in (None, 0) for r in report.ranks)),
                                       ("restarts", any(r.restarts for r in report.ranks))) if show]
    rest = [name for name in REPLICA_PRIORITY if name not in telling]
    cut = rest.index("eval loss") + 1
    split = ["backend"] if report.parts else []  # a run split over backends: where each replica runs
    return rest[:2] + split + rest[2:cut] + telling + rest[cut:]


def replica_table(report: RunReport, *, title: str | Text | None = None, width: int | None = None,
                  max_rows: int | None = None) -> FittedTable:
    """Per replica: state, step/total, round, train/eval loss, tokens/s, seconds blocked in sync.

    ``width`` drops the least important columns that do not fit (a footer names them); ``max_rows`` shows the
    replicas that most need attention (failed, then not running, then the rest by rank) and one summary line for
    those hidden.
    """
    shown = list(range(len(report.ranks)))
    if max_rows is not None and len(shown) > max_rows:
        urgency = {"failed": 0, "cancelling": 1, "preempted": 1, "pending": 2, "unknown": 2}
        shown = sorted(shown, key=lambda i: (urgency.get(report.ranks[i].state.value, 3), i))[:max(1, max_rows - 1)]
        shown.sort()
    columns = REPLICA_COLUMNS
    if report.parts:
        columns = (*REPLICA_COLUMNS[:2], BACKEND_COLUMN, *REPLICA_COLUMNS[2:])
    fitted = fitted_table(columns, [_cells(report.ranks[i]) for i in shown], width=width,
                          priority=_replica_priority(report), title=title)
    hidden = [rep for i, rep in enumerate(report.ranks) if i not in set(shown)]
    if hidden:
        counts: dict[str, int] = {}
        for rep in hidden:
            counts[rep.state.value] = counts.get(rep.state.value, 0) + 1
        summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        fitted.notes.append(f"+{len(hidden)} more replicas not shown: {summary}")
    return fitted


def render_run(console: Console, report: RunReport) -> None:
    """The status/summary view of one run."""
    where = report.backend
    if report.parts:  # a run split over backends: which ranks each runs
        where += ": " + ", ".join(f"{p.backend} {_span(p.ranks)}" for p in report.parts)
    header = Text.assemble(("run ", ""), (report.run_id, "bold"), ": ", state_text(report.state.value),
                           f"  ({report.replicas} replicas, {where})")
    console.print(header)
    console.print(replica_table(report, width=console.width))
    if report.async_global_version is not None:
        console.print(async_line(report))
    if len(report.membership) > 1:  # an elastic run that was scaled: who joined and left, by round
        console.print(membership_line(report))
    if report.initial_eval_loss is not None and report.latest_eval_loss is not None:
        console.print(f"eval loss: {report.initial_eval_loss:.3f} -> {report.latest_eval_loss:.3f} "
                      f"(mean over replicas, before training -> latest)")
    trends = [(rep.rank, rep.eval_trend) for rep in report.ranks if rep.eval_trend]
    if trends:
        console.print("eval loss per replica (first, each evaluation, latest):")
        for rank, trend in trends:
            console.print(f"  r{rank}  {trend}")
    if report.billable_s is not None:
        cost = ""
        if report.cost_usd is not None:
            sources = {r.cost_source for r in report.ranks if r.cost_source}
            cost = f", estimated cost ${report.cost_usd:.4f}" + (f" ({'; '.join(sorted(sources))})" if sources else "")
        console.print(f"billable: {fmt_duration(report.billable_s)} over all replicas{cost}")
        for share in report.parts:  # a run split over backends: what each part billed
            if share.billable_s is not None:
                usd = f", ${share.cost_usd:.4f}" if share.cost_usd is not None else ""
                console.print(f"  part {share.part}, {share.backend} ({_span(share.ranks)}): "
                              f"{fmt_duration(share.billable_s)}{usd}")
    if report.diverged:
        console.print("diverged: some replica recorded a NaN or infinite loss (shown as -)")
    if report.weights_identical is not None or report.weights_detail:
        verdict = {True: "identical", False: "DIFFERENT", None: "not checked"}[report.weights_identical]
        console.print(f"final weights: {verdict}: {report.weights_detail}")
    if report.model_path:
        console.print(f"model: {report.model_path}")
    by_reason: dict[str, list[str]] = {}  # "r0, r2: cancelled (stopped by SIGTERM)", not one line per replica
    for rep in report.ranks:
        why = failure_why(rep) if rep.state.value == "failed" else rep.reason
        if why and rep.state.value != "succeeded":
            by_reason.setdefault(why, []).append(f"r{rep.rank}")
    for reason, ranks in by_reason.items():
        console.print(f"{', '.join(ranks)}: {reason}")


def _span(ranks: list[int]) -> str:
    """``r2``, ``r0-1``, or ``r0,r3`` for ranks that are not contiguous."""
    if len(ranks) == 1:
        return f"r{ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"r{ranks[0]}-{ranks[-1]}"
    return ",".join(f"r{r}" for r in ranks)


def membership_line(report: RunReport) -> str:
    """An elastic run's membership changes: ``members: round 1: 0-1; round 4: 4 (+2, 3); round 7: 3 (-3)``."""
    parts = []
    for change in report.membership:
        moved = ", ".join([f"+{', '.join(map(str, change.joined))}"] * bool(change.joined) +
                          [f"-{', '.join(map(str, change.left))}"] * bool(change.left))
        parts.append(f"round {change.round}: {len(change.members)}" + (f" ({moved})" if moved else ""))
    return "members: " + "; ".join(parts)


def async_line(report: RunReport, now: float | None = None) -> str:
    """Async mode: ``global version 42; r1 uploaded 3s ago (staleness 1), r2 ...``."""
    import time

    now = time.time() if now is None else now
    parts = []
    for rep in report.ranks:
        if rep.async_last_upload_at is None:
            parts.append(f"r{rep.rank} no upload yet")
        else:
            ago = fmt_duration(max(0.0, now - rep.async_last_upload_at))
            parts.append(f"r{rep.rank} uploaded {ago} ago (staleness {rep.async_staleness})")
    return f"async: global version {report.async_global_version}; " + ", ".join(parts)


def failure_why(rep: ReplicaReport) -> str:
    """The most telling one-line cause: the backend's reason unless it only restates the exit code (a time
    limit, a kill), else the replica's own ``diloco: error:`` line, else the last line of its stderr; then, when
    the backend could tell, the kind of failure and whether a relaunch may cure it."""
    if rep.reason and not rep.reason.startswith("exited with code"):
        why = " ".join(rep.reason.split())  # a service's reason may span lines (the training toolkit's does)
    else:
        errors = [line for line in rep.stderr_tail if line.startswith(ERROR_PREFIX)]
        if errors:
            why = errors[-1][len(ERROR_PREFIX):]
        else:
            why = rep.stderr_tail[-1] if rep.stderr_tail else rep.reason or "no reason recorded"
    return f"{why} -- {rep.failure.summary()}" if rep.failure is not None else why


def failure_lines(report: RunReport, run_ref: str) -> list[str]:
    """Which replica failed and why (exit code, last lines of its stderr), then what to do next."""
    lines: list[str] = []
    if report.left_behind:
        done = report.replicas - len(report.left_behind)
        lines.append(f"finished on {done} of {report.replicas} replicas (min_replicas): replica(s) "
                     f"{', '.join(map(str, report.left_behind))} failed for good and the others committed the "
                     f"remaining rounds without them")
    for rep in report.failed:
        code = "" if rep.exit_code is None else f" with exit code {rep.exit_code}"
        why = failure_why(rep)
        lines.append(f"replica {rep.rank} failed{code}: {why}")
        if [line for line in rep.stderr_tail if why not in line]:  # more than the line quoted above
            lines.append(f"  last lines of replica {rep.rank}'s stderr:")
            lines += [f"    {line}" for line in rep.stderr_tail]
    if lines:
        lines.append(f"full logs: diloco logs {run_ref} -r {report.failed[0].rank}")
        running = [str(r.rank) for r in report.ranks if not r.state.is_terminal]
        if running:
            lines.append(f"replica(s) {', '.join(running)} still running: they wait for the failed replica until "
                         f"store.timeout_s; stop them with: diloco cancel {run_ref}")
    return lines


def render_plan(console: Console, plan: LaunchPlan) -> None:
    """The dry run: what would be launched, per replica, and the fact that nothing was."""
    spec = plan.spec
    console.print(Text.assemble("dry run ", (spec.run_id, "bold"), f": {spec.replicas} replicas on ",
                                (plan.backend, "bold"), " (nothing launched)"))
    console.print(f"rendezvous: {spec.entrypoint_args.rendezvous_uri}")
    if spec.spec_uri is not None:  # what --spec names: every replica's settings, published by the launch
        console.print(f"settings ({spec.spec_uri}): {spec.entrypoint_args.model_dump_json(exclude_defaults=True)}",
                      markup=False, highlight=False)
    for entry in plan.requests:
        request = entry
        if "part" in entry and "request" in entry:  # a run split over backends: each part's own request
            ranks = entry["ranks"]
            span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
            console.print(Text(f"part {entry['part']} ({entry['backend']}, {span}):", style="bold"))
            request = entry["request"]
        label = f"replica {request['rank']}:" if "rank" in request else "request:"
        console.print(Text(label, style="bold"))
        if "argv" in request:
            console.print(f"  argv: {shlex.join(request['argv'])}")
            console.print("  env:  " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(request["env"].items())))
            console.print(f"  cwd:  {request['cwd']}")
            console.print(f"  logs: {request['log_dir']}")
        else:
            import json

            console.print(json.dumps(request, indent=2, default=str))


RUNS_COLUMNS = (Column("run", essential=True), Column("created"), Column("backend"), Column("replicas"),
                Column("state", essential=True))
#: The run id already says when it was created: the creation time goes first on a narrow terminal.
RUNS_PRIORITY = ("run", "state", "backend", "replicas", "created")


def render_runs(console: Console, runs: list[RunSummary]) -> None:
    if not runs:
        console.print("no runs yet: start one with `diloco launch`")
        return
    rows: list[dict[str, str | Text]] = [
        {"run": r.run_id, "created": fmt_time(r.created_at), "backend": r.backend, "replicas": str(r.replicas),
         "state": state_text(r.state.value)} for r in runs]
    console.print(fitted_table(RUNS_COLUMNS, rows, width=console.width, priority=RUNS_PRIORITY))


CANCEL_COLUMNS = (Column("replica", essential=True), Column("state", essential=True), Column("reason", wrap=True))


def render_cancel(console: Console, report: RunReport) -> None:
    rows: list[dict[str, str | Text]] = [
        {"replica": f"r{rep.rank}", "state": state_text(rep.state.value), "reason": rep.reason or ""}
        for rep in report.ranks]
    title = Text.assemble("run ", (report.run_id, "bold"), ": ", state_text(report.state.value))
    console.print(fitted_table(CANCEL_COLUMNS, rows, width=console.width, title=title))
