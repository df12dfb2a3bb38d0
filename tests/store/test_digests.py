"""SHA-256 of many chunks at once (``diloco.store.digests``): the digests hashlib gives, in order, on the shared
pool of hashing threads, also in a process forked after the pool started."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os

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


@pytest.mark.parametrize("sizes", [[4 << 20] * 6 + [123], [1000, 2000], [digests.MIN_PARALLEL_BYTES] * 3, []])
def test_every_chunk_gets_hashlibs_digest_in_order(sizes: list[int]) -> None:
    chunks = chunks_of(sizes, pieces=3)
    assert digests.sha256_all(chunks) == [hashlib.sha256(b"".join(c)).hexdigest() for c in chunks]


def hash_in_child(queue: mp.Queue) -> None:  # type: ignore[type-arg]
    chunks = chunks_of([1 << 20] * 4, pieces=1)
    queue.put(digests.sha256_all(chunks) == [hashlib.sha256(c[0]).hexdigest() for c in chunks])


@pytest.mark.skipif(not hasattr(os, "fork") or digests.workers() < 2, reason="needs fork and two CPUs")
def test_a_process_forked_after_the_pool_started_hashes_on_threads_of_its_own() -> None:
    digests.sha256_all(chunks_of([1 << 20] * 4, pieces=1))  # the parent's pool exists now
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
