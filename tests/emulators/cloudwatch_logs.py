"""CloudWatch Logs for the SageMaker emulator: the jobs' writer (``LogStreamWriter``) and the readers' front with
the service's read quotas (``LogsApiFront``).

``LogStreamWriter`` writes a process's output the way SageMaker's log agent does, through real boto3 ``logs``.
Why batched on a thread: the service takes at most 10,000 events or 1,048,576 bytes (message bytes + 26 per event)
per ``PutLogEvents`` and rejects empty messages, and a job may print faster than one call per line allows. Lines
are time-stamped when they are read (as the agent does), kept in order, and flushed every ``flush_interval_s``
and on ``close()``. The group and the stream are created on the first line only: before a job prints anything,
neither may exist, which is exactly what a log reader must tolerate against the real service.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from .aws_iam import ACCESS_DENIED, ActionLog, CallerPolicy, authorize
from .rate_limits import THROTTLING_CODE, THROTTLING_MESSAGE, Call, RateLimits

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


class LogsApiFront:
    """CloudWatch Logs as a client meets it: the account's read quotas in front of moto's Logs API.

    Why: moto answers every Logs call, however many, while the service throttles reading: GetLogEvents at 10
    requests/s per account and region (hard), DescribeLogStreams at 25, FilterLogEvents at 5 (``rate_limits.
    LOGS_QUOTAS``, each cited). A log follower that reads every stream's backlog twice, or polls every stream on
    its own schedule, passes against moto and fails against the service. So clients reach Logs here (the
    emulator exports ``AWS_ENDPOINT_URL_CLOUDWATCH_LOGS`` pointing at this front: botocore names the variable
    after the service id "CloudWatch Logs", upper-cased with spaces as underscores); the jobs' own writes
    (``LogStreamWriter``) go to moto directly, as the agent's writes are not the reader's quota.

    The wire is CloudWatch Logs' JSON 1.1 (``POST /``, ``X-Amz-Target: Logs_20140328.<Operation>``): an admitted
    call is forwarded unchanged (moto does not check signatures) and moto's answer relayed; a refused one gets
    ``{"__type": "ThrottlingException", "message": "Rate exceeded"}`` with HTTP 400, the service's answer.
    ``calls`` records every call with its outcome and parameters, for tests and the bench; ``throttle`` refuses
    the next calls on purpose, as ``SageMakerEmulator.throttle`` does for SageMaker. ``iam``: the caller's policy
    and the log its actions go to (``aws_iam``): a call the policy refuses gets ``AccessDeniedException`` (HTTP
    400) before it reaches moto or the read quota.
    """

    def __init__(self, upstream: str, limits: RateLimits | None, *, host: str = "127.0.0.1", port: int = 0,
                 iam: tuple[CallerPolicy | None, ActionLog] | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.limits = limits
        self.iam: tuple[CallerPolicy | None, ActionLog] = iam or (None, ActionLog())
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._throttle_left = 0
        self._throttle_ops: frozenset[str] | None = None
        self._server = ThreadingHTTPServer((host, port), _front_handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="logs-front", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> LogsApiFront:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def throttle(self, calls: int, operations: list[str] | None = None) -> None:
        """Refuse the next ``calls`` calls (of ``operations`` only, if given) with ThrottlingException."""
        with self._lock:
            self._throttle_left = calls
            self._throttle_ops = frozenset(operations) if operations else None

    def admit(self, operation: str, request: dict[str, Any] | None = None) -> bool:
        """Whether the account's bucket for ``operation`` has a token (and no throttle is pending); the call is
        recorded either way."""
        with self._lock:
            forced = self._throttle_left > 0 and (self._throttle_ops is None or operation in self._throttle_ops)
            if forced:
                self._throttle_left -= 1
        admitted = not forced and (self.limits is None or self.limits.admit(operation))
        with self._lock:
            self.calls.append(Call(operation, None if admitted else THROTTLING_CODE, time.time(), request))
        return admitted

    def forward(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        """Send the call on to moto unchanged; its status, headers and body."""
        target = urlsplit(self.upstream)
        conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port or 80, timeout=60)
        try:
            sent = {k: v for k, v in headers.items() if k.lower() not in ("host", "connection", "content-length")}
            conn.request("POST", path, body=body, headers=sent)
            resp = conn.getresponse()
            data = resp.read()
            kept = [(k, v) for k, v in resp.getheaders()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date")]
            return resp.status, kept, data
        finally:
            conn.close()


def _front_handler(front: LogsApiFront) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            operation = self.headers.get("X-Amz-Target", "").rpartition(".")[2]
            try:
                request = json.loads(body or b"{}")
            except ValueError:
                request = None
            policy, log = front.iam
            group = request.get("logGroupName") if isinstance(request, dict) else None
            denied = authorize(policy, log, f"logs:{operation}",
                               f"arn:aws:logs:*:*:log-group:{group}:*" if group else None)
            if denied is not None:
                payload = json.dumps({"__type": ACCESS_DENIED, "message": denied}).encode()
                self._send(400, [("Content-Type", "application/x-amz-json-1.1"),
                                 ("x-amzn-RequestId", str(uuid.uuid4()))], payload)
                return
            if not front.admit(operation, request if isinstance(request, dict) else None):
                payload = json.dumps({"__type": THROTTLING_CODE, "message": THROTTLING_MESSAGE}).encode()
                self._send(400, [("Content-Type", "application/x-amz-json-1.1"),
                                 ("x-amzn-RequestId", str(uuid.uuid4()))], payload)
                return
            try:
                status, headers, data = front.forward(self.path, dict(self.headers.items()), body)
            except OSError as exc:
                payload = json.dumps({"__type": "ServiceUnavailableException", "message": str(exc)}).encode()
                self._send(503, [("Content-Type", "application/x-amz-json-1.1")], payload)
                return
            self._send(status, headers, data)

        def _send(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
