"""``int8``: block absmax quantisation (``diloco.formats.blockwise``) with ``qmax`` 127, one int8 code per element.
Wire: ``<name>:q`` (int8, one per element) and ``<name>:scale`` (fp32, one per block). ``1 + 4 / block`` bytes per
element: 3.94x smaller than fp32 at the default block of 256."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.formats.base import CODES_SUFFIX, SCALE_SUFFIX, Allocator
from diloco.formats.blockwise import BlockQuantized

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Int8(BlockQuantized):
    name = "int8"
    summary = "8-bit codes, one fp32 scale per block (3.9x smaller)"
    qmax = 127

    def code_bytes(self, n: int) -> int:
        return n

    def code_dtype(self) -> torch.dtype:
        import torch

        return torch.int8

    def encode_flat(self, flat: torch.Tensor, empty: Allocator | None) -> tuple[torch.Tensor, torch.Tensor]:
        from diloco.formats.kernels import blockquant

        return blockquant.encode_int8(flat, self.qmax, self.block, empty=empty)

    def decode_tensor(self, wire: Mapping[str, torch.Tensor], name: str, out: torch.Tensor, mode: str) -> None:
        from diloco.formats.kernels import blockquant

        blockquant.decode_int8(wire[name + CODES_SUFFIX], wire[name + SCALE_SUFFIX], self.block, out, mode=mode)


FORMAT = Int8
