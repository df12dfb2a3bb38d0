"""The one wait on a run: poll until its outcome is decided, relaunching failed replicas and stopping the
survivors of a failure for good. ``launch``, ``watch``, ``collect``, ``status --watch`` and ``smoke`` all wait
through ``Run.wait_for_outcome``, which runs a ``Waiter``.

Fail-fast: replicas meet at every outer round, so once one replica has *failed for good* the others can only wait
for it until ``store.timeout_s`` and then fail too; a wait therefore stops the survivors as soon as one fails,
unless told not to. What counts as curable, lost or finished is ``diloco.launcher.lifecycle``'s; this module holds
what a wait in progress knows (the relaunches it scheduled, the retries it has told) and does the I/O.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from diloco.errors import BackendError, ConfigError, DilocoError
from diloco.executors.base import ReplicaState, ReplicaStatus, RunHandle, RunState, RunStatus
from diloco.executors.signals import interrupts_recorded, raise_if_lost
from diloco.launcher import lifecycle
from diloco.launcher.lifecycle import DEFAULT_RESTART_BACKOFF_S

if TYPE_CHECKING:
    from diloco.executors.base import ServerlessExecutor
    from diloco.launcher.reports import ReplicaReport, RunReport
    from diloco.launcher.runs import RunRecord, RunRegistry
    from diloco.store.objects import ObjectStore

logger = logging.getLogger(__name__)

#: Seconds a wait goes on while some replica's backend cannot be asked, unless ``$DILOCO_UNREACHABLE_PATIENCE_S``
#: says otherwise. A blip (a token refreshed, an API server restarting) passes well within it; a shell that has no
#: access to that backend at all (no kubeconfig) would otherwise wait forever, since the replica reads ``unknown``.
DEFAULT_UNREACHABLE_PATIENCE_S = 300.0
UNREACHABLE_PATIENCE_ENV = "DILOCO_UNREACHABLE_PATIENCE_S"
#: Seconds a wait's reports reuse the replicas' metrics while no replica's state changes: a live table, a
#: webhook or the status page is at most this late on a step or a loss (``diloco.launcher.progress.ProgressCache``).
PROGRESS_REFRESH_S = 1.0
#: How ``MixedBackend.describe`` says a part's backend could not be asked (the reason of its ``unknown`` replicas).
UNREACHABLE_REASON = "its backend could not be asked"


class BackendUnreachable(BackendError):
    """A wait gave up: some replica's backend could not be asked for ``unreachable_patience()`` seconds while the
    run had not ended. The run itself is untouched."""


def restart_backoff() -> float:
    """Seconds before a replica's first relaunch (doubled for each further one): ``$DILOCO_RESTART_BACKOFF_S``,
    else 2 s. A short pause lets a node that is going away finish going; tests and the kill harness set 0."""
    from diloco.envvars import RESTART_BACKOFF_S

    raw = os.environ.get(RESTART_BACKOFF_S, "").strip()
    if not raw:
        return DEFAULT_RESTART_BACKOFF_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{RESTART_BACKOFF_S}: must be a number of seconds (got {raw!r})",
                          hint=f"e.g. {RESTART_BACKOFF_S}=2, or unset it") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{RESTART_BACKOFF_S}: must be >= 0 seconds (got {raw!r})",
                          hint=f"e.g. {RESTART_BACKOFF_S}=2, or unset it")
    return value


def unreachable_patience() -> float:
    """``$DILOCO_UNREACHABLE_PATIENCE_S``, else ``DEFAULT_UNREACHABLE_PATIENCE_S``."""
    raw = os.environ.get(UNREACHABLE_PATIENCE_ENV, "").strip()
    if not raw:
        return DEFAULT_UNREACHABLE_PATIENCE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{UNREACHABLE_PATIENCE_ENV}: must be a number of seconds >= 0 (got {raw!r})",
                          hint=f"e.g. {UNREACHABLE_PATIENCE_ENV}=300, or unset it")
    return value


def unreachable(status: RunStatus) -> list[ReplicaStatus]:
    """The replicas whose backend could not be asked (``unknown``, saying so)."""
    return [s for s in status.replicas
            if s.state == ReplicaState.UNKNOWN and UNREACHABLE_REASON in (s.reason or "")]


class WaitedRun(Protocol):
    """What a wait asks of the run it waits on (``diloco.launcher.run.Run`` answers it)."""

    record: RunRecord
    registry: RunRegistry | None
    executor: ServerlessExecutor[Any, Any]

    @property
    def run_id(self) -> str: ...
    @property
    def store(self) -> ObjectStore: ...
    @property
    def handle(self) -> RunHandle | None: ...
    @property
    def final_state(self) -> RunState | None: ...
    def replica_status(self) -> RunStatus: ...
    def report(self, status: RunStatus | None = None, *, with_stderr: bool = True,
               trends: bool = False, progress_max_age_s: float = 0.0) -> RunReport: ...
    def add_stderr(self, report: RunReport) -> RunReport: ...
    def relaunches_now(self) -> lifecycle.Relaunches: ...
    def lost(self, status: RunStatus) -> list[int]: ...
    def left_behind(self, status: RunStatus) -> list[int]: ...
    def keep_handle(self, handle: RunHandle, *, replicas: int | None = None) -> None: ...
    def can_go_on_without(self, status: RunStatus) -> bool: ...
    def can_finish(self, status: RunStatus) -> bool: ...
    def stop(self, ranks: list[int] | None = None) -> RunStatus: ...


class Waiter:
    """One wait on ``run`` in progress: the relaunches it has scheduled (``pending``: rank -> when it is due),
    how many restarts it grants a replica, and the backend retries it has already told."""

    def __init__(self, run: WaitedRun, *, max_restarts: int, restart_backoff_s: float,
                 on_relaunch: Callable[[int, int, str], None] | None,
                 on_retried: Callable[[int, int, str], None] | None) -> None:
        self.run = run
        self.max_restarts = max_restarts
        self.relaunching = max_restarts > 0 and bool(run.relaunches_now().ranks)
        self.restarts = max_restarts if self.relaunching else 0
        self.backoff_s = restart_backoff_s
        self.pending: dict[int, float] = {}
        self.retries_seen: set[tuple[int, int]] = set()
        self.on_relaunch, self.on_retried = on_relaunch, on_retried
        self.marked_left: set[int] = set()

    def wait(self, deadline: float | None, poll_interval_s: float,
             on_update: Callable[[RunReport], None] | None,
             on_fail_fast: Callable[[ReplicaReport, list[int]], None] | None,
             fail_fast: bool) -> tuple[RunReport, bool]:
        """The loop. A run whose end is recorded (``final_state``) has ended whatever a backend answers now: a part
        out of this shell's reach reads ``unknown`` forever, and is not waited on. While the run is live, an
        unreachable backend is said (in ``report.warnings``, with its fix) and waited on for
        ``unreachable_patience()`` seconds at most, then ``BackendUnreachable``.

        Every Ctrl-C during the wait is written down (``interrupts_recorded``), so one whose exception a finalizer
        swallowed still stops the wait at the next poll instead of leaving the command waiting for the run's end."""
        with interrupts_recorded():
            return self._wait(deadline, poll_interval_s, on_update, on_fail_fast, fail_fast)

    def _wait(self, deadline: float | None, poll_interval_s: float,
              on_update: Callable[[RunReport], None] | None,
              on_fail_fast: Callable[[ReplicaReport, list[int]], None] | None,
              fail_fast: bool) -> tuple[RunReport, bool]:
        run = self.run
        stopping, first_look = False, True
        patience = unreachable_patience()
        out_of_reach_since: float | None = None
        while True:
            raise_if_lost()  # a Ctrl-C whose exception a finalizer swallowed still stops the wait
            status = run.replica_status()
            if not stopping and run.final_state is None and self._ask_again_for_capacity():
                status = run.replica_status()
            if self.relaunching and not stopping and run.final_state is None:
                found = status
                status = self._recover(status)
                if first_look and status is not found and on_update is not None:
                    # The run as this wait found it, before the relaunches it made at once: what it relaunched was
                    # seen failed first, so observers (a webhook, the page) hear of it as of any later relaunch.
                    on_update(run.report(found, with_stderr=False))
            report = run.report(status, with_stderr=False, progress_max_age_s=PROGRESS_REFRESH_S)
            self._tell_retries(status, first=first_look)
            first_look = False
            gone = unreachable(status) if run.final_state is None else []
            if gone:
                out_of_reach_since = out_of_reach_since if out_of_reach_since is not None else time.monotonic()
                report.warnings.append(_unreachable_line(gone, patience))
            else:
                out_of_reach_since = None
            if on_update is not None:
                on_update(report)
            if (status.terminal or run.final_state is not None) and not self.pending:
                return run.add_stderr(report), False
            if out_of_reach_since is not None and time.monotonic() - out_of_reach_since >= patience:
                raise BackendUnreachable(
                    f"run {run.run_id}: {_unreachable_line(gone, None)}; stopped waiting after {patience:g}s",
                    hint=f"the run was not stopped; once that backend answers: diloco watch {run.run_id}")
            lost = run.lost(status)
            if run.final_state is None and not stopping:
                self._mark_left_behind(status)
            failed = [r for r in report.failed if r.rank in lost]
            if failed and not stopping and not run.can_go_on_without(status):
                if not fail_fast:
                    return run.add_stderr(report), False
                survivors = [s.rank for s in status.replicas if not s.state.is_terminal]
                if on_fail_fast is not None:
                    on_fail_fast(failed[0], survivors)
                run.stop(survivors)
                stopping = True
            if deadline is not None and time.monotonic() >= deadline:
                return run.add_stderr(report), True
            time.sleep(poll_interval_s)

    def _tell_retries(self, status: RunStatus, *, first: bool) -> None:
        """Tell ``on_retried`` of each replica its backend is bringing back itself: ``preempted`` now, or on a
        later attempt than last seen, that this wait did not relaunch. The first look only learns the attempts
        already made (a ``watch`` started long after a retry does not announce it)."""
        for s in status.replicas:
            if s.state == ReplicaState.PREEMPTED:
                attempt, reason = s.restarts + 1, s.reason or s.detail or "its attempt ended"
            elif s.restarts > 0 and not s.state.is_terminal:
                attempt, reason = s.restarts, "its previous attempt ended"
            else:
                continue
            if (s.rank, attempt) in self.retries_seen:
                continue
            self.retries_seen.add((s.rank, attempt))
            if not first and self.on_retried is not None and s.rank not in self.pending:
                self.on_retried(s.rank, attempt, reason)

    def _recover(self, status: RunStatus) -> RunStatus:
        """Schedule a relaunch for each newly failed replica with restarts left; start the ones that are due.
        Returns the status to judge the run by (re-described after a relaunch)."""
        run = self.run
        now = time.monotonic()
        if not run.can_finish(status):  # cancelled, or failed for good: a relaunched replica would wait in vain
            self.pending = {}
            return status
        for s in lifecycle.to_relaunch(status, run.record.policy, run.relaunches_now(), self.max_restarts):
            delay = lifecycle.relaunch_delay(self.backoff_s, s.restarts)
            self.pending[s.rank] = now + delay
            reason = s.reason or "failed"
            self.announce_relaunch(s.rank, attempt=s.restarts + 1, ready_in_s=delay, reason=reason)
            if self.on_relaunch is not None:
                self.on_relaunch(s.rank, s.restarts + 1, reason)
        due = [rank for rank, at in self.pending.items() if at <= now]
        for rank in due:
            handle = run.handle
            if handle is None:
                break
            del self.pending[rank]
            try:
                handle = run.executor.relaunch(handle, rank)
            except DilocoError:
                if not run.replica_status().replica(rank).state.is_terminal:
                    continue  # another waiter (a second `diloco watch`) relaunched it first: it runs again
                raise
            run.keep_handle(handle)
            self.retries_seen.add((rank, status.replica(rank).restarts + 1))  # announced as this wait's relaunch
        return run.replica_status() if due else status

    def _mark_left_behind(self, status: RunStatus) -> None:
        """Record in the store each replica the run now goes on without (failed for good in a ``min_replicas``
        run: ``lifecycle.left_behind``), once, so its peers' rounds commit without it at once instead of waiting
        out their deadline for it (``diloco.collectives.gather``). Only while the run can still finish without it."""
        from diloco.store.layout import LEFT_KEY

        run = self.run
        if not run.can_go_on_without(status):
            return
        for rank in run.left_behind(status):
            if rank in self.marked_left:
                continue
            record = {"rank": rank, "at": time.time(), "reason": status.replica(rank).reason or "failed"}
            try:
                run.store.put(LEFT_KEY.format(rank=rank), json.dumps(record).encode())
            except DilocoError as exc:  # peers then wait out the round deadline, as before
                logger.warning("could not record in the store that replica %d was left behind: %s", rank, exc)
                continue
            self.marked_left.add(rank)

    def _ask_again_for_capacity(self) -> bool:
        """Let the backend ask again for replicas its service refused for capacity (a spot run launched with
        ``--max-replicas``: ``ServerlessExecutor.ask_again_for_capacity``); record the handle naming the new jobs.
        Not a relaunch: no restart is counted. Whether anything was asked for."""
        run = self.run
        handle = run.handle
        if handle is None:
            return False
        asked = run.executor.ask_again_for_capacity(handle)
        if asked == handle:
            return False
        run.keep_handle(asked)
        return True

    def announce_relaunch(self, rank: int, *, attempt: int, ready_in_s: float, reason: str) -> None:
        """Record in the store that ``rank`` is being relaunched, so its peers' all-reduce keeps waiting for it
        until ``until`` (the backoff plus one more round timeout, time for the new replica to start and
        contribute) instead of timing out (``diloco.collectives.allreduce``)."""
        from diloco.store.layout import LEFT_KEY

        grace = self.run.record.policy.round_timeout_s
        try:
            self.run.store.delete(LEFT_KEY.format(rank=rank))  # coming back: its peers wait for it again
            self.marked_left.discard(rank)
            announce_start(self.run.store, rank, attempt=attempt, reason=reason, wait_s=ready_in_s + grace)
        except DilocoError as exc:  # the relaunch still happens; peers may time out and be relaunched in turn
            logger.warning("could not record the relaunch of replica %d in the store: %s", rank, exc)


def announce_start(store: ObjectStore, rank: int, *, attempt: int, reason: str, wait_s: float) -> None:
    """Tell ``rank``'s peers that it is starting (a relaunch, or a new rank of a grown run) and to wait for it past
    their round deadline for ``wait_s`` more seconds (``relaunch/rank_RRRR.json``, read by
    ``diloco.collectives.driver.RoundIO.relaunch_extension``)."""
    from diloco.store.layout import RELAUNCH_KEY

    now = time.time()
    record = {"rank": rank, "attempt": attempt, "reason": reason, "at": now, "until": now + wait_s}
    store.put(RELAUNCH_KEY.format(rank=rank), json.dumps(record).encode())


def _unreachable_line(gone: list[ReplicaStatus], patience: float | None) -> str:
    """One line for the replicas whose backend could not be asked: which, why (with the backend's fix)."""
    ranks = ", ".join(str(s.rank) for s in gone)
    backends = ", ".join(dict.fromkeys(s.backend or "its backend" for s in gone))
    wait = f"; waiting up to {patience:g}s ({UNREACHABLE_PATIENCE_ENV}) for it to answer" \
        if patience is not None else ""
    return f"replica(s) {ranks} ({backends}) cannot be seen from here: {gone[0].reason}{wait}"
