"""The reports the launcher returns and the CLI renders (``-o json`` prints them as they are; ``docs/output-schema
.json`` is their schema), and how a run's report is put together from its replicas' statuses and progress.

Each field is declared once: a replica's row is its backend status (``ReplicaStatus``) and its progress
(``ProgressMetrics``) by inheritance, plus what only a report has, so a field added to either is in the report
(and its schema) without a line here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from diloco.executors.base import ReplicaState, ReplicaStatus, RunState, RunStatus
from diloco.launcher.progress import MetricsReadout, ProgressMetrics

if TYPE_CHECKING:
    from diloco.launcher.runs import RunRecord
    from diloco.store.objects import ObjectStore


class ReplicaReport(ReplicaStatus, ProgressMetrics):
    """One replica: its backend state and its latest metrics (``None`` until it has reported any)."""

    eval_trend: str | None = None  # `diloco status`: first and latest eval loss around a sparkline
    async_last_upload_at: float | None = None  # async mode: when the master last received this replica's delta
    async_staleness: int | None = None  # async mode: global versions its last delta lagged behind
    stderr_tail: list[str] = Field(default_factory=list)  # only for failed replicas

    @classmethod
    def of(cls, status: ReplicaStatus, progress: ProgressMetrics | None) -> ReplicaReport:
        """A replica's backend status and its latest metrics, as one row."""
        metrics = progress.model_dump(include=set(ProgressMetrics.model_fields)) if progress is not None else {}
        return cls.model_validate({**metrics, **dict(status)})


class PartShare(BaseModel):
    """One part of a run split over backends: its backend, its replicas and what they billed (summed)."""

    part: int
    backend: str
    ranks: list[int]
    billable_s: float | None = None
    cost_usd: float | None = None


class MembershipChange(BaseModel):
    """An elastic run's membership where it changed: round ``round`` (numbered from 1) averaged ``members``;
    ``joined`` took part for the first time, ``left`` had taken part in the round before and not in this one."""

    round: int
    members: list[int]
    joined: list[int] = Field(default_factory=list)
    left: list[int] = Field(default_factory=list)


class RunReport(BaseModel):
    """A run as the CLI shows it; ``-o json`` prints exactly this (plus ``schema_version``)."""

    run_id: str
    backend: str
    state: RunState
    created_at: float
    ended_at: float | None = None  # when the last replica ended, once the run is terminal
    rendezvous_uri: str
    replicas: int  # how many replicas the run has (the same word everywhere)
    ranks: list[ReplicaReport]  # one row per replica, in rank order
    timed_out: bool = False  # a replica hit the run's time limit (timeout_s)
    billable_s: float | None = None  # summed over replicas, on backends that bill
    cost_usd: float | None = None  # estimated, summed over replicas (each replica's cost_source says from what)
    initial_eval_loss: float | None = None  # mean over replicas of the loss before training
    latest_eval_loss: float | None = None  # the model's latest eval loss: mean over the replicas at the latest round
    final_eval_loss: float | None = None  # the final model's: mean over the replicas that succeeded holding it
    diverged: bool = False  # some replica recorded a NaN or infinite loss
    weights_identical: bool | None = None  # set by collect (and launch's summary)
    weights_detail: str | None = None
    model_path: str | None = None  # where collect wrote the agreed model
    warnings: list[str] = Field(default_factory=list)  # e.g. metric rows a trainer wrote that could not be read
    async_global_version: int | None = None  # async mode: the latest global version the master published
    #: ``min_replicas`` runs only: ranks that failed for good while the run went on without them (their rounds
    #: were committed by the others; they hold no final weights). Empty when every replica took part to the end.
    left_behind: list[int] = Field(default_factory=list)
    #: Failed replicas that a relaunch can still bring back (killed or lost, restarts left, the run not cancelled
    #: and not failed for good): the run is ``running`` and goes on once they rejoin. A waiting ``diloco launch``
    #: or ``diloco watch`` relaunches them; with nobody waiting, ``diloco watch RUN`` does.
    awaiting_relaunch: list[int] = Field(default_factory=list)
    #: A run split over backends (``--backend mixed``): each part's replicas and their billing, summed; empty for a
    #: run on one backend.
    parts: list[PartShare] = Field(default_factory=list)
    #: An elastic run (``--max-replicas``) that was scaled: the committed rounds where its members changed (the
    #: first round included), read from the rounds' manifests; empty for a run of fixed replicas or never scaled.
    membership: list[MembershipChange] = Field(default_factory=list)

    @property
    def failed(self) -> list[ReplicaReport]:
        return [r for r in self.ranks if r.state == ReplicaState.FAILED]


