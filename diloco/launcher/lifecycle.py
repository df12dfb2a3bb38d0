"""A run's state rules, as pure functions over the replicas' statuses and the run's policy; no I/O.

Which failures a relaunch cures, which replicas are lost for good, which a ``min_replicas`` run leaves behind,
whether the run can still finish, what state it is in (the verdict) and how long a relaunch waits: every command
that judges a run (``status``, ``watch``, ``runs``, a waiting ``launch``) asks these, so each rule is written once,
here, and is tested with hand-built statuses (``tests/launcher/test_lifecycle_rules.py``).

What the rules need beyond the statuses comes in two values: the run's ``RunPolicy`` (its settings that decide,
recorded with the run) and a ``Relaunches`` (who can bring a failed replica back right now: the ranks whose
backend relaunches, the restarts a replica may have, and the relaunches a wait has scheduled).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from diloco.executors.base import ReplicaState, ReplicaStatus, RunState, RunStatus
from diloco.store.settings import StoreSettings

_STORE = StoreSettings.model_fields


class RunPolicy(BaseModel):
    """The run's settings that decide how it is judged and relaunched, typed, as the run record keeps them
    (``RunRecord.policy``). Defaults are the run config's own (``StoreSettings``), never restated."""

    model_config = ConfigDict(extra="forbid")

    #: ``store.min_replicas``: a round commits with this many contributions; None: every round needs every replica.
    min_replicas: int | None = Field(default=_STORE["min_replicas"].default, ge=1)
    #: How many times a replica may be relaunched (``launch --max-restarts``; ``watch --max-restarts`` changes it).
    max_restarts: int = Field(default=0, ge=0)
    #: ``store.timeout_s``: how long a replica waits for its peers in one round.
    round_timeout_s: float = Field(default=_STORE["timeout_s"].default, gt=0)
    #: ``store.poll_interval_s``: the replicas' own cadence of looking at the store.
    poll_interval_s: float = Field(default=_STORE["poll_interval_s"].default, gt=0)
    #: ``train.mode``: an async run's workers are at no common round.
    mode: Literal["sync", "async"] = "sync"

    @classmethod
    def of_config(cls, config: Mapping[str, Any], *, max_restarts: int | None = None) -> RunPolicy:
        """The policy of a resolved config as recorded (``RunConfig.recorded()``): for a new record, and to migrate
        a record written before the policy was (records older still kept ``min_replicas`` at the top).
        ``max_restarts``: the record's own, which wins over the config's."""
        store = config.get("store") if isinstance(config.get("store"), Mapping) else {}
        train = config.get("train") if isinstance(config.get("train"), Mapping) else {}
        values: dict[str, Any] = {
            "min_replicas": store.get("min_replicas", config.get("min_replicas")),
            "round_timeout_s": store.get("timeout_s"),
            "poll_interval_s": store.get("poll_interval_s"),
            "mode": train.get("mode"),
            "max_restarts": max_restarts if max_restarts is not None else config.get("max_restarts"),
        }
        return cls.model_validate({k: v for k, v in values.items() if v is not None})

    @property
    def watch_interval_s(self) -> float:
        """How often someone waiting on the run asks its backend: the replicas' cadence, kept between 0.2 s and
        2 s (what a person watching wants)."""
        return min(max(self.poll_interval_s, 0.2), 2.0)


@dataclass(frozen=True)
class Relaunches:
    """Who can bring a failed replica back now."""

    #: Ranks whose backend relaunches a replica (``ServerlessExecutor.relaunches``).
    ranks: frozenset[int] = frozenset()
    #: How many restarts a replica may have: the run's ``max_restarts``, or more while a wait relaunches up to more.
    limit: int = 0
    #: Ranks whose relaunch a wait in progress has scheduled.
    pending: frozenset[int] = field(default_factory=frozenset)


#: The first relaunch's backoff when neither the caller nor ``$DILOCO_RESTART_BACKOFF_S`` says otherwise.
DEFAULT_RESTART_BACKOFF_S = 2.0


def relaunch_delay(base_s: float, restarts: int) -> float:
    """Seconds before a replica's next relaunch: ``base_s`` doubled for each restart it has had."""
    return base_s * 2 ** restarts


def relaunchable(status: ReplicaStatus) -> bool:
    """Whether a replica's failure is one a relaunch can cure. A backend that reads its service's failure report
    decides (``status.failure``: the provider's own failure, a kill, missing capacity are curable; the job's own
    error or a report it cannot read are not: ``diloco.executors.failures``). Otherwise the exit code does: killed
    by a signal (SIGKILL, the OOM killer, a spot reclaim's SIGTERM: exit code >= 128), lost without an exit code,
    or dropped from a ``min_replicas`` round (75, ``EXIT_DROPPED``: the relaunch rejoins at the next round) is
    curable; a replica that exited with its own error (1: the trainer raised; 2: bad arguments; 127: could not
    start) would fail the same way again. A replica that hit the run's time limit never is. What is not curable
    fails the run fast, naming it, as without relaunching."""
    from diloco.executors.failures import EXIT_DROPPED

    if status.state != ReplicaState.FAILED or status.timed_out:
        return False
    if status.failure is not None:
        return status.failure.relaunch
    return status.exit_code is None or status.exit_code >= 128 or status.exit_code == EXIT_DROPPED


