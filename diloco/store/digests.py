"""SHA-256 of many chunks at once, on several cores.

Why: every byte a round writes or reads is hashed (``diloco.store.codec``'s chunk digests), and SHA-256 runs at
about 1.5 GiB/s on one core even with the CPU's SHA extensions: as fast as the 10 Gbit/s link of an instance, so a
round that hashed on one core would spend as long hashing as sending. The chunks of an object are independent
(one digest per ``codec.CHUNK_BYTES``) and ``hashlib`` releases the GIL while it hashes a buffer, so they are
hashed on a small pool of threads shared by the whole process (every rank of a process that runs several, as the
tests and benchmarks do, shares it: the cores are not oversubscribed).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

#: At most this many chunks are hashed at once (more rarely pays: memory bandwidth is shared).
MAX_WORKERS = 8
#: A chunk smaller than this is hashed on the calling thread (handing it to a thread costs more than it saves).
MIN_PARALLEL_BYTES = 256 * 2**10

#: A chunk given as the pieces it is made of (views of several tensors, never joined).
Pieces = Sequence["memoryview | bytes | bytearray"]

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def workers() -> int:
    """Threads hashing at once: the CPUs this process may run on, at most ``MAX_WORKERS``."""
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


def sha256_all(chunks: Sequence[Pieces]) -> list[str]:
    """``sha256_hex`` of every chunk, in order; on the shared pool when there are several large ones."""
    if len(chunks) < 2 or workers() < 2 or sum(len(memoryview(p)) for p in chunks[0]) < MIN_PARALLEL_BYTES:
        return [sha256_hex(chunk) for chunk in chunks]
    return list(_shared_pool().map(sha256_hex, chunks))


def _shared_pool() -> ThreadPoolExecutor:
    """The process's hashing threads, created on first use (again in a forked child: threads do not survive a
    fork, and a pool inherited without them would never run a task)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(workers(), thread_name_prefix="diloco-sha256")
            _pool_pid = os.getpid()
        return _pool
