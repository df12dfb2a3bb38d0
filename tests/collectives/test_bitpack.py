"""Fixed-width fields packed into bytes (diloco.formats.kernels.bitpack): the documented LSB-first layout for every
width from 1 to 16 bits, at counts that do and do not fill the last byte, checked against a plain Python-integer
bit stream (tests/support/codec_reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.codec_reference import pack_bits, unpack_bits

from diloco.formats.kernels import bitpack


@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 1001])
def test_every_width_packs_as_the_reference_and_back(bits: int, count: int) -> None:
    values = torch.randint(0, 1 << bits, (count,), generator=torch.Generator().manual_seed(bits * 100 + count))
    packed = bitpack.pack(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == bitpack.packed_nbytes(count, bits) == -(-count * bits // 8)
    assert packed.is_contiguous()  # a wire tensor: safetensors stores contiguous tensors only
    assert packed.numpy().tobytes() == pack_bits(values.tolist(), bits).tobytes()
    assert bitpack.unpack(packed, bits, count).tolist() == values.tolist()
    assert unpack_bits(np.asarray(packed.numpy()), bits, count) == values.tolist()


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 1001])
@pytest.mark.parametrize("on_device", [False, True], ids=["cpu-numpy", "tensor-arithmetic"])
def test_flags_pack_as_one_bit_fields_and_back(count: int, on_device: bool) -> None:
    """A bitmap (uint8 0s and 1s) packs to the bytes of 1-bit fields, on the CPU's NumPy path and on the tensor
    arithmetic an accelerator runs, and unpacks to the same flags."""
    flags = (torch.rand(count, generator=torch.Generator().manual_seed(count)) < 0.3).to(torch.uint8)
    pack = bitpack.pack_flags_on_device if on_device else bitpack.pack_flags
    unpack = bitpack.unpack_flags_on_device if on_device else bitpack.unpack_flags
    packed = pack(flags)
    assert packed.dtype == torch.uint8 and packed.tolist() == bitpack.pack(flags, 1).tolist()
    assert unpack(packed, count).tolist() == flags.tolist()
    with pytest.raises(ValueError, match="cannot hold"):
        bitpack.unpack_flags(packed[:-1], count) if count else bitpack.unpack_flags(packed, 1)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_fields_wider_than_their_bits_lose_only_the_high_bits(dtype: torch.dtype) -> None:
    values = torch.tensor([0x7ABC, 0x1123, 5], dtype=dtype)
    assert bitpack.pack(values, 12).tolist() == bitpack.pack(values & 0xFFF, 12).tolist()


def test_two_12_bit_fields_take_three_bytes_low_bits_first() -> None:
    packed = bitpack.pack(torch.tensor([0xABC, 0x123]), 12)
    assert packed.tolist() == [0xBC, 0x3A, 0x12]


def test_a_short_stream_and_a_bad_width_are_refused() -> None:
    with pytest.raises(ValueError, match="a stream of 2 bytes cannot hold 2 fields of 12 bits"):
        bitpack.unpack(torch.zeros(2, dtype=torch.uint8), 12, 2)
    with pytest.raises(ValueError, match="field width 17 bits: use 1 to 16"):
        bitpack.pack(torch.zeros(1, dtype=torch.int64), 17)
