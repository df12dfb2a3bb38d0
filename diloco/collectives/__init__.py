"""Collectives over an object store: the mean all-reduce that is the replicas' only way to exchange tensors.

One protocol (``Collective``, what ``diloco.replica.manager.ObjectStoreManager`` takes), two sibling implementations:

* ``ObjectStoreAllReduce`` (``store.allreduce: gather``, ``diloco.collectives.gather``): every rank reads every
  peer's whole contribution. S written, (N-1)·S read, 1 PUT + (N-1) GETs per rank per round.
* ``ShardedAllReduce`` (``store.allreduce: sharded``, ``diloco.collectives.sharded``): reduce-scatter then
  all-gather. S + S/N written, 2·S·(N-1)/N read, 2 PUTs + 3(N-1) GETs per rank per round.

Both are a ``RoundDriver`` (``diloco.collectives.driver``: round counter, background round thread, ``Work``,
polling, verified reads, deletion, stats) around their own ``Exchange``; neither subclasses the other. The wire
format (``store.compression``, with error feedback) is ``diloco.collectives.wire`` over the payload framing of
``diloco.collectives.compression`` and the registered formats of ``diloco.formats``, one module each; every
contribution, a rank's own included, is added to the sum from its wire tensors; the arithmetic they share (fp32,
rank order, so bitwise-identical means) is ``diloco.collectives.reduce``; the keys are ``diloco.store.layout``.
A round writes into the buffers the round before handed on (``diloco.collectives.spares``) and reads its peers
into one reused buffer: fresh memory costs a page fault per 4 KiB, more than the copy into it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from diloco.collectives.driver import AllReduceStats, AllReduceWork, RoundDriver
from diloco.collectives.gather import ObjectStoreAllReduce
from diloco.collectives.reduce import Tensors, average, number
from diloco.collectives.sharded import ShardedAllReduce

if TYPE_CHECKING:
    from diloco.store.objects import ObjectStore

STRATEGIES: tuple[str, ...] = ("gather", "sharded")


class Collective(Protocol):
    """What the manager needs of a collective: one mean all-reduce round at a time, in lockstep with the peers."""

    rank: int
    world_size: int
    timeout_s: float
    poll_interval_s: float
    store: ObjectStore
    #: Whether each round's members are data (an elastic run: ``diloco.collectives.membership``).
    elastic: bool

    @property
    def next_round(self) -> int: ...

    def members_after(self, round_: int) -> list[int] | None: ...

    @property
    def stats(self) -> AllReduceStats: ...

    def resume_at(self, round_: int) -> None: ...

    def has_own_contribution(self, round_: int) -> bool: ...

    def allreduce_async(self, tensors: Tensors) -> AllReduceWork: ...

    def close(self, wait: bool = True) -> None: ...


__all__ = ["STRATEGIES", "AllReduceStats", "AllReduceWork", "Collective", "ObjectStoreAllReduce", "RoundDriver",
           "ShardedAllReduce", "Tensors", "average", "number"]
