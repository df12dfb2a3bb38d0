"""A loopback reverse proxy that injects faults between a real client (boto3/s3fs) and a real server (moto).

Why a proxy and not a patched client: the code under test must meet faults exactly as it would in production,
through botocore's retry handlers, s3fs's error translation and our own retry loop, with nothing replaced.

Rules are evaluated per request, in the order they were added; the first matching rule that fires decides the
request's fate. A rule matches on method and a regular expression over the request path (``/bucket/key?query``),
fires for the next ``times`` matching requests (``None`` = forever) and, when ``probability < 1``, only for that
share of them, drawn from a seeded RNG so a failing test can be replayed.

Actions:

* ``drop``: read the request, then close the connection without answering (a reset / dropped connection).
* ``drop_response``: forward the request (the server acts on it), then close without answering: the client
  cannot know whether its write happened and retries it.
* ``delay``: wait ``delay_s`` then forward normally (a slow network or a slow server).
* ``status``: answer ``status`` with an S3-style XML error body ``code`` (``503 SlowDown``, ``403 AccessDenied``).
* ``truncate``: forward, then return only the first half of the body with an honest ``Content-Length`` and the
  S3 checksum headers removed, so the client cannot tell; only an end-to-end checksum can catch it.
* ``strip_header``: forward without the request header ``header`` (e.g. ``If-None-Match``): the server never sees
  it, as an S3-compatible store that ignores that header behaves (the client's signature is not checked by moto).

A stopped proxy forwards nothing more: a request still waiting out a ``delay`` is hung up on instead, and
``stop()`` waits for the forwards already under way, so no request of one test reaches the server during the next
(the server is shared by the tests of a worker, and reset between them).
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import urlsplit

Action = Literal["drop", "drop_response", "delay", "status", "truncate", "strip_header"]

_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "expect", "content-length",
}


@dataclass
class Rule:
    """One fault: which requests it applies to, what it does, and how often."""

    action: Action
    method: str | None = None  # e.g. "GET", "PUT", "HEAD"; None = any
    path: str | None = None  # regex searched in "/bucket/key?query"; None = any
    times: int | None = None  # fire for the next N matching requests; None = forever
    probability: float = 1.0  # fire for this share of the matching requests (seeded RNG)
    status: int = 503
    code: str = "SlowDown"
    delay_s: float = 0.0
    header: str = ""  # strip_header: the request header the server must not see
    fired: int = 0
    _pattern: re.Pattern[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._pattern = re.compile(self.path) if self.path else None

    def matches(self, method: str, path: str) -> bool:
        if self.method is not None and self.method.upper() != method.upper():
            return False
        return self._pattern is None or self._pattern.search(path) is not None

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.fired >= self.times


@dataclass(frozen=True)
class Seen:
    """One request the proxy handled, and what it did with it (``forward`` or the rule's action)."""

    method: str
    path: str
    outcome: str
    headers: dict[str, str] = field(default_factory=dict)  # request headers, lower-cased names


class FaultProxy:
    """A threaded HTTP reverse proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``)."""

    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.seen: list[Seen] = []
        self._stopped = threading.Event()
        self._forwarding = 0  # requests being forwarded upstream now, under _lock
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)

    # ---------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        deadline = time.monotonic() + 60.0  # one upstream request's own timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._forwarding == 0:
                    break
            time.sleep(0.01)
        self._server.shutdown()
        self._server.server_close()

    def _begin_forward(self) -> bool:
        """Count a forward in, unless the proxy is stopping (then the request must not reach the server)."""
        with self._lock:
            if self._stopped.is_set():
                return False
            self._forwarding += 1
            return True

    def _end_forward(self) -> None:
        with self._lock:
            self._forwarding -= 1

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- rules
    def add(self, action: Action, **kw: object) -> Rule:
        """Add a rule (see ``Rule``) and return it, so a test can read ``rule.fired`` afterwards."""
        rule = Rule(action=action, **kw)  # type: ignore[arg-type]
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule and forget the request log; the proxy forwards everything again."""
        with self._lock:
            self._rules.clear()
            self.seen.clear()

    def reseed(self, seed: int) -> None:
        with self._lock:
            self._rng = random.Random(seed)

    def _decide(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.exhausted or not rule.matches(method, path):
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                rule.fired += 1
                return rule
            return None

    def _record(self, method: str, path: str, outcome: str, headers: dict[str, str]) -> None:
        with self._lock:
            self.seen.append(Seen(method, path, outcome, headers))

    def requests(self, method: str | None = None, path: str | None = None) -> list[Seen]:
        """The requests seen so far, optionally only ``method`` ones whose path matches the regex ``path``."""
        pattern = re.compile(path) if path else None
        with self._lock:
            return [s for s in self.seen
                    if (method is None or s.method == method) and (pattern is None or pattern.search(s.path))]

    def count(self, outcome: str | None = None, method: str | None = None) -> int:
        """How many requests had ``outcome`` (and ``method``); both optional."""
        with self._lock:
            return sum(
                1 for s in self.seen
                if (outcome is None or s.outcome == outcome) and (method is None or s.method == method)
            )


def _s3_error(status: int, code: str, path: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected by FaultProxy</Message>"
        f"<Resource>{path}</Resource><RequestId>faultproxy</RequestId></Error>"
    ).encode()


def _make_handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue handled by the base class

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet test output
            pass

        def _read_body(self) -> bytes:
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        break
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                return b"".join(chunks)
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _hang_up(self) -> None:
            """Close the client's connection without a response (what a dropped connection looks like)."""
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def _handle(self) -> None:
            body = self._read_body()
            method, path = self.command, self.path
            seen_headers = {k.lower(): v for k, v in self.headers.items()}
            rule = proxy._decide(method, path)
            if rule is not None and rule.action == "drop":
                proxy._record(method, path, "drop", seen_headers)
                self._hang_up()
                return
            if rule is not None and rule.action == "status":
                proxy._record(method, path, f"status:{rule.status}", seen_headers)
                payload = b"" if method == "HEAD" else _s3_error(rule.status, rule.code, path)
                self.send_response(rule.status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                if rule.status == 503:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(payload)
                return
            if rule is not None and rule.action == "delay":
                proxy._stopped.wait(rule.delay_s)
            strip = rule.header.lower() if rule is not None and rule.action == "strip_header" else None
            if not proxy._begin_forward():
                self._hang_up()
                return
            try:
                status, reason, headers, data = self._forward(method, path, body, strip)
            finally:
                proxy._end_forward()
            if rule is not None and rule.action == "drop_response":
                proxy._record(method, path, "drop_response", seen_headers)
                self._hang_up()
                return
            if rule is not None and rule.action == "truncate" and method != "HEAD" and len(data) > 1:
                proxy._record(method, path, "truncate", seen_headers)
                data = data[: len(data) // 2]
                headers = [(k, v) for k, v in headers if not k.lower().startswith("x-amz-checksum")]
            else:
                proxy._record(method, path, rule.action if rule is not None else "forward", seen_headers)
            self.send_response(status, reason)
            for k, v in headers:
                if k.lower() not in _HOP_BY_HOP and k.lower() not in ("date", "server"):
                    self.send_header(k, v)
            length = int(dict((k.lower(), v) for k, v in headers).get("content-length", len(data))) \
                if method == "HEAD" else len(data)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(data)

        def _forward(self, method: str, path: str, body: bytes,
                     strip: str | None = None) -> tuple[int, str, list[tuple[str, str]], bytes]:
            conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP
                           and k.lower() != strip}
                if body or method in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(method, path, body=body if body else None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.reason, resp.getheaders(), data
            finally:
                conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler
