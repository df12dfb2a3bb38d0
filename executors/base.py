"""The backend contract, ``ServerlessExecutor``: one run of N replicas, planned, submitted, described, cancelled
and logged as a whole.

A *run* is N replica jobs that never talk to each other except through the rendezvous store. A backend (local
processes, SageMaker Training Jobs, a Kubernetes Indexed Job, or a third party's) is a thin translator between that
idea and its own service, and every call takes the whole run, so a backend can answer with one list or describe call
per poll instead of N (SageMaker throttles ``DescribeTrainingJob``; an Indexed Job is one object anyway):

* ``plan(spec) -> LaunchPlan`` is pure: the exact requests the backend would send (argv + env for local,
  CreateTrainingJob kwargs for SageMaker, the Job manifest for Kubernetes), with the estimated cost and any
  warning. No directory, no mutation, and no network beyond bounded best-effort lookups (a price, a hint);
  ``diloco launch --dry-run`` prints it and tests snapshot it. Deterministic for a fixed run id.
* ``submit(plan, on_progress) -> RunHandle`` is all-or-nothing: if replica k cannot be created, whatever was
  created before it is cancelled before the error propagates (also on Ctrl-C), and what the backend wrote of its
  own for the run (shipped code, a run directory) is removed once those replicas have ended, so a failed launch
  never leaves orphan jobs or files. ``on_progress`` receives the handle before the first replica is created and
  after each one, so the caller can record it at once. The caller (``diloco launch``) publishes the run's objects
  in the store first (``run.json``, the spec object at ``LaunchSpec.spec_uri``) and removes them if ``submit``
  raises.
* ``describe(handle) -> RunStatus``: every replica's state, reason, exit code, restarts, timestamps, backend detail
  and artifacts in one call.
* ``cancel(handle, ranks=None)`` asks the replicas to stop and returns without waiting (idempotent: a finished or
  already cancelled replica is not an error). ``wait(handle)`` is for callers that need the end.
* ``logs(handle, ranks, follow, since) -> Iterator[LogRecord]``: timestamped lines, each replica's in order; the
  orchestrator merges replicas in time order and the CLI prefixes ``[rK]``.
* ``list_runs()``: the runs the backend can see on its own (without the local run registry).
* ``roll_back(handle)``: undo a submitted run as ``submit``'s own rollback would (stop, wait, remove its leftovers);
  a composite backend calls it on the parts it had already submitted when a later part is refused.
* ``remove(handle, dry_run)``: delete what the backend itself keeps of a run that has ended (the local backend: its
  run directory with the logs); ``diloco rm``/``prune`` call it after deleting the store objects, before the record.

A handle is a pydantic model the backend defines (``handle_type``); it is JSON in the run registry, so a later CLI
process can manage a run it did not launch. Backend configuration is a pydantic model the backend owns
(``config_type``); the run config's ``backend`` section is validated against it, and the backend is built from it.
Its fields may declare command-line flags (``cli_flag``, ``diloco.executors.flags``): ``diloco launch``, ``smoke``
and ``doctor`` offer them under the backend's own help section.

Every replica gets the same environment on every backend (``LaunchSpec.replica_env``): the user's ``env``
(``--env``), ``DILOCO_RUN_ID``, ``REPLICA_RANK``, ``WORLD_SIZE``, ``RENDEZVOUS_URI``, plus the backend's native
variables. A plan shown to a person is ``LaunchPlan.masked()``: the user's values that look secret hidden.

A run may be split over several backends (``diloco.executors.mixed``): each then runs a contiguous range of the
run's ranks (``LaunchSpec.ranks``), ``replicas`` stays the run's world size, and every replica still gets its
global rank. A backend that can run such a part says so (``supports_rank_ranges``) and then creates, names,
describes, cancels, relaunches and logs exactly its ranks (``LaunchSpec.own_ranks``, ``RunHandle.own_ranks``), with
names and directories per global rank so two parts of one run never collide. One that does not is refused such a
part with one clear line (``require_rank_support``); for whole runs nothing changes.

A run may grow while it runs (``diloco scale``): a backend that ``supports_scaling`` starts replicas for new global
ranks on the live run with ``add_ranks(handle, ranks, spec)``, under the same argv and environment contract as
``submit``, and returns the handle that now covers them, so ``describe``, ``logs``, ``relaunch``, ``cancel`` and
``remove`` reach the new replicas as they reach the first ones (``RunHandle.replicas`` and ``RunHandle.ranks`` grow;
nothing may assume they are fixed at submit). New ranks come after every rank the handle has (``grown_ranks``), so
a rank is never reused. ``WORLD_SIZE`` is the run's *rank space*, one more than its highest rank (``max(ranks)+1``
for the replicas that grow it), not how many replicas live: who takes part in a round is that round's membership,
kept in the store. A run shrinks without a backend call: a drained replica exits 0 by itself; ``cancel(handle,
ranks)`` is the fallback.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco import envvars
from diloco.defaults import DEFAULT_ENTRYPOINT, DEFAULT_MAX_RESTARTS, DEFAULT_TRAINER
from diloco.errors import ConfigError
from diloco.executors.failures import FailureVerdict
from diloco.executors.flags import FlagSpec, model_flags
from diloco.executors.logstream import LogRecord
from diloco.replica.settings import SettingsObject
from diloco.replica.spec import SPEC_FORMAT, EntrypointArgs, ReplicaSpec

if TYPE_CHECKING:
    from diloco.executors.checks import Check, DoctorContext

__all__ = ["DEFAULT_ENTRYPOINT", "DEFAULT_TRAINER", "SPEC_FORMAT", "Backend", "EntrypointArgs", "LogRecord",
           "ReplicaSpec", "ServerlessExecutor"]


# ---------------------------------------------------------------------------------------------- states
class ReplicaState(str, enum.Enum):
    """One lifecycle for a replica on every backend. A backend value it does not know maps to ``UNKNOWN``
    (non-terminal), never to a ``KeyError``.

    PENDING -> RUNNING -> SUCCEEDED | FAILED; any non-terminal -> CANCELLING -> CANCELLED;
    RUNNING -> PREEMPTED -> RUNNING (the backend is bringing the replica back: spot restart, pod retry).
    """

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    UNKNOWN = "unknown"

    @property
    def is_terminal(self) -> bool:
        return self in (ReplicaState.SUCCEEDED, ReplicaState.FAILED, ReplicaState.CANCELLED)


class RunState(str, enum.Enum):
    """The state of a whole run, derived from its replicas by ``RunState.of`` (a run is never "preempted": while
    a replica is being brought back, the run is still running)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"

    @property
    def is_terminal(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)

    @classmethod
    def of(cls, states: Sequence[ReplicaState]) -> RunState:
        """Any failure fails the run; all succeeded succeeds it; a cancel in progress or done wins next; otherwise
        the least advanced state (a preempted replica counts as running: its run goes on)."""
        if not states:
            return cls.PENDING
        s = set(states)
        if ReplicaState.FAILED in s:
            return cls.FAILED
        if s == {ReplicaState.SUCCEEDED}:
            return cls.SUCCEEDED
        if ReplicaState.CANCELLING in s:
            return cls.CANCELLING
        if ReplicaState.CANCELLED in s:
            return cls.CANCELLED if all(x.is_terminal for x in s) else cls.CANCELLING
        if ReplicaState.PENDING in s:
            return cls.PENDING
        if s & {ReplicaState.RUNNING, ReplicaState.PREEMPTED, ReplicaState.SUCCEEDED}:
            return cls.RUNNING
        return cls.UNKNOWN


