"""What the sparse format's wire holds and costs, and how a row of chunks is described: shared by the one-tensor
kernels (``diloco.formats.kernels.topk``) and the many-small-tensors ones (``diloco.formats.kernels.topk_many``),
which neither import the other's internals this way.

``TopkSpec`` is the format's parameters with their wire sizes; ``low_bits``/``upper_bits``/``positions_nbytes`` the
Elias-Fano layout of a run's positions (``topk``'s module docstring and ``diloco.formats.topk`` have the whole
wire); ``describe_rows`` the selection rule itself in NumPy (every row's ``kept`` largest keys: magnitude bits, then
the reversed position) with its codes and levels, which ``topk``'s pre-filter of large tensors reproduces exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.formats.kernels import bitpack
from diloco.topk_params import TopkParams

if TYPE_CHECKING:
    import numpy as np

MAGNITUDE = 0x7FFFFFFF
NONFINITE_BITS = 0x7F800000  # fp32 bits of +inf: magnitudes at or above are inf or NaN


@dataclass(frozen=True)
class TopkSpec(TopkParams):
    """The sparse format's parameters (``diloco.topk_params``, their defaults and rules) and what they cost on the
    wire."""

    def index_nbytes(self, n: int) -> int:
        """Bytes of the positions of a tensor of ``n`` elements (``encode_positions``)."""
        return sum(positions_nbytes(rows, width, kept) for rows, width, kept in self.parts(n))

    def wire_nbytes(self, n: int) -> int:
        """Bytes on the wire for ``n`` elements: the positions, the packed codes and the fp32 levels."""
        return (self.index_nbytes(n) + bitpack.packed_nbytes(self.kept(n), self.value_bits)
                + 4 * self.levels * self.num_chunks(n))


# ---------------------------------------------------------------- positions (Elias-Fano)
def low_bits(width: int, kept: int) -> int:
    """Elias-Fano's low bits per position: ``floor(log2(width / kept))`` (0 when over half the chunk is kept)."""
    return (width // kept).bit_length() - 1


def upper_bits(width: int, kept: int) -> int:
    """Bits of a chunk's upper bitmap: one set bit per kept element, one clear bit per bucket boundary."""
    return kept + ((width - 1) >> low_bits(width, kept)) + 1


def positions_nbytes(rows: int, width: int, kept: int) -> int:
    low = low_bits(width, kept)
    return (bitpack.packed_nbytes(rows * kept, low) if low else 0) + \
        bitpack.packed_nbytes(rows * upper_bits(width, kept), 1)


@functools.lru_cache(maxsize=64)
def median_ranks(k: int, levels: int) -> tuple[list[int], list[int]]:
    """Per magnitude group: the rank of its median element (0 for an empty group); and the empty groups."""
    first = [-(-g * k // levels) for g in range(levels + 1)]
    median = [(first[g] + first[g + 1] - 1) // 2 if first[g + 1] > first[g] else 0 for g in range(levels)]
    return median, [g for g in range(levels) if first[g + 1] == first[g]]


def describe_rows(block: np.ndarray, kept: int, spec: TopkSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions ascending, codes in position order, levels) of every row of ``block`` (R, width) fp32, each
    keeping its ``kept`` largest keys (``_keys``); what ``_describe_kept`` writes, in NumPy."""
    import numpy as np

    rows, width = block.shape
    bits = block.view(np.int32)
    keys = (bits & MAGNITUDE).astype(np.int64) << spec.index_bits
    keys |= (width - 1) - np.arange(width, dtype=np.int64)
    top = np.partition(keys, width - kept, axis=1)[:, width - kept :] if kept < width else keys
    top = np.sort(top, axis=1)[:, ::-1]  # rank order: largest key first
    position = (width - 1) - (top & ((1 << spec.index_bits) - 1))
    magnitude = (top >> spec.index_bits).astype(np.int32)
    negative = np.take_along_axis(bits, position, axis=1) < 0
    rank = np.argsort(position, axis=1)  # positions are unique in a row
    cols = np.take_along_axis(position, rank, axis=1)
    group_code = np.arange(kept, dtype=np.int64) * spec.levels // kept * 2
    median, empty = median_ranks(kept, spec.levels)
    codes = np.take_along_axis(group_code + negative, rank, axis=1)
    levels = np.ascontiguousarray(magnitude[:, median]).view(np.float32)
    if empty:
        levels[:, empty] = 0.0
    levels[magnitude[:, 0] >= NONFINITE_BITS] = np.nan  # the whole chunk decodes to NaN
    return cols, codes, levels
