"""What a replica's processes need to exchange and commit by rows, built only when the trainer shards its model.

Why a separate object: the replica entrypoint builds the manager before the trainer has built (and perhaps
sharded) its model, and in a multi-process replica only local process 0 has a manager over the store. ``PartsSetup``
carries the replica's store settings to every local process; the managers (``diloco.replica.manager``,
``diloco.replica.local_group``) call it the first time the outer loop exchanges rows, and the entrypoint closes
what it built when the replica ends, as it closes the replica's whole-tensor collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diloco.replica.checkpoint import DEFAULT_KEEP

if TYPE_CHECKING:
    from diloco.collectives.parts import PartsAllReduce
    from diloco.replica.checkpoint_parts import PartCheckpoints


class PartsSetup:
    """Builds this process's parts collective and committed-parts store for replica ``rank`` of ``world_size``."""

    def __init__(self, uri: str, rank: int, world_size: int, settings: Any = None, *, run_id: str | None = None,
                 keep: int = DEFAULT_KEEP) -> None:
        self.uri, self.rank, self.world_size = uri, rank, world_size
        self.settings, self.run_id, self.keep = settings, run_id, keep
        self.made: list[PartsAllReduce] = []

    def collective(self, part: int, parts: int) -> PartsAllReduce:
        """Local process ``part`` of ``parts``'s collective (``diloco.collectives.parts``)."""
        from diloco.collectives.parts import create_parts_allreduce

        collective = create_parts_allreduce(self.uri, self.rank, self.world_size, self.settings, run_id=self.run_id,
                                            part=part, parts=parts)
        self.made.append(collective)
        return collective

    def checkpoints(self) -> PartCheckpoints:
        """The run's committed rounds, written and read by rows (``diloco.replica.checkpoint_parts``)."""
        from diloco.replica.checkpoint_parts import PartCheckpoints
        from diloco.store.objects import ObjectStore

        store = self.made[0].store if self.made else ObjectStore(self.uri)
        return PartCheckpoints(store, run_id=self.run_id, world_size=self.world_size, keep=self.keep)

    def close(self, wait: bool = True) -> None:
        """Close every collective built here (``wait``: let an upload in progress land first)."""
        for collective in self.made:
            collective.close(wait=wait)
