"""Values worked out from a byte stream, kept so that the same bytes met again soon are not worked out twice.

Why: the sparse format's positions are decoded from a stream of bits, and a round meets the same stream more than
once: it checks a peer's payload whole when it reads it, then decodes it again to add it; error feedback decodes
what it has just encoded to keep the residual, and a gather round then adds that same payload as its own
contribution. Decoding the positions is about as costly as the rest of a decode, so both sparse kernels
(``topk`` for a large tensor, ``topk_many`` for a payload's small ones) keep what they decoded here.

An entry is found by its stream's exact bytes, never by where they are: a round reads every peer into the same
buffer, so a buffer's address says nothing about its content. The lookup key is the stream's length and CRC-32
with the caller's ``tag`` (what else the value depends on: the format's parameters, the layout); a hit is then
compared in full with a copy of the bytes kept beside the value, so a CRC collision costs a decode, never a wrong
value. What is held is bounded twice: ``max_bytes`` (streams' copies and values together, the oldest entries
going first) and ``max_entries``; an entry larger than ``max_entry_bytes`` is not kept at all (its decode is then
data, not a fixed cost worth saving). With ``take_once`` an entry is forgotten as it is handed out: a large
payload's positions are held from its check to its decode and no longer.
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import numpy as np

V = TypeVar("V")


class ContentMemo(Generic[V]):
    """A bounded, thread-safe map from (tag, a stream's exact bytes) to a value worked out from them."""

    def __init__(self, *, max_bytes: int, take_once: bool, max_entries: int | None = None,
                 max_entry_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.max_entry_bytes = max_entry_bytes
        self.take_once = take_once
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[Hashable, int, int], tuple[np.ndarray, V, int]] = OrderedDict()
        self._bytes = 0

    @staticmethod
    def _key(tag: Hashable, content: np.ndarray) -> tuple[Hashable, int, int]:
        return tag, content.nbytes, zlib.crc32(content)

    def keep(self, tag: Hashable, content: np.ndarray, value: V, value_nbytes: int) -> None:
        """Hold ``value`` for ``content`` (an array, copied: the caller may reuse its memory)."""
        import numpy as np

        content = np.ascontiguousarray(content)
        size = content.nbytes + value_nbytes
        if self.max_entry_bytes is not None and value_nbytes > self.max_entry_bytes:
            return
        key = self._key(tag, content)
        entry = (content.copy(), value, size)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[2]
            self._entries[key] = entry
            self._bytes += size
            while self._entries and (self._bytes > self.max_bytes or
                                     (self.max_entries is not None and len(self._entries) > self.max_entries)):
                self._bytes -= self._entries.popitem(last=False)[1][2]

    def find(self, tag: Hashable, content: np.ndarray) -> V | None:
        """The value kept for exactly these bytes under ``tag``, or None; with ``take_once`` it is forgotten."""
        import numpy as np

        content = np.ascontiguousarray(content)
        key = self._key(tag, content)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not np.array_equal(entry[0], content):
                return None
            if self.take_once:
                del self._entries[key]
                self._bytes -= entry[2]
            else:
                self._entries.move_to_end(key)
            return entry[1]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_bytes(self) -> int:
        """What the entries hold: their streams' copies and values."""
        return self._bytes