def map_state(table: Mapping[str, ReplicaState], native: str | None) -> ReplicaState:
    """A backend's own state name through its documented table; anything else is ``UNKNOWN``."""
    return table.get(native or "", ReplicaState.UNKNOWN)


# ---------------------------------------------------------------------------------------------- specs
class LaunchSpec(BaseModel):
    """Backend-neutral description of one run: ``replicas`` identical copies of one entrypoint."""

    run_id: str
    replicas: int = Field(ge=1)
    entrypoint: str = DEFAULT_ENTRYPOINT  # a python module run with ``python -m``
    entrypoint_args: EntrypointArgs
    gpu: str | None = None
    timeout_s: float | None = None  # wall-clock limit per replica job
    #: Extra environment for every replica (the run config's ``env``), under diloco's own contract
    #: (``replica_env``): names diloco sets are refused by the run config, and shown masked where secret.
    env: dict[str, str] = Field(default_factory=dict)
    #: Where the launcher publishes ``entrypoint_args`` as the spec object (``<rendezvous>/spec.json``); the
    #: replicas then get ``--spec URI --spec-sha256 HEX`` instead of every setting as a flag. ``None``: the flags.
    spec_uri: str | None = None
    #: How many times a killed or lost replica is started again for its rank (``--max-restarts``). The launcher
    #: relaunches while it waits on a backend that ``supports_relaunch``; a backend whose service retries a
    #: replica itself (an Indexed Job's per-index retry) puts it into what it submits instead.
    max_restarts: int = Field(DEFAULT_MAX_RESTARTS, ge=0)
    #: The global ranks this backend runs, ascending and contiguous, when it runs one part of a run split over
    #: several backends; ``None``: all ``replicas`` of them. ``replicas`` stays the run's world size either way.
    ranks: list[int] | None = None
    #: The most replicas the run may grow to (``--max-replicas``); None: no bound was set. With it, a backend whose
    #: service may refuse a replica for capacity (SageMaker managed spot) keeps asking for that replica, the rank
    #: waiting as pending, instead of failing it (the backend says how in its docs).
    max_replicas: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_ranks(self) -> LaunchSpec:
        if self.ranks is not None:
            problem = rank_range_problem(self.ranks, self.replicas)
            if problem:
                raise ValueError(f"ranks: {problem}")
        return self

    @property
    def own_ranks(self) -> list[int]:
        """The global ranks this backend creates: ``ranks``, else every rank of the run."""
        return list(range(self.replicas)) if self.ranks is None else list(self.ranks)

    @property
    def is_part(self) -> bool:
        """Whether this backend runs only some of the run's ranks (a part of a run split over backends)."""
        return self.ranks is not None and len(self.ranks) < self.replicas

    def spec_object(self) -> bytes:
        """The bytes to publish at ``spec_uri`` before any replica starts."""
        return SettingsObject(run_id=self.run_id, settings=self.entrypoint_args).to_bytes()

    def entrypoint_argv(self) -> list[str]:
        """The entrypoint's arguments, one token per element: the spec object's URI and checksum when there is
        one (a few short tokens whatever the settings' size), else every setting as a flag (``to_argv``)."""
        if self.spec_uri is None:
            return self.entrypoint_args.to_argv()
        import hashlib

        return ["--spec", self.spec_uri, "--spec-sha256", hashlib.sha256(self.spec_object()).hexdigest()]

    def replica_env(self, rank: int) -> dict[str, str]:
        """The common environment contract for replica ``rank`` (backends add their native variables)."""
        return {
            **self.env,
            envvars.RUN_ID: self.run_id,
            envvars.REPLICA_RANK: str(rank),
            envvars.WORLD_SIZE: str(self.replicas),
            envvars.RENDEZVOUS_URI: self.entrypoint_args.rendezvous_uri,
        }

    def argv(self, python: str = "python") -> list[str]:
        """``python -m <entrypoint> <args>``: the command every backend runs in a replica."""
        return [python, "-m", self.entrypoint, *self.entrypoint_argv()]


