"""Each replica's data position, saved with every committed round, so a relaunched replica reads on exactly where the
committed state it rejoins at left its data.

The committed round itself (``diloco.replica.checkpoint``) is the run's global state, one copy written by whichever
rank finishes first; a data position is one process's own (its slot of the stream), so each process writes its own
next to it, as one small JSON object in the run's store::

    data_positions/rank_RRRR/proc_LL/round_NNNNNN.json

written right after the process's inner step that committed round NNNNNN (its data then stands exactly at the end
of that round). A relaunched process rejoining at round N reads its own position of round N, never the position its
killed predecessor reached later. A predecessor killed between the round's commit and this write left no position
for N: the newest earlier one is read and the stream moved on by the steps between (``advance``), which is exact
because every inner step takes the same number of blocks; with none at all, the stream is advanced from its start.

The object names the data it belongs to, so a position of other data (a reused store) is refused. The newest
``KEEP`` positions per process are kept; older ones are deleted by their writer.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diloco.errors import ObjectNotFound, StoreError

if TYPE_CHECKING:
    from diloco.store.objects import ObjectStore

log = logging.getLogger("diloco.trainers.hf")

PREFIX = "data_positions/"
FORMAT = "diloco.data-position/1"
#: Positions kept per process (as many as committed rounds are kept by default).
KEEP = 3
_ROUND = re.compile(r"round_(\d{6})\.json$")


@dataclass(frozen=True)
class SavedPosition:
    """A position read back: the committed round it was saved with and the stream's ``state_dict``."""

    round: int
    position: dict[str, Any]


class DataPositions:
    """One process's data positions in ``store``, for ``data`` (refused if saved for other data)."""

    def __init__(self, store: ObjectStore, *, rank: int, local_rank: int, data: str) -> None:
        self.store, self.rank, self.local_rank, self.data = store, rank, local_rank, data
        self.prefix = f"{PREFIX}rank_{rank:04d}/proc_{local_rank:02d}/"

    def key(self, round_number: int) -> str:
        return f"{self.prefix}round_{round_number:06d}.json"

    def save(self, round_number: int, position: dict[str, Any]) -> None:
        """Write this process's position as of committed round ``round_number``; drop the one ``KEEP`` older.
        A failed write is logged, not raised: it costs a rejoin the fallback (advancing from an older one)."""
        body = {"format": FORMAT, "round": round_number, "rank": self.rank, "local_rank": self.local_rank,
                "data": self.data, "position": position}
        try:
            self.store.put(self.key(round_number), json.dumps(body, sort_keys=True).encode())
            if round_number > KEEP:
                self.store.delete(self.key(round_number - KEEP))
        except (StoreError, OSError) as exc:
            log.warning("could not save the data position of round %d: %s", round_number, exc)

    def load(self, round_number: int) -> SavedPosition | None:
        """The position saved with round ``round_number``, else the newest one before it, else ``None``."""
        rounds = sorted((int(m.group(1)) for key in self.store.list(self.prefix)
                         if (m := _ROUND.search(key)) and int(m.group(1)) <= round_number), reverse=True)
        for found in rounds:
            try:
                body = json.loads(self.store.get(self.key(found)))
            except (ObjectNotFound, ValueError) as exc:
                log.warning("data position of round %d unreadable (%s); trying an older one", found, exc)
                continue
            if body.get("format") != FORMAT or body.get("data") != self.data:
                log.warning("data position of round %d belongs to data %r, not %r: ignored", found, body.get("data"),
                            self.data)
                continue
            return SavedPosition(round=found, position=dict(body["position"]))
        return None
