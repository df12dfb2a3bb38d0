"""Tensor codec: safetensors bytes with metadata and a checksum; every corruption is detected."""

from __future__ import annotations

import json

import pytest
import torch

from diloco.errors import CorruptObjectError
from diloco.store.codec import FORMAT, decode_tensors, encode_tensors

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.uint8,
          torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_is_exact_for_every_dtype(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=gen) * 50
    tensors = {
        "matrix": base.to(dtype),
        "scalar": torch.tensor(3, dtype=dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
        "strided": base.t().to(dtype),  # non-contiguous input
    }
    data = encode_tensors(tensors, {"round": 7, "rank": 2})
    out, meta = decode_tensors(data, expect={"round": 7, "rank": "2"})
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)
    assert meta["round"] == "7" and meta["rank"] == "2" and meta["format"] == FORMAT


def test_bf16_bits_survive() -> None:
    t = torch.tensor([1.0078125, -3.140625, 65280.0, 1e-30], dtype=torch.bfloat16)
    out, _ = decode_tensors(encode_tensors({"t": t}))
    assert torch.equal(out["t"].view(torch.int16), t.view(torch.int16))


def test_is_safetensors_not_pickle() -> None:
    data = encode_tensors({"t": torch.ones(2)}, {"rank": 0})
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    assert header["t"]["dtype"] == "F32" and header["__metadata__"]["rank"] == "0"
    assert b"torch._utils" not in data and not data.startswith(b"\x80")  # no pickle opcode stream


def test_metadata_expect_mismatch_names_the_field() -> None:
    data = encode_tensors({"t": torch.ones(2)}, {"round": 3, "rank": 1})
    with pytest.raises(CorruptObjectError, match=r"round_000003/rank_0001.*round='3', expected '4'"):
        decode_tensors(data, expect={"round": 4}, source="round_000003/rank_0001")
    with pytest.raises(CorruptObjectError, match="world_size=None"):
        decode_tensors(data, expect={"world_size": 2})


@pytest.mark.parametrize("cut", [0, 4, 8, 20, -1, -8])
def test_truncated_bytes_are_detected(cut: int) -> None:
    data = encode_tensors({"t": torch.arange(64, dtype=torch.float32)}, {"rank": 0})
    truncated = data[:cut] if cut >= 0 else data[: len(data) + cut]
    with pytest.raises(CorruptObjectError, match="peer-object"):
        decode_tensors(truncated, source="peer-object")


def test_flipped_byte_in_the_tensor_data_fails_the_checksum() -> None:
    data = bytearray(encode_tensors({"t": torch.arange(64, dtype=torch.float32)}, {"rank": 0}))
    data[-3] ^= 0x01  # a single bit in the last float: still a valid safetensors file
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode_tensors(bytes(data))


def test_flipped_byte_in_the_header_is_detected() -> None:
    data = bytearray(encode_tensors({"t": torch.arange(64, dtype=torch.float32)}, {"rank": 0}))
    data[9] ^= 0xFF  # inside the JSON header
    with pytest.raises(CorruptObjectError):
        decode_tensors(bytes(data))


def test_foreign_safetensors_without_our_format_tag_are_rejected() -> None:
    from safetensors.torch import save

    data = save({"t": torch.ones(2)}, metadata={"rank": "0"})
    with pytest.raises(CorruptObjectError, match="format"):
        decode_tensors(data)


# ---------------------------------------------------------------------------------------------- decode: ours or plain
def test_decode_accepts_plain_safetensors_written_by_a_trainer(tmp_path) -> None:
    """Final weights written with safetensors.torch.save_file (no metadata) or by
    save_pretrained (``format: pt``) are accepted; only ``decode_tensors`` (contributions) insists on ours."""
    from safetensors.torch import save, save_file

    from diloco.store.codec import decode

    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.arange(4.0)}, str(path))
    tensors, meta = decode(path.read_bytes())
    assert torch.equal(tensors["w"], torch.arange(4.0)) and meta == {}
    tensors, meta = decode(save({"w": torch.ones(2)}, metadata={"format": "pt"}))
    assert meta == {"format": "pt"}
    with pytest.raises(CorruptObjectError, match="format"):
        decode_tensors(path.read_bytes())


def test_decode_still_verifies_our_checksum_when_present() -> None:
    from diloco.store.codec import decode

    data = bytearray(encode_tensors({"t": torch.arange(64, dtype=torch.float32)}, {"rank": 0}))
    assert torch.equal(decode(bytes(data), expect={"rank": 0})[0]["t"], torch.arange(64, dtype=torch.float32))
    data[-3] ^= 0x01
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode(bytes(data), source="final/rank_0001.safetensors")
    with pytest.raises(CorruptObjectError, match="not a readable safetensors"):
        decode(bytes(data[:20]))
