"""What the outer loop asks of a manager, as typed protocols: torchft's four calls, and what diloco's own managers
add to them (committed rounds, error-feedback state, the final export, rows of a sharded model).

Why protocols and one adapter rather than asking each manager what it has: the outer loop (``diloco.replica.outer``)
used to probe a manager for each optional method before it called it, so a manager that lost a method (or misspelt
it) silently lost the behaviour (no rejoin, no committed rounds, no residuals saved) instead of failing a type
check. Now a manager is either a ``RoundKeeper`` (``diloco.replica.manager.ObjectStoreManager``,
``diloco.replica.local_group.LocalGroupManager`` and the wrappers the tests put around them) and is called as one,
or it is any other torchft-style ``Manager`` and ``as_round_keeper`` wraps it in ``ForeignManager``, which answers
the additions neutrally (nothing committed, nothing to rejoin, no store to export to). The check is made once,
when the loop is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from diloco.collectives.part_layout import ShardSpec
    from diloco.replica.checkpoint import CommittedRound
    from diloco.replica.metrics import MetricsWriter

#: Where a replica keeps its inner optimizer's state between restarts: (run id, local process place (local rank,
#: local processes) or None for a replica held whole).
InnerStatePlace = tuple[str | None, tuple[int, int] | None]


class Work(Protocol):
    def wait(self, timeout: object = None) -> bool: ...


class Manager(Protocol):
    """torchft's ``Manager`` calls the outer loop makes on any manager."""

    def start_quorum(self) -> None: ...

    def allreduce(self, tensor_or_tensors: Any) -> Work: ...

    def should_commit(self) -> bool: ...

    def current_step(self) -> int: ...


@runtime_checkable
class RoundKeeper(Manager, Protocol):
    """A diloco manager: torchft's calls plus what the replica entrypoint's managers keep for the outer loop."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def store(self) -> Any | None:
        """The rendezvous store the final weights are exported to; None: no export."""

    @property
    def metrics(self) -> MetricsWriter | None: ...

    def report_error(self, exc: BaseException) -> None: ...

    def commit_round(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep the round just committed, for a replica that restarts (a no-op without committed rounds)."""

    def rejoin(self) -> CommittedRound | None:
        """The latest committed round when this replica restarts mid-run; None on a first start."""

    def inner_state_place(self, shards: bool) -> InnerStatePlace | None:
        """Where the inner optimizer's state is kept next to committed rounds; None: the manager commits none."""

    def wire_state(self) -> dict[str, Any]:
        """The error-feedback residuals this replica still owes its peers ({} when the wire keeps none)."""

    def load_wire_state(self, state: Mapping[str, Any]) -> None: ...

    def error_feedback_active(self) -> bool | None:
        """Whether the wire carries error feedback; None when the manager cannot tell."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class ShardKeeper(RoundKeeper, Protocol):
    """A manager that also exchanges, commits, restores and gathers a model by rows (FSDP2 shards)."""

    def allreduce_shards(self, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec]) -> Work: ...

    def commit_round_shards(self, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec]) -> None: ...

    def rejoin_shards(self, specs: Mapping[str, ShardSpec]) -> CommittedRound | None: ...

    def gather_shards(self, tensors: Mapping[str, torch.Tensor],
                      specs: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor] | None: ...


class NoWireState:
    """The wire answers of a manager that keeps no error-feedback residuals of its own: a foreign manager, and the
    local group of a multi-process replica (its processes share none; local rank 0's wire is its replica
    manager's). Whether the wire has error feedback is not told: only rank 0 sees it, and the local processes must
    agree on the outer rule."""

    def wire_state(self) -> dict[str, Any]:
        return {}

    def load_wire_state(self, state: Mapping[str, Any]) -> None:
        return None

    def error_feedback_active(self) -> bool | None:
        return None


class ForeignManager(NoWireState):
    """A torchft-style manager diloco did not build, as a ``RoundKeeper``: its four calls forwarded, and the
    additions answered as a manager without a store: one replica of one, nothing committed or rejoined, no export,
    no residuals; errors and checkpoint state go to the manager's own ``report_error``/``state_dict`` (torchft's
    ``Manager`` has both) where it has them."""

    def __init__(self, manager: Manager) -> None:
        self._manager = manager

    def start_quorum(self) -> None:
        self._manager.start_quorum()

    def allreduce(self, tensor_or_tensors: Any) -> Work:
        return self._manager.allreduce(tensor_or_tensors)

    def should_commit(self) -> bool:
        return self._manager.should_commit()

    def current_step(self) -> int:
        return self._manager.current_step()

    rank = 0
    world_size = 1
    store = None
    metrics = None

    def report_error(self, exc: BaseException) -> None:
        report = getattr(self._manager, "report_error", None)
        if callable(report):
            report(exc)

    def commit_round(self, tensors: Mapping[str, torch.Tensor]) -> None:
        return None

    def rejoin(self) -> CommittedRound | None:
        return None

    def inner_state_place(self, shards: bool) -> InnerStatePlace | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        own = getattr(self._manager, "state_dict", None)
        return own() if callable(own) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = getattr(self._manager, "load_state_dict", None)
        if callable(own) and state:
            own(state)


def as_round_keeper(manager: Manager) -> RoundKeeper:
    """``manager`` itself when it is a diloco manager, else it wrapped in ``ForeignManager``."""
    return manager if isinstance(manager, RoundKeeper) else ForeignManager(manager)


def as_shard_keeper(manager: Manager) -> ShardKeeper:
    """``manager`` for a model exchanged by rows; ``ValueError`` naming what it lacks when it cannot be one."""
    if isinstance(manager, ShardKeeper):
        return manager
    raise ValueError(f"the model's parameters are exchanged by rows (FSDP2 shards or shard_exchange), but the "
                     f"manager ({type(manager).__name__}) is not a ShardKeeper (allreduce_shards, "
                     f"commit_round_shards, rejoin_shards, gather_shards and the RoundKeeper calls): use the replica "
                     f"entrypoint's manager")
