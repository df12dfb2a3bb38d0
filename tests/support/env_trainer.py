"""A trainer that reports what environment its replica got (``--trainer support.env_trainer:report``): the values of
the variables named in ``names`` (comma-separated), written to the run's store as ``env/rank_<r>.json``, so a test
reads what each replica saw on any backend, from the store every backend shares. It trains nothing."""

from __future__ import annotations

import json
import os
from typing import Any

ENV_PREFIX = "env"


def report(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int, names: str = "",
           **_: Any) -> None:
    """Write ``{name: value or None}`` for each of ``names`` to ``env/rank_<rank>.json`` in the store."""
    seen = {name: os.environ.get(name) for name in names.split(",") if name}
    manager.store.put(f"{ENV_PREFIX}/rank_{rank}.json", json.dumps(seen).encode())
