"""Checksums of many chunks at once, on several cores: CRC-32 for what a round writes now, SHA-256 for objects
written before (still read and verified).

Why CRC-32: every byte a round writes or reads is checksummed (``diloco.store.codec``'s chunk checksums), which
at real payload sizes is a pass over gigabytes per round on the replica's own cores. SHA-256 runs at about
1.6 GiB/s on one core even with the CPU's SHA extensions; ``zlib.crc32`` at about 4 GiB/s (2.6x: on the 2-core
machine of ``bench/round_phases.py`` a 1 GiB fp32 gather round at N=4 spent 40% of its time in SHA-256). What
the checksum has to catch is the same either way: a truncated, torn or corrupted range of a 4 MiB chunk (a
random corruption slips past a 32-bit CRC with probability 2^-32 per chunk; S3 itself checks transfers with
CRC32). It is no defence against a forger, and SHA-256 was none either: whoever can write an object to the
store can write its checksums too.

The chunks of an object are independent (one checksum per ``codec.CHUNK_BYTES``), and both ``zlib.crc32`` and
``hashlib`` release the GIL on a large buffer, so they are checksummed on a small pool of threads shared by the
whole process (every rank of a process that runs several, as the tests and benchmarks do, shares it: the cores
are not oversubscribed).
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

#: At most this many chunks are checksummed at once (more rarely pays: memory bandwidth is shared).
MAX_WORKERS = 8
#: A chunk smaller than this is checksummed on the calling thread (handing it to a thread costs more than it saves).
MIN_PARALLEL_BYTES = 256 * 2**10

#: A chunk given as the pieces it is made of (views of several tensors, never joined).
Pieces = Sequence["memoryview | bytes | bytearray"]

#: The checksum new objects carry.
CRC32 = "crc32"
#: The checksum objects written before carry (verified on read, never written).
SHA256 = "sha256"

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def workers() -> int:
    """Threads checksumming at once: the CPUs this process may run on, at most ``MAX_WORKERS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus))


def sha256_hex(pieces: Pieces) -> str:
    """The hex SHA-256 of the concatenation of ``pieces``."""
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.hexdigest()


def crc32_hex(pieces: Pieces) -> str:
    """The CRC-32 (zlib's, as S3's CRC32 checksum) of the concatenation of ``pieces``, as 8 hex digits."""
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return f"{crc:08x}"


#: Each checksum by name: what an object's metadata says its chunk checksums are.
CHECKSUMS: dict[str, Callable[[Pieces], str]] = {CRC32: crc32_hex, SHA256: sha256_hex}


def checksum_all(chunks: Sequence[Pieces], algorithm: str = CRC32) -> list[str]:
    """The ``algorithm`` checksum (``CHECKSUMS``) of every chunk, in order; on the shared pool when there are
    several large ones."""
    one = CHECKSUMS[algorithm]
    if len(chunks) < 2 or workers() < 2 or sum(len(memoryview(p)) for p in chunks[0]) < MIN_PARALLEL_BYTES:
        return [one(chunk) for chunk in chunks]
    return list(_shared_pool().map(one, chunks))


def _shared_pool() -> ThreadPoolExecutor:
    """The process's checksumming threads, created on first use (again in a forked child: threads do not survive
    a fork, and a pool inherited without them would never run a task)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(workers(), thread_name_prefix="diloco-checksum")
            _pool_pid = os.getpid()
        return _pool
