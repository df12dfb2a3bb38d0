"""A third party's diloco backend: each replica is a subprocess under a small runner of its own (``runner.py``),
which keeps the replica's state in files, so any later process can describe, cancel and read the run.

It imports only diloco's contract (``diloco.executors.base`` and ``diloco.executors.flags``, which declares
its ``--subproc-grace`` flag) and the error it raises (``diloco.errors``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from diloco.errors import BackendError
from diloco.executors.base import (
    BackendConfig,
    LaunchPlan,
    LaunchSpec,
    LogRecord,
    ReplicaState,
    ReplicaStatus,
    RunHandle,
    RunStatus,
    ServerlessExecutor,
)
from diloco.executors.flags import cli_flag


class SubprocConfig(BackendConfig):
    """The ``backend:`` section for ``kind: subproc``."""

    kind: Literal["subproc"] = "subproc"
    root: str = os.path.join(tempfile.gettempdir(), "diloco-subproc")  # one directory per run under it
    grace_s: float = Field(1.0, gt=0, description="Seconds a cancelled replica has between SIGTERM and SIGKILL.",
                           json_schema_extra=cli_flag("--subproc-grace", metavar="SECONDS"))

    rendezvous_schemes: ClassVar[tuple[str, ...]] = ("file", "s3")
    places_replicas: ClassVar[bool] = False

    def default_rendezvous(self, run_id: str) -> str | None:
        return f"file://{self.root}/{run_id}/store"

    def default_check_trainer_locally(self) -> bool:
        return True


class SubprocHandle(RunHandle):
    backend: str = "subproc"
    root: str


class SubprocBackend(ServerlessExecutor[SubprocConfig, SubprocHandle]):
    """Replicas as runner subprocesses on this machine."""

    name: ClassVar[str] = "subproc"
    config_type = SubprocConfig
    handle_type = SubprocHandle
    STATES: ClassVar[dict[str, ReplicaState]] = {
        "pending": ReplicaState.PENDING, "running": ReplicaState.RUNNING, "succeeded": ReplicaState.SUCCEEDED,
        "failed": ReplicaState.FAILED, "cancelling": ReplicaState.CANCELLING, "cancelled": ReplicaState.CANCELLED,
    }

    def plan(self, spec: LaunchSpec) -> LaunchPlan:
        requests = [{"rank": rank, "argv": spec.argv(sys.executable), "env": spec.replica_env(rank),
                     "grace_s": self.config.grace_s,
                     "cwd": os.getcwd()} for rank in range(spec.replicas)]
        return LaunchPlan(backend=self.name, spec=spec, requests=requests)

    def _dir(self, handle: SubprocHandle, rank: int) -> Path:
        return Path(handle.root) / handle.run_id / f"rank_{rank}"

    def submit(self, plan: LaunchPlan,
               on_progress: Callable[[SubprocHandle], None] | None = None) -> SubprocHandle:
        handle = SubprocHandle(run_id=plan.spec.run_id, replicas=plan.spec.replicas, root=self.config.root)
        if on_progress is not None:
            on_progress(handle)
        for request in plan.requests:
            rank = request["rank"]
            where = self._dir(handle, rank)
            where.mkdir(parents=True, exist_ok=True)
            try:
                runner = subprocess.Popen(
                    [sys.executable, "-m", "diloco_subproc.runner", str(where), str(request["grace_s"]), "--",
                     *request["argv"]],
                    cwd=request["cwd"], env={**os.environ, **request["env"]}, start_new_session=True,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except OSError as exc:
                self.cancel(handle)
                raise BackendError(f"replica {rank} could not be started: {exc}") from exc
            (where / "runner.pid").write_text(str(runner.pid))
            if on_progress is not None:
                on_progress(handle)
        return handle

    def _state(self, handle: SubprocHandle, rank: int) -> ReplicaStatus:
        where = self._dir(handle, rank)
        job_id = f"{handle.run_id}/r{rank}"
        cancelled = (where / "cancelled").exists()
        if (where / "exit").exists():
            code = int((where / "exit").read_text())
            if cancelled:
                return ReplicaStatus(rank=rank, job_id=job_id, state=ReplicaState.CANCELLED, exit_code=code)
            if code == 0:
                return ReplicaStatus(rank=rank, job_id=job_id, state=ReplicaState.SUCCEEDED, exit_code=0)
            return ReplicaStatus(rank=rank, job_id=job_id, state=ReplicaState.FAILED, exit_code=code,
                                 reason=f"exit code {code}")
        if not (where / "runner.pid").exists():
            return ReplicaStatus(rank=rank, job_id=job_id, state=ReplicaState.PENDING)
        if not _alive(int((where / "runner.pid").read_text())):  # the runner died before writing the exit code
            state = ReplicaState.CANCELLED if cancelled else ReplicaState.FAILED
            return ReplicaStatus(rank=rank, job_id=job_id, state=state, reason="its runner ended without a code")
        state = ReplicaState.CANCELLING if cancelled else ReplicaState.RUNNING
        return ReplicaStatus(rank=rank, job_id=job_id, state=state)

    def describe(self, handle: SubprocHandle) -> RunStatus:
        return RunStatus(run_id=handle.run_id, replicas=[self._state(handle, r) for r in range(handle.replicas)])

    def cancel(self, handle: SubprocHandle, ranks: Sequence[int] | None = None) -> None:
        for rank in range(handle.replicas) if ranks is None else ranks:
            where = self._dir(handle, rank)
            if (where / "exit").exists() or not (where / "runner.pid").exists():
                continue  # finished, or never started: nothing to stop
            (where / "cancelled").touch()
            try:  # the runner forwards it to the replica, then kills it after the grace period
                os.kill(int((where / "runner.pid").read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass

    def replica_logs(self, handle: SubprocHandle, rank: int, *, follow: bool = False,
                     since: float | None = None) -> Iterator[LogRecord]:
        path = self._dir(handle, rank) / "log.tsv"
        offset = 0
        while True:
            ended = self._state(handle, rank).state.is_terminal
            if path.exists():
                with path.open() as f:
                    f.seek(offset)
                    for line in f:
                        if not line.endswith("\n"):
                            break
                        offset += len(line.encode())
                        ts, stream, text = line.rstrip("\n").split("\t", 2)
                        if since is None or float(ts) >= since:
                            yield LogRecord(float(ts), rank, stream, text)
            if not follow or ended:
                return
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def live_pids(root: str, run_id: str) -> list[int]:
    """The run's runner and replica processes still alive (for the conformance suite's ``live``)."""
    pids = []
    for pid_file in sorted(Path(root, run_id).glob("rank_*/*.pid")):
        pid = int(pid_file.read_text())
        if _alive(pid):
            pids.append(pid)
    return pids


__all__ = ["SubprocBackend", "SubprocConfig", "SubprocHandle", "live_pids"]