class RunSummary(BaseModel):
    """One line of ``diloco runs``."""

    # Filled from the run's record by these names (``summarize_runs``), and its state.

    run_id: str
    created_at: float
    backend: str
    replicas: int
    state: RunState
    rendezvous_uri: str
    left_behind: list[int] = Field(default_factory=list)  # as in the run's report: a succeeded min_replicas run's


def run_report(record: RunRecord, status: RunStatus, readout: MetricsReadout, *, state: RunState,
               left_behind: list[int], awaiting_relaunch: list[int]) -> RunReport:
    """The run's report from its replicas' statuses and progress, once its state is judged
    (``diloco.launcher.lifecycle``): the per-replica rows, and the run's totals, means and model losses."""
    progress = readout.by_rank()
    ranks = [ReplicaReport.of(s, progress.get(s.rank)) for s in sorted(status.replicas, key=lambda s: s.rank)]
    ended = [r.ended_at for r in ranks if r.ended_at is not None]
    by_round = record.policy.mode != "async"
    return RunReport(run_id=record.run_id, backend=record.backend, state=state, created_at=record.created_at,
                     rendezvous_uri=record.rendezvous_uri, replicas=record.replicas, ranks=ranks,
                     ended_at=max(ended) if state.is_terminal and ended else None,
                     timed_out=any(r.timed_out for r in ranks),
                     billable_s=_total([r.billable_s for r in ranks]), cost_usd=_total([r.cost_usd for r in ranks]),
                     initial_eval_loss=_mean([r.initial_eval_loss for r in ranks]),
                     latest_eval_loss=model_eval_loss(ranks, by_round=by_round),
                     diverged=any(r.diverged for r in ranks),
                     final_eval_loss=model_eval_loss(ranks, final=True, by_round=True)
                     if state == RunState.SUCCEEDED else None,
                     warnings=readout.warnings, left_behind=left_behind, awaiting_relaunch=awaiting_relaunch,
                     parts=_shares(ranks),
                     **({"weights_identical": False, "weights_detail": record.weights_disagree}
                        if record.weights_disagree is not None else {}))


def add_async_status(report: RunReport, store: ObjectStore) -> None:
    """Async runs (``train.mode: async``): the published global version, each replica's last upload and its
    staleness, from the master's metadata. A synchronous run has none: one missing object, nothing changes."""
    from diloco.launcher.async_status import read_async_status
    from diloco.replica.async_diloco.record import node_of_rank

    try:
        published = read_async_status(store)
    except Exception:  # noqa: BLE001 - status must show the run even when this extra read fails
        return
    if published is None:
        return
    report.async_global_version = published.version
    for rep in report.ranks:
        worker = published.workers.get(node_of_rank(rep.rank))
        if worker is not None:
            rep.async_last_upload_at = worker.last_upload_time
            rep.async_staleness = worker.staleness


def _shares(ranks: list[ReplicaReport]) -> list[PartShare]:
    """Per part of a run split over backends, in part order; [] for a run on one backend."""
    by_part: dict[int, list[ReplicaReport]] = {}
    for rep in ranks:
        if rep.part is not None:
            by_part.setdefault(rep.part, []).append(rep)
    return [PartShare(part=part, backend=reps[0].backend or "", ranks=[r.rank for r in reps],
                      billable_s=_total([r.billable_s for r in reps]), cost_usd=_total([r.cost_usd for r in reps]))
            for part, reps in sorted(by_part.items())]


def _total(values: list[float | None]) -> float | None:
    """The sum of the known values; None when none is known (a backend that does not bill)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def model_eval_loss(ranks: list[ReplicaReport], *, final: bool = False, by_round: bool = True) -> float | None:
    """The eval loss of the run's model: the mean over the replicas that hold it, never a stale one.

    A replica's eval loss is that of the model after the last round it took part in, and every replica of one
    round holds the same global model. So a replica behind its peers (dropped from a round, failed, or being
    relaunched: its loss is an earlier round's model) is left out: the mean is over the replicas at the latest
    round among those that have not failed (over the failed ones only when no other reported). ``final``: only
    the replicas that succeeded, at the last round (what ``collect`` writes). ``by_round=False`` (async runs,
    whose workers' rounds do not line up) keeps every replica that has not failed."""
    reported = [r for r in ranks if r.step and isinstance(r.eval_loss, (int, float)) and math.isfinite(r.eval_loss)]
    if final:
        holders = [r for r in reported if r.state == ReplicaState.SUCCEEDED]
    else:
        holders = [r for r in reported if r.state != ReplicaState.FAILED] or reported
    if by_round and holders:
        latest = max(r.round or 0 for r in holders)
        holders = [r for r in holders if (r.round or 0) == latest]
    return _mean([r.eval_loss for r in holders])
