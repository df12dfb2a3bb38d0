"""What the CLI commands do, without the CLI: plan, launch, watch, cancel, collect a run.

Each function takes plain values (a ``RunConfig``, a ``RunRecord``, an executor) and returns pydantic reports
that the CLI renders as a table or JSON; none of them prints. The replicas' progress comes from the metrics
they write to the store (``metrics/rank_RRRR.jsonl``), their fate from the backend (``executor.poll``).

Fail-fast: replicas meet at every outer round, so once one replica has *failed* the others can only wait for it
until ``store.timeout_s`` and then fail too. Commands that wait on a run (``launch``, ``collect``,
``status --watch``) therefore stop the surviving replicas as soon as one fails, unless told not to.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from diloco.config import RunConfig
from diloco.errors import ConfigError, CorruptObjectError, DilocoError, ObjectNotFound
from diloco.executors import create_executor, require_available
from diloco.executors.base import (
    EntrypointArgs,
    LaunchPlan,
    LaunchSpec,
    ReplicaHandle,
    ReplicaStatus,
    RunState,
    aggregate_state,
)
from diloco.layout import FINAL_KEY, METRICS_KEY, RUN_INFO_KEY
from diloco.logstream import LogRecord, follow_merged, merged, records_for, tail
from diloco.runs import RunRecord, RunRegistry, default_local_rendezvous, new_run_id

if TYPE_CHECKING:
    from diloco.executors.base import ServerlessExecutor
    from diloco.store import ObjectStore


# ---------------------------------------------------------------------------------------------- reports
class ReplicaReport(BaseModel):
    """One replica: its backend state and its latest metrics (``None`` until it has reported any)."""

    rank: int
    state: RunState
    job_id: str = ""
    exit_code: int | None = None
    reason: str | None = None
    step: int | None = None
    total_steps: int | None = None
    round: int | None = None
    train_loss: float | None = None
    eval_loss: float | None = None
    initial_eval_loss: float | None = None
    tokens_per_s: float | None = None
    sync_s: float | None = None
    bytes_written: int | None = None
    bytes_read: int | None = None
    finished_training: bool = False  # the trainer recorded its "final" metrics
    stderr_tail: list[str] = Field(default_factory=list)  # only for failed replicas


class RunReport(BaseModel):
    """A run as the CLI shows it; ``-o json`` prints exactly this (plus ``schema_version``)."""

    run_id: str
    backend: str
    state: RunState
    created_at: float
    rendezvous_uri: str
    world_size: int
    replicas: list[ReplicaReport]
    initial_eval_loss: float | None = None  # mean over replicas of the loss before training
    final_eval_loss: float | None = None  # mean over replicas of the last recorded eval loss
    weights_identical: bool | None = None  # set by collect (and launch's summary)
    weights_detail: str | None = None
    model_path: str | None = None  # where collect wrote the agreed model

    @property
    def failed(self) -> list[ReplicaReport]:
        return [r for r in self.replicas if r.state == RunState.FAILED]


class RunSummary(BaseModel):
    """One line of ``diloco runs``."""

    run_id: str
    created_at: float
    backend: str
    replicas: int
    state: RunState
    rendezvous_uri: str


# ---------------------------------------------------------------------------------------------- plan/launch
def executor_options(cfg: RunConfig) -> dict[str, Any]:
    """The backend section of the config as executor constructor options (``kind`` removed)."""
    return cfg.backend.model_dump(exclude={"kind"})


def rendezvous_for(cfg: RunConfig, run_id: str) -> str:
    """The run's rendezvous URI: the configured one with ``{run_id}`` expanded, else the local default."""
    if cfg.store.rendezvous:
        return cfg.store.rendezvous.replace("{run_id}", run_id).rstrip("/")
    return default_local_rendezvous(run_id)


def build_spec(cfg: RunConfig, run_id: str) -> LaunchSpec:
    """The backend-neutral launch spec. The trainer gets ``total_steps``/``sync_every`` from ``train``."""
    trainer_kwargs = {"total_steps": cfg.train.steps, "sync_every": cfg.train.sync_every, **cfg.train.trainer_kwargs}
    args = EntrypointArgs(rendezvous_uri=rendezvous_for(cfg, run_id), world_size=cfg.replicas,
                          trainer=cfg.train.trainer, trainer_kwargs=trainer_kwargs, timeout_s=cfg.store.timeout_s,
                          poll_interval_s=cfg.store.poll_interval_s)
    return LaunchSpec(run_id=run_id, n_replicas=cfg.replicas, entrypoint_args=args, gpu=cfg.gpu,
                      timeout_s=cfg.timeout_s)