def awaits_relaunch(status: ReplicaStatus, relaunches: Relaunches) -> bool:
    """Whether a failed replica can still be brought back: a wait has scheduled its relaunch, or it failed in a way
    a relaunch cures (``relaunchable``) on a backend that relaunches, with restarts left. Whether the run itself
    can still use it is ``can_finish``'s question."""
    if status.state != ReplicaState.FAILED:
        return False
    if status.rank in relaunches.pending:
        return True
    return status.rank in relaunches.ranks and relaunchable(status) and status.restarts < relaunches.limit


def awaiting_relaunch(status: RunStatus, relaunches: Relaunches) -> list[int]:
    """The ranks that failed and can still be brought back (``awaits_relaunch``), in rank order."""
    return sorted(s.rank for s in status.replicas if awaits_relaunch(s, relaunches))


def lost(status: RunStatus, relaunches: Relaunches) -> list[int]:
    """Ranks that failed for good: failed, and no relaunch can bring them back."""
    return sorted(s.rank for s in status.replicas
                  if s.state == ReplicaState.FAILED and not awaits_relaunch(s, relaunches))


def left_behind(status: RunStatus, policy: RunPolicy, relaunches: Relaunches) -> list[int]:
    """Ranks that failed for good in a ``min_replicas`` run (the others went on without them)."""
    return lost(status, relaunches) if policy.min_replicas is not None else []


def can_go_on_without(status: RunStatus, policy: RunPolicy, relaunches: Relaunches) -> bool:
    """Whether the run can still finish though some replicas failed for good: only with ``min_replicas``, and
    only while at least that many replicas have not (they commit each round without the others)."""
    if policy.min_replicas is None:
        return False
    return len(status.replicas) - len(lost(status, relaunches)) >= policy.min_replicas


def can_finish(status: RunStatus, policy: RunPolicy, relaunches: Relaunches) -> bool:
    """Whether the run can still end with its model: nothing cancelled it (a cancelled replica does not come back),
    and no replica failed for good, or ``min_replicas`` lets the others finish without it. Only then is a relaunch
    of a dead replica of any use: relaunched into a run that cannot finish, it would wait for peers that are gone
    until its round times out."""
    if any(s.state in (ReplicaState.CANCELLING, ReplicaState.CANCELLED) for s in status.replicas):
        return False
    return not lost(status, relaunches) or can_go_on_without(status, policy, relaunches)


def verdict(status: RunStatus, policy: RunPolicy, relaunches: Relaunches) -> RunState:
    """The run's state. The backend's aggregate fails a run as soon as one replica fails; here a run has failed
    only when it can no longer finish (``can_finish``). While a dead replica awaits its relaunch, or the others of
    a ``min_replicas`` run go on without one that failed for good, the run is ``running``; once every replica has
    ended, a ``min_replicas`` run that finished on at least ``min_replicas`` of them has succeeded (``left_behind``
    names the others). A run cancelled while a dead replica awaited its relaunch is cancelled (or cancelling), not
    failed."""
    state = status.state
    if state != RunState.FAILED:
        return state
    if not can_finish(status, policy, relaunches):
        if lost(status, relaunches):
            return RunState.FAILED
        # Cancelled while a dead replica awaited its relaunch: the cancel, not that replica, ended the run.
        return RunState.of([s.state for s in status.replicas if s.state != ReplicaState.FAILED])
    if awaiting_relaunch(status, relaunches) or not status.terminal:
        return RunState.RUNNING
    succeeded = sum(1 for s in status.replicas if s.state == ReplicaState.SUCCEEDED)
    return RunState.SUCCEEDED if succeeded >= (policy.min_replicas or len(status.replicas)) else RunState.FAILED


def to_relaunch(status: RunStatus, policy: RunPolicy, relaunches: Relaunches, max_restarts: int) -> list[ReplicaStatus]:
    """The failed replicas a wait that relaunches up to ``max_restarts`` times should schedule now: curable
    (``relaunchable``), on a backend that relaunches, with restarts left, not scheduled yet, in a run that can
    still finish (none in a run that cannot: a relaunched replica would wait in vain for peers that are gone)."""
    if not can_finish(status, policy, relaunches):
        return []
    return [s for s in status.replicas if relaunchable(s) and s.rank in relaunches.ranks
            and s.rank not in relaunches.pending and s.restarts < max_restarts]
