"""Replica log lines as timestamped records, merged across replicas in time order.

Backends that know when each line was written (the local supervisor stamps every line; CloudWatch stamps
events) expose ``log_records(handle, follow)``; for any other backend the lines of ``stream_logs`` are stamped
on arrival. ``diloco logs`` prints the merge with a ``[r<rank>]`` prefix on every line.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from diloco.executors.base import ReplicaHandle, ServerlessExecutor


class LogRecord(NamedTuple):
    ts: float  # unix time the line was written (or first seen)
    rank: int
    stream: str  # "out" | "err"
    text: str  # the line, without its trailing newline ("\r" kept)


def records_for(executor: ServerlessExecutor, handle: ReplicaHandle, follow: bool) -> Iterator[LogRecord]:
    """``executor.log_records`` when the backend has it, else ``stream_logs`` stamped on arrival."""
    native = getattr(executor, "log_records", None)
    if native is not None:
        yield from native(handle, follow=follow)
        return
    for line in executor.stream_logs(handle, follow=follow):
        yield LogRecord(time.time(), handle.rank, "out", line.rstrip("\n"))


def tail(records: Iterable[LogRecord], n: int | None) -> list[LogRecord]:
    """The last ``n`` records (all of them when ``n`` is None)."""
    return list(records) if n is None else list(deque(records, maxlen=max(0, n)))


def merged(streams: Sequence[Iterable[LogRecord]]) -> Iterator[LogRecord]:
    """Finite, individually time-ordered streams merged into one time-ordered stream (stable by rank)."""
    return heapq.merge(*streams, key=lambda r: (r.ts, r.rank))


def follow_merged(streams: Sequence[Iterable[LogRecord]]) -> Iterator[LogRecord]:
    """Follow several (possibly endless) streams at once, one thread each, yielding records as they arrive.

    Ends when every stream has ended. The first exception raised by a stream is re-raised here. Threads are
    daemons, so an interrupted caller (Ctrl-C) never waits for them.
    """
    q: queue.Queue[tuple[str, object]] = queue.Queue()
    stop = threading.Event()  # set on the first error: the other pumps stop at their next record

    def pump(stream: Iterable[LogRecord]) -> None:
        try:
            for record in stream:
                if stop.is_set():
                    break
                q.put(("record", record))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer thread
            q.put(("error", exc))
        finally:
            q.put(("done", None))

    threads = [threading.Thread(target=pump, args=(s,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    remaining = len(threads)
    while remaining:
        kind, item = q.get()
        if kind == "record":
            yield item  # type: ignore[misc]
        elif kind == "error":
            stop.set()
            raise item  # type: ignore[misc]
        else:
            remaining -= 1


def format_record(record: LogRecord, prefix: Callable[[int], str] | None = None) -> str:
    """``[r0] text``: every line carries its replica, whatever the output is piped into."""
    tag = prefix(record.rank) if prefix else f"[r{record.rank}]"
    return f"{tag} {record.text}"
