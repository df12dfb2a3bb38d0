"""``bf16``: torch's own fp32 -> bf16 cast (round to nearest even). Wire: ``<name>`` in bf16.

Relative error per element at most 2^-8 (finite values in bf16's normal range); half of fp32's bytes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.formats.base import Allocator, BlockTagged, WireSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Bf16(BlockTagged):
    name = "bf16"
    summary = "bfloat16, round to nearest even (2x smaller)"

    def wire_of(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> WireSpec:
        import torch

        return {name: (tuple(shape), torch.bfloat16)}

    def encode_tensor(self, name: str, tensor: torch.Tensor, empty: Allocator | None = None
                      ) -> dict[str, torch.Tensor]:
        import torch

        x = self.fp32(name, tensor)
        return {name: x.to(torch.bfloat16) if empty is None else empty(tuple(x.shape), torch.bfloat16).copy_(x)}

    def decode_tensor(self, wire: Mapping[str, torch.Tensor], name: str, out: torch.Tensor, mode: str) -> None:
        from diloco.formats.kernels.blockquant import combine_dense

        combine_dense(wire[name].reshape(-1), out, mode)


FORMAT = Bf16
