"""Replica log lines as timestamped records, merged across replicas in time order.

Every backend yields ``LogRecord``s (the local supervisor stamps every line as it is written; CloudWatch and the
Kubernetes API stamp them too). ``diloco logs`` prints the merge with a ``[r<rank>]`` prefix on every line.
"""

from __future__ import annotations

import heapq
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple


class LogRecord(NamedTuple):
    ts: float  # unix time the line was written (or first seen)
    rank: int
    stream: str  # "out" | "err"
    text: str  # the line, without its trailing newline ("\r" kept)


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
