"""Checksums of many chunks at once (``diloco.store.digests``): the CRC-32s zlib gives and the SHA-256s hashlib
gives, in order, on the shared pool of threads, also in a process forked after the pool started."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import zlib

import pytest

from diloco.store import digests


def chunks_of(sizes: list[int], pieces: int) -> list[list[bytes]]:
    """Chunks of the given sizes, each cut into ``pieces`` parts (as a chunk spanning several tensors is)."""
    out = []
    for i, size in enumerate(sizes):
        data = os.urandom(size)
        step = -(-size // pieces)
        out.append([data[j:j + step] for j in range(0, size, step)] or [b""])
        assert sum(map(len, out[-1])) == size, i
    return out


#: What each checksum must equal for a chunk's bytes, computed whole by the standard library.
WHOLE = {
    digests.CRC32: lambda data: f"{zlib.crc32(data):08x}",
    digests.SHA256: lambda data: hashlib.sha256(data).hexdigest(),
}


@pytest.mark.parametrize("algorithm", sorted(WHOLE))
@pytest.mark.parametrize("sizes", [[4 << 20] * 6 + [123], [1000, 2000], [digests.MIN_PARALLEL_BYTES] * 3, []])
def test_every_chunk_gets_the_checksum_of_its_joined_pieces_in_order(sizes: list[int], algorithm: str) -> None:
    chunks = chunks_of(sizes, pieces=3)
    assert digests.checksum_all(chunks, algorithm) == [WHOLE[algorithm](b"".join(c)) for c in chunks]


def test_crc32_is_the_default_and_eight_hex_digits() -> None:
    chunks = chunks_of([1 << 20, 5], pieces=2)
    got = digests.checksum_all(chunks)
    assert got == [WHOLE[digests.CRC32](b"".join(c)) for c in chunks]
    assert all(len(g) == 8 and int(g, 16) >= 0 for g in got)


def hash_in_child(queue: mp.Queue) -> None:  # type: ignore[type-arg]
    chunks = chunks_of([1 << 20] * 4, pieces=1)
    queue.put(digests.checksum_all(chunks) == [WHOLE[digests.CRC32](c[0]) for c in chunks])


@pytest.mark.skipif(not hasattr(os, "fork") or digests.workers() < 2, reason="needs fork and two CPUs")
def test_a_process_forked_after_the_pool_started_checksums_on_threads_of_its_own() -> None:
    digests.checksum_all(chunks_of([1 << 20] * 4, pieces=1))  # the parent's pool exists now
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=hash_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=120) is True  # an inherited pool without its threads would never answer
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
