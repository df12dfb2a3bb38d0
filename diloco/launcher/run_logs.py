"""A run's replica output, merged in time order and followed through relaunches (``Run.logs``, ``diloco logs``).

Kept apart from ``diloco.launcher.run`` because following is its own job: which incarnation of a replica is being
read, when the next one exists, and which lines a read from a timestamp repeats. It needs of a run only what
``FollowedRun`` declares (its handle, its backend, its record read again, two lifecycle rules), which
``diloco.launcher.run.Run`` provides.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from diloco.executors.base import ReplicaState, ReplicaStatus, RunHandle, RunStatus
from diloco.executors.logstream import LogRecord, follow_merged, merged, tail

if TYPE_CHECKING:
    from diloco.executors.base import ServerlessExecutor

__all__ = ["FollowedRun", "run_log_lines"]


class FollowedRun(Protocol):
    """What following a run's logs reads of it."""

    @property
    def replicas(self) -> int: ...
    @property
    def handle(self) -> RunHandle | None: ...
    @property
    def executor(self) -> ServerlessExecutor[Any, Any]: ...
    @property
    def poll_interval_s(self) -> float: ...

    def reloaded(self) -> FollowedRun | None:
        """The run as its record reads now; None once it is gone."""
        ...

    def replica_status(self) -> RunStatus: ...
    def awaits_relaunch(self, status: ReplicaStatus) -> bool: ...
    def can_finish(self, status: RunStatus) -> bool: ...


def run_log_lines(run: FollowedRun, *, ranks: list[int] | None = None, follow: bool = False,
                  tail_n: int | None = None) -> Iterator[LogRecord]:
    """All (or ``ranks``') replicas' lines of ``run`` merged in time order; ``tail_n`` lines per replica at most.

    With ``follow``, the backlog comes first (time-ordered), then new lines as they arrive, until every
    followed replica has ended. The follow starts at each replica's last backlog line (``since``), so a
    backend that can read from a time (CloudWatch, the Kubernetes API) does not fetch the backlog again;
    the lines at that very moment that the backlog already had are skipped. A replica whose process or job
    ended in a failure that a relaunch cures is followed into its relaunch (``_next_incarnation``), whichever
    process relaunches it (the attached ``launch``, a ``watch``): its lines go on under the same prefix.
    """
    handle = run.handle
    if handle is None:
        return
    selected = list(range(run.replicas)) if ranks is None else ranks
    backlogs = [list(run.executor.logs(handle, [rank], follow=False)) for rank in selected]
    yield from merged([tail(b, tail_n) for b in backlogs])
    if not follow:
        return

    def rest(rank: int, backlog: list[LogRecord]) -> Iterator[LogRecord]:
        since = backlog[-1].ts if backlog else None
        at_since = [r for r in backlog if since is not None and r.ts >= since]  # a read from since repeats them
        current: RunHandle | None = handle
        while current is not None:
            # Which incarnation is followed, read before its stream ends: by the time it has, a watching
            # process may already have relaunched it, and then the relaunch is what comes next.
            followed = run.executor.describe(current).replica(rank)
            repeats = list(at_since)
            for record in run.executor.logs(current, [rank], follow=True, since=since):
                if repeats and record == repeats[0]:
                    repeats.pop(0)
                    continue
                repeats = []
                if since is None or record.ts > since:
                    since, at_since = record.ts, []
                if record.ts == since:
                    at_since.append(record)
                yield record
            current = _next_incarnation(run, followed, rank)

    yield from follow_merged([rest(r, b) for r, b in zip(selected, backlogs, strict=True)])


def _next_incarnation(run: FollowedRun, ended: ReplicaStatus, rank: int) -> RunHandle | None:
    """The handle of ``rank``'s next incarnation once one exists, after ``ended`` (its status while it was
    followed) has ended; None when none will come.

    The relaunch is another process's doing (the attached ``launch`` or a ``watch``), recorded in the registry
    when it happens, so the record is read again every poll. A replica that failed in a way a relaunch cures,
    with restarts left, in a run that can still finish, is waited for (``status`` calls such a run running
    too); one that succeeded, was cancelled or failed for good ends its stream. One whose stream ended while its
    status does not say it ended (a killed process's log closes before its exit is recorded; a preempted one is
    being brought back) is followed again after a poll, from where its lines stopped: reading that moment as the
    end would stop following just before a relaunch."""
    while (now_run := run.reloaded()) is not None:  # None: the run was removed while it was followed
        handle = now_run.handle
        if handle is None:
            return None
        status = now_run.replica_status()
        now = status.replica(rank)
        if now.job_id != ended.job_id or now.restarts > ended.restarts:
            return handle
        if not now.state.is_terminal:
            time.sleep(run.poll_interval_s)
            return handle
        if now.state != ReplicaState.FAILED or not now_run.awaits_relaunch(now) or not now_run.can_finish(status):
            return None
        time.sleep(run.poll_interval_s)
    return None
