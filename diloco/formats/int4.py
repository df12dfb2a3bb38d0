"""``int4``: block absmax quantisation (``diloco.formats.blockwise``) with ``qmax`` 7, codes stored offset by 8 (so
1..15) as nibbles, two per uint8: element ``2i`` in the low nibble (bits 0-3) of byte ``i``, element ``2i + 1`` in
the high nibble (bits 4-7); an odd element count pads the last high nibble with 8 (the code of zero). Wire:
``<name>:q`` (uint8, ``ceil(n / 2)`` bytes) and ``<name>:scale`` (fp32, one per block). ``0.5 + 4 / block`` bytes
per element: 7.76x smaller than fp32 at the default block of 256."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.formats.base import CODES_SUFFIX, SCALE_SUFFIX, Allocator
from diloco.formats.blockwise import BlockQuantized

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Int4(BlockQuantized):
    name = "int4"
    summary = "4-bit codes, one fp32 scale per block (7.8x smaller)"
    qmax = 7

    def code_bytes(self, n: int) -> int:
        return -(-n // 2)

    def code_dtype(self) -> torch.dtype:
        import torch

        return torch.uint8

    def encode_flat(self, flat: torch.Tensor, empty: Allocator | None) -> tuple[torch.Tensor, torch.Tensor]:
        from diloco.formats.kernels import blockquant

        return blockquant.encode_int4(flat, self.qmax, self.block, empty=empty)

    def decode_tensor(self, wire: Mapping[str, torch.Tensor], name: str, out: torch.Tensor, mode: str) -> None:
        from diloco.formats.kernels import blockquant

        blockquant.decode_int4(wire[name + CODES_SUFFIX], wire[name + SCALE_SUFFIX], self.block, out, mode=mode)


FORMAT = Int4
