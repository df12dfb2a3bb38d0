"""The local backend: each replica is a ``python -m <entrypoint>`` process on this machine.

Why it looks the way it does:

* Each replica runs under ``diloco.executors.local_supervisor`` in its **own session / process group**, so a
  Ctrl-C in the launching terminal never reaches it. ``cancel`` sends one SIGTERM to the supervisor, which forwards
  it and, after the grace period, SIGKILLs the replica's whole group itself: the escalation does not depend on the
  CLI staying alive. A second ``cancel`` SIGKILLs at once.
* The supervisor writes ``exit.json`` when the replica ends; that file, not the launching process's memory, is
  the source of truth, so ``diloco status`` in a brand-new process knows the exit code. If the supervisor is
  killed on its own (``kill -9``, the OOM killer), a replica still alive in its group reads as running (and
  ``cancel`` still stops it), never as failed while it trains on.
* A handle records each supervisor's pid *and* its start time (``/proc/<pid>/stat``), so a recycled pid is never
  mistaken for our replica, and never signalled. The handle is also kept in the run's directory
  (``handle.json``), updated as each replica starts, so ``list_runs`` and a later ``cancel`` find the replicas of a
  launch that was interrupted half-way.
* Nothing started is ever unrecorded: the handle is written (``handle.json``, then ``on_progress``) before the first
  replica and after each one, and starting a replica and recording it is one step that Ctrl-C cannot split
  (``diloco.executors.signals.signals_deferred``). While it submits, SIGTERM and SIGHUP take Ctrl-C's path
  (``terminate_as_interrupt``): whatever was started is stopped before the launcher exits. If the launcher is
  killed outright (``kill -9``) the replicas it had no time to record are still found, by the ``DILOCO_RUN_ID`` in
  their environment, and adopted into the handle so ``status`` and ``cancel`` see them.
* A launch this machine cannot hold (more replicas than ``REPLICAS_PER_CORE`` per CPU core, or than its available
  memory at the replica size estimated for the trainer) is refused before any process starts, with the numbers and
  the fix, unless forced (``check_capacity``; ``backend.oversubscribe: true``). With ``--procs-per-replica K`` the
  limits count every training process: replicas times K, each of the replica's size.
* ``plan`` is pure: it computes argv, the added environment, cwd and the log directory and creates nothing.
* Every replica inherits this process's environment plus the run's ``env`` (``--env``), ``DILOCO_RUN_ID``,
  ``REPLICA_RANK``, ``WORLD_SIZE``, ``RENDEZVOUS_URI``, ``PYTHONUNBUFFERED=1`` and, unless already set, an
  ``OMP_NUM_THREADS`` that shares the CPU cores between the replicas' processes instead of oversubscribing them.
  The run directory's ``requests.json`` (what a relaunch repeats) holds that environment, so only its owner may
  read it.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, Field

from diloco import envvars
from diloco.errors import BackendError, ConfigError, DilocoError
from diloco.executors.base import (
    BackendConfig,
    LaunchPlan,
    LaunchSpec,
    ReplicaState,
    ReplicaStatus,
    RunHandle,
    RunListing,
    RunStatus,
    ServerlessExecutor,
    grown_ranks,
    ranks_label,
)
from diloco.executors.local_supervisor import (
    CANCEL_MARKER,
    CHILD_FILE,
    COMBINED_LOG,
    EXIT_FILE,
    STDERR_LOG,
    SUPERVISOR_LOG,
    command_line,
    group_members,
    has_procfs,
    live_process_groups,
    parse_combined_line,
    proc_stat,
    processes_with_env,
    read_from,
    read_json,
    uncopied_output,
    write_json_atomic,
)
from diloco.executors.logstream import LogRecord
from diloco.executors.replica_memory import (  # noqa: F401  (the estimate every backend uses)
    OTHER_TRAINER_MIB,
    SUPERVISOR_MIB,
    replica_memory,
)
from diloco.executors.signals import signals_deferred, terminate_as_interrupt

if TYPE_CHECKING:
    from diloco.executors.checks import Check, DoctorContext
    from diloco.executors.failures import FailureVerdict

SUPERVISOR_MODULE = "diloco.executors.local_supervisor"
HANDLE_FILE = "handle.json"
REQUESTS_FILE = "requests.json"  # in the run directory: each rank's spawn request, so a relaunch repeats it
RUN_CANCEL_MARKER = "cancel_requested"  # in the run directory: a launch in progress stops starting replicas


class LocalBackendConfig(BackendConfig):
    """Replicas as processes on this machine."""

    kind: Literal["local"] = "local"
    log_root: str | None = None  # default: $DILOCO_HOME/runs
    grace_period_s: float = Field(10.0, ge=0)  # SIGTERM -> SIGKILL on cancel
    python: str | None = None  # interpreter for the replicas; default: the one running diloco
    oversubscribe: bool = False  # launch even when the replicas exceed this machine's cores or memory
    # One replica's memory for the capacity check; default: the trainer's own estimate (@diloco.memory_estimate),
    # else 512 MiB. Its supervisor's 16 MiB (SUPERVISOR_MIB) is counted on top either way.
    memory_per_replica_mb: int | None = Field(None, gt=0)

    rendezvous_schemes: ClassVar[tuple[str, ...]] = ("file", "s3")
    places_replicas: ClassVar[bool] = False

    def default_rendezvous(self, run_id: str) -> str | None:
        from diloco.run_dirs import default_local_rendezvous

        return default_local_rendezvous(run_id)

    def default_check_trainer_locally(self) -> bool:
        return self.python is None  # another interpreter may have other packages


class LocalProcess(BaseModel):
    """One replica's supervisor: pid + start time identify it across pid reuse."""

    rank: int
    pid: int
    start_time: int | None = None
    log_dir: str
    launched_at: float
    restarts: int = 0  # how many times this rank was relaunched (this process is attempt restarts + 1)
    restart_reasons: list[str] = Field(default_factory=list)  # why each earlier attempt ended

    @property
    def moved_dir(self) -> str:
        """Where a relaunch moves this attempt's files (``rank_R.tryN``, N = this attempt's number), so that
        the next attempt gets the rank's log directory."""
        return f"{self.log_dir}.try{self.restarts + 1}"

    def attempt_dir(self) -> str:
        """Where this attempt's files are now: its log directory, or ``moved_dir`` once a relaunch has moved them
        there (the move is one rename, so one of the two holds them at any moment). A handle read before the
        relaunch (a record another process has not rewritten yet, a ``logs -f`` following this attempt) so
        reads its own attempt: never the next one's files, nor, while the next one starts, none at all."""
        return self.moved_dir if os.path.isdir(self.moved_dir) else self.log_dir


