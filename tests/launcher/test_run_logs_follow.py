"""``diloco logs -f`` follows a replica into its relaunch even when its stream ends before its status does: a
killed process's log closes before its exit is recorded, and that moment must not read as the replica's end
(``diloco.launcher.run_logs._next_incarnation``). Driven through a fake backend whose status lags its logs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from diloco.executors.base import ReplicaState, ReplicaStatus, RunHandle, RunStatus
from diloco.executors.logstream import LogRecord
from diloco.launcher.run_logs import run_log_lines

HANDLE = RunHandle(backend="fake", run_id="r", replicas=1)


class LaggingBackend:
    """One replica: its first incarnation's lines, then (its stream over) a status that still says running for
    ``lag`` looks, then failed and waiting for its relaunch for one look, then the relaunch's lines."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.looks = 0
        self.relaunched = False

    def status(self) -> ReplicaStatus:
        self.looks += 1
        if self.relaunched:
            return ReplicaStatus(rank=0, state=ReplicaState.SUCCEEDED, job_id="j", restarts=1)
        if self.looks <= 1 + self.lag:  # the read before the stream, then the lagging looks
            return ReplicaStatus(rank=0, state=ReplicaState.RUNNING, job_id="j")
        self.relaunched = True  # a watch relaunches it once it is seen failed
        return ReplicaStatus(rank=0, state=ReplicaState.FAILED, job_id="j", exit_code=137)

    def describe(self, handle: RunHandle) -> RunStatus:
        return RunStatus(run_id="r", replicas=[self.status()])

    def logs(self, handle: RunHandle, ranks: list[int], *, follow: bool, since: float | None = None
             ) -> Iterator[LogRecord]:
        first = [LogRecord(1.0, 0, "out", "first 1"), LogRecord(2.0, 0, "out", "first 2")]
        second = [LogRecord(3.0, 0, "out", "relaunched 1"), LogRecord(4.0, 0, "out", "relaunched 2")]
        lines = first + second if self.relaunched else first
        yield from (r for r in lines if since is None or r.ts >= since)


class FakeRun:
    def __init__(self, backend: LaggingBackend) -> None:
        self.backend = backend

    replicas = 1
    handle = HANDLE
    poll_interval_s = 0.0

    @property
    def executor(self) -> Any:
        return self.backend

    def reloaded(self) -> FakeRun:
        return self

    def replica_status(self) -> RunStatus:
        return self.backend.describe(HANDLE)

    def awaits_relaunch(self, status: ReplicaStatus) -> bool:
        return status.state == ReplicaState.FAILED and status.restarts < 2

    def can_finish(self, status: RunStatus) -> bool:
        return True


def test_a_stream_that_ends_before_its_status_is_followed_into_the_relaunch() -> None:
    for lag in (0, 1, 3):
        lines = [r.text for r in run_log_lines(FakeRun(LaggingBackend(lag)), follow=True)]
        assert lines == ["first 1", "first 2", "relaunched 1", "relaunched 2"], (lag, lines)
