"""Per-replica progress, the launcher's half: every rank's metrics read back from the run's store, validated.

What a replica writes, and where, is ``diloco.replica.metric_rows``; this is what ``diloco status``, ``watch``,
``plot`` and the launch's live table read.

**For readers** (``read_progress``): every row is validated field by field. A bad field (``"train_loss": "abc"``)
or an unreadable line is skipped, and each (rank, field) problem becomes exactly one warning string, returned to
the caller so the CLI can print it once. Non-finite losses are reported as divergence (``diverged: true``, value
``None``), never as NaN.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from diloco.replica.metric_rows import MetricRow, RowProblems, get_text, parse_history
from diloco.store.layout import METRICS_KEY, PROGRESS_KEY

if TYPE_CHECKING:
    from diloco.store.objects import ObjectStore


class ProgressMetrics(BaseModel):
    """What a replica's metrics say of its progress, declared once: ``ReplicaProgress`` reads them back, and each
    row of a run's report (``diloco.launcher.reports.ReplicaReport``) shows them beside the backend's status."""

    step: int | None = None
    total_steps: int | None = None
    round: int | None = None
    train_loss: float | None = None
    eval_loss: float | None = None
    initial_eval_loss: float | None = None  # the eval loss before the first outer round
    tokens: int | None = None
    tokens_per_s: float | None = None
    sync_s: float | None = None
    bytes_written: int | None = None
    bytes_read: int | None = None
    diverged: bool = False  # some recorded loss was NaN or infinite
    finished_training: bool = False  # the newest row is the ``final`` one
    updated_at: float | None = None  # time of the newest row (seconds since the epoch)


class ReplicaProgress(ProgressMetrics):
    """One replica's progress as the CLI shows it: the newest row's values, plus what the history adds."""

    rank: int
    extra: dict[str, float | None] = Field(default_factory=dict)


class MetricsReadout(BaseModel):
    """Every rank's progress, in rank order, and one warning per (rank, field) that had to be skipped."""

    replicas: list[ReplicaProgress]
    warnings: list[str] = Field(default_factory=list)

    def by_rank(self) -> dict[int, ReplicaProgress]:
        return {r.rank: r for r in self.replicas}


def summarize(rank: int, history: list[MetricRow], progress: MetricRow | None) -> ReplicaProgress:
    """Fold one rank's rows into its progress: values from the newest row (history wins a tie), the initial
    eval loss from the history, divergence from any row."""
    rows = list(history) + ([progress] if progress is not None else [])
    out = ReplicaProgress(rank=rank)
    if not rows:
        return out
    latest = history[-1] if history else progress
    if progress is not None and history and (progress.time or 0.0) > (history[-1].time or 0.0):
        latest = progress
    assert latest is not None
    out = ReplicaProgress(
        rank=rank, step=latest.step, total_steps=latest.total_steps, round=latest.round,
        train_loss=latest.train_loss, eval_loss=latest.eval_loss, tokens=latest.tokens,
        tokens_per_s=latest.tokens_per_s, sync_s=latest.sync_s, bytes_written=latest.bytes_written,
        bytes_read=latest.bytes_read, updated_at=latest.time, extra=dict(latest.extra),
        diverged=any(r.diverged for r in rows), finished_training=latest.kind == "final",
    )
    before_training = [r for r in history if r.kind == "init" or r.round == 0]
    out.initial_eval_loss = next((r.eval_loss for r in before_training if r.eval_loss is not None), None)
    return out


def read_replica(store: ObjectStore, rank: int) -> tuple[ReplicaProgress, list[str]]:
    """One rank's progress (history and progress objects) and its warnings."""
    problems = RowProblems(rank)
    history = parse_history(get_text(store, METRICS_KEY.format(rank=rank)) or "", problems)
    progress = None
    text = get_text(store, PROGRESS_KEY.format(rank=rank))
    if text is not None and text.strip():
        rows = parse_history(text.replace("\n", " "), problems)
        progress = rows[-1] if rows else None
    return summarize(rank, history, progress), problems.warnings()


def read_progress(store: ObjectStore, world_size: int) -> MetricsReadout:
    """Every rank's progress; absent objects mean "nothing reported yet". Store errors other than a missing
    object propagate (the caller decides whether a failed poll matters)."""
    replicas, warnings = [], []
    for rank in range(world_size):
        progress, problems = read_replica(store, rank)
        replicas.append(progress)
        warnings += problems
    return MetricsReadout(replicas=replicas, warnings=warnings)


class ProgressCache:
    """The last readout of a run's progress, for a command that reports the run again and again while it waits.

    A waiting command asks the backend about the run as often as the replicas poll the store (five times a
    second by default), but each readout is two GETs per replica, and a replica rewrites its metrics once a
    round and its progress object every few seconds at most: read at that pace, an 8-replica run cost its
    launcher a third of a core and 80 requests a second. A readout is therefore reused for ``max_age_s`` while
    the replicas' states (``key``) stay as they were; any change of state (a replica ended, failed, came back)
    reads afresh, so a report that ends a wait always holds the latest metrics."""

    def __init__(self) -> None:
        self._at = -math.inf
        self._key: Hashable = None
        self._readout: MetricsReadout | None = None

    def read(self, store: ObjectStore, world_size: int, *, key: Hashable, max_age_s: float) -> MetricsReadout:
        """``read_progress(store, world_size)``, or the last readout when it is younger than ``max_age_s`` and was
        read for the same ``key`` and world size. A readout is shared: read it, never change it."""
        now = time.monotonic()
        last = self._readout
        if last is not None and key == self._key and len(last.replicas) == world_size and now - self._at < max_age_s:
            return last
        self._readout, self._key, self._at = read_progress(store, world_size), key, now
        return self._readout