class LocalRunHandle(RunHandle):
    """The run's supervisors on this host; ``complete`` once every replica has been started."""

    backend: str = "local"
    host: str
    run_dir: str
    launcher_pid: int
    launcher_start_time: int | None = None  # with the pid, tells a live launcher from a recycled pid
    complete: bool = False
    processes: list[LocalProcess] = Field(default_factory=list)

    def process(self, rank: int) -> LocalProcess | None:
        return next((p for p in self.processes if p.rank == rank), None)


class LocalBackend(ServerlessExecutor[LocalBackendConfig, LocalRunHandle]):
    """Replicas as supervised local processes. See the module docstring for the guarantees."""

    name: ClassVar[str] = "local"
    supports_relaunch: ClassVar[bool] = True
    #: A part of a run split over backends gets a directory of its own (``part_dir``: its handle, requests, logs
    #: and checkpoints, removed with it); logs and checkpoints are per global rank.
    supports_rank_ranges: ClassVar[bool] = True
    #: New ranks join a live run as more supervised processes in its directory (``add_ranks``).
    supports_scaling: ClassVar[bool] = True
    config_type = LocalBackendConfig
    handle_type = LocalRunHandle
    STATES: ClassVar[dict[str, ReplicaState]] = {
        "not-started": ReplicaState.PENDING,  # the launch is still starting earlier replicas
        "starting": ReplicaState.PENDING,  # supervisor up, replica not yet
        "running": ReplicaState.RUNNING,
        "unsupervised": ReplicaState.RUNNING,  # supervisor killed, replica alive in its group
        "cancel-requested": ReplicaState.CANCELLING,
        "succeeded": ReplicaState.SUCCEEDED,
        "failed": ReplicaState.FAILED,
        "lost": ReplicaState.FAILED,  # supervisor killed, nothing left, no exit code
        "cancelled": ReplicaState.CANCELLED,
        "never-started": ReplicaState.CANCELLED,  # the launch was interrupted before this replica
        "elsewhere": ReplicaState.UNKNOWN,  # launched on another host
        "files-gone": ReplicaState.UNKNOWN,  # ended, and its log directory was deleted since
    }

    def __init__(self, config: LocalBackendConfig | None = None) -> None:
        super().__init__(config or LocalBackendConfig())
        self.python = self.config.python or sys.executable
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # supervisors this object started (to reap them)
        self._capacity_checked: set[str] = set()  # run ids whose capacity a caller checked before submitting

    # ------------------------------------------------------------------ planning (pure)
    def run_dir(self, run_id: str) -> str:
        """``<log_root>/<run_id>``: logs, exit records and the handle of one run."""
        root = self.config.log_root
        if root is None:
            from diloco.run_dirs import runs_dir

            root = str(runs_dir())
        return os.path.join(os.path.abspath(root), run_id)

    def part_dir(self, spec: LaunchSpec) -> str:
        """The directory of what this backend runs of ``spec``: the run directory for a whole run; for one part
        of a run split over backends, ``<run_dir>/part-r<first>-<last>``, so that two local parts of one run keep
        their handles, requests and cancel markers apart."""
        if not spec.is_part:
            return self.run_dir(spec.run_id)
        return os.path.join(self.run_dir(spec.run_id), f"part-{ranks_label(spec.own_ranks)}")

    def log_dir(self, run_id: str, rank: int, base: str | None = None) -> str:
        """Where replica ``rank``'s logs and exit record live: ``<run_dir>/logs/rank_<r>`` (``base``: the part's
        directory instead of the run's)."""
        return os.path.join(base or self.run_dir(run_id), "logs", f"rank_{rank}")

    def plan(self, spec: LaunchSpec) -> LaunchPlan:
        """The exact argv, added environment, cwd and log dir of every replica (of its ranks). Creates nothing."""
        return LaunchPlan(backend=self.name, spec=spec, requests=self._requests(spec, self.part_dir(spec)))

    def _requests(self, spec: LaunchSpec, base: str, processes: int | None = None) -> list[dict[str, Any]]:
        """The spawn request of each of ``spec``'s own ranks, whose directory is ``base`` (the run's or its part's);
        ``processes``: the training processes to share the cores between (default: the spec's)."""
        added: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
        if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in spec.env:
            added["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (processes or processes_of(spec))))
        if envvars.CHECKPOINT_DIR not in os.environ and envvars.CHECKPOINT_DIR not in spec.env:
            # Each rank keeps its inner optimizer state here (rank_RRRR/), so a relaunched replica resumes it.
            added[envvars.CHECKPOINT_DIR] = os.path.join(base, "checkpoints")
        cwd = os.getcwd()
        return [
            {"rank": rank, "argv": spec.argv(self.python), "env": {**added, **spec.replica_env(rank)}, "cwd": cwd,
             "log_dir": self.log_dir(spec.run_id, rank, base), "timeout_s": spec.timeout_s,
             "stop_file": os.path.join(base, RUN_CANCEL_MARKER)}
            for rank in spec.own_ranks
        ]

    # ------------------------------------------------------------------ capacity
    def check_capacity(self, spec: LaunchSpec, force: bool = False) -> CapacityEstimate:
        """Whether this machine can hold ``spec``'s replicas; ``ConfigError`` (one line, the numbers and the fix)
        if not, unless ``force`` or ``backend.oversubscribe``. Reads the machine, never changes it: call it before
        anything of the run is created (``diloco launch`` does, not ``--dry-run``: a plan is for any machine)."""
        estimate = estimate_capacity(spec, self.config.memory_per_replica_mb)
        if estimate.problem is not None and not (force or self.config.oversubscribe):
            raise ConfigError(estimate.problem, hint=estimate.fix)
        self._capacity_checked.add(spec.run_id)
        return estimate

    def preflight(self, spec: LaunchSpec, *, force: bool = False) -> None:
        """The launch-time check of the backend contract: for local processes, the machine's capacity."""
        self.check_capacity(spec, force=force)

    # ------------------------------------------------------------------ submitting
    def submit(self, plan: LaunchPlan,
               on_progress: Callable[[LocalRunHandle], None] | None = None) -> LocalRunHandle:
        """Start every replica, reporting the handle before the first and after each; if one cannot be started
        (or Ctrl-C, SIGTERM or SIGHUP arrives, or a ``cancel`` from another process), stop those already started
        and raise. A caller that did not check the capacity first gets it checked here, before any process."""
        spec = plan.spec
        if spec.run_id not in self._capacity_checked:
            self.check_capacity(spec)
        me = proc_stat(os.getpid())
        handle = LocalRunHandle(backend=self.name, run_id=spec.run_id, replicas=spec.replicas, ranks=spec.ranks,
                                host=socket.gethostname(), run_dir=self.part_dir(spec),
                                launcher_pid=os.getpid(), launcher_start_time=me.start_time if me else None)
        with terminate_as_interrupt():  # `kill <launcher>` rolls back like Ctrl-C instead of orphaning replicas
            try:
                os.makedirs(handle.run_dir, exist_ok=True)
                _write_private_json(os.path.join(handle.run_dir, REQUESTS_FILE), {"requests": plan.requests})
                self._progress(handle, on_progress)  # findable before its first replica exists
                for request in plan.requests:
                    if os.path.exists(os.path.join(handle.run_dir, RUN_CANCEL_MARKER)):
                        raise BackendError(f"run {spec.run_id} was cancelled while it was being launched")
                    with signals_deferred():  # a replica started is a replica recorded, Ctrl-C or not
                        handle.processes.append(self._spawn(request))
                    self._progress(handle, on_progress)
                handle.complete = True
                self._progress(handle, on_progress)
            except BaseException as exc:  # an OSError, a cancel, or a signal mid-submit: no replica is orphaned
                self._roll_back(handle)
                self._remove_run_dir(handle)
                if isinstance(exc, OSError):
                    rank = spec.own_ranks[len(handle.processes)]
                    raise BackendError(
                        f"could not start local replica {rank}: {type(exc).__name__}: {exc}",
                        hint="the replicas already started were stopped; fix the cause and launch again",
                    ) from exc
                raise
        return handle

    def add_ranks(self, handle: LocalRunHandle, ranks: Sequence[int], spec: LaunchSpec) -> LocalRunHandle:
        """Start replicas for the new global ``ranks`` of a live run, in the run's (or part's) directory, each under
        its own supervisor exactly as ``submit`` starts one, and return the handle that lists them.

        Their requests join ``requests.json`` (so ``relaunch`` repeats them) and the handle joins ``handle.json``
        after each start (a replica started is a replica recorded, as in ``submit``): a ``describe``, ``logs`` or
        ``cancel`` from any process then covers them. Refused (``ConfigError``, nothing started) for a run that was
        cancelled, launched on another host, or that this machine cannot hold with them (``check_capacity`` over
        every rank the run would then have, unless ``backend.oversubscribe``). If one cannot be started, the ones
        this call started are stopped and forgotten before the error propagates; the run's other replicas go on."""
        handle = self._current(handle)
        grown = grown_ranks(handle, ranks, spec)
        if handle.host != socket.gethostname():
            raise ConfigError(f"run {handle.run_id} runs on host {handle.host}; its replicas are added there",
                              hint=f"run diloco scale on {handle.host}")
        if os.path.exists(os.path.join(handle.run_dir, RUN_CANCEL_MARKER)):
            raise ConfigError(f"run {handle.run_id} was cancelled; a cancelled run does not grow",
                              hint="launch a new run")
        every = len(handle.own_ranks) + len(grown.spec.own_ranks)
        self.check_capacity(spec.model_copy(update={"replicas": every, "ranks": None}))
        requests = self._requests(grown.spec, handle.run_dir, every * (spec.entrypoint_args.procs_per_replica or 1))
        path = os.path.join(handle.run_dir, REQUESTS_FILE)
        recorded = (read_json(path) or {}).get("requests") or []
        started: list[LocalProcess] = []
        grown_handle = handle.model_copy(update={"replicas": grown.replicas, "ranks": grown.own})
        with terminate_as_interrupt():
            try:
                _write_private_json(path, {"requests": [*recorded, *requests]})
                for request in requests:
                    with signals_deferred():  # a replica started is a replica recorded, Ctrl-C or not
                        started.append(self._spawn(request))
                        grown_handle = grown_handle.model_copy(
                            update={"processes": [*handle.processes, *started]})
                        write_json_atomic(os.path.join(handle.run_dir, HANDLE_FILE),
                                          grown_handle.model_dump(mode="json"))
            except BaseException as exc:
                self._forget_added(handle, started, recorded)
                if isinstance(exc, OSError):
                    rank = grown.spec.own_ranks[len(started)]
                    raise BackendError(f"could not start local replica {rank}: {type(exc).__name__}: {exc}",
                                       hint="the replicas this call had started were stopped; the run goes on "
                                            "as it was") from exc
                raise
        return grown_handle

    def _forget_added(self, handle: LocalRunHandle, started: list[LocalProcess],
                      recorded: list[dict[str, Any]]) -> None:
        """Undo an ``add_ranks`` cut short: stop and kill the replicas it started, and put the run's handle and
        requests back as they were (the run's first replicas are never touched)."""
        with signals_deferred():
            if started:
                partial = handle.model_copy(update={"processes": started})
                self.cancel(partial, [p.rank for p in started])
                deadline = time.monotonic() + self.config.grace_period_s + 5.0
                while time.monotonic() < deadline and any(self._alive(p) for p in started):
                    time.sleep(0.05)
                for p in started:
                    if self._alive(p):
                        self._signal_group(p, signal.SIGKILL)
            write_json_atomic(os.path.join(handle.run_dir, HANDLE_FILE), handle.model_dump(mode="json"))
            _write_private_json(os.path.join(handle.run_dir, REQUESTS_FILE), {"requests": recorded})

    def roll_back(self, handle: LocalRunHandle) -> None:
        """What a failed ``submit`` does: stop the replicas, kill what outlives the grace period, delete the run's
        directory."""
        handle = self._current(handle)
        self._roll_back(handle)
        self._remove_run_dir(handle)

    def _progress(self, handle: LocalRunHandle, on_progress: Callable[[LocalRunHandle], None] | None) -> None:
        write_json_atomic(os.path.join(handle.run_dir, HANDLE_FILE), handle.model_dump(mode="json"))
        if on_progress is not None:
            on_progress(handle)

    def _roll_back(self, handle: LocalRunHandle) -> None:
        """Stop what a failed launch started, and wait (bounded) until it is gone.

        Signals are held meanwhile, so a second Ctrl-C cannot cut the stop in two; it only hurries it: the wait
        for a clean stop ends and everything left is killed at once. The held signal is acted on afterwards."""
        with signals_deferred() as hurry:
            if handle.processes:
                self.cancel(handle)
                deadline = time.monotonic() + self.config.grace_period_s + 5.0
                while time.monotonic() < deadline and not hurry():
                    groups = live_process_groups()
                    if not any(self._alive(p, groups) for p in handle.processes):
                        break
                    time.sleep(0.05)
            self._kill_everything(handle)

    def _remove_run_dir(self, handle: LocalRunHandle) -> None:
        """A launch that was rolled back leaves no run directory (its handle, requests, logs and default store):
        with the record gone nothing could find it again, and ``list_runs`` would show a run that never was.
        Best effort, after every replica is gone; the error that caused the rollback is what matters."""
        from diloco.run_dirs import remove_run_files

        try:
            remove_run_files(handle.run_dir)
        except (OSError, DilocoError):
            pass

    def _kill_everything(self, handle: LocalRunHandle) -> None:
        """SIGKILL what is left of a run: its replicas' groups, then any process still carrying its run id (a
        replica's child that left the group). Never this process or its own group."""
        groups = live_process_groups()
        for p in handle.processes:
            if self._alive(p, groups):
                self._signal_group(p, signal.SIGKILL)
        for pid in processes_with_env(envvars.RUN_ID, handle.run_id):
            st = proc_stat(pid)
            if pid != os.getpid() and st is not None and st.pgrp != os.getpgrp():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _spawn(self, request: dict[str, Any]) -> LocalProcess:
        log_dir = request["log_dir"]
        os.makedirs(log_dir, exist_ok=True)
        cmd = [sys.executable, "-m", SUPERVISOR_MODULE, "--log-dir", log_dir,
               "--grace", f"{self.config.grace_period_s:g}"]
        if request.get("timeout_s") is not None:
            cmd += ["--timeout", f"{request['timeout_s']:g}"]
        if request.get("stop_file"):  # absent from requests an older diloco recorded
            cmd += ["--stop-file", request["stop_file"]]
        cmd += ["--", *request["argv"]]
        with open(os.path.join(log_dir, SUPERVISOR_LOG), "ab") as sup_log:
            proc = subprocess.Popen(
                cmd, cwd=request["cwd"], env={**os.environ, **request["env"]}, stdin=subprocess.DEVNULL,
                stdout=sup_log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            )
        self._procs[proc.pid] = proc
        st = proc_stat(proc.pid)
        return LocalProcess(rank=request["rank"], pid=proc.pid, start_time=st.start_time if st else None,
                            log_dir=log_dir, launched_at=time.time())

    # ------------------------------------------------------------------ state
    def _reap(self, pid: int) -> None:
        proc = self._procs.get(pid)
        if proc is not None and proc.poll() is not None:
            self._procs.pop(pid, None)

    def _is_ours(self, p: LocalProcess) -> bool | None:
        """Whether the pid is still *our* supervisor: True/False, or None if it no longer exists."""
        self._reap(p.pid)
        st = proc_stat(p.pid)
        if st is None:
            if has_procfs():
                return None
            try:  # no /proc (macOS): best effort, no pid-reuse check
                os.kill(p.pid, 0)
            except (ProcessLookupError, PermissionError):
                return None
            return True
        if p.start_time is not None and st.start_time != p.start_time:
            return False  # the pid was recycled by an unrelated process
        return None if st.state == "Z" else True

    def _alive(self, p: LocalProcess, groups: dict[int, list[int]] | None = None) -> bool:
        """Anything of the replica's process group still alive (the supervisor, or what it left behind).
        ``groups`` is one ``live_process_groups()`` pass shared by many replicas."""
        if self._is_ours(p) is False:
            return False  # recycled pid: the kernel never reuses a pid that is still a live group id
        return bool(groups.get(p.pid)) if groups is not None else bool(group_members(p.pid))

    def _launcher_alive(self, handle: LocalRunHandle) -> bool:
        """Whether the process that submitted the run is still there (so it may still start replicas)."""
        st = proc_stat(handle.launcher_pid)
        if st is None:
            return not has_procfs() and _pid_alive(handle.launcher_pid)
        if st.state == "Z":
            return False
        return handle.launcher_start_time is None or st.start_time == handle.launcher_start_time

    def _current(self, handle: LocalRunHandle) -> LocalRunHandle:
        """The handle as completely as it can be known.

        A caller's copy (the run registry's) can lag the launch's own ``handle.json``, which is written first;
        and a launcher killed outright may have started a replica it had no time to record anywhere. Once such
        a launcher is gone, its replicas are found by the run id in their environment and adopted (and written
        to ``handle.json``), so ``describe`` shows them and ``cancel`` stops them."""
        if handle.host != socket.gethostname():
            return handle
        data = read_json(os.path.join(handle.run_dir, HANDLE_FILE))
        if data:
            try:
                latest = self.load_handle(data)
            except ValueError:
                latest = handle
            if latest.run_id == handle.run_id and (len(latest.processes) > len(handle.processes)
                                                   or (latest.complete and not handle.complete)
                                                   or _restarts(latest) > _restarts(handle)):
                handle = latest
        if handle.complete or self._launcher_alive(handle):
            return handle
        strays = self._strays(handle)
        if strays:
            processes = sorted([*handle.processes, *strays], key=lambda p: p.rank)
            handle = handle.model_copy(update={"processes": processes})
            try:
                write_json_atomic(os.path.join(handle.run_dir, HANDLE_FILE), handle.model_dump(mode="json"))
            except OSError:
                pass  # adopted for this call all the same
        return handle

    def _strays(self, handle: LocalRunHandle) -> list[LocalProcess]:
        """Replicas of ``handle``'s run that it does not list: one per process group carrying the run id."""
        known_groups = {p.pid for p in handle.processes}
        known_ranks = {p.rank for p in handle.processes}
        found: list[LocalProcess] = []
        for pid, env in sorted(processes_with_env(envvars.RUN_ID, handle.run_id).items()):
            st = proc_stat(pid)
            try:
                rank = int(env.get(envvars.REPLICA_RANK, ""))
            except ValueError:
                continue
            if st is None or st.pgrp in known_groups or st.pgrp == os.getpgrp() or rank in known_ranks \
                    or rank not in handle.own_ranks:
                continue
            leader = proc_stat(st.pgrp)  # the supervisor, which leads the group (gone if it was killed)
            args = command_line(st.pgrp)
            log_dir = args[args.index("--log-dir") + 1] if "--log-dir" in args[:-1] else \
                self.log_dir(handle.run_id, rank, handle.run_dir)
            found.append(LocalProcess(rank=rank, pid=st.pgrp, start_time=leader.start_time if leader else None,
                                      log_dir=log_dir, launched_at=time.time()))
            known_groups.add(st.pgrp)
            known_ranks.add(rank)
        return found

    def describe(self, handle: LocalRunHandle) -> RunStatus:
        """Every replica's state, from its ``exit.json`` and its supervisor's liveness (works from any process)."""
        handle = self._current(handle)
        replicas = []
        for rank in handle.own_ranks:
            status = self._replica_status(handle, rank)
            p = handle.process(rank)
            if p is not None and p.restarts:
                status.restarts = p.restarts
                why = "; ".join(p.restart_reasons)
                status.detail = f"{status.detail or ''} (relaunched {p.restarts}x: {why})".strip()
            replicas.append(status)
        return RunStatus(run_id=handle.run_id, replicas=replicas)

    # ------------------------------------------------------------------ relaunching
    def relaunch(self, handle: LocalRunHandle, rank: int) -> LocalRunHandle:
        """Start replica ``rank`` again with the request it was first started with. Its previous attempt's logs
        move to ``rank_<r>.try<n>`` (kept, so its failure can still be read); the new process gets the rank's
        log directory, so ``diloco logs`` follows the live attempt. Refused while the old one is alive."""
        handle = self._current(handle)
        old = handle.process(rank)
        if old is not None and self._alive(old):
            raise BackendError(f"replica {rank} of run {handle.run_id} is still running; it cannot be relaunched",
                               hint=f"stop it first: diloco cancel {handle.run_id} -r {rank}")
        requests = (read_json(os.path.join(handle.run_dir, REQUESTS_FILE)) or {}).get("requests") or []
        request = next((r for r in requests if r.get("rank") == rank), None)
        if request is None:
            raise BackendError(f"run {handle.run_id} has no recorded request for replica {rank} "
                               f"({os.path.join(handle.run_dir, REQUESTS_FILE)}); it cannot be relaunched",
                               hint="it was launched by an older diloco; launch the run again")
        reasons = list(old.restart_reasons) if old is not None else []
        if old is not None:
            reasons.append(self._replica_status(handle, rank).reason or "ended")
            if os.path.isdir(old.log_dir):
                os.replace(old.log_dir, old.moved_dir)
        with signals_deferred():  # a replica started is a replica recorded
            fresh = self._spawn(request).model_copy(update={"restarts": len(reasons), "restart_reasons": reasons})
            processes = sorted([p for p in handle.processes if p.rank != rank] + [fresh], key=lambda p: p.rank)
            handle = handle.model_copy(update={"processes": processes})
            write_json_atomic(os.path.join(handle.run_dir, HANDLE_FILE), handle.model_dump(mode="json"))
        return handle

    def _status(self, rank: int, native: str, job_id: str = "", **fields: Any) -> ReplicaStatus:
        return ReplicaStatus(rank=rank, state=self.map_state(native), job_id=job_id, **fields)

    def _replica_status(self, handle: LocalRunHandle, rank: int) -> ReplicaStatus:
        if handle.host != socket.gethostname():
            return self._status(rank, "elsewhere", reason=f"launched on host {handle.host}; run diloco there")
        p = handle.process(rank)
        if p is None:
            stopped = os.path.exists(os.path.join(handle.run_dir, RUN_CANCEL_MARKER))  # the launch starts no more
            if handle.complete or stopped or not self._launcher_alive(handle):
                return self._status(rank, "never-started", reason="never started: its launch was interrupted")
            return self._status(rank, "not-started", detail="waiting for the launch to start it")
        job_id = str(p.pid)
        files = p.attempt_dir()
        cancel_requested = os.path.exists(os.path.join(files, CANCEL_MARKER))
        child = read_json(os.path.join(files, CHILD_FILE)) or {}
        started = child.get("started_at")
        exit_rec = read_json(os.path.join(files, EXIT_FILE))
        if self._is_ours(p):
            # No exit record yet, or the supervisor wrote it and has not quite exited: a replica is terminal only
            # once its supervisor is gone (it kills the rest of the group first), so a caller that waited for it
            # finds no process left.
            native = "cancel-requested" if cancel_requested else ("running" if child else "starting")
            return self._status(rank, native, job_id, started_at=started, detail=f"pid {p.pid}")
        if exit_rec is None:  # it may have finished between the two reads
            exit_rec = read_json(os.path.join(files, EXIT_FILE))
        if exit_rec is None and self._is_ours(p) is None and self._alive(p):
            # The supervisor was killed (kill -9, OOM killer) but the replica lives on in its process group:
            # still running, and still ours to stop (cancel signals the group).
            return self._status(
                rank, "cancel-requested" if cancel_requested else "unsupervised", job_id, started_at=started,
                detail="unsupervised",
                reason=f"its supervisor (pid {p.pid}) was killed; the replica runs on unsupervised: its output "
                       f"still goes to stdout.log and stderr.log in {files} (`diloco logs` shows it, stamped "
                       f"when read), but its exit code will not be recorded")
        if exit_rec is None and not os.path.isdir(files):
            return self._status(rank, "files-gone", job_id, started_at=started,
                                reason=f"its run files are gone ({files} was deleted): how it ended is no "
                                       f"longer known here")
        if exit_rec is None:
            if cancel_requested:
                return self._status(rank, "cancelled", job_id, reason="cancelled (no exit code was recorded)",
                                    started_at=started)
            return self._status(
                rank, "lost", job_id, started_at=started,
                reason=f"ended without recording an exit code: its supervisor (pid {p.pid}) was killed "
                       f"(kill -9, the OOM killer, a reboot?); see {os.path.join(files, SUPERVISOR_LOG)}")
        code = int(exit_rec.get("exit_code", 1))
        reason = exit_rec.get("reason")
        failure = None
        if code == 0:
            native = "succeeded"
        elif cancel_requested:
            native, reason = "cancelled", f"cancelled ({reason})"
        else:
            native = "failed"
            failure = _dropped(code)
            reason = "dropped from a round it was late for (exit code 75)" if failure is not None else reason
        return self._status(rank, native, job_id, reason=reason, exit_code=code, failure=failure,
                            timed_out=bool(exit_rec.get("timed_out")),
                            started_at=exit_rec.get("started_at", started), ended_at=exit_rec.get("ended_at"))

    # ------------------------------------------------------------------ cancelling
    def _signal_group(self, p: LocalProcess, sig: int) -> bool:
        """Signal the replica's process group unless its leader pid now belongs to someone else."""
        if self._is_ours(p) is False:
            return False
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def cancel(self, handle: LocalRunHandle, ranks: Sequence[int] | None = None) -> None:
        """Ask the (given) replicas to stop and return at once; idempotent.

        The first request SIGTERMs each supervisor, which forwards it to its replica and SIGKILLs the replica's
        group after ``grace_period_s`` on its own. A repeated request, or a replica whose supervisor is gone, gets
        the group-wide signal directly (SIGKILL when it was already asked once). A launch still in progress stops
        starting replicas (``cancel_requested`` in the run directory). Ctrl-C while it asks is acted on once every
        replica has been asked: a cancel cut in half would leave the rest running with nobody to escalate.
        """
        if ranks is None:  # first: a supervisor that starts after the look below finds it and starts nothing
            _touch(os.path.join(handle.run_dir, RUN_CANCEL_MARKER))
        handle = self._current(handle)  # also the replicas a killed launch had no time to record
        with signals_deferred():
            groups = live_process_groups()
            for p in handle.processes:
                if (ranks is None or p.rank in ranks) and self._alive(p, groups):
                    self._ask_to_stop(p)

    def _ask_to_stop(self, p: LocalProcess) -> None:
        """SIGTERM through the supervisor the first time, SIGKILL to the whole group the next."""
        marker = os.path.join(p.log_dir, CANCEL_MARKER)
        again = os.path.exists(marker)
        if not again and not os.path.exists(os.path.join(p.log_dir, EXIT_FILE)):
            _touch(marker)
        if again:
            self._signal_group(p, signal.SIGKILL)
        elif self._is_ours(p):
            try:  # one SIGTERM, through the supervisor (a group-wide one would reach the replica twice)
                os.kill(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        else:
            self._signal_group(p, signal.SIGTERM)

    # ------------------------------------------------------------------ logs
    def replica_logs(self, handle: LocalRunHandle, rank: int, *, follow: bool = False,
                     since: float | None = None) -> Iterator[LogRecord]:
        """The replica's output lines with the time each was written; ``follow`` waits for more until it ends.
        After them, what a killed supervisor left uncopied (the replica kept writing into its own files): each
        stream's lines in order, stamped when read."""
        p = handle.process(rank) or self._current(handle).process(rank)
        buf = b""
        offset = 0
        uncopied_shown = 0
        while True:
            # looked up at every read: a relaunch may move this attempt's files aside once it has ended
            path = os.path.join(p.attempt_dir() if p else self.log_dir(handle.run_id, rank, handle.run_dir),
                                COMBINED_LOG)
            chunk = read_from(path, offset)
            offset += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                parsed = parse_combined_line(raw.decode(errors="replace"))
                if parsed is not None and (since is None or parsed[0] >= since):
                    yield LogRecord(parsed[0], rank, parsed[1], parsed[2])
            if not chunk or not follow:
                uncopied = self._uncopied(p)
                now = time.time()
                for stream, text in uncopied[uncopied_shown:]:
                    yield LogRecord(now, rank, stream, text)
                uncopied_shown = max(uncopied_shown, len(uncopied))
            if not follow:
                return
            if not chunk:
                if p is None:
                    handle = self._current(handle)
                    p = handle.process(rank)
                if self._replica_status(handle, rank).state.is_terminal:
                    follow = False  # one more read: the last lines may have landed after the previous one
                    continue
                time.sleep(0.2)

    def _uncopied(self, p: LocalProcess | None) -> list[tuple[str, str]]:
        """Output its supervisor never copied into ``combined.log``: none while the supervisor lives or once it
        recorded the end (it copies everything first); otherwise it was killed, and the replica's own files hold
        what came after."""
        if p is None or self._is_ours(p):
            return []
        files = p.attempt_dir()
        return [] if os.path.exists(os.path.join(files, EXIT_FILE)) else uncopied_output(files)

    def failure_tail(self, handle: LocalRunHandle, rank: int, n: int = 10) -> list[str]:
        """The last ``n`` lines the replica wrote to stderr (why it failed, usually)."""
        p = handle.process(rank) or self._current(handle).process(rank)
        if p is None:
            return []
        path = os.path.join(p.attempt_dir(), STDERR_LOG)
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 64 * 1024))
                data = f.read()
        except OSError:
            return []
        lines = [ln for ln in data.decode(errors="replace").splitlines() if ln.strip()]
        return list(deque(lines, maxlen=n))

    # ------------------------------------------------------------------ housekeeping
    def remove(self, handle: LocalRunHandle, *, dry_run: bool = False) -> list[str]:
        """The run directory: every replica's logs and exit record, the handle, and the default file:// store."""
        from diloco.run_dirs import remove_run_files

        return remove_run_files(handle.run_dir, dry_run=dry_run)

    # ------------------------------------------------------------------ discovery
    def list_runs(self) -> list[RunListing]:
        """Runs whose handle is under the log root (also launches interrupted before the registry saw them)."""
        root = os.path.dirname(self.run_dir("x"))
        out: list[RunListing] = []
        try:
            names = sorted(os.listdir(root))
        except OSError:
            return []
        for name in names:
            data = read_json(os.path.join(root, name, HANDLE_FILE))
            if not data:
                continue
            try:
                handle = self.load_handle(data)
            except ValueError:
                continue
            created = min((p.launched_at for p in handle.processes), default=None)
            out.append(RunListing(run_id=handle.run_id, backend=self.name, state=self.describe(handle).state,
                                  replicas=handle.replicas, created_at=created))
        return out

    @classmethod
    def doctor_checks(cls, ctx: DoctorContext) -> list[Check]:
        return [check_replica_environment(ctx)]


