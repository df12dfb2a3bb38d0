"""``none``: every tensor as it is (fp32 for pseudo-gradients, its own dtype otherwise). Wire: ``<name>``.

Lossless, so it keeps no error feedback, and the all-reduce sends an uncompressed contribution untagged (the
objects of a run without compression are plain safetensors of the tensors)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.formats.base import Allocator, BlockTagged, WireSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class NoCompression(BlockTagged):
    name = "none"
    summary = "the tensors as they are (lossless)"
    lossless = True

    def wire_of(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> WireSpec:
        return {name: (tuple(shape), dtype)}

    def encode_tensor(self, name: str, tensor: torch.Tensor, empty: Allocator | None = None
                      ) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().to("cpu").contiguous()}

    def decode_tensor(self, wire: Mapping[str, torch.Tensor], name: str, out: torch.Tensor, mode: str) -> None:
        from diloco.formats.kernels.blockquant import combine_dense

        combine_dense(wire[name].reshape(-1), out, mode)

    def decode_new(self, wire: Mapping[str, torch.Tensor], name: str, numel: int) -> torch.Tensor:
        return wire[name].reshape(-1)  # as sent, in its own dtype: nothing to decode


FORMAT = NoCompression