class PlanCost(BaseModel):
    """What a planned run may cost, reckoned before anything is created: an estimate, never the bill."""

    usd_per_hour: float | None  # every replica's instance together; None when some price is unknown
    usd_at_time_limit: float | None  # if every replica ran to its time limit (the most the run can bill)
    time_limit_s: float | None  # each replica's limit (the longest, if they differ)
    source: str  # where the prices came from
    spot_upper_bound: bool = False  # spot capacity bills less than the on-demand prices used: both are ceilings
    detail: str  # the same in one line, as `diloco launch` prints it before submitting


class LaunchPlan(BaseModel):
    """The dry run: everything ``submit`` will send, and nothing sent yet.

    ``requests`` are the backend's own requests, in submission order (one per replica for SageMaker and local,
    one Job for Kubernetes); ``-o json`` prints them verbatim. ``cost`` is set by backends that bill (None: free,
    or a cluster already paid for); ``warnings`` are what the backend sees that may make the run fail although
    the plan is valid (``diloco launch`` prints both before submitting, and with ``--dry-run``); ``notes`` say how
    the backend chose a value the user did not set (printed with ``--dry-run``).
    """

    backend: str
    spec: LaunchSpec
    requests: list[dict[str, Any]]
    cost: PlanCost | None = None
    warnings: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)  # how the backend chose what was not set (a derived size)

    def masked(self) -> LaunchPlan:
        """The plan as it may be shown (``--dry-run``, its JSON and YAML): every value of the user's ``env`` that
        looks secret masked, in the spec and wherever a request spells it out (``diloco.executors.user_env``).
        ``submit`` gets the plan itself, real values and all."""
        from diloco.executors.user_env import masked, masked_env

        env = self.spec.env
        if masked_env(env) == env:
            return self
        spec = self.spec.model_copy(update={"env": masked_env(env)})
        return self.model_copy(update={"spec": spec, "requests": masked(self.requests, env)})


