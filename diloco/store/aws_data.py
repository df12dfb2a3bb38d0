"""botocore's data files (service models, endpoint rules, partitions, SDK defaults), decoded once per process.

Every botocore session has its own loader, and a loader decodes each JSON file the first time it is asked for it:
the endpoint table alone is over a megabyte. A process makes several sessions: s3fs one per S3 filesystem, boto3
one per ``boto3.Session``, the doctor one per context. Each then decoded the same files again, about 90 ms of CPU per
S3 filesystem before its first request, where a client built on a warm loader costs about 5 ms. A loader only reads
files and keeps what it decoded, so one loader per data path serves every session of the process; credentials,
region, profile and configuration stay each session's own.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_LOCK = threading.Lock()


@functools.cache
def _loader(data_path: str | None) -> Any:
    import botocore.loaders

    return botocore.loaders.create_loader(data_path)


def share_loader(session: Any) -> Any:
    """Give ``session`` (a botocore or aiobotocore session, before it made any client) the process's loader for
    its data path (``AWS_DATA_PATH`` or the profile's ``data_path``); returns the session."""
    with _LOCK:
        loader = _loader(session.get_config_variable("data_path"))
    session.register_component("data_loader", loader)
    return session


def botocore_session() -> Any:
    """A new botocore session on the process's loader (for ``boto3.Session(botocore_session=...)``)."""
    import botocore.session

    return share_loader(botocore.session.get_session())


def aio_session(**kwargs: Any) -> Any:
    """A new aiobotocore session (``kwargs``: what s3fs would pass it, e.g. ``profile``) on the process's loader."""
    from aiobotocore.session import AioSession

    return share_loader(AioSession(**kwargs))


def boto3_session(region_name: str | None = None) -> Any:
    """A new ``boto3.Session`` on the process's loader."""
    import boto3

    return boto3.Session(botocore_session=botocore_session(), region_name=region_name)
