"""Several local processes in one replica (``--procs-per-replica K``): inner data-parallel, one DiLoCo round.

Why it looks the way it does:

* **torch's own launcher.** A replica asked for K > 1 processes re-runs the replica entrypoint K times under
  ``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun --standalone --nproc-per-node K`` does): a
  c10d rendezvous on localhost, ``LOCAL_RANK``/``RANK``/``MASTER_ADDR``... set for each child, a failed child
  stopping the others. ``max_restarts`` is 0: a replica that fails is relaunched (and rejoins) by diloco's own
  recovery, as a whole, never half of it.
* **One store client per replica.** Only local rank 0 builds the object-store all-reduce and its manager; it alone
  uploads the pseudo-gradient, reads the peers', writes the metrics, the committed rounds and the final weights.
  The other local ranks get the round's mean by a broadcast inside the replica (``LocalGroupManager``), so the
  bytes each replica moves per round do not grow with K.
* **Identical bits inside the replica.** The broadcast carries local rank 0's exact tensors (the mean, the commit
  decision, the round a rejoining replica resumes at), so every local process applies the same outer step to the
  same global copy: their weights after every round are bitwise those of local rank 0.
* **Failures stay one line.** A child writes its last ``diloco: error:`` line to a file in a directory the launching
  process owns; the launcher quotes the root cause's line last on stderr (the peers the agent stopped only print
  "stopped by SIGTERM") and exits with the root cause's code, so the CLI and the Kubernetes failure policy see
  what they would see for a one-process replica.

A sharded model (FSDP2) is different: no process holds it whole, so each local process exchanges, commits and
restores its own rows through the store (``LocalGroupManager``'s shard methods, ``diloco.replica.local_shards``).

The inner optimizer's per-replica checkpoints (``$DILOCO_CHECKPOINT_DIR``, ``diloco.replica.checkpoint``): a sharded
model's local processes each keep their own rows' state (``inner_state_place``) and get it back on a rejoin. With a
model every process holds whole (DDP) they are off (``LocalGroupManager`` has no ``rounds``): a rejoining replica
then starts its inner optimizer fresh, as the log says.

A trainer opts in with ``@supports_local_processes`` (``diloco.trainers.hf:train`` does): it then finds its local
group with ``current_local_group()``, wraps its model in DDP and reads its own sub-shard. A trainer that does not
opt in always runs one process per replica; asking it for more is a one-line error naming ``--procs-per-replica``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from diloco.replica.manager_api import NoWireState

if TYPE_CHECKING:
    import torch

    from diloco.collectives.part_layout import ShardSpec
    from diloco.replica.checkpoint import CommittedRound
    from diloco.replica.parts_setup import PartsSetup

log = logging.getLogger("diloco.replica.local_group")

#: Set by the launching process for its children: the directory each child writes its last error line into. Its
#: presence (with torch's ``LOCAL_RANK``) is what makes a replica entrypoint a child instead of a launcher.
ERROR_DIR_ENV = "DILOCO_LOCAL_ERROR_DIR"
#: The attribute ``supports_local_processes`` sets on a trainer function.
SUPPORTS_ATTR = "__diloco_local_processes__"
#: Exit code of a child stopped by SIGTERM (the replica entrypoint's); such a child is never the root cause.
_SIGTERM_EXIT = 143
#: Seconds the process group waits in one collective beyond twice the all-reduce timeout: local rank 0 may spend
#: up to about twice ``timeout_s`` in one store round (its upload, then the peers') while the others wait.
_COLLECTIVE_MARGIN_S = 600.0

F = TypeVar("F", bound=Callable[..., Any])


# ---------------------------------------------------------------------------------------------- trainer opt-in
def supports_local_processes(fn: F) -> F:
    """Mark a trainer as able to run as several local processes (DDP inside the replica); returns it unchanged."""
    setattr(fn, SUPPORTS_ATTR, True)
    return fn


def trainer_supports_local_processes(fn: Callable[..., Any]) -> bool:
    return bool(getattr(fn, SUPPORTS_ATTR, False))


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without torch's CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_procs_per_replica(requested: int | None, trainer: Callable[..., Any], trainer_name: str) -> None:
    """``ConfigError`` (one line naming ``--procs-per-replica``) when more than one process is asked of a trainer
    that did not opt in. No torch import: ``diloco launch`` can call it before anything starts."""
    from diloco.errors import ConfigError

    if requested is not None and requested > 1 and not trainer_supports_local_processes(trainer):
        raise ConfigError(f"train.procs_per_replica (--procs-per-replica {requested}): trainer {trainer_name} runs "
                          f"one process per replica",
                          hint="use a trainer marked @diloco.replica.local_group.supports_local_processes (e.g. "
                               "diloco.trainers.hf:train), or drop --procs-per-replica")


def resolve_procs_per_replica(requested: int | None, trainer: Callable[..., Any], trainer_name: str,
                              gpus: int | None = None) -> int:
    """How many local processes this replica runs: ``requested``, else one per visible GPU (1 without one).

    A trainer that did not opt in (``supports_local_processes``) runs one process: by default silently, and
    ``ConfigError`` (``check_procs_per_replica``) when more were asked for explicitly. On a GPU machine more
    processes than GPUs is refused too (``ConfigError``): NCCL needs one device per process."""
    from diloco.errors import ConfigError

    if requested is None:
        if not trainer_supports_local_processes(trainer):
            return 1
        found = visible_gpus() if gpus is None else gpus
        return max(1, found)
    check_procs_per_replica(requested, trainer, trainer_name)
    found = visible_gpus() if gpus is None and requested > 1 else (gpus or 0)
    if requested > 1 and found and requested > found:
        raise ConfigError(f"--procs-per-replica {requested}: this machine has {found} GPU(s), and each process "
                          f"needs its own", hint=f"use --procs-per-replica {found} or a machine with more GPUs")
    return requested


def is_child(env: Mapping[str, str]) -> bool:
    """Whether this entrypoint was started by ``launch_local_processes`` (then it trains; it never launches)."""
    return bool(env.get(ERROR_DIR_ENV)) and env.get("LOCAL_RANK") is not None


# ---------------------------------------------------------------------------------------------- the group
@dataclass
class LocalGroup:
    """This process's place in its replica's local process group, and the collectives the round needs."""

    rank: int  # local rank, 0..size-1
    size: int
    backend: str  # "nccl" on GPUs, "gloo" on CPU
    device: torch.device  # where this process trains (cuda:<local rank>, or cpu)

    @property
    def is_leader(self) -> bool:
        """Local rank 0: the one process that talks to the store."""
        return self.rank == 0

    def broadcast_object(self, obj: Any) -> Any:
        """``obj`` from local rank 0 (plain Python values only: tensors go through ``broadcast_tensors``)."""
        import torch.distributed as dist

        box = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.backend == "nccl" else None)
        return box[0]

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite ``tensors`` on every local rank with local rank 0's, in place, keeping their devices.

        One flat buffer per dtype, so a round costs a couple of collectives whatever the number of tensors."""
        import torch
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype in sorted(by_dtype, key=str):
            group = by_dtype[dtype]
            flat = _flatten_dense_tensors([t.detach().to(self.device) for t in group])
            dist.broadcast(flat, src=0)
            with torch.no_grad():
                for t, value in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                    t.copy_(value)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every local rank's ``obj`` (plain Python values), in local rank order, on every local rank."""
        import torch.distributed as dist

        box: list[Any] = [None] * self.size
        dist.all_gather_object(box, obj)
        return box

    def gather_rows(self, tensors: Mapping[str, torch.Tensor],
                    specs: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor] | None:
        """The whole tensors, on local rank 0 (on the CPU), from the rows each local rank holds (``specs``, FSDP2's
        cut); ``None`` on the others. One tensor at a time, so the extra memory is one whole tensor."""
        import torch
        import torch.distributed as dist

        from diloco.collectives.part_layout import part_rows

        out: dict[str, torch.Tensor] | None = {} if self.is_leader else None
        for name in sorted(tensors):
            spec, held = specs[name], tensors[name]
            chunk = -(-spec.length // self.size) * spec.row_size
            padded = torch.zeros(chunk, dtype=held.dtype, device=self.device)
            padded[:held.numel()].copy_(held.reshape(-1))
            received = [torch.empty_like(padded) for _ in range(self.size)] if self.is_leader else None
            dist.gather(padded, received, dst=0)
            if out is not None and received is not None:
                rows = [part_rows(spec.length, self.size, p) for p in range(self.size)]
                whole = torch.cat([buf[:(end - start) * spec.row_size] for buf, (start, end) in
                                   zip(received, rows, strict=True)])
                out[name] = whole.to("cpu").view(spec.shape)
        return out

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the local processes (e.g. a loss each computed on its own sub-shard)."""
        import torch.distributed as dist

        out = value.detach().clone().to(self.device)
        dist.all_reduce(out)
        return out / self.size

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


_current: LocalGroup | None = None


def current_local_group() -> LocalGroup | None:
    """The local process group this replica process belongs to, or ``None`` in a one-process replica."""
    return _current


def init_local_group(env: Mapping[str, str], *, timeout_s: float) -> LocalGroup:
    """Join the replica's local process group from torch's launcher environment: NCCL with one GPU per process
    where CUDA is available, else gloo on the CPU. Collectives wait up to twice ``timeout_s`` plus a margin, since
    the other ranks wait in one while local rank 0 does a store round."""
    import datetime

    import torch
    import torch.distributed as dist

    global _current
    rank, size = int(env["LOCAL_RANK"]), int(env.get("LOCAL_WORLD_SIZE") or env["WORLD_SIZE"])
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    timeout = datetime.timedelta(seconds=2 * timeout_s + _COLLECTIVE_MARGIN_S)
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    _current = LocalGroup(rank=rank, size=size, backend=backend, device=device)
    return _current


def leave_local_group() -> None:
    """Destroy the process group (end of the child's life; idempotent)."""
    global _current
    group, _current = _current, None
    if group is not None:
        group.close()


# ---------------------------------------------------------------------------------------------- the manager
class LocalRoundFailed(RuntimeError):
    """Local rank 0's store round failed; raised on the other local ranks with its message."""


class _BroadcastWork:
    """A round's ``Work`` inside a replica: rank 0 waits for the store round, then every rank gets its mean."""

    def __init__(self, manager: LocalGroupManager, inner: Any, tensors: list[torch.Tensor]) -> None:
        self._manager, self._inner, self._tensors = manager, inner, tensors
        self._done = False

    def wait(self, timeout: object = None) -> bool:
        if self._done:
            return True
        self._done = True
        group = self._manager.group
        error: BaseException | None = None
        if group.is_leader:
            try:
                self._inner.wait(timeout)
            except Exception as exc:  # noqa: BLE001 - told to the other ranks, then re-raised
                error = exc
        self._manager.share_outcome(error, "the all-reduce")
        group.broadcast_tensors(self._tensors)
        return True

    def is_completed(self) -> bool:
        return self._done


class LocalGroupManager(NoWireState):
    """The outer loop's ``Manager`` (``diloco.replica.outer.Manager``) for one process of a multi-process replica.

    On local rank 0 every call goes to the real manager (``diloco.replica.manager.ObjectStoreManager``) and what the other
    ranks need from it is broadcast; on the other ranks nothing touches the store: they receive. ``metrics`` and
    ``store`` exist only on local rank 0, so the outer loop records progress and exports the final weights once
    per replica."""

    def __init__(self, inner: Any | None, group: LocalGroup, *, rank: int, world_size: int,
                 parts: PartsSetup | None = None) -> None:
        """``parts`` (``diloco.replica.parts_setup.PartsSetup``) lets every local process exchange a sharded model's
        rows itself (the shard methods)."""
        from diloco.replica.local_shards import LocalShardRounds

        if group.is_leader and inner is None:
            raise ValueError("local rank 0 needs the replica's real manager")
        self.group = group
        self._inner = inner if group.is_leader else None
        self._rank, self._world_size = rank, world_size
        self._step = 0  # the mirror of rank 0's committed rounds, on the other ranks
        self._shards = LocalShardRounds(self, parts)

    @property
    def inner(self) -> Any | None:
        """Local rank 0's replica manager (``None`` on the other local ranks)."""
        return self._inner

    @staticmethod
    def relayed(message: str) -> LocalRoundFailed:
        """The error a local process raises for a sibling's failure (never the replica's root cause)."""
        return LocalRoundFailed(message)

    def mirror_step(self, step: int) -> None:
        """Set the other ranks' mirror of local rank 0's committed rounds."""
        self._step = step

    # ---------------------------------------------------------------- identity
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def metrics(self) -> Any:
        return getattr(self._inner, "metrics", None)

    @property
    def store(self) -> Any:
        return getattr(self._inner, "store", None)

    @property
    def stats(self) -> Any:
        return getattr(self._inner, "stats", None)

    def num_participants(self) -> int:
        return self._world_size

    def current_step(self) -> int:
        return self._inner.current_step() if self._inner is not None else self._step

    # ---------------------------------------------------------------- the round
    def share_outcome(self, error: BaseException | None, what: str) -> None:
        """Tell every local rank whether rank 0's ``what`` worked; raise there (and re-raise here) if not, so no
        rank waits in a collective for a round that will never come."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        message = self.group.broadcast_object(message)
        if error is not None:
            raise error
        if message is not None:
            raise LocalRoundFailed(f"local rank 0 of replica {self._rank}: {what} failed: {message}")

    def start_quorum(self) -> None:
        if self._inner is not None:
            self._inner.start_quorum()

    def allreduce(self, tensor_or_tensors: Any) -> _BroadcastWork:
        import torch

        if isinstance(tensor_or_tensors, torch.Tensor):
            tensors = [tensor_or_tensors]
        elif isinstance(tensor_or_tensors, Mapping):
            tensors = [tensor_or_tensors[name] for name in sorted(tensor_or_tensors)]
        else:
            tensors = list(tensor_or_tensors)
        inner = self._inner.allreduce(tensor_or_tensors) if self._inner is not None else None
        return _BroadcastWork(self, inner, tensors)

    def should_commit(self) -> bool:
        decision, error = False, None
        if self._inner is not None:
            try:
                decision = bool(self._inner.should_commit())
            except Exception as exc:  # noqa: BLE001 - told to the other ranks, then re-raised
                error = exc
        self.share_outcome(error, "the commit")
        decision, step = self.group.broadcast_object((decision, self.current_step()))
        self._step = step
        return decision

    def report_error(self, exc: BaseException) -> None:
        if self._inner is not None:
            self._inner.report_error(exc)

    def errored(self) -> BaseException | None:
        return self._inner.errored() if self._inner is not None else None

    def commit_round(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if self._inner is not None:
            self._inner.commit_round(tensors)

    def rejoin(self) -> CommittedRound | None:
        """Rank 0 finds the round its peers are in; every rank gets that round's state (or ``None``)."""
        import torch

        state, error = None, None
        if self._inner is not None:
            try:
                state = self._inner.rejoin()
            except Exception as exc:  # noqa: BLE001 - told to the other ranks, then re-raised
                error = exc
        self.share_outcome(error, "rejoining")
        header = None if state is None else (state.round, state.run_id, [
            (name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in sorted(state.tensors.items())])
        header = self.group.broadcast_object(header)
        if header is None:
            return None
        round_, run_id, layout = header
        if state is None:
            tensors = {name: torch.empty(shape, dtype=getattr(torch, dtype)) for name, shape, dtype in layout}
        else:
            tensors = dict(state.tensors)
        self.group.broadcast_tensors([tensors[name] for name, _, _ in layout])
        self._step = round_
        if state is not None:
            return state
        from diloco.replica.checkpoint import CommittedRound

        return CommittedRound(round=round_, tensors=tensors, run_id=run_id)

    # ---------------------------------------------------------------- a sharded model, by rows
    def allreduce_shards(self, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec]) -> Any:
        """This process's rows averaged through its own parts collective; ``wait()`` agrees with the siblings."""
        return self._shards.allreduce(tensors, specs)

    def commit_round_shards(self, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec]) -> None:
        """Every process commits its rows of the round just committed; local rank 0 marks it."""
        self._shards.commit(tensors, specs)

    def rejoin_shards(self, specs: Mapping[str, ShardSpec]) -> CommittedRound | None:
        """Local rank 0 finds the round; every process reads its rows of it (or ``None``: a first start)."""
        return self._shards.rejoin(specs)

    def gather_shards(self, tensors: Mapping[str, torch.Tensor],
                      specs: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor] | None:
        """The whole tensors on local rank 0 (``None`` elsewhere), for the final export."""
        return self._shards.gather(tensors, specs)

    def inner_state_place(self, shards: bool) -> tuple[str | None, tuple[int, int] | None] | None:
        """Where this process keeps its inner optimizer state: with shards, its own rows' (the run id, (local rank,
        local processes)), or ``None`` when the replica commits no rounds (no parts setup); a model held whole
        keeps none here (local rank 0's rounds are its replica manager's)."""
        return self._shards.checkpoint_place() if shards else None

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict() if self._inner is not None else {"step": self._step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._inner is not None:
            self._inner.load_state_dict(state)
        self._step = int(state["step"])


# ---------------------------------------------------------------------------------------------- the launcher
@dataclass(frozen=True)
class ChildFailure:
    """The root cause of a failed multi-process replica: its exit code and its ``diloco: error:`` line."""

    exit_code: int
    message: str | None


def error_file(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"local_rank_{local_rank}.txt")


def write_child_error(env: Mapping[str, str], message: str, *, derived: bool = False) -> None:
    """In a child, keep its last error line, and when it failed, where the launching process will look for them.
    ``derived``: the error only relays another local process's (``LocalRoundFailed``), so it is never the root
    cause when that one's is there."""
    import json
    import time

    directory, local_rank = env.get(ERROR_DIR_ENV), env.get("LOCAL_RANK")
    if not directory or local_rank is None:
        return
    record = {"time": time.time(), "derived": derived, "message": " ".join(message.split())}
    try:
        with open(error_file(directory, int(local_rank)), "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError:
        pass  # the error is on stderr anyway


def launch_local_processes(procs: int, child_argv: list[str], *, timeout_s: float) -> ChildFailure | None:
    """Run ``python -m diloco.replica.entrypoint <child_argv>`` as ``procs`` local processes under torch's elastic
    launcher and wait for them; ``None`` when all succeeded, else the root cause.

    Raises torch's ``SignalException`` when this process is stopped (SIGTERM): the launcher has then stopped the
    children already."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=procs, run_id=f"diloco-{uuid.uuid4().hex[:12]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5,
                          rdzv_configs={"timeout": int(max(900.0, timeout_s))})
    args = ["-u", "-m", "diloco.replica.entrypoint", *child_argv]
    with tempfile.TemporaryDirectory(prefix="diloco-local-") as errors, _children_env(errors):
        try:
            elastic_launch(config, sys.executable)(*args)
        except ChildFailedError as exc:
            return _root_cause(exc, errors)
    return None


class _children_env:
    """The children's environment: this process's plus the error directory and this interpreter's import path
    (so a trainer module found here is found there). Restored afterwards: ``main`` may run inside a test."""

    def __init__(self, errors: str) -> None:
        path = [p for p in sys.path if p] + [os.getcwd()]
        self.values = {ERROR_DIR_ENV: errors, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for key, value in self.values.items():
            self.saved[key] = os.environ.get(key)
            os.environ[key] = value

    def __exit__(self, *exc: object) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _root_cause(exc: Any, errors: str) -> ChildFailure:
    """The failure to report: among the processes that failed on their own (not stopped by SIGTERM), one killed
    by a signal first (a SIGKILL, the OOM killer: it could write no error line, and its siblings' lost
    connections are its consequence; its exit code, 128 + N, makes the replica relaunchable), else the first to
    fail, as the clocks in their error records say, a relayed error (``derived``) only when nothing else is there.
    (A process whose peer died first often fails too, with a lost connection, a moment later.)"""
    failures = dict(exc.failures)  # local rank -> ProcessFailure (exitcode, ...)
    codes = {rank: _exit_code(f.exitcode) for rank, f in failures.items()}
    causes = [rank for rank in failures if codes[rank] != _SIGTERM_EXIT] or list(failures)
    records = {rank: _read_record(error_file(errors, rank)) for rank in causes}

    def killed(rank: int) -> bool:
        return codes[rank] > 128 and codes[rank] != _SIGTERM_EXIT and not records[rank]

    rank = min(causes, key=lambda r: (not killed(r), bool(records[r].get("derived")),
                                      records[r].get("time", float("inf")), r))
    return ChildFailure(exit_code=codes[rank], message=records[rank].get("message"))


def _exit_code(code: int) -> int:
    """A child's exit status as a shell reports it (a signal ``-N`` becomes ``128 + N``)."""
    return 128 - code if code < 0 else code


def _read_record(path: str) -> dict[str, Any]:
    """A child's error record (``write_child_error``); empty when it wrote none (killed outright)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
