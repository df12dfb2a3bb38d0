"""What ``diloco status`` shows of an asynchronous run: the master's published ``global/latest.json``, read with
the record the replicas write it with (``diloco.replica.async_diloco.record``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from diloco.errors import ObjectNotFound
from diloco.replica.async_diloco.record import DEFAULT_PREFIX, LATEST_KEY, GlobalRecord

if TYPE_CHECKING:
    from diloco.store.objects import ObjectStore


def read_async_status(store: ObjectStore, prefix: str = DEFAULT_PREFIX) -> GlobalRecord | None:
    """The published global metadata (version, time, per-node last upload and staleness); ``None`` when the run is
    not asynchronous, has not published yet, or the record cannot be parsed."""
    from pydantic import ValidationError

    try:
        # The key under this store, not a child store: a child builds a client of its own, each poll.
        return GlobalRecord.model_validate_json(store.get(f"{prefix.strip('/')}/{LATEST_KEY}"))
    except (ObjectNotFound, ValidationError):
        return None
