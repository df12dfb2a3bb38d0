"""The built-in trainer with one straggling replica, for the partial-participation CLI tests
(``--trainer support.late_trainer:train``, run by the real replica entrypoint from the tests directory).

Rank ``late_rank`` holds back its contribution to each round listed in ``late_rounds`` (numbered from 1, as in the
logs) until its peers have committed that round without it (the round's manifest exists): what a straggler past
the round's deadline looks like to them, without a race against the machine's load, so the drop is certain. Each
listed round is late once in the whole run (the first attempt that reaches it claims it with an object in the
store), so a relaunched replica trains at its peers' pace, as one on a healthy machine would.

The other ranks hold back their contribution to each round in ``hold_rounds`` until the late rank has rejoined the
run for that round (its ``rejoin/rank_RRRR.json`` names it): peers whose rounds take longer than a relaunch, as on
any real model, so the relaunched replica finds them still in the run however slowly this machine starts it.
Everything else is ``diloco.trainers.gpt.diloco_train`` with the kwargs given.
"""

from __future__ import annotations

import json
import time
from typing import Any

from diloco.errors import ObjectNotFound
from diloco.store.layout import REJOIN_KEY, ROUND_MANIFEST_KEY

#: Where an attempt claims a round it holds back (under the run's rendezvous root).
CLAIM_KEY = "late_trainer/round_{number:06d}"


def late_round_numbers(late_rounds: str | int) -> set[int]:
    """``"1,6"`` (or one number: ``-k late_rounds=3`` arrives as an int) as a set of round numbers."""
    return {int(part) for part in str(late_rounds).split(",") if part.strip()}


#: How long a held contribution waits for what it waits for before the trainer gives up (raises), in timeouts.
GIVE_UP_TIMEOUTS = 60


class LateManager:
    """The replica's real manager, except that ``allreduce`` of a held round first waits: on the late rank, for the
    round to commit without it (its manifest); on the others, for the late rank to rejoin for the round."""

    def __init__(self, manager: Any, *, late_rank: int, late: set[int], hold: set[int]) -> None:
        self._manager = manager
        self._late_rank = late_rank
        self._late = late if manager.rank == late_rank else set()
        self._hold = hold if manager.rank != late_rank else set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def allreduce(self, tensors: Any) -> Any:
        number = self._manager.current_step() + 1  # the round being opened (current_step counts committed ones)
        store = self._manager.store
        if number in self._late and store.put_if_absent(CLAIM_KEY.format(number=number), b"late"):
            manifest = ROUND_MANIFEST_KEY.format(round=number - 1)
            self._wait(lambda: store.exists(manifest), f"round {number} to commit without it")
        if number in self._hold:
            self._wait(lambda: self._rejoined_for(number - 1), f"rank {self._late_rank} to rejoin for round {number}")
        return self._manager.allreduce(tensors)

    def _rejoined_for(self, index: int) -> bool:
        try:
            record = json.loads(self._manager.store.get(REJOIN_KEY.format(rank=self._late_rank)))
        except ObjectNotFound:
            return False
        return int(record.get("round", -1)) >= index

    def _wait(self, done: Any, what: str) -> None:
        give_up = time.monotonic() + GIVE_UP_TIMEOUTS * self._manager._allreduce.timeout_s
        while not done():
            if time.monotonic() > give_up:
                raise RuntimeError(f"rank {self._manager.rank} waited in vain for {what}")
            time.sleep(0.05)


def train(*, manager: Any, rank: int, world_size: int, late_rank: int = -1, late_rounds: str | int = "",
          hold_rounds: str | int = "", **kwargs: Any) -> dict[str, Any]:
    """``diloco_train`` on every rank, the managers holding back ``late_rounds`` / ``hold_rounds`` (see above)."""
    from diloco.trainers.gpt import diloco_train

    manager = LateManager(manager, late_rank=late_rank, late=late_round_numbers(late_rounds),
                          hold=late_round_numbers(hold_rounds))
    return diloco_train(manager=manager, rank=rank, world_size=world_size, **kwargs)
