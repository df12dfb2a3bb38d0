"""moto's S3/STS/IAM/Logs/ECR server on a loopback port, in a thread of this process.

moto's dispatcher finds the service of every request anew: it lists moto's package directory (a ``stat`` per
service module) and tries each service's URL patterns against the request's host, about 0.7 ms a request on
this machine, a fifth of what an S3 request costs moto. Which service a host means never changes while the
server runs, so the answer is kept per host. The requests and the answers are moto's own, unchanged.

Nor is a request logged: werkzeug's server logs every request at INFO, and under pytest the record is formatted
and kept by pytest's log capture (with the replicas polling, thousands a test). Errors are still logged.
"""

from __future__ import annotations

import functools
from typing import Any


def start_moto_server(ip_address: str = "127.0.0.1") -> Any:
    """A started ``moto.server.ThreadedMotoServer`` on a free port of ``ip_address`` (``get_host_and_port()``
    says which; ``stop()`` ends it)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address=ip_address, port=0, verbose=False)
    server.start()  # returns once the server is bound, so its WSGI application exists
    wsgi_server = getattr(server, "_server", None)
    handler = getattr(wsgi_server, "RequestHandlerClass", None)
    if handler is not None:  # read for each connection it accepts
        wsgi_server.RequestHandlerClass = type("UnloggedRequestHandler", (handler,), {  # type: ignore[union-attr]
            "log_request": lambda self, code="-", size="-": None})
    app = getattr(wsgi_server, "app", None)
    lookup = getattr(app, "get_backend_for_host", None)
    if lookup is not None:  # moto calls it under its dispatcher's lock, so the cache needs no lock of its own
        app.get_backend_for_host = functools.lru_cache(maxsize=256)(lookup)  # type: ignore[union-attr]
    return server
