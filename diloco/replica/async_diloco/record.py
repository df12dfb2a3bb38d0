"""Where an asynchronous run keeps its objects, and the records both sides read: defined once, here.

The replicas write these objects (under the coordinator's ``prefix``, default ``async/``, of the run's store) and
the launcher reads ``global/latest.json`` for ``diloco status`` (``diloco.launcher.async_status``)::

    global/v000000000042.safetensors   the global weights of version 42 (written first)
    global/latest.json                 a ``GlobalRecord``: version, key, SHA-256 of the data, per-worker stats
                                       (written last: the publication's commit)
    deltas/<time_ns>-<node>-<seq>.safetensors
                                       one node's delta; metadata names its node, base version and step
    master/committed/round_NNNNNN/{state.safetensors,COMMITTED}
                                       the master's outer state after version NNNNNN (global weights, momentum,
                                       which deltas were applied), committed before that version is published
                                       (``diloco.replica.checkpoint.RoundCheckpoints``, verified on read)
    nodes/<node>.json                  a ``NodePosition``: the last step whose progress the node handed to the
                                       store (a relaunched node resumes there)
    done/<node>                        a worker finished its steps (the master waits for every one)
    final.json                         a ``GlobalRecord`` naming the final version every node exports

Only JSON and key names here: nothing imports torch, so the launcher reads a status without it.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

#: The coordinator's default prefix in the run's store.
DEFAULT_PREFIX = "async"

LATEST_KEY = "global/latest.json"
GLOBAL_KEY = "global/v{version:012d}.safetensors"
GLOBAL_PREFIX = "global/"
GLOBAL_KEY_PATTERN = re.compile(r"^global/v(\d+)\.safetensors$")
DELTA_PREFIX = "deltas/"
#: The master's committed outer state: ``RoundCheckpoints`` rooted here, one committed "round" per version.
MASTER_STATE_PREFIX = "master"
POSITION_KEY = "nodes/{node}.json"
DONE_KEY = "done/{node}"
FINAL_KEY = "final.json"


def node_of_rank(rank: int) -> str:
    """The node id the built-in trainer gives a rank (``diloco status`` finds each rank's stats under it)."""
    return f"replica-{rank}"


class WorkerRecord(BaseModel):
    """What the master knows of one node's deltas (the master's own included)."""

    model_config = ConfigDict(extra="ignore")

    applied: int = 0
    rejected: int = 0
    last_upload_time: float | None = None  # when the master received its latest delta (unix time)
    last_base_version: int | None = None
    last_staleness: int | None = None
    last_weight: float | None = None
    staleness: int | None = None  # the same as last_staleness: the name ``diloco status`` shows


class GlobalRecord(BaseModel):
    """``global/latest.json`` (and ``final.json``): one published global version.

    ``sha256`` is the digest of the version's data object: a reader checks the bytes it downloads or finds in its
    cache against it, so a version is never read from another object than the one published under its number."""

    model_config = ConfigDict(extra="ignore")

    version: int
    key: str
    sha256: str | None = None
    time: float | None = None
    master: str | None = None
    workers: dict[str, WorkerRecord] = {}


class NodePosition(BaseModel):
    """``nodes/<node>.json``: how far one node got, written before each of its deltas is uploaded. A relaunched
    node resumes its inner steps (and data order) after ``step``, on the newest global."""

    model_config = ConfigDict(extra="ignore")

    node_id: str
    run_id: str = ""
    step: int
    seq: int = 0
    base_version: int = 0
    time: float | None = None
