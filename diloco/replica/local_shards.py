"""A sharded model's rounds inside a multi-process replica: every local process exchanges, commits and restores its
own rows through the store, in parallel with its siblings, and they agree on the outcome.

Why not local rank 0 alone, as for a model every process holds whole (``LocalGroupManager``'s broadcast)? With
FSDP2 no process holds the whole model: gathering the pseudo-gradient to one process would put the whole model
in its memory and the whole payload on its network path. So each process has its own parts collective
(``diloco.collectives.parts``) and writes its own part of each committed round
(``diloco.replica.checkpoint_parts``); what stays with local rank 0 is what is one per replica: the round count,
the commit decision, where a rejoin starts, the metrics and the final export.

Agreement: after each of those steps every process tells the others whether its own part worked
(``LocalGroup.gather_objects``); one failure fails every process of the replica (the failed one with its own error,
the others naming it), so no process applies an outer step its siblings did not, and none waits for a collective
that will never come.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from diloco.collectives.part_layout import ShardSpec
    from diloco.collectives.parts import PartsAllReduce
    from diloco.replica.checkpoint import CommittedRound
    from diloco.replica.checkpoint_parts import PartCheckpoints
    from diloco.replica.parts_setup import PartsSetup


class ShardRoundsHost(Protocol):
    """What the shard rounds use of the local process's manager that owns them
    (``diloco.replica.local_group.LocalGroupManager``): declared here, so this module does not import the module
    that imports it."""

    group: Any  # the replica's LocalGroup: rank, size, is_leader, gather_objects, broadcast_object

    @property
    def inner(self) -> Any | None: ...

    @property
    def rank(self) -> int: ...

    def relayed(self, message: str) -> Exception: ...

    def current_step(self) -> int: ...

    def share_outcome(self, error: BaseException | None, what: str) -> None: ...

    def mirror_step(self, step: int) -> None: ...


class LocalShardRounds:
    """The shard methods of one local process's ``LocalGroupManager`` (see the module docstring)."""

    def __init__(self, manager: ShardRoundsHost, parts: PartsSetup | None) -> None:
        self.manager = manager
        self.group = manager.group
        self._parts = parts
        self._collective: PartsAllReduce | None = None

    def collective(self) -> PartsAllReduce:
        """This process's parts collective: local rank 0's is its replica manager's (so the metrics count it)."""
        if self._collective is None:
            inner = self.manager.inner
            if inner is not None and callable(getattr(inner, "parts_collective", None)):
                self._collective = inner.parts_collective(self.group.rank, self.group.size)
            elif self._parts is not None:
                self._collective = self._parts.collective(self.group.rank, self.group.size)
            else:
                from diloco.errors import DilocoError

                raise DilocoError("this local process was started without a parts setup, so it cannot exchange a "
                                  "sharded model by rows", hint="run the trainer through the replica entrypoint")
        return self._collective

    def checkpoints(self) -> PartCheckpoints | None:
        return self._parts.checkpoints() if self._parts is not None else None

    def checkpoint_place(self) -> tuple[str | None, tuple[int, int]] | None:
        if self._parts is None:
            return None
        return self._parts.run_id, (self.group.rank, self.group.size)

    # ---------------------------------------------------------------- agreement
    def agree(self, error: BaseException | None, what: str, extra: Any = None) -> list[Any]:
        """Every process's ``extra``, once every process said whether its ``what`` worked; raises this process's
        own error, or ``LocalRoundFailed`` naming the first sibling that failed."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        outcomes = self.group.gather_objects((message, extra))
        if error is not None:
            raise error
        for local_rank, (failed, _) in enumerate(outcomes):
            if failed is not None:
                raise self.manager.relayed(f"local process {local_rank} of replica {self.manager.rank}: {what} "
                                           f"failed: {failed}")
        return [value for _, value in outcomes]

    # ---------------------------------------------------------------- the round
    def allreduce(self, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec]) -> PartsWork:
        work, error = None, None
        try:
            work = self.collective().allreduce_shards_async(tensors, specs)
        except Exception as exc:  # noqa: BLE001 - told to the other processes by wait(), then raised
            error = exc
        return PartsWork(self, work, error)

    def after_round(self, error: BaseException | None) -> None:
        """Agree on a round's outcome; local rank 0's manager learns what its siblings moved (its metrics)."""
        if error is not None and self.manager.inner is not None:
            self.manager.inner.report_error(error)
        stats = self._collective.stats if self._collective is not None else None
        moved = (stats.bytes_written, stats.bytes_read) if stats is not None else (0, 0)
        everyone = self.agree(error, "the all-reduce", moved)
        inner = self.manager.inner
        if inner is not None and hasattr(inner, "sibling_bytes"):
            inner.sibling_bytes = (sum(w for w, _ in everyone[1:]), sum(r for _, r in everyone[1:]))

    # ---------------------------------------------------------------- committed rounds
    def commit(self, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec]) -> None:
        """Each process writes its part of the round just committed; local rank 0 then marks it committed."""
        checkpoints = self.checkpoints()
        if checkpoints is None:
            return
        round_number = self.manager.current_step()
        digest, error = None, None
        try:
            digest = checkpoints.write_part(round_number, self.group.size, self.group.rank, tensors, specs)
        except Exception as exc:  # noqa: BLE001 - told to the other processes, then raised
            error = exc
        digests = self.agree(error, f"committing round {round_number}", digest)
        if self.group.is_leader and all(d is not None for d in digests):
            checkpoints.mark(round_number, self.group.size, digests)

    def rejoin(self, specs: Mapping[str, ShardSpec]) -> CommittedRound | None:
        """Local rank 0 finds the round the run is at (waiting while a part of ours of the next round is in the
        store); every process reads its own rows of that committed round."""
        checkpoints = self.checkpoints()
        inner = self.manager.inner
        latest, error = 0, None
        if inner is not None and checkpoints is not None:
            try:
                latest = inner.rejoin_round(contributed=self.collective().replica_contributed)
            except Exception as exc:  # noqa: BLE001 - told to the other processes, then re-raised
                error = exc
        self.manager.share_outcome(error, "rejoining")
        latest = int(self.group.broadcast_object(latest))
        self.manager.mirror_step(latest)
        if latest == 0 or checkpoints is None:
            return None
        self.collective().resume_at(latest)
        state, error = None, None
        try:
            state = checkpoints.read(latest, specs)
        except Exception as exc:  # noqa: BLE001 - told to the other processes, then raised
            error = exc
        self.agree(error, f"reading committed round {latest}")
        return state

    def gather(self, tensors: Mapping[str, torch.Tensor],
               specs: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor] | None:
        return self.group.gather_rows(tensors, specs)


class PartsWork:
    """One local process's round of parts: ``wait()`` waits for its own, then agrees with its siblings."""

    def __init__(self, rounds: LocalShardRounds, work: Any, error: BaseException | None) -> None:
        self._rounds, self._work, self._error = rounds, work, error
        self._done = False

    def wait(self, timeout: object = None) -> bool:
        if self._done:
            if self._error is not None:
                raise self._error
            return True
        self._done = True
        if self._work is not None and self._error is None:
            try:
                self._work.wait(timeout)
            except Exception as exc:  # noqa: BLE001 - told to the other processes, then raised
                self._error = exc
        self._rounds.after_round(self._error)
        return True

    def is_completed(self) -> bool:
        return self._done