def check_replica_environment(ctx: DoctorContext) -> Check:
    """Local replicas run ``python -m diloco.replica.entrypoint`` with this interpreter: can it import the
    replica side (torch included), the way a replica will, in a fresh process?"""
    from diloco.executors.checks import Check, Status

    name = "replica environment"
    python = ctx.option("python") or sys.executable
    code = "import torch, safetensors, diloco.replica.entrypoint, diloco.trainers.gpt; print(torch.__version__)"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(name=name, status=Status.FAIL, detail=f"cannot run {python}: {exc}",
                     fix="set backend.python to a working interpreter, or leave it unset to use this one")
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return Check(name=name, status=Status.FAIL, detail=f"{python} cannot import the replica side: {last}",
                     fix="install diloco into that environment (`make demo` does, or `pip install -e .`)")
    return Check(name=name, status=Status.PASS,
                 detail=f"{python}: torch {out.stdout.strip()}, {os.cpu_count()} CPU core(s) to share")


# ---------------------------------------------------------------------------------------------- capacity
#: At most this many replicas per CPU core: beyond it each replica gets so little of a core that a run crawls, and
#: starting hundreds of Python processes at once can take a machine down before the first round.
REPLICAS_PER_CORE = 4
#: The available memory a launch may plan to use; the rest is for the launcher, the store and everything else.
MEMORY_SHARE = 0.9
_MIB = 1024 * 1024


