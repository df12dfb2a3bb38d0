"""A replica's own output, kept in the run's store as it is written, so its log outlives the machine it ran on.

Why: on a cluster the only copy of a replica's log is the container log on its node. The kubelet rotates it
(10 MiB by default), deletes it with the pod (a cancel, the Job failing fast, its TTL, an evicted pod), and cannot
serve it at all while the node is NotReady. A replica started with ``DILOCO_LOG_URI`` set therefore tees its own
stdout and stderr, at the file-descriptor level (so every child process, every C extension and the interpreter's
own last words are caught), into timestamped chunks under that URI, and still writes every byte to where it went
before (the container log), unchanged:

    <DILOCO_LOG_URI>/rank_RRRR/<attempt>/chunk_NNNNNN.json   {"lines": [[unix_time, text], ...]}, in order
    <DILOCO_LOG_URI>/rank_RRRR/<attempt>/end.json            {"exit_code": N, "ended_at": T}, last, at exit

``<attempt>`` names this start of the replica: ``DILOCO_LOG_ATTEMPT`` (a pod's own name, from the downward API),
else the start time and process id. A chunk is written every ``flush_every_s`` (2 s) while there are new lines,
and once more at exit; a replica that is SIGKILLed (the OOM killer, a node going away) loses at most its last
interval, and has no ``end.json``. The reader thread that passes the bytes on to the container log dies with the
process too: a SIGKILL can also take the last lines written to the pipe in the milliseconds before it from the
container log. Shipping is best effort: a store that refuses a chunk is retried at the next
interval and never stops or slows the training (lines beyond ``max_buffered`` wait in memory are dropped with a
note in the next chunk).

Replica side only: nothing here imports the launcher or a backend. ``read_attempts`` is the reading half, used by
the launcher's backends.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diloco.envvars import JOB_COMPLETION_INDEX, REPLICA_RANK, rank_offset

if TYPE_CHECKING:
    from diloco.store.objects import ObjectStore

#: Where the replica ships its log (a store URI); unset: no shipping.
LOG_URI_ENV = "DILOCO_LOG_URI"
#: This start's name in the store (a pod's name); unset: the start time and process id.
ATTEMPT_ENV = "DILOCO_LOG_ATTEMPT"
ATTEMPT_PREFIX = "rank_{rank:04d}/"
CHUNK_KEY = "rank_{rank:04d}/{attempt}/chunk_{index:06d}.json"
END_KEY = "rank_{rank:04d}/{attempt}/end.json"
FLUSH_EVERY_S = 2.0
MAX_BUFFERED = 100_000


class LogShipper:
    """Tee file descriptors 1 and 2 into one pipe; a reader thread passes every byte on to the original stdout and
    keeps each line with its time; a flusher thread writes the new lines as the next chunk every interval."""

    def __init__(self, store: ObjectStore, rank: int, attempt: str, *, flush_every_s: float = FLUSH_EVERY_S,
                 max_buffered: int = MAX_BUFFERED) -> None:
        self.store, self.rank, self.attempt = store, rank, attempt
        self.flush_every_s, self.max_buffered = flush_every_s, max_buffered
        self._pending: list[list[float | str]] = []
        self._dropped = 0
        self._chunk = 0
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._saved: dict[int, int] = {}
        self._read_fd = self._write_fd = -1
        self._reader: threading.Thread | None = None
        self._flusher: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> LogShipper:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        self._read_fd, self._write_fd = os.pipe()
        for fd in (1, 2):
            self._saved[fd] = os.dup(fd)
            os.dup2(self._write_fd, fd)
        self._reader = threading.Thread(target=self._read, name="diloco-log-tee", daemon=True)
        self._flusher = threading.Thread(target=self._flush_loop, name="diloco-log-ship", daemon=True)
        self._reader.start()
        self._flusher.start()
        return self

    def close(self, exit_code: int | None) -> None:
        """Put stdout and stderr back, pass on and ship what is left, and record how the replica ended."""
        import sys

        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # the pipe's last writers (besides children that outlive us) are gone now
        os.close(self._write_fd)
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=5)
        self.flush()
        try:
            self.store.put(END_KEY.format(rank=self.rank, attempt=self.attempt), json.dumps(
                {"exit_code": exit_code, "ended_at": time.time()}).encode())
        except Exception:  # noqa: BLE001 - shipping is best effort; the container log still has everything
            pass
        for saved in self._saved.values():
            os.close(saved)

    # ---------------------------------------------------------------- threads
    def _read(self) -> None:
        out = self._saved[1]
        partial = b""
        while True:
            try:
                data = os.read(self._read_fd, 65536)
            except OSError:
                data = b""
            if not data:
                break
            _write_all(out, data)
            now = time.time()
            *lines, partial = (partial + data).split(b"\n")
            if lines:
                self._keep([(now, line) for line in lines])
        if partial:
            self._keep([(time.time(), partial)])
        os.close(self._read_fd)

    def _keep(self, lines: list[tuple[float, bytes]]) -> None:
        with self._lock:
            for ts, line in lines:
                self._pending.append([ts, line.decode(errors="replace")])
            overflow = len(self._pending) - self.max_buffered
            if overflow > 0:
                del self._pending[:overflow]
                self._dropped += overflow

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_every_s):
            self.flush()

    def flush(self) -> None:
        """Write the lines kept since the last chunk as the next chunk (nothing when there are none)."""
        with self._flush_lock:
            with self._lock:
                lines, dropped = list(self._pending), self._dropped
            if not lines and not dropped:
                return
            body: dict[str, object] = {"lines": lines}
            if dropped:
                body["dropped"] = dropped
            try:
                self.store.put(CHUNK_KEY.format(rank=self.rank, attempt=self.attempt, index=self._chunk),
                               json.dumps(body).encode())
            except Exception:  # noqa: BLE001 - retried with the next chunk; training goes on
                return
            self._chunk += 1
            with self._lock:
                del self._pending[:len(lines)]
                self._dropped -= dropped


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError:
            return  # nobody reads the original stdout any more: the store still gets the line
        view = view[written:]


def ship_output(env: Mapping[str, str] | None = None) -> LogShipper | None:
    """Start shipping this process's output when ``DILOCO_LOG_URI`` is set (and take it out of the environment,
    so the local processes a replica starts, whose output already passes through this one's, do not ship it
    again); None otherwise, or when the store cannot even be opened."""
    environ = os.environ if env is None else env
    uri = environ.get(LOG_URI_ENV, "").strip()
    if not uri:
        return None
    os.environ.pop(LOG_URI_ENV, None)
    rank_text = (environ.get(REPLICA_RANK) or environ.get(JOB_COMPLETION_INDEX) or "").strip()
    try:
        rank = int(rank_text) + rank_offset(environ)  # the global rank, as the entrypoint reads it
    except ValueError:
        return None
    attempt = environ.get(ATTEMPT_ENV, "").strip() or f"{time.time_ns()}-{os.getpid()}"
    try:
        from diloco.store.objects import ObjectStore

        store = ObjectStore(uri, retries=2)
    except Exception:  # noqa: BLE001 - no shipping is better than no training
        return None
    shipper = LogShipper(store, rank, attempt)
    shipper._keep([(ts, line.encode()) for ts, line in kept_lines(environ.get(KEPT_LOG_ENV, ""))])
    os.environ.pop(KEPT_LOG_ENV, None)  # a child that ships (none should) would ship them again
    return shipper.start()


#: Where the job's bootstrap (``diloco_bootstrap.py``, which runs before this process) kept its own lines: it
#: cannot ship them (nothing is installed yet), so the replica ships them first, with their own times.
KEPT_LOG_ENV = "DILOCO_BOOTSTRAP_LOG"


def kept_lines(path: str) -> list[tuple[float, str]]:
    """The ``[time, line]`` rows of ``path`` (none when unset or unreadable; a torn last row is skipped)."""
    if not path:
        return []
    rows: list[tuple[float, str]] = []
    try:
        with open(path) as f:
            for raw in f:
                try:
                    ts, line = json.loads(raw)
                    rows.append((float(ts), str(line)))
                except (ValueError, TypeError):
                    continue
    except OSError:
        return []
    return rows


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class ShippedAttempt:
    """One start of a replica as its shipped log tells it: its lines, and how it ended (None: it has not, or
    was killed before it could say)."""

    name: str
    lines: list[tuple[float, str]] = field(default_factory=list)
    dropped: int = 0
    ended: bool = False
    exit_code: int | None = None
    ended_at: float | None = None
    chunks_read: int = 0

    @property
    def started_at(self) -> float:
        return self.lines[0][0] if self.lines else (self.ended_at or 0.0)


def read_attempts(store: ObjectStore, rank: int, *, known: dict[str, ShippedAttempt] | None = None
                  ) -> dict[str, ShippedAttempt]:
    """Every shipped attempt of ``rank``, oldest first, with its lines so far. ``known`` (a previous answer) is
    updated in place: only chunks not read before are fetched."""
    attempts = known if known is not None else {}
    prefix = ATTEMPT_PREFIX.format(rank=rank)
    keys = store.list(prefix)
    by_attempt: dict[str, list[str]] = {}
    for key in keys:
        parts = key[len(prefix):].split("/")
        if len(parts) == 2:
            by_attempt.setdefault(parts[0], []).append(parts[1])
    for name, files in by_attempt.items():
        attempt = attempts.setdefault(name, ShippedAttempt(name))
        chunks = sorted(f for f in files if f.startswith("chunk_") and f.endswith(".json"))
        done = attempt.chunks_read
        for chunk in chunks[done:]:
            try:
                body = json.loads(store.get(f"{prefix}{name}/{chunk}"))
            except Exception:  # noqa: BLE001 - being written, or unreadable: read again next time
                break
            attempt.lines.extend((float(ts), str(text)) for ts, text in body.get("lines") or [])
            attempt.dropped += int(body.get("dropped") or 0)
            done += 1
        attempt.chunks_read = done
        if "end.json" in files and not attempt.ended:
            try:
                end = json.loads(store.get(f"{prefix}{name}/end.json"))
                attempt.ended, attempt.exit_code, attempt.ended_at = True, end.get("exit_code"), end.get("ended_at")
            except Exception:  # noqa: BLE001
                pass
    return dict(sorted(attempts.items(), key=lambda item: item[1].started_at))