# ---------------------------------------------------------------------------------------------- handles, status
class RunHandle(BaseModel):
    """Enough to find a run's replicas again from another process. Each backend subclasses it with typed fields
    (pids and log directories, job names, the Job's namespace and name); no free-form dicts."""

    model_config = ConfigDict(extra="forbid")

    backend: str
    run_id: str
    replicas: int = Field(ge=1)  # the run's world size
    #: The global ranks this handle's replicas run (``LaunchSpec.ranks``); ``None``: every rank of the run.
    ranks: list[int] | None = None

    @property
    def own_ranks(self) -> list[int]:
        """The global ranks of this handle's replicas."""
        return list(range(self.replicas)) if self.ranks is None else list(self.ranks)


def rank_range_problem(ranks: Sequence[int], replicas: int) -> str | None:
    """What is wrong with ``ranks`` as one backend's part of a run of ``replicas`` (None: nothing): it must be a
    non-empty, ascending, contiguous range of ranks that exist."""
    if not ranks:
        return "a part runs at least one rank (got none)"
    if list(ranks) != list(range(ranks[0], ranks[0] + len(ranks))):
        return f"must be ascending and contiguous (got {list(ranks)})"
    if ranks[0] < 0 or ranks[-1] >= replicas:
        return f"must lie in 0..{replicas - 1}, the run's ranks (got {list(ranks)})"
    return None


class GrownRanks(BaseModel):
    """What a handle becomes when ``add_ranks`` gives it new ``ranks``: the run's new rank space (``replicas``),
    the handle's ranks (``own``: None when they are every rank of that space), and the spec the new replicas are
    planned from (``spec``: ``replicas`` the new rank space, ``ranks`` the new ones)."""

    replicas: int
    own: list[int] | None
    spec: LaunchSpec


def grown_ranks(handle: RunHandle, ranks: Sequence[int], spec: LaunchSpec) -> GrownRanks:
    """Check ``ranks`` as the new ranks of ``handle``'s run and say what the handle becomes (``GrownRanks``);
    ``ConfigError`` (one line naming ``ranks`` and the fix, nothing created) when they are empty, not ascending and
    contiguous, or not after every rank the handle already has (a rank is never reused: a replica that ended is
    relaunched, not added)."""
    new = [int(r) for r in ranks]
    if spec.run_id != handle.run_id:
        raise ConfigError(f"spec.run_id: the spec is run {spec.run_id}'s, the handle run {handle.run_id}'s",
                          hint="pass the spec of the run being grown")
    if not new or new != list(range(new[0], new[0] + len(new))) or new[0] < 0:
        raise ConfigError(f"ranks: the new ranks must be ascending and contiguous, at least one (got {new})",
                          hint="add ranks such as [2, 3] to a run of ranks 0-1")
    have = handle.own_ranks
    if new[0] <= max(have):
        taken = sorted(set(new) & set(have))
        why = f"rank(s) {taken} already run here" if taken else f"they must come after its highest rank, {max(have)}"
        raise ConfigError(f"ranks: cannot add {new} to run {handle.run_id} (ranks {have}): {why}",
                          hint=f"add ranks from {max(handle.replicas, max(have) + 1)} on; a replica that ended is "
                               "relaunched, not added")
    replicas = max(handle.replicas, new[-1] + 1)
    own = sorted([*have, *new])
    grown_spec = spec.model_copy(update={"replicas": replicas, "ranks": new})
    return GrownRanks(replicas=replicas, own=None if own == list(range(replicas)) else own, spec=grown_spec)


