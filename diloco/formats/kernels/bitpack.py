"""Fixed-width unsigned fields packed into a byte stream, and back: the sparse format's indices and codes.

Layout (little-endian bit order, no padding between fields): field ``i`` of ``bits`` bits occupies stream bits
``[i * bits, (i + 1) * bits)``, its least significant bit first; stream bit ``s`` is bit ``s % 8`` (bit 0 the least
significant) of byte ``s // 8``. The last byte's unused high bits are 0. So ``n`` fields take ``ceil(n * bits / 8)``
bytes: two 12-bit fields in 3 bytes, four 2-bit codes in one.

Why not one field per byte or int16: a 5-bit Elias-Fano low part stored in 8 bits wastes three eighths of it.

How, without a Python loop over fields: ``g`` consecutive fields, where ``g * bits`` is the least common multiple
of ``bits`` and 8, fill exactly ``g * bits / 8`` bytes; they are combined into one int64 per group (shifted and
OR-ed, one whole-tensor operation per field of a group, at most 8) whose first bytes are the group's (read in
place on a little-endian machine, shifted out on a big-endian one), a few whole-tensor operations. Widths whose group exceeds 64 bits (9, 11, 13, 15) go through a
per-bit expansion instead (slower, same layout). Works on any device (plain tensor arithmetic).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

#: Field widths supported (the sparse format's indices need up to 16 bits; its codes 1 to 8).
MAX_BITS = 16
#: Up to this many fields a CPU stream is packed and unpacked in NumPy (``_pack_numpy``): a small tensor's fields
#: cost torch's fixed cost per operation more than their work; above it torch's vectorised path is as fast or faster.
NUMPY_FIELDS = 1 << 14


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that ``count`` fields of ``bits`` bits take."""
    _check_bits(bits)
    return -(-count * bits // 8)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """1-D integer ``values``, each in ``[0, 2**bits)`` (not checked: higher bits are dropped), -> uint8 stream."""
    import sys

    import torch

    _check_bits(bits)
    n = values.numel()
    nbytes = packed_nbytes(n, bits)
    per_group, group_bytes = _group(bits)
    if group_bytes > 8:
        return _pack_by_bits(values, bits, nbytes)
    if values.device.type == "cpu" and n <= NUMPY_FIELDS:
        return torch.from_numpy(_pack_numpy(values.reshape(-1).numpy(), bits, nbytes))
    groups = -(-n // per_group)
    v = values.reshape(-1).to(torch.int64)
    if groups * per_group != n:
        v = torch.cat([v, v.new_zeros(groups * per_group - n)])
    fields = v.view(groups, per_group)
    mask = (1 << bits) - 1
    word = fields[:, 0] & mask  # the fields OR-ed into one int64 per group, one field at a time
    for j in range(1, per_group):
        word |= (fields[:, j] & mask) << (j * bits)
    if sys.byteorder == "little":  # the group's bytes are the word's first bytes in memory
        return word.view(torch.uint8).view(groups, 8)[:, :group_bytes].reshape(-1)[:nbytes].contiguous()
    byte_shifts = torch.arange(group_bytes, device=values.device) * 8
    return ((word[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).view(-1)[:nbytes]


def unpack(stream: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` fields of a uint8 ``stream`` as int64 (inverse of ``pack``). ``ValueError`` when the
    stream is shorter than ``count`` fields need."""
    import torch

    _check_bits(bits)
    nbytes = packed_nbytes(count, bits)
    if stream.numel() < nbytes:
        raise ValueError(f"a stream of {stream.numel()} bytes cannot hold {count} fields of {bits} bits")
    per_group, group_bytes = _group(bits)
    if group_bytes > 8:
        return _unpack_by_bits(stream, bits, count)
    if stream.device.type == "cpu" and count <= NUMPY_FIELDS:
        return torch.from_numpy(_unpack_numpy(stream.numpy(), bits, count))
    groups = -(-count // per_group)
    padded = torch.zeros(groups * group_bytes, dtype=torch.int64, device=stream.device)
    padded[:nbytes] = stream.reshape(-1)[:nbytes]
    byte_shifts = torch.arange(group_bytes, device=stream.device) * 8
    word = (padded.view(groups, group_bytes) << byte_shifts).sum(dim=1, keepdim=True)
    shifts = torch.arange(per_group, device=stream.device) * bits
    return ((word >> shifts) & ((1 << bits) - 1)).view(-1)[:count]


def _pack_numpy(values: np.ndarray, bits: int, nbytes: int) -> np.ndarray:
    """``pack`` on a CPU, in NumPy (``_unpack_numpy`` says why): the same group words, their bytes read in place
    as little-endian."""
    import numpy as np

    per_group, group_bytes = _group(bits)
    n = values.size
    groups = -(-n // per_group)
    fields = np.zeros(groups * per_group, dtype=np.uint64)
    fields[:n] = values
    fields &= np.uint64((1 << bits) - 1)
    fields = fields.reshape(groups, per_group)
    word = fields[:, 0].copy()  # the fields OR-ed into one word per group, one field at a time
    for j in range(1, per_group):
        word |= fields[:, j] << np.uint64(j * bits)
    as_bytes = word.astype("<u8", copy=False).view(np.uint8).reshape(groups, 8)
    return np.ascontiguousarray(as_bytes[:, :group_bytes]).reshape(-1)[:nbytes].copy()


def _unpack_numpy(stream: np.ndarray, bits: int, count: int) -> np.ndarray:
    """``unpack`` on a CPU, in NumPy: the same group words, read in place as little-endian uint64 (a NumPy
    operation costs about a microsecond where a torch one costs several, and a small tensor's unpack is a few
    operations: what a round of many small tensors pays for every peer)."""
    import numpy as np

    per_group, group_bytes = _group(bits)
    groups = -(-count // per_group)
    nbytes = packed_nbytes(count, bits)
    words = np.zeros((groups, 8), dtype=np.uint8)
    if group_bytes == 8 or groups == 0:
        words.reshape(-1)[:nbytes] = stream.reshape(-1)[:nbytes]
    else:
        padded = np.zeros(groups * group_bytes, dtype=np.uint8)
        padded[:nbytes] = stream.reshape(-1)[:nbytes]
        words[:, :group_bytes] = padded.reshape(groups, group_bytes)
    word = words.view("<u8")  # (groups, 1): the group's bytes, least significant first, whatever the machine
    shifts = np.arange(per_group, dtype=np.uint64) * np.uint64(bits)
    fields = (word >> shifts) & np.uint64((1 << bits) - 1)
    return fields.reshape(-1)[:count].astype(np.int64)


def pack_flags(flags: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor of 0s and 1s -> the uint8 stream ``pack(flags, 1)`` gives, without widening every flag to
    int64 first: a bitmap's way (NumPy's ``packbits`` on a CPU, eight shifted adds elsewhere)."""
    import torch

    if flags.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.packbits(flags.numpy(), bitorder="little"))
    return pack_flags_on_device(flags)


def pack_flags_on_device(flags: torch.Tensor) -> torch.Tensor:
    """``pack_flags`` in tensor arithmetic only (what an accelerator runs; any device)."""
    import torch

    n = flags.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=flags.device)
    padded[:n] = flags
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=flags.device)
    return padded.view(-1, 8).mul_(weights).sum(dim=1, dtype=torch.uint8)


def unpack_flags(stream: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` 1-bit fields of ``stream`` as a uint8 tensor of 0s and 1s (``unpack(stream, 1, count)``
    without int64 fields). ``ValueError`` when the stream is shorter than ``count`` bits."""
    import torch

    if stream.numel() < -(-count // 8):
        raise ValueError(f"a stream of {stream.numel()} bytes cannot hold {count} fields of 1 bit")
    if stream.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.unpackbits(stream.numpy(), count=count, bitorder="little"))
    return unpack_flags_on_device(stream, count)


def unpack_flags_on_device(stream: torch.Tensor, count: int) -> torch.Tensor:
    """``unpack_flags`` in tensor arithmetic only (what an accelerator runs; any device)."""
    import torch

    shifts = torch.arange(8, dtype=torch.uint8, device=stream.device)
    return (stream[: -(-count // 8), None] >> shifts).bitwise_and_(1).view(-1)[:count]


def _pack_by_bits(values: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
    import torch

    shifts = torch.arange(bits, dtype=torch.int64, device=values.device)
    stream = ((values.reshape(-1, 1).to(torch.int64) >> shifts) & 1).view(-1)
    padded = torch.zeros(nbytes * 8, dtype=torch.int64, device=values.device)
    padded[: stream.numel()] = stream
    weights = 1 << torch.arange(8, dtype=torch.int64, device=values.device)
    return (padded.view(nbytes, 8) * weights).sum(dim=1).to(torch.uint8)


def _unpack_by_bits(stream: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    import torch

    nbytes = packed_nbytes(count, bits)
    shifts = torch.arange(8, dtype=torch.int64, device=stream.device)
    bitstream = ((stream.reshape(-1)[:nbytes].to(torch.int64).view(-1, 1) >> shifts) & 1).view(-1)
    fields = bitstream[: count * bits].view(count, bits)
    weights = 1 << torch.arange(bits, dtype=torch.int64, device=stream.device)
    return (fields * weights).sum(dim=1)


def _group(bits: int) -> tuple[int, int]:
    """(fields per group, bytes per group): the smallest run of fields that ends on a byte boundary."""
    lcm = bits * 8 // math.gcd(bits, 8)
    return lcm // bits, lcm // 8


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"field width {bits!r} bits: use 1 to {MAX_BITS}")
