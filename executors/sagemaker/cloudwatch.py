"""Reading a run's CloudWatch Logs within the service's read quotas: one pace for all of a run's streams.

Why: GetLogEvents is limited to 10 requests per second per account and region, and the limit is hard
(awsdocs/amazon-cloudwatch-logs-user-guide cloudwatch_limits_cwl.md); DescribeLogStreams to 25 per second
(botocore's logs model; 5 in older revisions of the same page, so diloco stays under both). ``diloco logs -f``
follows every rank at once, so the reads of all of a run's streams share this process's pacers: the follow slows
down as the run grows instead of being throttled. Each stream is read forward from a token, so its backlog is read
once; the run's streams are found with one (paged) DescribeLogStreams of the run's common name prefix, shared by
every rank and renewed at most once per poll; throttling waits and tries again, and never ends a follow.

The group is ``/aws/sagemaker/TrainingJobs`` and a job's streams are ``<job>/algo-1-<epoch>`` (one more per spot
restart); before a job first prints, neither may exist (``ResourceNotFoundException`` means "nothing yet").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from diloco.executors.sagemaker.aws_errors import aws_error
from diloco.executors.sagemaker.pacing import Pacer, backoff_s, error_code, is_transient, was_retried

#: This process's share of GetLogEvents' account-wide 10 requests/s.
GET_LOG_EVENTS_RATE_PER_S = 4.0
GET_LOG_EVENTS_BURST = 4.0
#: This process's share of DescribeLogStreams' account-wide 25 requests/s (5 in older documentation).
DESCRIBE_LOG_STREAMS_RATE_PER_S = 2.0
DESCRIBE_LOG_STREAMS_BURST = 2.0
#: GetLogEvents returns at most this many events per page (botocore's logs model, ``limit``).
MAX_EVENTS_PER_PAGE = 10_000


@dataclass
class StreamCursor:
    """Where reading one stream goes on from: the last ``nextForwardToken``, else ``start_ms`` (or the head)."""

    name: str
    token: str | None = None
    start_ms: int | None = None


def stream_order(stream: str) -> tuple[int, str]:
    """Streams of one job in start order: by the epoch after ``algo-1-``."""
    tail = stream.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 0, stream)


class RunLogs:
    """One run's CloudWatch streams and reads in this process (shared by every rank's thread)."""

    def __init__(self, logs: Any, group: str, *, get_pacer: Pacer, describe_pacer: Pacer,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self._logs = logs
        self.group = group
        self._get_pacer = get_pacer
        self._describe_pacer = describe_pacer
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._by_job: dict[str, list[str]] = {}
        self._listed_at: float | None = None
        self._prefix: str | None = None

    # ------------------------------------------------------------------ streams
    def streams(self, job: str, prefix: str, *, max_age_s: float, fresh_after: float | None = None) -> list[str]:
        """The job's streams in start order, from a listing of every stream under ``prefix`` (the run's jobs'
        common name prefix) at most ``max_age_s`` old and, with ``fresh_after``, made after that moment."""
        with self._lock:
            if self._prefix is None or not prefix.startswith(self._prefix):
                self._prefix = prefix if self._prefix is None else _common_prefix(self._prefix, prefix)
                self._listed_at = None
            now = self._clock()
            stale = self._listed_at is None or now - self._listed_at > max_age_s or (
                fresh_after is not None and self._listed_at < fresh_after)
            if stale:
                self._listed_at = self._clock()
                self._by_job = self._list(self._prefix)
            return list(self._by_job.get(job, []))

    def _list(self, prefix: str) -> dict[str, list[str]]:
        by_job: dict[str, list[str]] = {}
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"logGroupName": self.group, "logStreamNamePrefix": prefix}
            if token:
                kwargs["nextToken"] = token
            page = self._call(self._describe_pacer, self._logs.describe_log_streams, kwargs)
            if page is None:  # no group yet: no job has printed anything
                return by_job
            for stream in page.get("logStreams", []):
                name = stream["logStreamName"]
                by_job.setdefault(name.split("/", 1)[0], []).append(name)
            token = page.get("nextToken")
            if not token:
                return {job: sorted(names, key=stream_order) for job, names in by_job.items()}

    # ------------------------------------------------------------------ events
    def read(self, cursor: StreamCursor, *, to_the_end: bool = True) -> Iterator[dict[str, Any]]:
        """The stream's events after the cursor, page by page, until ``nextForwardToken`` repeats (the end, for
        now); the cursor moves along, so the next ``read`` goes on from there. Without ``to_the_end`` (a follow
        between two polls) a page that is not full ends the read: the next poll goes on from its token, so a
        stream that is caught up costs one call per poll instead of two."""
        while True:
            kwargs: dict[str, Any] = {"logGroupName": self.group, "logStreamName": cursor.name,
                                      "startFromHead": True}
            if cursor.token:
                kwargs["nextToken"] = cursor.token
            if cursor.start_ms is not None:  # with the token too: a token may count only the events from then on
                kwargs["startTime"] = cursor.start_ms
            page = self._call(self._get_pacer, self._logs.get_log_events, kwargs)
            if page is None:
                return
            events = page.get("events", [])
            yield from events
            token = page.get("nextForwardToken")
            if token is None or token == cursor.token:
                return
            cursor.token = token
            if not to_the_end and len(events) < MAX_EVENTS_PER_PAGE:
                return

    def last_lines(self, streams: list[str], n: int) -> list[str]:
        """The last ``n`` non-empty lines of these streams (in start order): one backward page per stream, from
        the newest, as far back as ``n`` lines need."""
        lines: list[str] = []
        for stream in reversed(streams):
            page = self._call(self._get_pacer, self._logs.get_log_events, {
                "logGroupName": self.group, "logStreamName": stream, "startFromHead": False,
                "limit": min(MAX_EVENTS_PER_PAGE, max(100, 20 * n))})
            texts = [e["message"].rstrip("\n") for e in (page or {}).get("events", [])]
            lines = [t for t in texts if t.strip()] + lines
            if len(lines) >= n:
                break
        return lines[-n:] if n else []

    # ------------------------------------------------------------------ one call, paced
    def _call(self, pacer: Pacer, method: Callable[..., dict[str, Any]],
              kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The call's answer, None when the group or stream does not exist; throttling and other transient
        trouble wait and try again (never an error); anything else is a ``BackendError``."""
        attempt = 0
        while True:
            pacer.acquire()
            try:
                response = method(**kwargs)
            except Exception as exc:
                if error_code(exc) == "ResourceNotFoundException":
                    return None
                if not is_transient(exc):
                    raise aws_error(f"could not read CloudWatch Logs ({self.group})", exc,
                                    hint="your AWS identity needs logs:DescribeLogStreams and logs:GetLogEvents "
                                         "on it") from exc
                pacer.throttled()
                self._sleep(backoff_s(attempt))
                attempt += 1
                continue
            if was_retried(response):
                pacer.throttled()
            else:
                pacer.succeeded()
            return response


def _common_prefix(a: str, b: str) -> str:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return a[:i]
