"""Buffers a round gives back for the next one: fresh memory is paid for in page faults.

Why: a fresh payload-sized tensor costs a page fault per 4 KiB the first time it is written. On the VMs replicas
run on that is about as slow as writing the tensor twenty times (8 MiB: ``x.clone()`` 5.7 ms, ``y.copy_(x)`` into
an existing tensor 0.26 ms, on the machine of ``bench/results``), and a round writes two or three payload-sized
tensors (the snapshot, the sum, the gathered mean). So a round hands its buffers back once nothing reads them any
more (the snapshot once it was sent and summed, the mean once ``Work.wait()`` copied it into the caller's tensors),
and the next round takes them by shape and dtype instead of allocating.

Memory: only the latest round's buffers are kept (anything older that no round took is dropped), so between rounds
a rank holds at most what its round held at once anyway; Streaming DiLoCo's fragments, which share shapes from
layer to layer, reuse each other's. ``clear`` drops everything (the all-reduce's ``close``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Spares:
    """Tensors given back by the latest round, by (shape, dtype), for the next round to write into."""

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._round = -1  # the round whose buffers are kept
        self._lock = threading.Lock()  # given back on the caller's thread, taken on the round thread

    def empty(self, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of ``shape`` and ``dtype`` with undefined contents: a spare when there is one."""
        import torch

        shape = tuple(int(d) for d in shape)
        with self._lock:
            stack = self._free.get((shape, dtype))
            if stack:
                return stack.pop()
        return torch.empty(shape, dtype=dtype)

    def give(self, round_: int, tensors: Iterable[torch.Tensor]) -> None:
        """Keep ``tensors`` (contiguous CPU tensors nothing reads any more) for later rounds; spares of rounds
        before ``round_`` that no round took are dropped."""
        with self._lock:
            if round_ > self._round:
                self._free.clear()
                self._round = round_
            elif round_ < self._round:
                return  # an older round's, handed back late: the newer round's buffers are the ones to keep
            for t in tensors:
                if t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0 and \
                        t.untyped_storage().nbytes() == t.numel() * t.element_size():
                    self._free.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def clear(self) -> None:
        """Drop every spare."""
        with self._lock:
            self._free.clear()
