"""`diloco smoke`: a two-minute end-to-end proof that a rendezvous store works for DiLoCo.

It runs N local replica processes of a tiny model (the built-in trainer: 1 layer, n_embd 32, 2 outer rounds)
that meet through the given store, exactly as cloud replica jobs would, then checks:

1. every replica exited 0;
2. every rank completed every round: read from each rank's ``metrics/rank_RRRR.jsonl`` (one ``round`` record
   per completed outer round, then ``final``). This, not the round objects, is the authority: writers delete their
   round k-1 object once round k is complete, so after a run only the last round's objects remain, and a tiny
   round can come and go between two polls. The smoke still polls the store while it runs and reports how many
   ``round_NNNNNN/rank_RRRR`` objects it saw, as evidence that they went through the store;
3. all final weights are bitwise identical (the point of DiLoCo's synchronized outer step);
4. the per-round wall time, time blocked in the all-reduce and bytes moved, from the same metrics.

It runs under a fresh sub-prefix ``smoke-<time>-<hex>`` of the store (a temporary ``file://`` directory when no
S3 URI is given) and deletes that sub-prefix afterwards unless ``keep``; nothing outside it is touched.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from diloco.doctor import Check, Status
from diloco.errors import ConfigError

#: The tiny model and schedule: seconds per round on a laptop core, yet the full DiLoCo path.
TINY_TRAINER_KWARGS: dict[str, Any] = {
    "n_layer": 1, "n_head": 1, "n_embd": 32, "block_size": 16, "batch_size": 4, "eval_batches": 1,
    "max_corpus_bytes": 100_000, "threads": 1,
}
SYNC_EVERY = 2
ROUNDS = 2
MAX_REPLICAS = 16
_ROUND_KEY = re.compile(r"^round_(\d{6})/rank_(\d{4})\.safetensors$")


class RoundStat(BaseModel):
    """One outer round across all ranks: the slowest rank's wall time and sync time, bytes summed over ranks."""

    round: int
    seconds: float
    sync_s: float
    bytes_written: int
    bytes_read: int


class SmokeReport(BaseModel):
    uri: str  # the unique rendezvous prefix this smoke used
    replicas: int
    rounds: int
    checks: list[Check]
    round_stats: list[RoundStat]
    observed_round_objects: int  # round objects seen while polling (evidence, not the verdict; see module doc)
    seconds: float
    kept: bool
    log_dir: str | None = None  # kept when something failed
    timed_out: bool = False  # the replicas had not finished within the timeout (the CLI exits 124)
    ok: bool


def _round_stats(metrics: dict[int, list[dict[str, Any]]]) -> list[RoundStat]:
    """Per-round deltas of the cumulative metrics counters (``init`` row = round 0 baseline)."""
    per_round: dict[int, list[dict[str, float]]] = {}
    for rows in metrics.values():
        prev = next((r for r in rows if r.get("kind") == "init"), None)
        for row in (r for r in rows if r.get("kind") == "round"):
            if prev is not None:
                per_round.setdefault(int(row["round"]), []).append({
                    "seconds": float(row["time"]) - float(prev["time"]),
                    "sync_s": float(row["sync_s"]) - float(prev["sync_s"]),
                    "bytes_written": float(row["bytes_written"]) - float(prev["bytes_written"]),
                    "bytes_read": float(row["bytes_read"]) - float(prev["bytes_read"]),
                })
            prev = row
    return [
        RoundStat(round=k, seconds=max(d["seconds"] for d in v), sync_s=max(d["sync_s"] for d in v),
                  bytes_written=int(sum(d["bytes_written"] for d in v)),
                  bytes_read=int(sum(d["bytes_read"] for d in v)))
        for k, v in sorted(per_round.items())
    ]


def _rounds_check(metrics: dict[int, list[dict[str, Any]]], rounds: int, observed: int, world: int) -> Check:
    name = "every rank completed every round"
    incomplete = []
    for rank, rows in sorted(metrics.items()):
        done = sorted(int(r["round"]) for r in rows if r.get("kind") == "round")
        finished = any(r.get("kind") == "final" for r in rows)
        if done != list(range(1, rounds + 1)) or not finished:
            incomplete.append(f"rank {rank}: rounds {done}{'' if finished else ', no final record'}")
    evidence = f"round objects seen in the store while polling: {observed} of {world * rounds}"
    if incomplete:
        return Check(name=name, status=Status.FAIL, detail="; ".join(incomplete) + f" ({evidence})",
                     fix="see 'replicas exited 0' above; rerun with --keep to inspect the store")
    return Check(name=name, status=Status.PASS,
                 detail=f"{world} rank(s) x {rounds} round(s) in the metrics; {evidence}")