def check_trainer_importable(cfg: RunConfig) -> None:
    """For local replicas (this interpreter, this working directory): ``ConfigError`` if ``train.trainer``'s
    module cannot be found, so a typo fails before launch instead of in every replica. Imports only the module's
    parent packages; other backends import it in their own image, so they are not checked here."""
    import importlib.util
    import sys

    if cfg.backend.kind != "local" or getattr(cfg.backend, "python", None):
        return
    module = cfg.train.trainer.split(":", 1)[0]
    cwd = os.getcwd()
    sys.path.insert(0, cwd)  # `python -m` puts the replica's working directory (this one) on its path
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        found = False
    finally:
        sys.path.remove(cwd)
    if not found:
        raise ConfigError(f"train.trainer: module {module!r} is not importable here (looked in {cwd} and "
                          f"the installed packages)",
                          hint="check the spelling, install its package, or launch from the directory that holds it")


def plan_run(cfg: RunConfig, run_id: str | None = None) -> tuple[ServerlessExecutor, LaunchPlan]:
    """The executor and its dry-run plan. Pure: no process, no directory, no registry entry, no network."""
    require_available(cfg.backend.kind)
    executor = create_executor(cfg.backend.kind, **executor_options(cfg))
    return executor, executor.plan(build_spec(cfg, run_id or new_run_id()))


def launch(cfg: RunConfig, registry: RunRegistry | None = None) -> tuple[RunRecord, ServerlessExecutor]:
    """Plan, check the rendezvous is unused, record the run, submit. A failed submit leaves no record."""
    from diloco.store import ObjectStore

    registry = registry or RunRegistry()
    registry.prepare()  # an unwritable DILOCO_HOME fails here, before the store is touched
    executor, plan = plan_run(cfg)
    spec = plan.spec
    uri = spec.entrypoint_args.rendezvous_uri
    store = ObjectStore(uri)
    leftovers = store.list()
    if leftovers:
        raise ConfigError(
            f"store.rendezvous: {uri} already holds {len(leftovers)} object(s) (e.g. {leftovers[0]}); replicas "
            f"would read a previous run's contributions",
            hint="use a fresh prefix (put {run_id} in store.rendezvous) or delete the old objects",
        )
    record = RunRecord(run_id=spec.run_id, backend=plan.backend, created_at=time.time(), rendezvous_uri=uri,
                       world_size=spec.n_replicas, config=cfg.model_dump(mode="json"),
                       executor_options=executor_options(cfg))
    store.put(RUN_INFO_KEY, json.dumps({"run_id": spec.run_id, "config": record.config}, indent=2).encode())
    registry.save(record)  # first, so a crash mid-submit still leaves something `diloco cancel` can find
    try:
        record.handles = executor.submit(plan)
    except BaseException:
        registry.delete(record.run_id)
        raise
    registry.save(record)
    return record, executor


def executor_for(record: RunRecord) -> ServerlessExecutor:
    """The executor that manages ``record``'s replicas, rebuilt from the options recorded at launch."""
    return create_executor(record.backend, **record.executor_options)


