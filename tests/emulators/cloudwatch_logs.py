"""Write a process's output to CloudWatch Logs the way SageMaker's log agent does, through real boto3 ``logs``.

Why batched on a thread: the service takes at most 10,000 events or 1,048,576 bytes (message bytes + 26 per event)
per ``PutLogEvents`` and rejects empty messages, and a job may print faster than one call per line allows. Lines
are time-stamped when they are read (as the agent does), kept in order, and flushed every ``flush_interval_s``
and on ``close()``. The group and the stream are created on the first line only: before a job prints anything,
neither may exist, which is exactly what a log reader must tolerate against the real service.
"""

from __future__ import annotations

import threading
import time
from typing import Any

MAX_BATCH_EVENTS = 10_000
MAX_BATCH_BYTES = 1_048_576
EVENT_OVERHEAD_BYTES = 26
MAX_EVENT_BYTES = 256 * 1024 - EVENT_OVERHEAD_BYTES


class LogStreamWriter:
    """Buffers lines for one log stream and ships them with ``PutLogEvents`` from a background thread."""

    def __init__(self, logs_client: Any, group: str, stream: str, *, flush_interval_s: float = 0.2) -> None:
        self._logs = logs_client
        self.group = group
        self.stream = stream
        self._flush_interval_s = flush_interval_s
        self._pending: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._created = False
        self._last_ms = 0
        self.sent = 0
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name=f"cwlogs-{stream}", daemon=True)
        self._thread.start()

    def write(self, line: str) -> None:
        """Queue one line (without its newline); empty lines are dropped (the service refuses empty events)."""
        if not line:
            return
        data = line.encode("utf-8", "replace")
        if len(data) > MAX_EVENT_BYTES:
            line = data[:MAX_EVENT_BYTES].decode("utf-8", "ignore")
        with self._cond:
            now_ms = max(int(time.time() * 1000), self._last_ms)  # never backwards within a stream
            self._last_ms = now_ms
            self._pending.append({"timestamp": now_ms, "message": line})
            if len(self._pending) >= MAX_BATCH_EVENTS:
                self._cond.notify()

    def close(self) -> None:
        """Flush everything written so far and stop the thread (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._closed and len(self._pending) < MAX_BATCH_EVENTS:
                    self._cond.wait(self._flush_interval_s)
                batch, self._pending = self._pending, []
                closing = self._closed
            while batch:
                batch = self._send_some(batch)
            if closing:
                with self._cond:
                    if not self._pending:
                        return

    def _send_some(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Send the largest prefix of ``events`` one call allows; return the rest."""
        size, count = 0, 0
        for event in events[:MAX_BATCH_EVENTS]:
            cost = len(event["message"].encode("utf-8")) + EVENT_OVERHEAD_BYTES
            if size + cost > MAX_BATCH_BYTES:
                break
            size, count = size + cost, count + 1
        try:
            self._ensure_stream()
            self._logs.put_log_events(logGroupName=self.group, logStreamName=self.stream, logEvents=events[:count])
            self.sent += count
        except Exception as exc:  # noqa: BLE001 - a lost batch must not kill the job; the error is kept
            self.errors.append(f"{type(exc).__name__}: {exc}")
        return events[count:]

    def _ensure_stream(self) -> None:
        if self._created:
            return
        for create, kwargs in ((self._logs.create_log_group, {"logGroupName": self.group}),
                               (self._logs.create_log_stream, {"logGroupName": self.group,
                                                               "logStreamName": self.stream})):
            try:
                create(**kwargs)
            except self._logs.exceptions.ResourceAlreadyExistsException:
                pass
        self._created = True
