"""What the integer formats share: symmetric round-to-nearest (ties to even) with one fp32 absmax scale per block
of ``block`` elements of the tensor flattened in C order (the last block may be shorter): ``scale = max|x| /
qmax``, ``q = round(x / scale)`` in [-qmax, qmax], decoded as ``q * scale``. Error per element at most ``scale /
2`` of its block. Wire: ``<name>:q`` (the codes, layout per format) and ``<name>:scale`` (fp32, one per block),
both 1-D. The arithmetic is ``diloco.formats.kernels.blockquant``'s (vectorised, on the tensor's device).

An all-zero block has scale 0 and decodes to exact zeros; a block holding a NaN or an infinity gets a non-finite
scale and decodes to NaN throughout (a diverged replica stays visible in the mean)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from diloco.formats.base import (
    CODES_SUFFIX,
    SCALE_SUFFIX,
    Allocator,
    BlockTagged,
    WireFormat,
    WireSpec,
    numel,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class BlockQuantized(BlockTagged):
    """An integer format: ``qmax`` and its codes' layout (``code_bytes``, ``code_dtype``) are the subclass's."""

    qmax: ClassVar[int]

    def code_bytes(self, n: int) -> int:
        raise NotImplementedError

    def code_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def mismatch(self, got: WireFormat) -> str | None:
        assert isinstance(got, BlockQuantized)
        if got.block == self.block:
            return None
        return (f"compressed payload has block={got.block}, expected {self.block}: the peer quantizes with "
                "another block size")

    def wire_of(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> WireSpec:
        import torch

        from diloco.formats.kernels import blockquant

        n = numel(shape)
        return {name + CODES_SUFFIX: ((self.code_bytes(n),), self.code_dtype()),
                name + SCALE_SUFFIX: ((blockquant.num_blocks(n, self.block),), torch.float32)}

    def encode_tensor(self, name: str, tensor: torch.Tensor, empty: Allocator | None = None
                      ) -> dict[str, torch.Tensor]:
        codes, scales = self.encode_flat(self.fp32(name, tensor).view(-1), empty)
        return {name + CODES_SUFFIX: codes, name + SCALE_SUFFIX: scales}

    def encode_flat(self, flat: torch.Tensor, empty: Allocator | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def residual_finite(self, wire: Mapping[str, torch.Tensor]) -> bool:
        """A block with a finite scale held only finite values and decodes to values no larger than them."""
        import torch

        return all(bool(torch.isfinite(t).all()) for name, t in wire.items() if name.endswith(SCALE_SUFFIX))
