"""Streamed, range-verifiable objects: ``encode_stream`` + ``read_header``/``read_data``/``tensors_from_data``.

What these prove: a streamed object is an ordinary checksummed safetensors object (the strict reader accepts it),
any byte range of its data can be fetched in one ranged read and is verified chunk by chunk (a flipped bit, a
truncated object or a tampered header is a ``CorruptObjectError`` naming the key), and the tensors a range covers
are viewed in place, so a shard can be accumulated without materialising whole tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diloco.errors import CorruptObjectError, ObjectNotFound
from diloco.store.codec import (
    CHUNK_BYTES,
    HEADER_PROBE_BYTES,
    decode,
    decode_tensors,
    encode_stream,
    read_data,
    read_header,
    tensors_from_data,
)
from diloco.store.objects import ObjectStore

CHUNK = 64  # bytes: many chunks from small tensors


def sample() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(17, 9, generator=gen),
        "half": torch.randn(11, generator=gen).to(torch.bfloat16),  # odd bf16 count: laid out after the fp32s
        "steps": torch.arange(5, dtype=torch.int64),
        "bias": torch.randn(33, generator=gen),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
    }


def publish(store: ObjectStore, key: str, tensors: dict[str, torch.Tensor], chunk_bytes: int = CHUNK) -> int:
    size, chunks = encode_stream(tensors, {"round": 4, "rank": 1}, chunk_bytes=chunk_bytes)
    assert store.put_stream(key, chunks, size=size) == size
    return size


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(f"file://{tmp_path}/run")


def test_streamed_object_is_a_checksummed_safetensors_object(store: ObjectStore) -> None:
    tensors = sample()
    size = publish(store, "obj", tensors)
    data = store.get("obj")
    assert len(data) == size
    out, meta = decode_tensors(data, expect={"round": 4, "rank": 1})
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)
    assert decode(data)[0].keys() == tensors.keys()
    assert meta["chunk_bytes"] == str(CHUNK)


def test_chunks_are_views_no_larger_than_chunk_bytes() -> None:
    big = torch.arange(1000, dtype=torch.float32)
    size, chunks = encode_stream({"big": big}, chunk_bytes=256)
    pieces = list(chunks)
    assert sum(len(p) for p in pieces) == size
    assert all(len(p) <= 256 for p in pieces[1:])  # the header first, then bounded views
    # The data pieces alias the tensor's memory: no joined copy of the payload was made.
    first = torch.frombuffer(bytearray(pieces[1]), dtype=torch.float32)
    assert torch.equal(first, big[:64])
    with pytest.raises(ValueError, match="chunk_bytes"):
        encode_stream({"big": big}, chunk_bytes=100)


def test_header_lists_tensors_aligned_and_in_order(store: ObjectStore) -> None:
    publish(store, "obj", sample())
    before = store.traffic
    header = read_header(store, "obj")
    assert (store.traffic - before).requests == {"get_range": 1}
    assert header.data_offset % 8 == 0 and header.chunk_bytes == CHUNK
    entries = list(header.tensors.values())
    assert [e.begin for e in entries] == sorted(e.begin for e in entries)
    for e in entries:
        assert e.begin % e.dtype.itemsize == 0  # every tensor starts aligned to its element size
    assert header.tensors["w"].shape == (17, 9) and header.tensors["half"].dtype == torch.bfloat16
    assert header.metadata["rank"] == "1"
    assert len(header.digests) == -(-header.data_size // CHUNK)
    assert header.chunk_aligned(65, 130) == (64, 192)
    assert header.chunk_aligned(0, header.data_size) == (0, header.data_size)
    with pytest.raises(ValueError):
        header.chunk_aligned(0, header.data_size + 1)


def test_every_range_reads_back_verified_and_views_the_right_elements(store: ObjectStore) -> None:
    tensors = sample()
    publish(store, "obj", tensors)
    header = read_header(store, "obj")
    whole = store.get("obj")[header.data_offset:]
    # Reassemble every tensor from four uneven element-aligned ranges, as a shard owner accumulates its part.
    cuts = [0, 8, 200, 680, header.data_size]
    rebuilt = {name: torch.full((e.numel,), -1).to(e.dtype) for name, e in header.tensors.items()}
    for begin, end in zip(cuts[:-1], cuts[1:], strict=True):
        before = store.traffic
        data = read_data(store, "obj", header, begin, end)
        assert (store.traffic - before).requests == {"get_range": 1}  # one ranged read per range
        assert bytes(data) == whole[begin:end]
        for name, (offset, view) in tensors_from_data(header, data, begin, end).items():
            rebuilt[name][offset : offset + view.numel()] = view
    for name, t in tensors.items():
        assert torch.equal(rebuilt[name].view(t.shape), t), name


def test_aligned_range_returns_the_fetched_buffer_without_copy(store: ObjectStore) -> None:
    publish(store, "obj", {"w": torch.arange(256, dtype=torch.float32)})
    header = read_header(store, "obj")
    data = read_data(store, "obj", header, CHUNK, 3 * CHUNK)
    assert isinstance(data, bytearray) and len(data) == 2 * CHUNK
    offset, view = tensors_from_data(header, data, CHUNK, 3 * CHUNK)["w"]
    assert offset == CHUNK // 4 and torch.equal(view, torch.arange(16, 48, dtype=torch.float32))
    view += 0  # a writable buffer: an accumulator may even work in place
    with pytest.raises(ValueError, match="splits an element"):
        tensors_from_data(header, data[2:], CHUNK + 2, 3 * CHUNK)


def corrupt(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_flipped_data_bit_fails_only_the_ranges_that_cover_it(store: ObjectStore, tmp_path: Path) -> None:
    publish(store, "r/obj", {"w": torch.arange(512, dtype=torch.float32)})
    header = read_header(store, "r/obj")
    corrupt(tmp_path / "run" / "r" / "obj", header.data_offset + 300)  # inside chunk 4
    with pytest.raises(CorruptObjectError, match=r"r/obj failed the checksum of data chunk 4"):
        read_data(store, "r/obj", header, 290, 310)
    with pytest.raises(CorruptObjectError, match="r/obj"):
        read_data(store, "r/obj", header, 0, header.data_size)
    assert len(read_data(store, "r/obj", header, 0, 256)) == 256  # the chunks before it are intact
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode_tensors(store.get("r/obj"))  # and the whole-object reader agrees


def test_tampered_header_is_caught(store: ObjectStore, tmp_path: Path) -> None:
    publish(store, "obj", {"w": torch.arange(64, dtype=torch.float32)})
    path = tmp_path / "run" / "obj"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["w"]["dtype"] = "I32"  # same size, other meaning: only the layout digest can tell
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    path.write_bytes(raw[:8] + text + raw[8 + n :])
    with pytest.raises(CorruptObjectError, match=r"obj failed its header checksum"):
        read_header(store, "obj")
    with pytest.raises(CorruptObjectError, match="header checksum"):
        decode_tensors(path.read_bytes(), source="obj")  # the whole-object reader checks the same digests


def test_truncated_object_fails_the_range_that_reaches_its_end(store: ObjectStore, tmp_path: Path) -> None:
    publish(store, "obj", {"w": torch.arange(512, dtype=torch.float32)})
    header = read_header(store, "obj")
    path = tmp_path / "run" / "obj"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CorruptObjectError, match="obj is truncated"):
        read_data(store, "obj", header, 1024, header.data_size)
    with pytest.raises(CorruptObjectError, match="too short"):
        store.put("tiny", b"abc")
        read_header(store, "tiny")


def test_foreign_or_unstreamed_objects_are_rejected(store: ObjectStore) -> None:
    from safetensors.torch import save

    from diloco.store.codec import encode_tensors

    store.put("plain", save({"w": torch.ones(4)}))
    with pytest.raises(CorruptObjectError, match="plain has format None"):
        read_header(store, "plain")
    store.put("whole", encode_tensors({"w": torch.ones(4)}))
    with pytest.raises(CorruptObjectError, match="no chunk digests"):
        read_header(store, "whole")
    with pytest.raises(ObjectNotFound):
        read_header(store, "missing")


def test_a_large_header_costs_a_second_ranged_read(store: ObjectStore) -> None:
    tensors = {"w": torch.zeros(20_000, dtype=torch.float32)}  # 80 kB of data in 8-byte chunks: 10k digests
    size = publish(store, "obj", tensors, chunk_bytes=8)
    before = store.traffic
    header = read_header(store, "obj")
    assert header.data_offset > HEADER_PROBE_BYTES and size == header.data_offset + 80_000
    assert (store.traffic - before).requests == {"get_range": 2}
    assert CHUNK_BYTES % 8 == 0


def test_read_object_reads_a_whole_streamed_object_in_one_verified_get(store: ObjectStore, tmp_path: Path) -> None:
    from diloco.store.codec import read_object

    tensors = sample()
    publish(store, "obj", tensors)
    header = read_header(store, "obj")
    before = store.traffic
    got, data = read_object(store, "obj", data_bytes_hint=header.data_size)
    assert (store.traffic - before).requests == {"get_range": 1}
    assert got == header and len(data) == header.data_size
    for name, (offset, view) in tensors_from_data(got, data, 0, len(data)).items():
        assert offset == 0 and torch.equal(view.view(tensors[name].shape), tensors[name])
    before = store.traffic
    _, small = read_object(store, "obj")  # no hint: the header probe alone holds this small object
    assert bytes(small) == bytes(data) and (store.traffic - before).requests == {"get_range": 1}
    big = {"w": torch.arange(40_000, dtype=torch.float32)}  # 160 kB: past the probe
    publish(store, "big", big, chunk_bytes=CHUNK_BYTES)
    before = store.traffic
    _, rest = read_object(store, "big", data_bytes_hint=1000)  # a short hint: the probe, then the rest
    assert (store.traffic - before).requests == {"get_range": 2}
    assert torch.equal(torch.frombuffer(rest, dtype=torch.float32), big["w"])
    corrupt(tmp_path / "run" / "obj", header.data_offset + header.data_size - 1)
    with pytest.raises(CorruptObjectError, match="obj failed the checksum of data chunk"):
        read_object(store, "obj", data_bytes_hint=header.data_size)


def test_reads_into_one_buffer_give_what_fresh_reads_give(store: ObjectStore, tmp_path: Path) -> None:
    """A round reads its peers into one ``ReadBuffer``: each result is the object's bytes, verified, whatever was
    read into the buffer before; a result read before the buffer had to grow stays intact."""
    from diloco.store.codec import ReadBuffer, read_object

    small, big = {"w": torch.arange(1000, dtype=torch.float32)}, {"w": torch.arange(40_000, dtype=torch.float32)}
    publish(store, "small", small)
    publish(store, "big", big, chunk_bytes=CHUNK_BYTES)
    buffer = ReadBuffer()
    _, first = read_object(store, "small", buffer=buffer)
    before = store.traffic
    _, grown = read_object(store, "big", data_bytes_hint=1000, buffer=buffer)  # the probe, then the rest
    assert (store.traffic - before).requests == {"get_range": 2}
    assert torch.equal(torch.frombuffer(grown, dtype=torch.float32), big["w"])
    assert torch.equal(torch.frombuffer(first, dtype=torch.float32), small["w"])  # its memory was not reused
    _, again = read_object(store, "small", buffer=buffer)  # into the grown buffer
    assert torch.equal(torch.frombuffer(again, dtype=torch.float32), small["w"])
    header = read_header(store, "big")
    window = read_data(store, "big", header, 4000, 8000, buffer=buffer)
    assert torch.equal(torch.frombuffer(window, dtype=torch.float32), big["w"][1000:2000])
    corrupt(tmp_path / "run" / "big", header.data_offset + 5000)
    with pytest.raises(CorruptObjectError, match="big failed the checksum of data chunk 0"):
        read_data(store, "big", header, 4000, 8000, buffer=buffer)


def test_new_objects_carry_a_crc32_per_chunk_and_objects_with_sha256s_still_verify(store: ObjectStore,
                                                                                    tmp_path: Path) -> None:
    """Rounds write a CRC-32 per chunk (``diloco.store.digests`` says why); an object written with a SHA-256 per
    chunk, as every object was before, reads back verified by the same readers, and a flipped bit in it is caught."""
    import hashlib
    import zlib

    tensors = {"w": torch.arange(512, dtype=torch.float32)}
    publish(store, "new", tensors)
    header = read_header(store, "new")
    data = bytes(store.get("new"))[header.data_offset :]
    assert header.checksum == "crc32" and "chunk_sha256" not in header.metadata
    assert header.digests == tuple(f"{zlib.crc32(data[i:i + CHUNK]):08x}" for i in range(0, len(data), CHUNK))

    size, chunks = encode_stream(tensors, {"round": 4}, chunk_bytes=CHUNK, checksum="sha256")
    store.put_stream("old", chunks, size=size)
    header = read_header(store, "old")
    assert header.checksum == "sha256" and "chunk_crc32" not in header.metadata
    assert header.digests == tuple(hashlib.sha256(data[i:i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK))
    assert torch.equal(decode_tensors(store.get("old"))[0]["w"], tensors["w"])
    assert bytes(read_data(store, "old", header, 0, header.data_size)) == data
    corrupt(tmp_path / "run" / "old", header.data_offset + 300)
    with pytest.raises(CorruptObjectError, match=r"old failed the checksum of data chunk 4"):
        read_data(store, "old", header, 290, 310)
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode_tensors(store.get("old"))
    with pytest.raises(ValueError, match="checksum must be one of"):
        encode_stream(tensors, checksum="md5")
