"""``diloco.formats.kernels.content_memo.ContentMemo``, what both sparse kernels keep decoded positions in: found
again by the exact bytes only (a CRC-32 collision, a reused buffer or another tag is a miss), bounded by bytes, by
entries and per entry, and handed out once or kept for reuse as it was built to."""

from __future__ import annotations

import random
import threading
import zlib

import pytest

np = pytest.importorskip("numpy")

from diloco.formats.kernels.content_memo import ContentMemo  # noqa: E402


def stream(seed: int, size: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def crc_collision() -> tuple[np.ndarray, np.ndarray]:
    """Two different 8-byte streams with the same CRC-32 (a birthday search: about 80,000 draws)."""
    rng = random.Random(0)
    seen: dict[int, bytes] = {}
    while True:
        data = rng.randbytes(8)
        crc = zlib.crc32(data)
        other = seen.setdefault(crc, data)
        if other != data:
            return np.frombuffer(other, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8)


def test_a_value_is_found_by_its_bytes_not_by_the_memory_that_held_them() -> None:
    memo: ContentMemo[str] = ContentMemo(max_bytes=1 << 20, take_once=False)
    buffer = stream(1)
    memo.keep("tag", buffer, "first", 10)
    first_bytes = buffer.copy()
    buffer[:] = stream(2)  # a read buffer reused for the next peer
    assert memo.find("tag", buffer) is None
    assert memo.find("tag", first_bytes) == "first"
    assert memo.find("other tag", first_bytes) is None


def test_a_crc_collision_is_a_miss_never_the_other_streams_value() -> None:
    a, b = crc_collision()
    assert zlib.crc32(a) == zlib.crc32(b) and not np.array_equal(a, b)
    memo: ContentMemo[str] = ContentMemo(max_bytes=1 << 20, take_once=False)
    memo.keep("tag", a, "a's", 1)
    assert memo.find("tag", b) is None
    assert memo.find("tag", a) == "a's"


def test_take_once_hands_a_value_out_once_and_keep_for_reuse_does_not() -> None:
    once: ContentMemo[int] = ContentMemo(max_bytes=1 << 20, take_once=True)
    reuse: ContentMemo[int] = ContentMemo(max_bytes=1 << 20, take_once=False)
    for memo in (once, reuse):
        memo.keep("t", stream(3), 7, 100)
    assert once.find("t", stream(3)) == 7 and once.find("t", stream(3)) is None
    assert len(once) == 0 and once.held_bytes == 0
    assert reuse.find("t", stream(3)) == 7 and reuse.find("t", stream(3)) == 7
    assert reuse.held_bytes == 64 + 100


def test_what_is_held_is_bounded_by_bytes_entries_and_per_entry_oldest_used_first_out() -> None:
    by_bytes: ContentMemo[int] = ContentMemo(max_bytes=2 * (64 + 100), take_once=False)
    for seed in (1, 2, 3):
        by_bytes.keep("t", stream(seed), seed, 100)
    assert len(by_bytes) == 2 and by_bytes.find("t", stream(1)) is None

    by_count: ContentMemo[int] = ContentMemo(max_bytes=1 << 20, max_entries=2, take_once=False)
    by_count.keep("t", stream(1), 1, 0)
    by_count.keep("t", stream(2), 2, 0)
    assert by_count.find("t", stream(1)) == 1  # used: now the newest
    by_count.keep("t", stream(3), 3, 0)
    assert by_count.find("t", stream(2)) is None and by_count.find("t", stream(1)) == 1

    per_entry: ContentMemo[int] = ContentMemo(max_bytes=1 << 20, max_entry_bytes=50, take_once=False)
    per_entry.keep("t", stream(1), 1, 51)
    assert len(per_entry) == 0


def test_threads_keeping_and_finding_at_once_only_ever_get_their_own_values() -> None:
    memo: ContentMemo[int] = ContentMemo(max_bytes=40 * (64 + 8), take_once=False)
    wrong: list[tuple[int, int]] = []

    def work(offset: int) -> None:
        for i in range(300):
            seed = offset + i % 50
            memo.keep("t", stream(seed), seed, 8)
            found = memo.find("t", stream(seed))
            if found is not None and found != seed:
                wrong.append((seed, found))

    threads = [threading.Thread(target=work, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [] and len(memo) <= 40 and memo.held_bytes <= 40 * (64 + 8)
