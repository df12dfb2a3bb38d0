"""The built-in trainer with one straggling replica, for the partial-participation CLI tests
(``--trainer late_trainer:train``, run by the real replica entrypoint from the tests directory).

Rank ``late_rank`` holds back its contribution to each round listed in ``late_rounds`` (numbered from 1, as in the
logs) until its peers have committed that round without it (the round's manifest exists): what a straggler past
the round's deadline looks like to them, without a race against the machine's load, so the drop is certain. Each
listed round is late once in the whole run (the first attempt that reaches it claims it with an object in the
store), so a relaunched replica trains at its peers' pace, as one on a healthy machine would. Everything else is
``diloco.trainer.diloco_train`` with the kwargs given.
"""

from __future__ import annotations

import time
from typing import Any

from diloco.layout import ROUND_MANIFEST_KEY

#: Where an attempt claims a round it holds back (under the run's rendezvous root).
CLAIM_KEY = "late_trainer/round_{number:06d}"


def late_round_numbers(late_rounds: str | int) -> set[int]:
    """``"1,6"`` (or one number: ``-k late_rounds=3`` arrives as an int) as a set of round numbers."""
    return {int(part) for part in str(late_rounds).split(",") if part.strip()}


class LateManager:
    """The replica's real manager, except that ``allreduce`` of a late round first waits for the round's manifest."""

    def __init__(self, manager: Any, rounds: set[int]) -> None:
        self._manager = manager
        self._rounds = rounds

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def allreduce(self, tensors: Any) -> Any:
        number = self._manager.current_step() + 1  # the round being opened (current_step counts committed ones)
        store = self._manager.store
        if number in self._rounds and store.put_if_absent(CLAIM_KEY.format(number=number), b"late"):
            manifest = ROUND_MANIFEST_KEY.format(round=number - 1)
            give_up = time.monotonic() + 20 * self._manager._allreduce.timeout_s
            while not store.exists(manifest):
                if time.monotonic() > give_up:
                    raise RuntimeError(f"round {number} never committed without rank {self._manager.rank}")
                time.sleep(0.05)
        return self._manager.allreduce(tensors)


def train(*, manager: Any, rank: int, world_size: int, late_rank: int = -1, late_rounds: str = "",
          **kwargs: Any) -> dict[str, Any]:
    """``diloco_train`` on every rank; rank ``late_rank``'s manager holds back its ``late_rounds``."""
    from diloco.trainer import diloco_train

    if rank == late_rank:
        manager = LateManager(manager, late_round_numbers(late_rounds))
    return diloco_train(manager=manager, rank=rank, world_size=world_size, **kwargs)