def ranks_label(ranks: Sequence[int]) -> str:
    """A part's ranks in a name: ``r2`` for one, ``r2-3`` for several (Job names, directories)."""
    return f"r{ranks[0]}" if len(ranks) == 1 else f"r{ranks[0]}-{ranks[-1]}"


class ReplicaStatus(BaseModel):
    """One replica as its backend sees it. ``detail`` keeps the backend's own words (a SageMaker SecondaryStatus,
    a pod phase, a pid); ``reason`` says why it is in a failed or stopped state."""

    rank: int
    state: ReplicaState
    job_id: str = ""
    #: The backend running this replica and its part's index in ``backend.parts``, in a run split over several
    #: backends (``diloco.executors.mixed``); None otherwise.
    backend: str | None = None
    part: int | None = None
    reason: str | None = None
    detail: str | None = None
    exit_code: int | None = None
    restarts: int = 0
    timed_out: bool = False  # stopped for exceeding the run's wall-clock limit (timeout_s)
    started_at: float | None = None
    ended_at: float | None = None
    artifacts: dict[str, str] = Field(default_factory=dict)  # e.g. {"model": "s3://.../model.tar.gz"}
    billable_s: float | None = None  # cloud backends: what the provider bills for
    cost_usd: float | None = None  # an estimate of what those seconds cost (see cost_source)
    cost_source: str | None = None  # where the price came from, e.g. "AWS Price List API" or a dated table
    #: A failed replica's class of failure and whether a relaunch may cure it, when the backend can read its
    #: service's failure report (None: judged by ``exit_code`` alone; ``diloco.executors.failures``).
    failure: FailureVerdict | None = None


class RunStatus(BaseModel):
    """Every replica of a run in one call; ``state`` is derived from them."""

    run_id: str
    replicas: list[ReplicaStatus]

    @property
    def state(self) -> RunState:
        return RunState.of([r.state for r in self.replicas])

    @property
    def terminal(self) -> bool:
        return all(r.state.is_terminal for r in self.replicas)

    def replica(self, rank: int) -> ReplicaStatus:
        return next(r for r in self.replicas if r.rank == rank)


class RunListing(BaseModel):
    """A run a backend can see on its own (``diloco runs`` shows the registry's; this finds the others)."""

    run_id: str
    backend: str
    state: RunState
    replicas: int
    created_at: float | None = None


