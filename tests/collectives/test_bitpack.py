"""Fixed-width fields packed into bytes (diloco.collectives.bitpack): the documented LSB-first layout for every
width from 1 to 16 bits, at counts that do and do not fill the last byte, checked against a plain Python-integer
bit stream (tests/support/codec_reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.codec_reference import pack_bits, unpack_bits

from diloco.collectives import bitpack


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
