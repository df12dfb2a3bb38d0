"""The ``ServerlessExecutor`` protocol: one lifecycle model, planning separate from submitting.

A *run* is N replica jobs that never talk to each other except through the rendezvous store. Every backend
(local processes, SageMaker Training Jobs, Kubernetes Indexed Jobs) is a thin translator:

* ``plan(spec) -> LaunchPlan`` is pure: it returns the exact per-replica requests the backend would submit
  (argv + env for local, CreateTrainingJob kwargs for SageMaker, the Job manifest for Kubernetes). It touches no
  network, creates no directory and mutates nothing; ``diloco launch --dry-run`` prints it.
* ``submit(plan) -> handles`` only executes a plan. If submitting replica k fails, replicas 0..k-1 are cancelled
  before the error propagates: a backend failure never leaves orphan jobs.
* ``poll``, ``collect``, ``cancel``, ``stream_logs`` work from a ``ReplicaHandle`` alone (it is JSON-serialisable
  and stored in the run registry), so a later CLI invocation can manage a run it did not launch.

Every replica gets the same environment on every backend: ``DILOCO_RUN_ID``, ``REPLICA_RANK``, ``WORLD_SIZE``,
``RENDEZVOUS_URI``, plus the backend's native variables.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from diloco import envvars
from diloco.replica_entrypoint import DEFAULT_TRAINER

DEFAULT_ENTRYPOINT = "diloco.replica_entrypoint"


class RunState(str, enum.Enum):
    """One lifecycle for every backend. Unknown backend states map to ``UNKNOWN`` (non-terminal), never a KeyError.

    Transitions: PENDING -> RUNNING -> SUCCEEDED | FAILED; any non-terminal -> CANCELLING -> CANCELLED;
    RUNNING -> PREEMPTED -> RUNNING (the backend relaunched the replica, which rejoins from the store).
    """

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"  # preempted/recovering: the backend is bringing the replica back
    UNKNOWN = "unknown"

    @property
    def is_terminal(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)


class EntrypointArgs(BaseModel):
    """What the replica entrypoint needs; rendered into argv identically by every backend."""

    rendezvous_uri: str
    world_size: int = Field(ge=1)
    trainer: str = DEFAULT_TRAINER  # "module:function"
    trainer_kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = None  # all-reduce poll timeout inside the replica
    poll_interval_s: float | None = None  # how often a waiting replica polls the store (entrypoint default: 1 s)

    def to_argv(self) -> list[str]:
        """The entrypoint's arguments, one token per list element (as SageMaker's ContainerArguments wants)."""
        import json

        module, fn = self.trainer.split(":", 1)
        argv = [
            "--rendezvous", self.rendezvous_uri,
            "--world-size", str(self.world_size),
            "--trainer-module", module,
            "--trainer-fn", fn,
            "--trainer-kwargs-json", json.dumps(self.trainer_kwargs, sort_keys=True, separators=(",", ":")),
        ]
        if self.timeout_s is not None:
            argv += ["--timeout", f"{self.timeout_s:g}"]
        if self.poll_interval_s is not None:
            argv += ["--poll-interval", f"{self.poll_interval_s:g}"]
        return argv


class LaunchSpec(BaseModel):
    """Backend-neutral description of one run: N identical replicas of one entrypoint."""

    run_id: str
    n_replicas: int = Field(ge=1)
    entrypoint: str = DEFAULT_ENTRYPOINT  # a python module run with ``python -m``
    entrypoint_args: EntrypointArgs
    gpu: str | None = None
    timeout_s: float | None = None  # wall-clock limit per replica job
    env: dict[str, str] = Field(default_factory=dict)  # extra environment for every replica

    def replica_env(self, rank: int) -> dict[str, str]:
        """The common environment contract for replica ``rank`` (backends add their native variables)."""
        return {
            **self.env,
            envvars.RUN_ID: self.run_id,
            envvars.REPLICA_RANK: str(rank),
            envvars.WORLD_SIZE: str(self.n_replicas),
            envvars.RENDEZVOUS_URI: self.entrypoint_args.rendezvous_uri,
        }


class ReplicaRequest(BaseModel):
    """The exact request a backend would submit for one replica (its shape is the backend's own)."""

    rank: int
    request: dict[str, Any]


class LaunchPlan(BaseModel):
    """The dry-run: everything ``submit`` will do, and nothing done yet."""

    backend: str
    spec: LaunchSpec
    replicas: list[ReplicaRequest]


class ReplicaHandle(BaseModel):
    """Enough to find one replica job again from another process: backend name, run, rank, backend job id."""

    backend: str
    run_id: str
    rank: int
    job_id: str
    data: dict[str, Any] = Field(default_factory=dict)  # backend specifics (pid, log dir, job ARN, ...)


class ReplicaStatus(BaseModel):
    """The state of one replica, with the backend's own secondary status text kept verbatim."""

    rank: int
    state: RunState
    job_id: str = ""
    reason: str | None = None  # why it failed / was cancelled, in the backend's words
    secondary: str | None = None  # e.g. SageMaker SecondaryStatus, a pod phase
    exit_code: int | None = None
    timed_out: bool = False  # the backend stopped it for exceeding the run's wall-clock limit (timeout_s)
    started_at: float | None = None
    ended_at: float | None = None


class ReplicaResult(BaseModel):
    """What ``collect`` returns per replica once it is terminal."""

    rank: int
    status: ReplicaStatus
    artifacts: dict[str, str] = Field(default_factory=dict)  # e.g. {"model": "s3://.../model.tar.gz"}


def aggregate_state(states: Sequence[RunState]) -> RunState:
    """One state for a run: any failure fails it; all succeeded succeeds; otherwise the least advanced."""
    if not states:
        return RunState.UNKNOWN
    s = set(states)
    if RunState.FAILED in s:
        return RunState.FAILED
    if s == {RunState.SUCCEEDED}:
        return RunState.SUCCEEDED
    if RunState.CANCELLING in s:
        return RunState.CANCELLING
    if RunState.CANCELLED in s and all(x.is_terminal for x in s):
        return RunState.CANCELLED
    for state in (RunState.PREEMPTED, RunState.PENDING, RunState.RUNNING, RunState.UNKNOWN):
        if state in s:
            return state
    return RunState.UNKNOWN


@runtime_checkable
class ServerlessExecutor(Protocol):
    """What every backend implements. See the module docstring for the contract of each method."""

    name: str

    def plan(self, spec: LaunchSpec) -> LaunchPlan: ...

    def submit(self, plan: LaunchPlan) -> list[ReplicaHandle]: ...

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus: ...

    def cancel(self, handle: ReplicaHandle) -> None: ...

    def stream_logs(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[str]: ...


def launch_replicas(
    executor: ServerlessExecutor,
    n_replicas: int,
    entrypoint: str,
    entrypoint_args: EntrypointArgs,
    *,
    run_id: str,
    gpu: str | None = None,
    timeout: float | None = None,
) -> list[ReplicaHandle]:
    """``submit(plan(spec))``: the seed's ``launch_replicas`` in terms of the two phases."""
    spec = LaunchSpec(run_id=run_id, n_replicas=n_replicas, entrypoint=entrypoint,
                      entrypoint_args=entrypoint_args, gpu=gpu, timeout_s=timeout)
    return executor.submit(executor.plan(spec))


def collect(
    executor: ServerlessExecutor,
    handles: Sequence[ReplicaHandle],
    timeout: float | None = None,
    poll_interval_s: float = 1.0,
) -> list[ReplicaResult]:
    """Poll every replica until all are terminal; rank-ordered results. Raises ``TimeoutError`` past ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        statuses = [executor.poll(h) for h in handles]
        if all(s.state.is_terminal for s in statuses):
            return sorted((ReplicaResult(rank=s.rank, status=s) for s in statuses), key=lambda r: r.rank)
        if deadline is not None and time.monotonic() >= deadline:
            pending = [s.rank for s in statuses if not s.state.is_terminal]
            raise TimeoutError(f"replica(s) {pending} not finished after {timeout:g}s")
        time.sleep(poll_interval_s)