class BackendConfig(BaseModel):
    """Base of every backend's config section. ``kind`` names the backend; the rest is the backend's own."""

    model_config = ConfigDict(extra="forbid")

    kind: str

    #: URI schemes every replica of this backend can reach (a cloud job cannot see this machine's files).
    rendezvous_schemes: ClassVar[tuple[str, ...]] = ("s3",)
    #: Whether the backend places replicas on machines it chooses (so ``gpu`` means something).
    places_replicas: ClassVar[bool] = True
    #: The flags this backend takes -> its config fields, e.g. ``{"role": "role_arn"}``: derived from the fields
    #: that declare one (``json_schema_extra=cli_flag("--role", metavar="ARN")``, help from the description),
    #: never written by hand. ``diloco launch``, ``smoke`` and ``doctor`` offer every registered backend's flags
    #: and route each to the backend the run uses; one that backend does not declare is refused.
    flags: ClassVar[dict[str, str]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls.flags = {spec.key: spec.path.removeprefix("backend.") for spec in cls.flag_specs()}

    @classmethod
    def flag_specs(cls) -> list[FlagSpec]:
        """The flags this backend's fields declare, in field order (paths from the run config: ``backend.*``)."""
        return list(model_flags(cls, "backend."))

    @classmethod
    def apply_flags(cls, kind: str, section: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
        """``section`` (this backend's, not validated yet) with the backend flags given on the command line
        (``{"role": ARN}``, None meaning not given) set as its fields (``route_backend_flags``: a flag the backend
        does not declare is a one-line ``ConfigError``). A composite backend routes them to its parts."""
        from diloco.executors.flags import route_backend_flags

        out = dict(section)
        for path, value in route_backend_flags(kind, given).items():
            *outer, last = path.split(".")
            cur = out
            for part in outer:
                cur = cur.setdefault(part, {})
            cur[last] = value
        return out

    def default_rendezvous(self, run_id: str) -> str | None:
        """The rendezvous to use when none is configured; ``None`` means the user must give one."""
        return None

    def rendezvous_problem(self, scheme: str) -> str | None:
        """Why this configuration's replicas could not meet in a store of ``scheme`` (``file``, ``s3``), as the
        middle of ``store.rendezvous: ... (got URI)``; None when every replica can reach one. By default a scheme
        outside ``rendezvous_schemes``; a composite backend answers for all of its parts."""
        if scheme in self.rendezvous_schemes:
            return None
        schemes = " or ".join(f"{s}://" for s in self.rendezvous_schemes)
        return f"the {self.kind} backend needs an {schemes} URI every replica can reach"

    def places_some_replicas(self) -> bool:
        """Whether some replica runs on a machine the backend chooses, not this one (``places_replicas``; a
        composite backend: any of its parts), so ``gpu`` means something and this machine is no guide."""
        return self.places_replicas

    def fixed_replicas(self) -> int | None:
        """How many replicas this section itself fixes (a composite backend's parts, when each has a count); None
        when the run's ``replicas`` decides. The run config takes it as ``replicas`` when that is not given."""
        return None

    def replicas_problem(self, replicas: int) -> str | None:
        """What is wrong with a run of ``replicas`` on this configuration, as one line naming the field; None."""
        return None

    def default_check_trainer_locally(self) -> bool:
        """Whether the trainer is imported from this interpreter and directory (so it can be checked here)."""
        return False


# ---------------------------------------------------------------------------------------------- the protocol
H = TypeVar("H", bound=RunHandle)
C = TypeVar("C", bound=BackendConfig)


class ServerlessExecutor(Generic[C, H]):
    """The contract every backend implements (the design's name for it); defaults for what most backends have
    nothing special to do about.

    Subclasses set ``name``, ``config_type`` and ``handle_type`` and implement ``plan``, ``submit``, ``describe``,
    ``cancel`` and ``replica_logs`` (or ``logs``). ``STATES`` documents every state name the backend's service
    reports and the ``ReplicaState`` it means; the shipped conformance suite (``diloco.executors.testing``) checks
    it, and a third party's backend runs the same suite from its own tests.
    """

    name: ClassVar[str]
    config_type: ClassVar[type[BackendConfig]]
    handle_type: ClassVar[type[RunHandle]]
    #: What to install when the backend's SDK is missing (shown with the error).
    install_hint: ClassVar[str | None] = None
    #: The backend's own state names -> ReplicaState.
    STATES: ClassVar[Mapping[str, ReplicaState]] = {}
    #: Set (to a phrase such as "is not available in this version yet") while a backend cannot launch.
    unavailable_reason: ClassVar[str | None] = None
    #: Whether ``relaunch`` works: the launcher restarts a failed replica for its rank (it rejoins the run).
    supports_relaunch: ClassVar[bool] = False
    #: Whether the backend runs one part of a run split over several backends: a spec whose ``ranks`` is a range
    #: of the run's (``LaunchSpec.is_part``), creating, naming and reporting exactly those global ranks.
    supports_rank_ranges: ClassVar[bool] = False
    #: Whether ``add_ranks`` works: new replicas can join a live run for new global ranks (``diloco scale``).
    supports_scaling: ClassVar[bool] = False
    #: Who brings a replica back when the backend retries it itself (a Job's retry, a spot restart), as the waiting
    #: launch says it: "replica 1 preempted (...); the cluster brings it back".
    retrier: ClassVar[str] = "its backend"

    def __init__(self, config: C) -> None:
        self.config = config

    # ---------------------------------------------------------------- lifecycle (abstract)
    def plan(self, spec: LaunchSpec) -> LaunchPlan:
        raise NotImplementedError(f"{type(self).__name__}.plan")

    def submit(self, plan: LaunchPlan, on_progress: Callable[[H], None] | None = None) -> H:
        raise NotImplementedError(f"{type(self).__name__}.submit")

    def describe(self, handle: H) -> RunStatus:
        raise NotImplementedError(f"{type(self).__name__}.describe")

    def cancel(self, handle: H, ranks: Sequence[int] | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.cancel")

    def relaunch(self, handle: H, rank: int) -> H:
        """Start replica ``rank`` again (same run, argv and environment) after it ended in failure; returns the
        updated handle, whose ``describe`` counts the restart in ``ReplicaStatus.restarts``. The new replica
        rejoins the run from its committed rounds (``diloco.replica.checkpoint``). Only when ``supports_relaunch``."""
        raise NotImplementedError(f"{type(self).__name__}.relaunch")

    def replica_logs(self, handle: H, rank: int, *, follow: bool = False,
                     since: float | None = None) -> Iterator[LogRecord]:
        """One replica's lines in order; with ``follow``, until it is terminal (then one last read)."""
        raise NotImplementedError(f"{type(self).__name__}.replica_logs")

    def add_ranks(self, handle: H, ranks: Sequence[int], spec: LaunchSpec) -> H:
        """Start new replicas for the global ``ranks`` of a run this backend is running (``handle``), and return
        the handle that covers them as well as the first ones. Only when ``supports_scaling``.

        ``spec`` is the run's spec (its entrypoint, settings, environment; its ``replicas`` and ``ranks`` are not
        read); each new replica gets exactly what ``submit`` gives one (``LaunchSpec.replica_env(rank)``), with
        ``WORLD_SIZE`` the run's new rank space: ``max(handle.replicas, max(ranks) + 1)`` (``grown_ranks``).
        ``ranks`` must be ascending, contiguous and after every rank of the handle (``grown_ranks`` says why not, as
        a ``ConfigError`` naming the field, before anything is created). All or nothing, as ``submit``: a replica
        that cannot be started stops the ones this call started before the error propagates, and the run's first
        replicas are untouched either way. The new replicas find the run's latest committed round in the store and
        join at the next one, as a relaunched replica does."""
        raise NotImplementedError(f"the {self.name} backend cannot add replicas to a live run ({type(self).__name__}"
                                  f".add_ranks): it does not declare supports_scaling")

    # ---------------------------------------------------------------- defaults
    def ask_again_for_capacity(self, handle: H) -> H:
        """Ask again for the replicas the service refused for capacity, when the run keeps asking
        (``LaunchSpec.max_replicas`` on a backend whose service refuses capacity: SageMaker managed spot); returns
        the updated handle, unchanged when nothing was due. Such a replica reads as pending meanwhile, never
        failed, so the run goes on with the others. Whoever waits on the run calls it each poll and records the
        handle it returns; default: nothing is ever refused for capacity."""
        return handle

    def relaunches(self, handle: H, rank: int) -> bool:
        """Whether a failed replica ``rank`` can be relaunched (``relaunch``): ``supports_relaunch`` for a backend
        that runs every replica the same way; a composite one answers per replica, by the part that runs it."""
        return self.supports_relaunch

    def roll_back(self, handle: H) -> None:
        """Undo a run this backend submitted whole, as ``submit`` undoes one that fails half-way: stop every replica,
        wait (bounded by ``ROLL_BACK_WAIT_S``) until they have ended, then delete what the backend keeps of its own
        (``remove``). For a composite backend, whose later part was refused after this one was submitted. Backends
        whose own rollback does more (kills what outlives a stop) override it with that."""
        self.cancel(handle)
        self.wait(handle, timeout_s=ROLL_BACK_WAIT_S, poll_interval_s=0.5)
        self.remove(handle)

    def preflight(self, spec: LaunchSpec, *, force: bool = False) -> None:
        """Refuse (``ConfigError``, exit 2) a launch this backend cannot hold, before anything of it is created;
        ``force`` launches anyway. Not called for ``--dry-run``: a plan is for any machine. Default: no check."""

    def estimate_cost(self, plan: LaunchPlan, seconds_per_replica: float) -> tuple[float | None, str] | None:
        """What submitting ``plan`` would cost if each replica's own work took ``seconds_per_replica``:
        ``(usd, how it was reckoned)``, ``usd`` None when it costs money at a price that cannot be told; ``None``
        when running it is free (this machine's processes, a cluster already paid for).

        Pure apart from a price lookup: called before anything is created, so a command that would spend money
        can say how much and ask first (``diloco smoke`` refuses without ``--yes`` unless this is None). A backend
        that bills must therefore answer, including what its service bills beyond the work itself (start-up,
        image download). An estimate: the bill is the authority. Default: free."""
        return None

    def logs(self, handle: H, ranks: Sequence[int] | None = None, *, follow: bool = False,
             since: float | None = None) -> Iterator[LogRecord]:
        """Every (or ``ranks``') replica's records, merged in time order; followed until all have ended."""
        from diloco.executors.logstream import follow_merged, merged

        selected = handle.own_ranks if ranks is None else ranks
        streams = [self.replica_logs(handle, rank, follow=follow, since=since) for rank in selected]
        return follow_merged(streams) if follow else merged(streams)

    def failure_tail(self, handle: H, rank: int, n: int = 10) -> list[str]:
        """The last ``n`` lines replica ``rank`` wrote to stderr: usually why it failed."""
        from collections import deque

        errs = (r.text for r in self.replica_logs(handle, rank) if r.stream == "err" and r.text.strip())
        return list(deque(errs, maxlen=n))

    def wait(self, handle: H, *, timeout_s: float | None = None, poll_interval_s: float = 1.0) -> RunStatus:
        """Describe until every replica is terminal or ``timeout_s`` passes; the last status either way."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            status = self.describe(handle)
            if status.terminal or (deadline is not None and time.monotonic() >= deadline):
                return status
            time.sleep(poll_interval_s)

    def remove(self, handle: H, *, dry_run: bool = False) -> list[str]:
        """Delete what this backend keeps of its own of a run whose replicas have all ended, and return what was
        removed (paths or URIs); with ``dry_run``, what would be, removing nothing. Idempotent: ``[]`` once gone.

        Only the backend's own leftovers: the store's objects and the registry record are removed by the caller
        (``diloco.launcher.housekeeping``). The default keeps nothing to remove (a SageMaker job cannot be deleted and its
        logs follow CloudWatch's retention)."""
        return []

    def list_runs(self) -> list[RunListing]:
        """Runs this backend can find without the registry; backends that cannot search return nothing."""
        return []

    def load_handle(self, data: Mapping[str, Any]) -> H:
        """A handle from its JSON form (as stored in the run registry)."""
        return self.handle_type.model_validate(data)  # type: ignore[return-value]

    @classmethod
    def doctor_checks(cls, ctx: DoctorContext) -> list[Check]:
        """``diloco doctor --backend <name>``'s backend-specific checks (the store's are common)."""
        return []

    @classmethod
    def map_state(cls, native: str | None) -> ReplicaState:
        return map_state(cls.STATES, native)


#: How long the default ``roll_back`` waits for a stopped run's replicas to end (a SageMaker job keeps its container
#: 120 s after SIGTERM, then uploads what it saved).
ROLL_BACK_WAIT_S = 180.0


def require_rank_support(backend: ServerlessExecutor[Any, Any], spec: LaunchSpec) -> None:
    """``ConfigError`` (nothing created) when ``spec`` is a part of a larger run (``LaunchSpec.is_part``) and
    ``backend`` does not declare ``supports_rank_ranges``: a backend written for whole runs would create every rank
    of the run, not only the part's."""
    if spec.is_part and not backend.supports_rank_ranges:
        raise ConfigError(f"backend: the {backend.name} backend cannot run a part of a run (ranks "
                          f"{spec.own_ranks[0]}-{spec.own_ranks[-1]} of {spec.replicas}): it does not declare "
                          f"supports_rank_ranges", hint=f"run the whole run on {backend.name}, or this part on a "
                                                        f"backend that can (the built-in ones can)")


#: The contract's other name: backends written against ``Backend`` keep working unchanged.
Backend = ServerlessExecutor
