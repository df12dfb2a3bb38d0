"""`diloco smoke`: the cheapest end-to-end proof that a backend and a rendezvous store work for DiLoCo.

It runs N replicas (2 by default) of a tiny model (the built-in trainer: 1 layer, n_embd 32, 2 outer rounds) on
the chosen backend (the config's, else the default one: local processes), meeting through the given store, then
checks:

1. every replica exited 0;
2. every rank completed every round: read from each rank's ``metrics/rank_RRRR.jsonl`` (one ``round`` record
   per completed outer round, then ``final``). This, not the round objects, is the authority: writers delete their
   round k-1 object once round k is complete, so after a run only the last round's objects remain, and a tiny
   round can come and go between two polls. The smoke still polls the store while it runs and reports how many
   ``round_NNNNNN/rank_RRRR`` objects it saw, as evidence that they went through the store;
3. all final weights are bitwise identical (the point of DiLoCo's synchronized outer step);
4. the per-round wall time, time blocked in the all-reduce and bytes moved, from the same metrics.

It runs under a fresh sub-prefix ``smoke-<time>-<hex>`` of the store (a temporary ``file://`` directory when no
S3 URI is given and the backend's replicas can reach this machine's files) and deletes that sub-prefix afterwards
unless ``keep``; nothing outside it is touched. A backend that keeps its own files of a run under the rendezvous
(shipped code, uploaded artifacts) has them deleted with it.

**Money.** Before anything is created the backend is asked what the plan would cost
(``Backend.estimate_cost``); a smoke that would spend money refuses to start without ``yes``, saying how much
(``ConfigError``: exit 2, nothing launched, nothing written). Afterwards the report carries the billable seconds
and the estimated cost the backend reports, summed over the replicas.

The backend section is built without naming any backend: the config's ``backend`` (``--config``), switched by
``--backend``, with the backend flags the chosen backend takes (``config_type(kind).flags``: ``--role``,
``--image``, ...), plus a few smoke preferences applied only where the backend has such a field (``SMOKE_FIELDS``).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from diloco.errors import ConfigError
from diloco.executors.checks import Check, Status

if TYPE_CHECKING:
    from diloco.executors.base import BackendConfig, LaunchPlan, LaunchSpec, ServerlessExecutor
    from diloco.launcher.run import Run
    from diloco.launcher.runs import RunRecord

#: The tiny model and schedule: seconds per round on a laptop core, yet the full DiLoCo path.
TINY_TRAINER_KWARGS: dict[str, Any] = {
    "n_layer": 1, "n_head": 1, "n_embd": 32, "block_size": 16, "batch_size": 4, "eval_batches": 1,
    "max_corpus_bytes": 100_000, "threads": 1,
}
SYNC_EVERY = 2
ROUNDS = 2
MAX_REPLICAS = 16
#: Each replica's own work, for the cost estimate: starting Python and torch, 4 tiny steps, 2 rounds through the
#: store, and waiting at the first round for a peer whose job started later (cloud jobs start a minute or more
#: apart). What the backend bills on top (start-up, image download) is the backend's to add.
EXPECTED_WORK_S = 120.0
#: How often a backend that places replicas on its own machines (a cloud API) is asked for the replicas' states:
#: its describe calls are rate-limited, and its jobs take minutes anyway.
REMOTE_STATUS_INTERVAL_S = 2.0
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
    backend: str = ""  # the backend the replicas ran on
    replicas: int
    rounds: int
    checks: list[Check]
    round_stats: list[RoundStat]
    observed_round_objects: int  # round objects seen while polling (evidence, not the verdict; see module doc)
    seconds: float
    kept: bool
    log_dir: str | None = None  # kept when something failed
    timed_out: bool = False  # the replicas had not finished within the timeout (the CLI exits 124)
    expected_cost_usd: float | None = None  # the backend's estimate before the start (None: free or unknown)
    expected_cost_detail: str | None = None  # how that estimate was reckoned
    billable_s: float | None = None  # what the backend bills, summed over replicas (None: it does not bill)
    cost_usd: float | None = None  # the estimated cost of those seconds, summed over replicas
    cost_source: str | None = None  # where the prices came from
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
    backend: str | Mapping[str, Any] | None = None,
    yes: bool = False,
) -> SmokeReport:
    """Run the smoke (see the module docstring) on ``backend`` (a name or a ``backend:`` section; default: the
    default backend). Raises ``ConfigError`` for bad input and for a smoke that would cost money without ``yes``
    (nothing created then); otherwise every problem becomes a failed check in the report.

    Ctrl-C, SIGTERM and SIGHUP stop it the same way: the replicas are stopped (and waited for), then, unless
    ``keep``, its store prefix and temporary directory are deleted, and ``KeyboardInterrupt`` propagates."""
    from diloco.executors.signals import terminate_as_interrupt

    with terminate_as_interrupt():
        return _run_smoke(s3_uri=s3_uri, replicas=replicas, keep=keep, timeout_s=timeout_s,
                          poll_interval_s=poll_interval_s, progress=progress, backend_choice=backend, yes=yes)


class SmokeTarget(BaseModel):
    """Where and on what the smoke runs, resolved from the command line."""

    backend: dict[str, Any]  # the backend section, validated by its backend's own model
    s3_uri: str | None  # the store prefix (None: a temporary file:// store)


def resolve_target(*, config_path: str | Path | None = None, backend: str | None = None, s3: str | None = None,
                   backend_flags: Mapping[str, Any] | None = None,
                   env: Mapping[str, str] | None = None) -> SmokeTarget:
    """The backend section and store for ``diloco smoke``, by the launch's own rules: the config's backend
    (``config_path``), switched by ``backend``, with the backend flags (``{"role": ARN}``) the chosen backend takes
    (one it does not take is a ``ConfigError``); the store from ``s3``, else the config's s3:// rendezvous, else
    ``$DILOCO_S3_URI``. A given config must be valid as a whole (with the smoke's store as its rendezvous)."""
    from diloco.launcher.config import backend_config, merge_sources, validate
    from diloco.store.s3 import resolve_s3_uri

    data = merge_sources(config_path, {"backend": backend}, backend_flags=dict(backend_flags or {}))
    store = data.get("store") if isinstance(data.get("store"), dict) else {}
    rendezvous = store.get("rendezvous") if isinstance(store.get("rendezvous"), str) else None
    uri = resolve_s3_uri(s3, rendezvous, env)
    section = _as_section(data.get("backend"))
    require_reachable_store(backend_config(section), uri)
    if config_path is not None:
        validate({**data, "store": {**store, "rendezvous": f"{uri}/{{run_id}}" if uri else rendezvous}})
    return SmokeTarget(backend=section, s3_uri=uri)


def require_reachable_store(config: BackendConfig, s3_uri: str | None) -> None:
    """``ConfigError`` when no S3 prefix is given and the backend's replicas cannot meet in this machine's files."""
    if s3_uri is None and config.rendezvous_problem("file"):
        raise ConfigError(f"--s3: the {config.kind} backend's replicas cannot reach this machine's files, so the smoke "
                          f"needs an s3://bucket/prefix for them to meet in",
                          hint="pass --s3 s3://<bucket>/<prefix>, or set an s3:// store.rendezvous (--config) or "
                               "$DILOCO_S3_URI")


def _as_section(backend: Any) -> dict[str, Any]:
    """A merged config's ``backend`` (a name, a mapping, or absent) as a mapping with its ``kind``."""
    from diloco.executors import DEFAULT_BACKEND

    if isinstance(backend, str):
        return {"kind": backend}
    section = dict(backend) if isinstance(backend, Mapping) else {}
    section.setdefault("kind", DEFAULT_BACKEND)
    return section


def format_usd(usd: float) -> str:
    """``$0.046``, ``$0.00064``, ``$1.25``: enough digits to tell a smoke's cost from zero."""
    return f"${usd:.2f}" if usd >= 1 else f"${usd:.2g}" if usd < 0.001 else f"${usd:.3g}"


def _run_smoke(
    *,
    s3_uri: str | None,
    replicas: int,
    keep: bool,
    timeout_s: float,
    poll_interval_s: float,
    progress: Callable[[str], None] | None,
    backend_choice: str | Mapping[str, Any] | None,
    yes: bool,
) -> SmokeReport:
    """``run_smoke``'s body, run with SIGTERM and SIGHUP taking Ctrl-C's path."""
    from diloco.executors.base import ReplicaState
    from diloco.executors.signals import signals_deferred
    from diloco.launcher.run import Run
    from diloco.launcher.runs import RunRecord
    from diloco.launcher.weights import check_final_weights
    from diloco.replica.metric_rows import read_history
    from diloco.store.objects import ObjectStore
    from diloco.store.s3 import parse_s3_uri

    say = progress or (lambda _msg: None)
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(f"--replicas must be between 1 and {MAX_REPLICAS} (got {replicas})")
    if s3_uri is not None:
        parse_s3_uri(s3_uri)
    run_id = f"smoke-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    work_dir = tempfile.mkdtemp(prefix="diloco-smoke-")
    try:  # everything that can refuse the smoke, before anything is created or written
        backend = _smoke_backend(backend_choice, work_dir)
        require_reachable_store(backend.config, s3_uri)
        uri = f"{s3_uri.rstrip('/')}/{run_id}" if s3_uri else f"file://{work_dir}/store/{run_id}"
        plan = backend.plan(_smoke_spec(run_id, replicas, uri, timeout_s, poll_interval_s))
        expected_usd, expected_detail = _expected_cost(backend, plan, yes)
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    started = time.monotonic()
    checks: list[Check] = []
    metrics: dict[int, list[dict[str, Any]]] = {}
    observed: set[str] = set()
    failed = True
    interrupted = False
    record: RunRecord | None = None
    store = ObjectStore(uri)
    # Cloud APIs rate-limit their describe calls, and their jobs take minutes: no need to ask five times a second.
    status_every = REMOTE_STATUS_INTERVAL_S if backend.config.places_some_replicas() else poll_interval_s

    def report_of(*, failed: bool) -> SmokeReport:
        """The report of what was checked so far (``failed``: keep the replicas' log directory in it)."""
        return _report(uri, plan.backend, replicas, checks, metrics, observed, started, keep, work_dir,
                       failed=failed, expected=(expected_usd, expected_detail))

    try:
        say(f"smoke {run_id}: {replicas} replica(s) on {plan.backend}, {ROUNDS} round(s), rendezvous {uri}")
        if expected_detail is not None:
            amount = format_usd(expected_usd) if expected_usd is not None else "an unknown amount"
            say(f"expected cost: about {amount} ({expected_detail})")
        try:  # fail in seconds, not after the all-reduce timeout, when the store refuses us
            store.put("smoke.json", f'{{"run_id": "{run_id}", "replicas": {replicas}}}'.encode())
            store.get("smoke.json")
        except Exception as exc:  # noqa: BLE001 - becomes the report
            checks.append(Check(name="store writable", status=Status.FAIL, detail=f"{type(exc).__name__}: {exc}",
                                fix=getattr(exc, "hint", None) or "run `diloco doctor --s3 <uri>`"))
            return report_of(failed=True)
        checks.append(Check(name="store writable", status=Status.PASS, detail=store.url()))

        record = RunRecord(run_id=run_id, backend=plan.backend, created_at=time.time(), rendezvous_uri=uri,
                           replicas=replicas, config={"backend": backend.config.model_dump(mode="json")})
        run = Run(record, backend)
        try:
            record.handle = backend.submit(plan, on_progress=lambda h: setattr(
                record, "handle", h.model_dump(mode="json"))).model_dump(mode="json")
        except BaseException:
            _await_rollback(run)
            raise
        try:
            report, timed_out = run.wait_for_outcome(timeout_s=timeout_s, poll_interval_s=status_every,
                                                      on_update=lambda _r: observed.update(_observe(store)))
            observed |= _observe(store)
        finally:
            _stop_replicas(run)  # timed out, or Ctrl-C: stop the replicas before anything else
        report = run.report(with_stderr=True)
        timed_out = timed_out or report.timed_out  # a replica hit its own time limit
        bad = [r for r in report.ranks if r.state != ReplicaState.SUCCEEDED]
        if bad:
            lines = []
            for r in bad:
                why = r.stderr_tail[-1] if r.stderr_tail else (r.reason or "")
                lines.append(f"rank {r.rank} {r.state.value} (exit {r.exit_code}): {why}".strip())
            logs = _where_logs_are(work_dir, run_id, [r.job_id for r in bad])
            checks.append(Check(name="replicas exited 0", status=Status.FAIL,
                                detail=(f"timed out after {timeout_s:g}s; " if timed_out else "") + "; ".join(lines),
                                fix=f"a slow store or machine: raise --timeout; {logs}" if timed_out else logs))
        else:
            checks.append(Check(name="replicas exited 0", status=Status.PASS, detail=f"{replicas} replica(s)"))

        metrics = {rank: [row.model_dump() for row in read_history(store, rank)[0]] for rank in range(replicas)}
        checks.append(_rounds_check(metrics, ROUNDS, len(observed), replicas))
        weights = check_final_weights(store, replicas)
        checks.append(Check(name="final weights bitwise identical",
                            status=Status.PASS if weights.identical else Status.FAIL, detail=weights.detail,
                            fix=None if weights.identical else "the replicas diverged or did not finish; see the checks "
                                                               "above"))
        failed = any(c.status == Status.FAIL for c in checks)
        result = report_of(failed=failed)
        result.timed_out = timed_out
        result.billable_s, result.cost_usd = report.billable_s, report.cost_usd
        result.cost_source = "; ".join(sorted({r.cost_source for r in report.ranks if r.cost_source})) or None
        return result
    except KeyboardInterrupt:
        interrupted = True  # the replicas were stopped above; nothing of the smoke is kept
        raise
    finally:
        with signals_deferred():  # another Ctrl-C must not leave half a clean-up behind; it is acted on after
            if not keep:
                try:
                    store.delete_prefix("")
                except Exception as exc:  # noqa: BLE001 - reported, never masks the verdict
                    say(f"could not clean up {uri}: {exc}")
            if not keep and (interrupted or not failed or not os.path.isdir(os.path.join(work_dir, "logs"))):
                _remove_backend_leftovers(backend, record, say)  # e.g. a finished Kubernetes Job, before its TTL
                shutil.rmtree(work_dir, ignore_errors=True)  # kept only with --keep, or for a failure's logs


def _remove_backend_leftovers(backend: ServerlessExecutor[Any, Any], record: RunRecord | None,
                              say: Callable[[str], None]) -> None:
    """What the backend keeps of the smoke's run besides the store (``Backend.remove``); reported, never raised."""
    if record is None or record.handle is None:
        return
    try:
        backend.remove(backend.load_handle(record.handle))
    except Exception as exc:  # noqa: BLE001 - reported, never masks the verdict
        say(f"could not remove what the {record.backend} backend keeps of {record.run_id}: {exc}")


def _smoke_spec(run_id: str, replicas: int, uri: str, timeout_s: float, poll_interval_s: float) -> LaunchSpec:
    """The tiny run: the built-in trainer, ``SYNC_EVERY * ROUNDS`` steps, each job limited to ``timeout_s``."""
    from diloco.executors.base import EntrypointArgs, LaunchSpec

    args = EntrypointArgs(rendezvous_uri=uri, world_size=replicas, timeout_s=max(60.0, timeout_s / 2),
                          poll_interval_s=poll_interval_s,  # tiny rounds: poll the store briskly
                          trainer_kwargs={**TINY_TRAINER_KWARGS, "total_steps": SYNC_EVERY * ROUNDS,
                                          "sync_every": SYNC_EVERY})
    return LaunchSpec(run_id=run_id, replicas=replicas, entrypoint_args=args, timeout_s=timeout_s)


def _expected_cost(backend: ServerlessExecutor[Any, Any], plan: LaunchPlan, yes: bool) -> tuple[float | None, str | None]:
    """The backend's estimate of the plan's cost; ``ConfigError`` (nothing created) when it is not free and the
    user has not said ``yes``."""
    estimate = backend.estimate_cost(plan, EXPECTED_WORK_S)
    if estimate is None:
        return None, None
    usd, detail = estimate
    if not yes:
        amount = f"about {format_usd(usd)}" if usd is not None else "money (how much, diloco cannot tell)"
        raise ConfigError(f"smoke: {plan.spec.replicas} replica(s) on the {plan.backend} backend would cost {amount}: "
                          f"{detail}; nothing was started", hint="pass --yes to run it and spend that")
    return usd, detail


def _where_logs_are(work_dir: str, run_id: str, job_ids: list[str]) -> str:
    """Where a failed replica's whole log is: the smoke's own log directory (kept), else the backend's jobs."""
    if os.path.isdir(os.path.join(work_dir, "logs")):
        return f"replica logs: {os.path.join(work_dir, 'logs', run_id)}"
    ids = ", ".join(j for j in job_ids if j)
    return f"the jobs' logs stay with the backend: {ids}" if ids else "rerun with --keep to inspect the store"


def _stop_replicas(run: Run, patience_s: float = 30.0) -> None:
    """Stop the smoke's replicas and wait until they have ended, so nothing writes into the directory about to be
    deleted. Signals are held meanwhile; another Ctrl-C only hurries the stop (a second cancel kills at once)."""
    from diloco.executors.signals import signals_deferred

    with signals_deferred() as hurry:
        if run.replica_status().terminal:
            return
        run.stop()
        escalated = False
        deadline = time.monotonic() + patience_s
        while not run.replica_status().terminal and time.monotonic() < deadline:
            if hurry() and not escalated:
                run.stop()
                escalated = True
            time.sleep(0.1)


def _await_rollback(run: Run, patience_s: float = 30.0) -> None:
    """After a failed submit, whose backend has already asked what it created to stop: wait until those replicas
    (the ones with a job id) have ended, so nothing (a stopped job's last upload, a replica's last write) lands in
    the prefix after the clean-up. Signals are held meanwhile."""
    from diloco.executors.signals import signals_deferred

    with signals_deferred():
        deadline = time.monotonic() + patience_s
        while time.monotonic() < deadline:
            try:
                created = [r for r in run.replica_status().replicas if r.job_id]
            except Exception:  # noqa: BLE001 - cannot tell: the clean-up goes on, the submit's error is reported
                return
            if all(r.state.is_terminal for r in created):
                return
            time.sleep(0.2)


def _smoke_fields(work_dir: str) -> dict[str, Any]:
    """Settings the smoke prefers, applied only where the chosen backend has the field: its logs in the smoke's
    temporary directory and a short grace period (replicas on this machine), and an empty source directory to
    ship (the smoke runs the built-in trainer: none of your files need to travel, however large)."""
    source = os.path.join(work_dir, "source")
    os.makedirs(source, exist_ok=True)
    return {"log_root": os.path.join(work_dir, "logs"), "grace_period_s": 2.0, "source_dir": source}


def _smoke_backend(choice: str | Mapping[str, Any] | None, work_dir: str) -> ServerlessExecutor[Any, Any]:
    """The backend to run on: ``choice`` (a name or a section; default: the default backend) with the smoke's
    preferences (``_smoke_fields``) where it has such fields. ``ConfigError`` for an invalid section."""
    from diloco.executors import config_type, create_backend
    from diloco.launcher.config import backend_config

    section = _as_section(choice)
    fields = config_type(section["kind"]).model_fields
    wanted = {k: v for k, v in _smoke_fields(work_dir).items() if k in fields}
    return create_backend(backend_config({**section, **wanted}))


def _observe(store: Any) -> set[str]:
    """The round objects in the store right now (listing errors just mean: nothing seen this time)."""
    try:
        return {k for k in store.list() if _ROUND_KEY.match(k)}
    except Exception:  # noqa: BLE001 - a failed poll is not a verdict
        return set()


def _report(uri: str, backend: str, replicas: int, checks: list[Check], metrics: dict[int, list[dict[str, Any]]],
            observed: set[str], started: float, keep: bool, work_dir: str, *, failed: bool,
            expected: tuple[float | None, str | None]) -> SmokeReport:
    logs = os.path.join(work_dir, "logs")
    return SmokeReport(
        uri=uri, backend=backend, replicas=replicas, rounds=ROUNDS, checks=checks, round_stats=_round_stats(metrics),
        expected_cost_usd=expected[0], expected_cost_detail=expected[1],
        observed_round_objects=len(observed), seconds=round(time.monotonic() - started, 2), kept=keep,
        log_dir=logs if (failed or keep) and os.path.isdir(logs) else None,
        ok=not any(c.status == Status.FAIL for c in checks),
    )
