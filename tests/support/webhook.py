"""A webhook receiver on loopback, as a Slack incoming webhook answers: it records each POSTed JSON body and answers
200 ``ok`` (or ``status`` when told to fail)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any


class WebhookReceiver:
    """``with WebhookReceiver() as hook: ... hook.url ... hook.bodies``; ``status`` other than 200 refuses posts."""

    def __init__(self, status: int = 200) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.status = status
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                receiver.paths.append(self.path)
                receiver.bodies.append(body)
                payload = b"ok" if receiver.status == 200 else b"invalid_token"
                self.send_response(receiver.status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T000/B000/secret-token"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.server.shutdown()
        self.server.server_close()

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [b["diloco"] for b in self.bodies if b["diloco"]["event"] == kind]