def run_smoke(
    *,
    s3_uri: str | None = None,
    replicas: int = 2,
    keep: bool = False,
    timeout_s: float = 600.0,
    poll_interval_s: float = 0.2,
    progress: Callable[[str], None] | None = None,
) -> SmokeReport:
    """Run the smoke (see the module docstring). Raises ``ConfigError`` for bad input; otherwise every problem
    becomes a failed check in the report."""
    from diloco.executors.base import EntrypointArgs, LaunchSpec, RunState
    from diloco.executors.local import LocalProcessExecutor
    from diloco.orchestrate import check_final_weights, read_metrics
    from diloco.s3 import parse_s3_uri
    from diloco.store import ObjectStore

    say = progress or (lambda _msg: None)
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(f"--replicas must be between 1 and {MAX_REPLICAS} (got {replicas})")
    if s3_uri is not None:
        parse_s3_uri(s3_uri)
    run_id = f"smoke-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    work_dir = tempfile.mkdtemp(prefix="diloco-smoke-")
    uri = f"{s3_uri.rstrip('/')}/{run_id}" if s3_uri else f"file://{work_dir}/store/{run_id}"
    started = time.monotonic()
    checks: list[Check] = []
    metrics: dict[int, list[dict[str, Any]]] = {}
    observed: set[str] = set()
    failed = True
    store = ObjectStore(uri)
    try:
        say(f"smoke {run_id}: {replicas} replica(s), {ROUNDS} round(s), rendezvous {uri}")
        try:  # fail in seconds, not after the all-reduce timeout, when the store refuses us
            store.put("smoke.json", f'{{"run_id": "{run_id}", "replicas": {replicas}}}'.encode())
            store.get("smoke.json")
        except Exception as exc:  # noqa: BLE001 - becomes the report
            checks.append(Check(name="store writable", status=Status.FAIL, detail=f"{type(exc).__name__}: {exc}",
                                fix=getattr(exc, "hint", None) or "run `diloco doctor --s3 <uri>`"))
            return _report(uri, replicas, checks, metrics, observed, started, keep, work_dir, failed=True)
        checks.append(Check(name="store writable", status=Status.PASS, detail=store.url()))

        executor = LocalProcessExecutor(log_root=os.path.join(work_dir, "logs"), grace_period_s=2.0)
        args = EntrypointArgs(rendezvous_uri=uri, world_size=replicas, timeout_s=max(60.0, timeout_s / 2),
                              poll_interval_s=poll_interval_s,  # tiny rounds: poll the store briskly
                              trainer_kwargs={**TINY_TRAINER_KWARGS, "total_steps": SYNC_EVERY * ROUNDS,
                                              "sync_every": SYNC_EVERY})
        plan = executor.plan(LaunchSpec(run_id=run_id, n_replicas=replicas, entrypoint_args=args,
                                        timeout_s=timeout_s))
        handles = executor.submit(plan)
        deadline = time.monotonic() + timeout_s
        statuses = [executor.poll(h) for h in handles]
        timed_out = False
        try:
            while not all(s.state.is_terminal for s in statuses):
                observed |= _observe(store)
                timed_out = time.monotonic() > deadline
                if any(s.state == RunState.FAILED for s in statuses) or timed_out:
                    break
                time.sleep(poll_interval_s)
                statuses = [executor.poll(h) for h in handles]
            observed |= _observe(store)
        finally:
            if not all(s.state.is_terminal for s in statuses):
                executor.cancel_many(handles)
                statuses = [executor.poll(h) for h in handles]
        timed_out = timed_out or any(s.timed_out for s in statuses)  # a replica hit its own time limit
        bad = [s for s in statuses if s.state != RunState.SUCCEEDED]
        if bad:
            lines = []
            for s in bad:
                tail = executor.stderr_tail(handles[s.rank], 3)
                why = tail[-1] if tail else (s.reason or "")
                lines.append(f"rank {s.rank} {s.state.value} (exit {s.exit_code}): {why}".strip())
            logs = f"replica logs: {os.path.join(work_dir, 'logs', run_id)}"
            checks.append(Check(name="replicas exited 0", status=Status.FAIL,
                                detail=(f"timed out after {timeout_s:g}s; " if timed_out else "") + "; ".join(lines),
                                fix=f"a slow store or machine: raise --timeout; {logs}" if timed_out else logs))
        else:
            checks.append(Check(name="replicas exited 0", status=Status.PASS, detail=f"{replicas} replica(s)"))

        metrics = read_metrics(store, replicas)
        checks.append(_rounds_check(metrics, ROUNDS, len(observed), replicas))
        verdict, detail, _tensors, _meta = check_final_weights(store, replicas)
        checks.append(Check(name="final weights bitwise identical",
                            status=Status.PASS if verdict else Status.FAIL, detail=detail,
                            fix=None if verdict else "the replicas diverged or did not finish; see the checks above"))
        failed = any(c.status == Status.FAIL for c in checks)
        report = _report(uri, replicas, checks, metrics, observed, started, keep, work_dir, failed=failed)
        report.timed_out = timed_out
        return report
    finally:
        if not keep:
            try:
                store.delete_prefix("")
            except Exception as exc:  # noqa: BLE001 - reported, never masks the verdict
                say(f"could not clean up {uri}: {exc}")
        if not keep and (not failed or not os.path.isdir(os.path.join(work_dir, "logs"))):
            shutil.rmtree(work_dir, ignore_errors=True)  # kept only with --keep, or for the logs of a failure


def _observe(store: Any) -> set[str]:
    """The round objects in the store right now (listing errors just mean: nothing seen this time)."""
    try:
        return {k for k in store.list() if _ROUND_KEY.match(k)}
    except Exception:  # noqa: BLE001 - a failed poll is not a verdict
        return set()


def _report(uri: str, replicas: int, checks: list[Check], metrics: dict[int, list[dict[str, Any]]],
            observed: set[str], started: float, keep: bool, work_dir: str, *, failed: bool) -> SmokeReport:
    logs = os.path.join(work_dir, "logs")
    return SmokeReport(
        uri=uri, replicas=replicas, rounds=ROUNDS, checks=checks, round_stats=_round_stats(metrics),
        observed_round_objects=len(observed), seconds=round(time.monotonic() - started, 2), kept=keep,
        log_dir=logs if (failed or keep) and os.path.isdir(logs) else None,
        ok=not any(c.status == Status.FAIL for c in checks),
    )