class MachineCapacity(BaseModel):
    """What this machine offers a local run: usable CPU cores (affinity and cgroup quota) and available memory
    (``MemAvailable``, or the cgroup limit's headroom if lower)."""

    cores: int
    memory_bytes: int

    @property
    def max_by_cores(self) -> int:
        return self.cores * REPLICAS_PER_CORE

    def max_by_memory(self, per_replica_bytes: int) -> int:
        return int(self.memory_bytes * MEMORY_SHARE // max(1, per_replica_bytes))


class CapacityEstimate(BaseModel):
    """A local run against this machine: how many replicas it holds and, if the run needs more, why not.

    With several processes per replica (``--procs-per-replica K``) the cores and the memory are counted per
    process: ``max_replicas`` is how many replicas of K processes fit."""

    replicas: int
    procs_per_replica: int = 1
    per_replica_bytes: int
    basis: str  # where per_replica_bytes comes from
    machine: MachineCapacity
    max_replicas: int
    problem: str | None = None  # one line with the numbers; None if the run fits
    fix: str | None = None


def estimate_capacity(spec: LaunchSpec, memory_per_replica_mb: int | None = None,
                      machine: MachineCapacity | None = None) -> CapacityEstimate:
    """Replicas of ``spec`` against ``machine`` (default: this one, read now)."""
    machine = machine or machine_capacity()
    per_replica, basis = replica_memory(spec, memory_per_replica_mb)
    procs = spec.entrypoint_args.procs_per_replica or 1
    limit = max(0, min(machine.max_by_cores, machine.max_by_memory(per_replica)))
    if procs > 1:
        return _estimate_processes(spec, procs, per_replica, basis, machine, limit)
    wanted = len(spec.own_ranks)  # a part of a run split over backends: only its replicas run here
    estimate = CapacityEstimate(replicas=wanted, per_replica_bytes=per_replica, basis=basis, machine=machine,
                                max_replicas=limit)
    if wanted <= limit:
        return estimate
    estimate.problem = (
        f"replicas: this machine can hold {limit} local replica(s) of this run, not {wanted}: "
        f"{machine.cores} CPU core(s) take at most {machine.max_by_cores} ({REPLICAS_PER_CORE} per core) and "
        f"{_size(machine.memory_bytes)} of available memory holds {machine.max_by_memory(per_replica)} at about "
        f"{_size(per_replica)} each ({basis})")
    estimate.fix = (f"launch at most {limit} (--replicas {limit})" if limit else "free some memory") + \
        ", use smaller replicas, or pass --force (or --set backend.oversubscribe=true) to launch anyway"
    return estimate


def processes_of(spec: LaunchSpec) -> int:
    """The training processes a local run starts: its replicas (a part's own) times ``--procs-per-replica`` (1 when
    not set: without GPUs a replica runs one process)."""
    return len(spec.own_ranks) * (spec.entrypoint_args.procs_per_replica or 1)


def _estimate_processes(spec: LaunchSpec, procs: int, per_process: int, basis: str, machine: MachineCapacity,
                        process_limit: int) -> CapacityEstimate:
    """``estimate_capacity`` for replicas of ``procs`` processes each: the limits count processes."""
    wanted = processes_of(spec)
    estimate = CapacityEstimate(replicas=len(spec.own_ranks), procs_per_replica=procs,
                                per_replica_bytes=per_process * procs,
                                basis=basis, machine=machine, max_replicas=process_limit // procs)
    if wanted <= process_limit:
        return estimate
    estimate.problem = (
        f"procs_per_replica: this machine can hold {process_limit} local training process(es) of this run, not "
        f"{len(spec.own_ranks)} replica(s) x {procs} (--procs-per-replica): {machine.cores} CPU core(s) take at most "
        f"{machine.max_by_cores} ({REPLICAS_PER_CORE} per core) and {_size(machine.memory_bytes)} of available "
        f"memory holds {machine.max_by_memory(per_process)} at about {_size(per_process)} each ({basis})")
    fewer = process_limit // procs
    estimate.fix = (f"launch at most {fewer} replica(s) (--replicas {fewer}) or lower --procs-per-replica"
                    if fewer else "lower --procs-per-replica or free some memory") + \
        ", or pass --force (or --set backend.oversubscribe=true) to launch anyway"
    return estimate


def machine_capacity() -> MachineCapacity:
    """This machine's usable cores and available memory, read now."""
    return MachineCapacity(cores=_usable_cores(), memory_bytes=_available_memory())


def _usable_cores() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else max(1, cores)


def _cgroup_cpu_quota() -> float | None:
    """The container's CPU limit in cores (cgroup v2 ``cpu.max`` or v1 CFS quota), if it has one."""
    text = _read_text("/sys/fs/cgroup/cpu.max")
    if text:
        quota, _, period = text.partition(" ")
        if quota != "max" and period:
            return int(quota) / int(period)
        return None
    quota_us, period_us = _read_text("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), \
        _read_text("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if quota_us and period_us and int(quota_us) > 0:
        return int(quota_us) / int(period_us)
    return None


def _available_memory() -> int:
    """``MemAvailable`` (what can be used without swapping), capped by a cgroup memory limit's headroom."""
    available: int | None = None
    for line in (_read_text("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        try:
            available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            available = 0
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_text(limit_file), _read_text(usage_file)
        if limit and usage and limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:
            available = min(available, max(0, int(limit) - int(usage)))
            break
    return available


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _size(n: int) -> str:
    return f"{n / (1024 * _MIB):.1f} GiB" if n >= 1024 * _MIB else f"{n / _MIB:.0f} MiB"


def _restarts(handle: LocalRunHandle) -> int:
    """Relaunches recorded in ``handle`` (a copy with more is newer: relaunching keeps the number of processes)."""
    return sum(p.restarts for p in handle.processes)


def _write_private_json(path: str, data: dict[str, Any]) -> None:
    """``write_json_atomic`` readable by this user only (0600 from its creation): the requests hold the replicas'
    environment, ``--env`` credentials included, which a relaunch must repeat, as ``~/.aws/credentials`` is."""
    import json

    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    st = proc_stat(pid)
    return st is None or st.state != "Z"


def _touch(path: str) -> None:
    try:
        with open(path, "a"):
            pass
    except OSError:
        pass


__all__ = ["CapacityEstimate", "LocalBackend", "LocalBackendConfig", "LocalProcess", "LocalRunHandle",
           "MachineCapacity", "estimate_capacity", "machine_capacity"]


def _dropped(code: int) -> FailureVerdict | None:
    """The verdict on a replica that exited dropped from a ``min_replicas`` round (curable: it rejoins), else None."""
    from diloco.executors.failures import EXIT_DROPPED, dropped_verdict

    return dropped_verdict() if code == EXIT_DROPPED else None
