"""One boto3 session per process for the emulators' own AWS clients.

Every new boto3 session has its own botocore loader, which reads each service's JSON model again: the S3 and Logs
clients an emulator makes for its jobs cost tens of milliseconds of JSON decoding each, and the tests start an
emulator per test. The clients are made from one shared session instead, with the emulator's credentials, region
and endpoint given to each client (which win over whatever the session would find). boto3 sessions are not
thread-safe, so clients are made under a lock; the clients themselves are.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_LOCK = threading.Lock()


@functools.cache
def _session() -> Any:
    import boto3

    return boto3.session.Session()


def aws_client(service: str, *, endpoint_url: str, region_name: str, credentials: dict[str, str]) -> Any:
    """A boto3 client of ``service`` at ``endpoint_url`` with ``credentials`` (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, optionally ``AWS_SESSION_TOKEN``)."""
    with _LOCK:
        return _session().client(service, endpoint_url=endpoint_url, region_name=region_name,
                                 aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
                                 aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
                                 aws_session_token=credentials.get("AWS_SESSION_TOKEN"))
