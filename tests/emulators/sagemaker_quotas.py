"""A loopback Service Quotas endpoint holding an account's SageMaker quotas, for real boto3 clients.

Why: ``diloco doctor --backend sagemaker`` reads the account's training and warm-pool quotas with
``service-quotas ListServiceQuotas(ServiceCode="sagemaker")``, and moto does not implement that call. This speaks
the service's JSON 1.1 protocol (``X-Amz-Target: ServiceQuotasV20190624.ListServiceQuotas``), pages with
``NextToken``/``MaxResults`` like the service, and is found the standard way, through
``AWS_ENDPOINT_URL_SERVICE_QUOTAS``. With a caller ``policy`` (``aws_iam``) a caller without
``servicequotas:ListServiceQuotas`` gets ``AccessDeniedException``, as the service answers; ``iam_actions`` records
the actions evaluated.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .aws_iam import ACCESS_DENIED, ActionLog, CallerPolicy, authorize

_TARGET = "ServiceQuotasV20190624.ListServiceQuotas"


class QuotasEmulator:
    """``QuotasEmulator({"ml.m5.xlarge for training job usage": 4}).start()``; ``url``; ``stop()``."""

    def __init__(self, quotas: dict[str, float], *, page_size: int = 2, policy: CallerPolicy | None = None) -> None:
        self.quotas = dict(quotas)
        self.policy = policy
        self.iam_actions = ActionLog()
        self.page_size = page_size  # small, so clients must follow NextToken
        self.calls = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> QuotasEmulator:
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="quotas-emulator",
                         daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def page(self, body: dict[str, Any]) -> dict[str, Any]:
        """One page of the SageMaker quotas (any other service has none)."""
        self.calls += 1
        items = sorted(self.quotas.items()) if body.get("ServiceCode") == "sagemaker" else []
        start = int(body.get("NextToken") or 0)
        size = int(body.get("MaxResults") or self.page_size)
        chunk = items[start:start + size]
        out: dict[str, Any] = {"Quotas": [
            {"ServiceCode": "sagemaker", "ServiceName": "Amazon SageMaker", "QuotaName": name,
             "QuotaCode": f"L-{abs(hash(name)) % 10**8:08d}", "Value": float(value), "Unit": "None",
             "Adjustable": True, "GlobalQuota": False} for name, value in chunk]}
        if start + size < len(items):
            out["NextToken"] = str(start + size)
        return out


def _handler(emulator: QuotasEmulator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("X-Amz-Target") != _TARGET:
                self._reply(400, {"__type": "UnknownOperationException", "Message": "not emulated"})
                return
            denied = authorize(emulator.policy, emulator.iam_actions, "servicequotas:ListServiceQuotas")
            if denied is not None:
                self._reply(400, {"__type": ACCESS_DENIED, "Message": denied})
                return
            self._reply(200, emulator.page(json.loads(raw or b"{}")))

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/x-amz-json-1.1")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
