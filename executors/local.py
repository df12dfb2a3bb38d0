"""The local backend: each replica is a ``python -m <entrypoint>`` process on this machine.

Why it looks the way it does:

* Each replica runs under ``diloco.executors.local_supervisor`` in its **own session / process group**, so a
  Ctrl-C in the launching terminal never reaches it. ``cancel`` sends one SIGTERM through the supervisor (which
  forwards it) and, after the grace period, SIGKILLs the whole group (replica, its children, the supervisor).
* The supervisor writes ``exit.json`` when the replica ends; that file, not the launching process's memory, is
  the source of truth, so ``diloco status`` in a brand-new process knows the exit code. If the supervisor is
  killed on its own (``kill -9``, the OOM killer), a replica still alive in its group reads as running (and
  ``cancel`` still stops it), never as failed while it trains on.
* A handle records the supervisor's pid *and* its start time (``/proc/<pid>/stat``), so a recycled pid is never
  mistaken for our replica, and never signalled.
* ``plan`` is pure: it computes argv, the added environment, cwd and the log directory and creates nothing.
* Every replica inherits this process's environment plus ``DILOCO_RUN_ID``, ``REPLICA_RANK``, ``WORLD_SIZE``,
  ``RENDEZVOUS_URI``, ``PYTHONUNBUFFERED=1`` and, unless already set, an ``OMP_NUM_THREADS`` that shares the CPU
  cores between replicas instead of oversubscribing them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator

from diloco.errors import BackendError
from diloco.executors.base import (
    LaunchPlan,
    LaunchSpec,
    ReplicaHandle,
    ReplicaRequest,
    ReplicaStatus,
    RunState,
)
from diloco.executors.local_supervisor import (
    CANCEL_MARKER,
    CHILD_FILE,
    COMBINED_LOG,
    EXIT_FILE,
    STDERR_LOG,
    SUPERVISOR_LOG,
    group_members,
    has_procfs,
    parse_combined_line,
    proc_stat,
    read_json,
)
from diloco.logstream import LogRecord

SUPERVISOR_MODULE = "diloco.executors.local_supervisor"


def _default_log_root() -> str:
    from diloco.runs import runs_dir

    return str(runs_dir())


class LocalProcessExecutor:
    """Replicas as supervised local processes. See the module docstring for the guarantees."""

    name = "local"

    def __init__(self, log_root: str | None = None, grace_period_s: float = 10.0, python: str | None = None) -> None:
        if grace_period_s < 0:
            raise ValueError("grace_period_s must be >= 0")
        self.log_root = log_root
        self.grace_period_s = grace_period_s
        self.python = python or sys.executable
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # supervisors this object started (to reap them)

    # ------------------------------------------------------------------ planning (pure)
    def log_dir(self, run_id: str, rank: int) -> str:
        """Where replica ``rank``'s logs and exit record live: ``<log_root>/<run_id>/logs/rank_<r>``."""
        root = self.log_root or _default_log_root()
        return os.path.join(os.path.abspath(root), run_id, "logs", f"rank_{rank}")

    def plan(self, spec: LaunchSpec) -> LaunchPlan:
        """The exact argv, added environment, cwd and log dir of every replica. Creates nothing."""
        argv = [self.python, "-m", spec.entrypoint, *spec.entrypoint_args.to_argv()]
        added: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
        if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in spec.env:
            added["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.n_replicas))
        cwd = os.getcwd()
        replicas = [
            ReplicaRequest(rank=rank, request={
                "argv": list(argv),
                "env": {**added, **spec.replica_env(rank)},
                "cwd": cwd,
                "log_dir": self.log_dir(spec.run_id, rank),
                "timeout_s": spec.timeout_s,
            })
            for rank in range(spec.n_replicas)
        ]
        return LaunchPlan(backend=self.name, spec=spec, replicas=replicas)

    # ------------------------------------------------------------------ submitting
    def submit(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        """Start every replica; if replica k cannot be started, stop 0..k-1 and raise ``BackendError``."""
        handles: list[ReplicaHandle] = []
        for replica in plan.replicas:
            try:
                handles.append(self._spawn(plan.spec.run_id, replica))
            except BaseException as exc:  # an OSError, or Ctrl-C mid-submit: no replica is left orphaned
                self.cancel_many(handles)
                if not isinstance(exc, OSError):
                    raise
                raise BackendError(
                    f"could not start local replica {replica.rank}: {type(exc).__name__}: {exc}",
                    hint="the replicas already started were stopped; fix the cause and launch again",
                ) from exc
        return handles

    def _spawn(self, run_id: str, replica: ReplicaRequest) -> ReplicaHandle:
        req = replica.request
        log_dir = req["log_dir"]
        os.makedirs(log_dir, exist_ok=True)
        cmd = [sys.executable, "-m", SUPERVISOR_MODULE, "--log-dir", log_dir, "--grace", f"{self.grace_period_s:g}"]
        if req.get("timeout_s") is not None:
            cmd += ["--timeout", f"{req['timeout_s']:g}"]
        cmd += ["--", *req["argv"]]
        with open(os.path.join(log_dir, SUPERVISOR_LOG), "ab") as sup_log:
            proc = subprocess.Popen(
                cmd, cwd=req["cwd"], env={**os.environ, **req["env"]}, stdin=subprocess.DEVNULL,
                stdout=sup_log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            )
        self._procs[proc.pid] = proc
        st = proc_stat(proc.pid)
        return ReplicaHandle(
            backend=self.name, run_id=run_id, rank=replica.rank, job_id=str(proc.pid),
            data={"pid": proc.pid, "start_time": st.start_time if st else None, "log_dir": log_dir,
                  "host": socket.gethostname(), "launched_at": time.time()},
        )

    # ------------------------------------------------------------------ state
    def _reap(self, pid: int) -> None:
        proc = self._procs.get(pid)
        if proc is not None and proc.poll() is not None:
            self._procs.pop(pid, None)

    def _is_ours(self, handle: ReplicaHandle) -> bool | None:
        """Whether the handle's pid is still *our* supervisor: True/False, or None if it no longer exists."""
        pid, start = handle.data["pid"], handle.data.get("start_time")
        self._reap(pid)
        st = proc_stat(pid)
        if st is None:
            if has_procfs():
                return None
            try:  # no /proc (macOS): best effort, no pid-reuse check
                os.kill(pid, 0)
            except (ProcessLookupError, PermissionError):
                return None
            return True
        if start is not None and st.start_time != start:
            return False  # the pid was recycled by an unrelated process
        return None if st.state == "Z" else True

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        """The replica's state, read from ``exit.json`` and the supervisor's liveness (works from any process)."""
        d = handle.data
        if d.get("host") and d["host"] != socket.gethostname():
            return ReplicaStatus(rank=handle.rank, state=RunState.UNKNOWN, job_id=handle.job_id,
                                 reason=f"launched on host {d['host']}; run diloco there to see it")
        log_dir = d["log_dir"]
        cancel_requested = os.path.exists(os.path.join(log_dir, CANCEL_MARKER))
        child = read_json(os.path.join(log_dir, CHILD_FILE)) or {}
        started = child.get("started_at")
        exit_rec = read_json(os.path.join(log_dir, EXIT_FILE))
        if exit_rec is None and self._is_ours(handle):
            state = RunState.CANCELLING if cancel_requested else (RunState.RUNNING if child else RunState.PENDING)
            return ReplicaStatus(rank=handle.rank, state=state, job_id=handle.job_id, started_at=started,
                                 secondary=f"pid {d['pid']}")
        if exit_rec is None:  # it may have finished between the two reads
            exit_rec = read_json(os.path.join(log_dir, EXIT_FILE))
        if exit_rec is None and self._orphans(handle):
            # The supervisor was killed (kill -9, OOM killer) but the replica lives on in its process group:
            # still running, and still ours to stop (cancel signals the group).
            return ReplicaStatus(
                rank=handle.rank, state=RunState.CANCELLING if cancel_requested else RunState.RUNNING,
                job_id=handle.job_id, started_at=started, secondary="unsupervised",
                reason=f"its supervisor (pid {d['pid']}) was killed; the replica runs on unsupervised, its output "
                       f"is no longer logged and its exit code will not be recorded",
            )
        if exit_rec is None:
            if cancel_requested:
                return ReplicaStatus(rank=handle.rank, state=RunState.CANCELLED, job_id=handle.job_id,
                                     reason="cancelled (no exit code was recorded)", started_at=started)
            return ReplicaStatus(
                rank=handle.rank, state=RunState.FAILED, job_id=handle.job_id, started_at=started,
                reason=f"ended without recording an exit code: its supervisor (pid {d['pid']}) was killed "
                       f"(kill -9, the OOM killer, a reboot?); see {os.path.join(log_dir, SUPERVISOR_LOG)}",
            )
        code = int(exit_rec.get("exit_code", 1))
        reason = exit_rec.get("reason")
        if code == 0:
            state = RunState.SUCCEEDED
        elif cancel_requested:
            state, reason = RunState.CANCELLED, f"cancelled ({reason})"
        else:
            state = RunState.FAILED
        return ReplicaStatus(rank=handle.rank, state=state, job_id=handle.job_id, reason=reason, exit_code=code,
                             timed_out=bool(exit_rec.get("timed_out")),
                             started_at=exit_rec.get("started_at", started), ended_at=exit_rec.get("ended_at"))

    # ------------------------------------------------------------------ cancelling
    def _signal_group(self, handle: ReplicaHandle, sig: int) -> bool:
        """Signal the replica's process group unless its leader pid now belongs to someone else."""
        if self._is_ours(handle) is False:
            return False  # recycled pid: the kernel never reuses a pid that is still a live group id
        try:
            os.killpg(handle.data["pid"], sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def _terminate(self, handle: ReplicaHandle) -> None:
        """One SIGTERM for the replica: to its supervisor, which forwards it (a group-wide SIGTERM would reach
        the replica twice, and a second one can cut its clean shutdown short); to the whole group only when the
        supervisor is gone. Whatever survives the grace period gets the group-wide SIGKILL."""
        if self._is_ours(handle):
            try:
                os.kill(handle.data["pid"], signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        else:
            self._signal_group(handle, signal.SIGTERM)

    def _alive(self, handle: ReplicaHandle) -> bool:
        """Anything of the replica's process group still alive (the supervisor, or what it left behind)."""
        if self._is_ours(handle) is False:
            return False  # recycled pid: the kernel never reuses a pid that is still a live group id
        return bool(group_members(handle.data["pid"]))

    def _orphans(self, handle: ReplicaHandle) -> bool:
        """Whether the supervisor is gone but processes of its group (the replica) are still alive."""
        return self._is_ours(handle) is None and self._alive(handle)

    def cancel(self, handle: ReplicaHandle) -> None:
        """SIGTERM the replica (see ``_terminate``), SIGKILL its process group after ``grace_period_s``. Idempotent."""
        self.cancel_many([handle])

    def cancel_many(self, handles: Iterable[ReplicaHandle]) -> None:
        """``cancel`` for several replicas, sharing one grace period instead of one each."""
        handles = list(handles)
        live = []
        for h in handles:
            if self._alive(h):
                if not self._finished(h):
                    _touch(os.path.join(h.data["log_dir"], CANCEL_MARKER))
                self._terminate(h)
                live.append(h)
        deadline = time.monotonic() + self.grace_period_s
        while live and time.monotonic() < deadline:
            time.sleep(0.05)
            live = [h for h in live if self._alive(h)]
        for h in live:
            self._signal_group(h, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while live and time.monotonic() < deadline:
            time.sleep(0.05)
            live = [h for h in live if self._alive(h)]
        if live:
            raise BackendError(f"local replica(s) {[h.rank for h in live]} survived SIGKILL")

    @staticmethod
    def _finished(handle: ReplicaHandle) -> bool:
        return os.path.exists(os.path.join(handle.data["log_dir"], EXIT_FILE))

    # ------------------------------------------------------------------ logs
    def log_records(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[LogRecord]:
        """The replica's output lines with the time each was written; ``follow`` waits for more until it ends."""
        path = os.path.join(handle.data["log_dir"], COMBINED_LOG)
        buf = b""
        offset = 0
        while True:
            chunk = b""
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                pass
            offset += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                parsed = parse_combined_line(raw.decode(errors="replace"))
                if parsed is not None:
                    yield LogRecord(parsed[0], handle.rank, parsed[1], parsed[2])
            if not follow:
                return
            if not chunk:
                if self.poll(handle).state.is_terminal:
                    follow = False  # one more read: the last lines may have landed after the previous one
                    continue
                time.sleep(0.2)

    def stream_logs(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[str]:
        """The replica's stdout and stderr lines, interleaved as written."""
        for record in self.log_records(handle, follow=follow):
            yield record.text

    def stderr_tail(self, handle: ReplicaHandle, n: int = 10) -> list[str]:
        """The last ``n`` lines the replica wrote to stderr (why it failed, usually)."""
        path = os.path.join(handle.data["log_dir"], STDERR_LOG)
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 64 * 1024))
                data = f.read()
        except OSError:
            return []
        lines = [ln for ln in data.decode(errors="replace").splitlines() if ln.strip()]
        return list(deque(lines, maxlen=n))


def _touch(path: str) -> None:
    try:
        with open(path, "a"):
            pass
    except OSError:
        pass