# ---------------------------------------------------------------------------------------------- observe
def read_metrics(store: ObjectStore, world_size: int) -> dict[int, list[dict[str, Any]]]:
    """Each rank's metrics records so far (absent or unreadable objects count as none yet)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for rank in range(world_size):
        try:
            raw = store.get(METRICS_KEY.format(rank=rank))
        except ObjectNotFound:
            out[rank] = []
            continue
        rows = []
        for line in raw.decode(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        out[rank] = rows
    return out


def _replica_report(status: ReplicaStatus, rows: list[dict[str, Any]]) -> ReplicaReport:
    rep = ReplicaReport(rank=status.rank, state=status.state, job_id=status.job_id, exit_code=status.exit_code,
                        reason=status.reason)
    init = next((r for r in rows if r.get("kind") == "init"), None)
    if init is not None:
        rep.initial_eval_loss = init.get("eval_loss")
    if rows:
        last = rows[-1]
        rep.step, rep.total_steps, rep.round = last.get("step"), last.get("total_steps"), last.get("round")
        rep.eval_loss = last.get("eval_loss")
        rep.train_loss = last.get("train_loss")
        rep.tokens_per_s = last.get("tokens_per_s")
        rep.sync_s, rep.bytes_written, rep.bytes_read = last.get("sync_s"), last.get("bytes_written"), \
            last.get("bytes_read")
        rep.finished_training = last.get("kind") == "final"
    return rep


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None


def stderr_tail(executor: ServerlessExecutor, handle: ReplicaHandle, n: int = 10) -> list[str]:
    """The last lines a replica wrote to stderr (or to its log, for backends without separate streams)."""
    native = getattr(executor, "stderr_tail", None)
    if native is not None:
        return native(handle, n)
    return [r.text for r in tail((r for r in records_for(executor, handle, follow=False) if r.stream == "err"), n)]


class RunView:
    """A run being observed: its record, executor and store, polled on demand."""

    def __init__(self, record: RunRecord, executor: ServerlessExecutor | None = None,
                 registry: RunRegistry | None = None) -> None:
        self.record = record
        self.executor = executor or executor_for(record)
        self.registry = registry

    @functools.cached_property
    def store(self) -> ObjectStore:
        """The run's rendezvous store, opened on first use (``diloco logs`` never needs it)."""
        from diloco.store import ObjectStore

        return ObjectStore(self.record.rendezvous_uri)

    @property
    def handles(self) -> list[ReplicaHandle]:
        return sorted(self.record.handles, key=lambda h: h.rank)

    def statuses(self) -> list[ReplicaStatus]:
        return [self.executor.poll(h) for h in self.handles]

    def report(self, statuses: list[ReplicaStatus] | None = None, *, with_stderr: bool = True) -> RunReport:
        """Poll the backend (unless ``statuses`` are given) and read the metrics; failed replicas' stderr."""
        statuses = statuses if statuses is not None else self.statuses()
        metrics = read_metrics(self.store, self.record.world_size)
        replicas = [_replica_report(s, metrics.get(s.rank, [])) for s in statuses]
        state = aggregate_state([r.state for r in replicas]) if replicas else RunState.PENDING
        report = RunReport(run_id=self.record.run_id, backend=self.record.backend, state=state,
                           created_at=self.record.created_at, rendezvous_uri=self.record.rendezvous_uri,
                           world_size=self.record.world_size, replicas=replicas,
                           initial_eval_loss=_mean([r.initial_eval_loss for r in replicas]),
                           final_eval_loss=_mean([r.eval_loss for r in replicas if r.step]))
        self._remember(report.state)
        return self._add_stderr(report) if with_stderr else report

    def _add_stderr(self, report: RunReport) -> RunReport:
        """Attach the last stderr lines of every failed replica (they usually say why)."""
        for rep, handle in zip(report.replicas, self.handles, strict=True):
            if rep.state == RunState.FAILED:
                rep.stderr_tail = stderr_tail(self.executor, handle)
        return report

    def _remember(self, state: RunState) -> None:
        """Cache a terminal state in the record, so ``diloco runs`` need not poll finished runs."""
        if state.is_terminal and self.registry is not None and self.record.final_state != state.value:
            self.record.final_state = state.value
            self.registry.save(self.record)

    def cancel(self, ranks: list[int] | None = None) -> list[ReplicaStatus]:
        """Stop the (given) non-terminal replicas; returns every replica's status afterwards. Idempotent."""
        targets = [h for h in self.handles if (ranks is None or h.rank in ranks)
                   and not self.executor.poll(h).state.is_terminal]
        many = getattr(self.executor, "cancel_many", None)
        if many is not None:
            many(targets)
        else:
            for h in targets:
                self.executor.cancel(h)
        return self.statuses()

    def wait(
        self,
        *,
        timeout_s: float | None = None,
        poll_interval_s: float = 1.0,
        on_update: Callable[[RunReport], None] | None = None,
        on_fail_fast: Callable[[ReplicaReport, list[int]], None] | None = None,
        fail_fast: bool = True,
    ) -> tuple[RunReport, bool]:
        """Poll until the run's outcome is decided; ``(report, timed_out)``. KeyboardInterrupt propagates.

        Decided means every replica is terminal, or one has failed. With ``fail_fast`` a failure also gets
        the survivors stopped (``on_fail_fast(failed, survivors)`` is told first) and waits for them to end;
        without it the survivors are left running (they will wait for the failed one until store.timeout_s).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            statuses = self.statuses()
            report = self.report(statuses, with_stderr=False)
            if on_update is not None:
                on_update(report)
            if all(s.state.is_terminal for s in statuses):
                return self._add_stderr(report), False
            failed = [r for r in report.replicas if r.state == RunState.FAILED]
            if failed:
                if not fail_fast:
                    return self._add_stderr(report), False
                survivors = [s.rank for s in statuses if not s.state.is_terminal]
                if on_fail_fast is not None:
                    on_fail_fast(failed[0], survivors)
                return self.report(self.cancel(survivors)), False
            if deadline is not None and time.monotonic() >= deadline:
                return self._add_stderr(report), True
            time.sleep(poll_interval_s)

    # ------------------------------------------------------------------------------------------ logs
    def log_lines(self, *, ranks: list[int] | None = None, follow: bool = False,
                  tail_n: int | None = None) -> Iterator[LogRecord]:
        """All (or ``ranks``') replicas' lines merged in time order; ``tail_n`` lines per replica at most.

        With ``follow``, the backlog comes first (time-ordered), then new lines as they arrive, until every
        followed replica has ended.
        """
        handles = [h for h in self.handles if ranks is None or h.rank in ranks]
        backlogs = [list(records_for(self.executor, h, follow=False)) for h in handles]
        yield from merged([tail(b, tail_n) for b in backlogs])
        if not follow:
            return

        def rest(handle: ReplicaHandle, skip: int) -> Iterator[LogRecord]:
            for i, record in enumerate(records_for(self.executor, handle, follow=True)):
                if i >= skip:
                    yield record

        yield from follow_merged([rest(h, len(b)) for h, b in zip(handles, backlogs, strict=True)])


# ---------------------------------------------------------------------------------------------- collect
def check_final_weights(store: ObjectStore, world_size: int) -> tuple[bool | None, str, Any, dict[str, str]]:
    """Whether every rank's final weights are bitwise identical: ``(verdict, detail, tensors, metadata)``.

    ``verdict`` is None when some rank wrote no final weights (a trainer that does not export them).
    """
    import torch

    from diloco.codec import decode_tensors

    reference: dict[str, torch.Tensor] | None = None
    ref_meta: dict[str, str] = {}
    for rank in range(world_size):
        key = FINAL_KEY.format(rank=rank)
        try:
            data = store.get(key)
        except ObjectNotFound:
            return None, f"replica {rank} wrote no final weights ({store.url(key)} is missing)", None, {}
        try:
            tensors, meta = decode_tensors(data, source=store.url(key))
        except CorruptObjectError as exc:
            return False, str(exc), None, {}
        if reference is None:
            reference, ref_meta = tensors, meta
            continue
        if set(tensors) != set(reference):
            diff = sorted(set(tensors) ^ set(reference))
            return False, f"replica {rank}'s final weights have different tensors than replica 0's ({diff[:3]})", \
                None, {}
        for name in sorted(reference):
            a, b = reference[name], tensors[name]
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                gap = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("nan")
                return False, (f"replica {rank}'s final weights differ from replica 0's in {name!r} "
                               f"(max abs difference {gap:.3g})"), None, {}
    n = sum(t.numel() for t in (reference or {}).values())
    return True, f"{world_size} replica(s) hold identical final weights ({len(reference or {})} tensors, " \
                 f"{n} values)", reference, ref_meta


def write_model(path: str, tensors: Any, meta: dict[str, str], run_id: str) -> str:
    """Write the agreed weights as one safetensors file (atomic); returns its absolute path."""
    from diloco.codec import encode_tensors
    from diloco.store import write_file_atomic

    keep = {k: v for k, v in meta.items() if k != "rank"}  # encode_tensors sets its own format and checksum
    path = os.path.abspath(path)
    write_file_atomic(path, encode_tensors(tensors, {**keep, "run_id": run_id}))
    return path


def add_weights_verdict(view: RunView, report: RunReport) -> tuple[Any, dict[str, str]]:
    """Fill ``report.weights_*`` for a succeeded run; returns the agreed tensors (or None) and metadata."""
    if report.state != RunState.SUCCEEDED:
        return None, {}
    verdict, detail, tensors, meta = check_final_weights(view.store, view.record.world_size)
    report.weights_identical, report.weights_detail = verdict, detail
    return tensors, meta


def summarize_runs(registry: RunRegistry) -> list[RunSummary]:
    """Every recorded run, newest last, with its state (polled unless already known to be terminal)."""
    out = []
    for record in registry.list():
        state = RunState(record.final_state) if record.final_state else None
        if state is None:
            try:
                state = RunView(record, registry=registry).report(with_stderr=False).state
            except DilocoError:
                state = RunState.UNKNOWN
        out.append(RunSummary(run_id=record.run_id, created_at=record.created_at, backend=record.backend,
                              replicas=record.world_size, state=state, rendezvous_uri=record.rendezvous_uri))
    return out
