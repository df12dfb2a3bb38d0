"""A loopback reverse proxy in front of the Kubernetes API emulator that answers like an API server whose
kubelet proxy cannot reach a pod's node.

Why a proxy: a real client must meet the failure on the wire, through the ``kubernetes`` client's own request
path, with nothing replaced. Everything is forwarded as is (followed log streams chunk by chunk), except the
``pods/<name>/log`` requests of the pods in ``unreachable``: those get what an API server answers when the node's
kubelet does not (a NotReady node, a spot reclaim): HTTP 500 with a ``Status`` whose message is the dial error
to the kubelet's port 10250, and a followed log of such a pod that is open already is cut off mid-stream, as the
TCP connection to a vanished node is.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_LOG_PATH = re.compile(r"^/api/v1/namespaces/[^/]+/pods/([^/]+)/log$")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade"}


class KubeProxy:
    """Forward to ``upstream`` (``http://host:port``); ``unreachable`` holds the pods whose kubelet is lost."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.unreachable: set[str] = set()
        self.refused = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> KubeProxy:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def lost(self, pod: str) -> bool:
        with self._lock:
            if pod in self.unreachable:
                self.refused += 1
                return True
            return False


def _handler(proxy: KubeProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            pass

        def _serve(self) -> None:
            found = _LOG_PATH.match(urlsplit(self.path).path)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if found and proxy.lost(found.group(1)):
                self._lost_kubelet(found.group(1))
                return
            upstream = http.client.HTTPConnection(proxy.host, proxy.port, timeout=300)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP | {"host"}}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            answer = upstream.getresponse()
            self.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in _HOP_BY_HOP | {"date", "server"}:
                    self.send_header(key, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                while True:
                    chunk = answer.read1(65536)
                    if found and found.group(1) in proxy.unreachable:
                        self.close_connection = True  # cut off, with no last chunk
                        return
                    if not chunk:
                        break
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            finally:
                upstream.close()

        def _lost_kubelet(self, pod: str) -> None:
            message = (f'Get "https://10.0.3.17:10250/containerLogs/{pod}/replica?follow=true&timestamps=true": '
                       "dial tcp 10.0.3.17:10250: i/o timeout")
            data = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                               "message": message, "reason": "InternalError", "code": 500}).encode()
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve

    return Handler
