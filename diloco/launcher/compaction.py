"""Compaction: what a finished run's store keeps (one copy of the agreed final weights, the metrics, logs and
the run's records) and the verdict it keeps with them, so later commands need not check the weights again.

``compact_store``: a finished run keeps every rank's final weights, the last round's
contributions and the last committed rounds, several times the model's size. Once every replica has succeeded and
the weight check has found every rank's copy identical, one copy (rank 0's) is all that carries information; the
others and what only a running run reads are deleted, and a small ``final/compacted.json`` records the verdict,
the kept copy's SHA-256 and what the store said of it (its fingerprint), so a later ``collect``, ``watch`` or
``launch`` summary says "identical" without the copies it no longer has, and without reading or decoding the kept
copy while the fingerprint still matches (``compacted_verdict``).

Run at the end of a run by ``Run.collect`` (``diloco.launcher.run``); it reads the store and the weights check only,
never a ``Run``, so the run and housekeeping (which reads runs) both import it without a cycle.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from diloco.errors import CorruptObjectError, DilocoError, ObjectNotFound
from diloco.store.layout import FINAL_KEY

if TYPE_CHECKING:
    from diloco.launcher.weights import WeightsCheck
    from diloco.store.objects import ObjectStore

#: Written by ``compact_store``: the weight check's verdict and the checksum of the one copy kept.
COMPACTED_KEY = "final/compacted.json"
#: The rank whose final weights a compacted store keeps.
KEPT_RANK = 0

_FINAL_RANK_KEY = re.compile(r"final/rank_(\d{4})\.safetensors")


#: What only a run still going reads (compacted away once it finished, see ``compact_store``): the rounds'
#: contributions and manifests, the committed rounds a rejoining replica loads, and the relaunch and rejoin notes its peers
#: wait on.
_RUN_TIME_KEY = re.compile(r"(p\d+/)?round_\d{6}/((rank|shard)_\d{4}|rank_\d{4}/part_\d{4})\.safetensors|round_\d{6}/manifest\.json"
                           r"|committed/round_\d{6}/(state\.safetensors|COMMITTED|parts_\d{4}/part_\d{4}\.safetensors)|(relaunch|rejoin)/rank_\d{4}\.json")


class CompactReport(BaseModel):
    """What ``compact_store`` did to a finished run's store."""

    compacted: bool  # the store holds one copy of the agreed weights (now or from an earlier call)
    detail: str  # one line: why not, or what was kept
    kept_key: str | None = None  # the copy kept
    deleted: list[str] = Field(default_factory=list)  # keys deleted by this call
    bytes_freed: int = 0  # their size


class CompactionMarker(BaseModel):
    """``final/compacted.json``: the verdict the copies gave before they were deleted, and the kept copy's hash."""

    world_size: int
    kept_key: str
    sha256: str  # of the kept object's bytes
    size: int
    tensor_count: int
    value_count: int
    compacted_at: float
    #: What the store said of the kept object when it was hashed (``object_fingerprint``): while it says the same,
    #: the verdict holds without reading the object again (``compacted_verdict``).
    fingerprint: dict[str, str] = Field(default_factory=dict)


def object_sizes(store: ObjectStore) -> dict[str, int]:
    """Every object strictly under the store's root, with its size: one recursive listing of ``<root>/`` (so a
    sibling prefix that merely starts with the same characters is never included), temporaries too."""
    base = store.path("")
    prefix = base.rstrip("/") + "/"
    try:
        found: dict[str, dict[str, Any]] = store.fs.find(base, detail=True)
    except FileNotFoundError:
        return {}
    sizes = {}
    for path, info in found.items():
        if store.protocol == "memory":
            path = "/" + path.lstrip("/")
        if path.startswith(prefix) and info.get("type") != "directory":
            sizes[path[len(prefix):]] = int(info.get("size") or 0)
    return sizes



def remove_empty_directories(root: str) -> None:
    """A local prefix's directories left empty by the deletions, the root included (a directory that still holds
    anything stays)."""
    if not os.path.isdir(root) or os.path.islink(root):
        return
    for directory, _dirs, _files in os.walk(root, topdown=False):
        try:
            os.rmdir(directory)
        except OSError:  # not empty
            pass


# ---------------------------------------------------------------------------------------------- compaction
def compact_store(store: ObjectStore, replicas: int, *, check: WeightsCheck | None = None) -> CompactReport:
    """Keep what a finished run is still read for and delete the rest. Idempotent: a compacted store is
    recognised by ``final/compacted.json``, and compacting it again deletes what is left over (e.g. from an
    older diloco that kept more).

    Kept: ``run.json`` and ``spec.json`` (what the run was: ``rm`` proves ownership with ``run.json``),
    ``metrics/`` and ``progress/`` (``status``, ``plot``, ``watch``, TensorBoard), ``logs/`` (``diloco logs``
    where the replicas ship their output), one copy of the agreed final weights (``collect`` writes the model
    from it) and ``final/compacted.json`` (the verdict, so ``collect``/``watch``/``launch`` need not check again).
    Deleted: the other ranks' copies of the final weights, the rounds' contributions and manifests, the committed
    rounds and the relaunch and rejoin notes: only a run still going reads those (a replica rejoining it, its peers waiting),
    and a run whose every replica succeeded is never rejoined. On ``file://`` the directories left empty go too.

    Call it only once every replica has succeeded. ``check`` is the weight check the caller (``collect``) already
    made; without it the check is made here. Nothing is deleted unless every rank's copy was found bitwise
    identical.
    """
    marker = read_marker(store)
    if marker is None:
        if check is None:
            from diloco.launcher.weights import check_final_weights

            check = check_final_weights(store, replicas)
        if check.identical is not True:
            return CompactReport(compacted=False, detail=f"every replica's final weights kept: {check.detail}")
        marker = write_marker(store, replicas, check)
    sizes = object_sizes(store)
    doomed = [k for k in sorted(sizes) if _RUN_TIME_KEY.fullmatch(k) or _is_extra_final(k, marker.kept_key)]
    for key in doomed:
        store.delete(key)
    if store.protocol == "file":
        remove_empty_directories(store.path(""))  # the run's root holds run.json and the kept copy: it stays
    return CompactReport(compacted=True, kept_key=marker.kept_key, deleted=doomed,
                         bytes_freed=sum(sizes[k] for k in doomed),
                         detail=f"kept one copy of the agreed weights ({store.url(marker.kept_key)})")


def _is_extra_final(key: str, kept_key: str) -> bool:
    return key != kept_key and _FINAL_RANK_KEY.fullmatch(key) is not None


def write_marker(store: ObjectStore, replicas: int, check: WeightsCheck) -> CompactionMarker:
    """Record the verdict and the hash of the copy that will be kept, before anything is deleted: a compaction cut
    short leaves a store that is still checkable."""
    kept_key = FINAL_KEY.format(rank=KEPT_RANK)
    before = object_fingerprint(store, kept_key)
    data = store.get(kept_key)
    after = object_fingerprint(store, kept_key)  # the same on both sides of the read: these bytes are the object's
    marker = CompactionMarker(world_size=replicas, kept_key=kept_key, sha256=hashlib.sha256(data).hexdigest(),
                              size=len(data), tensor_count=check.tensor_count, value_count=check.value_count,
                              compacted_at=time.time(), fingerprint=after if after and after == before else {})
    store.put(COMPACTED_KEY, marker.model_dump_json(indent=2).encode())
    return marker


def read_marker(store: ObjectStore) -> CompactionMarker | None:
    """``final/compacted.json``, or None when the store was never compacted (or the marker is unreadable: then the
    store is treated as not compacted, and the weight check looks at every rank's copy as usual)."""
    try:
        return CompactionMarker.model_validate_json(store.get(COMPACTED_KEY))
    except ObjectNotFound:
        return None
    except ValueError:
        return None


#: The fields of a store's object info that change whenever the object is replaced: S3's ETag and LastModified,
#: a local file's mtime and inode, the size everywhere (``created`` for the in-memory store).
_FINGERPRINT_FIELDS = ("size", "ETag", "LastModified", "VersionId", "mtime", "ino", "created")


def object_fingerprint(store: ObjectStore, key: str) -> dict[str, str] | None:
    """What the store says of ``key`` without reading it (one HEAD on S3, a ``stat`` on ``file://``), as strings;
    None when it cannot say (then a caller reads the object instead of trusting a recorded verdict)."""
    path = store.path(key)
    try:
        store.fs.invalidate_cache(path)
        info = store.fs.info(path)
    except Exception:  # noqa: BLE001 - missing, denied or unreachable: no fingerprint, the caller reads instead
        return None
    found = {name: str(info[name]) for name in _FINGERPRINT_FIELDS if info.get(name) is not None}
    return found if len(found) > 1 else None  # the size alone does not tell a rewrite apart


def compacted_verdict(store: ObjectStore, world_size: int, *, with_tensors: bool = True) -> WeightsCheck | None:
    """The weight check of a compacted store: the verdict recorded before the copies were deleted, provided the
    kept copy is still the one that was checked. None when the store was not compacted (then check every rank's
    copy as usual).

    Without ``with_tensors`` (``watch``, ``launch``'s summary, ``collect`` before it writes) this costs one look at
    the kept object when the store still says of it what it said when it was hashed (``fingerprint``), else one
    read and a SHA-256 of its bytes; never torch. With it, the kept copy is also decoded (torch), checksum verified.
    """
    from diloco.launcher.weights import WeightsCheck

    marker = read_marker(store)
    if marker is None or marker.world_size != world_size:
        return None
    url = store.url(marker.kept_key)
    recorded = WeightsCheck(identical=True, world_size=world_size, tensor_count=marker.tensor_count,
                            value_count=marker.value_count, kept_key=marker.kept_key, kept_sha256=marker.sha256,
                            detail=f"{world_size} replica(s) hold identical final weights ({marker.tensor_count} "
                                   f"tensors, {marker.value_count} values; checked before the store kept one copy)")
    before = object_fingerprint(store, marker.kept_key)
    if not with_tensors and marker.fingerprint and before == marker.fingerprint:
        return recorded
    try:
        data = store.get(marker.kept_key)
    except ObjectNotFound:
        return WeightsCheck(identical=None, world_size=world_size, missing_ranks=[KEPT_RANK],
                            detail=f"the store kept one copy of the final weights, and it is gone ({url} is missing)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != marker.sha256:
        return WeightsCheck(identical=False, world_size=world_size, differing_rank=KEPT_RANK,
                            detail=f"{url} changed after the replicas' copies were checked and compacted "
                                   f"(sha256 {digest[:12]}..., checked {marker.sha256[:12]}...)")
    _refresh_fingerprint(store, marker, before)
    if not with_tensors:
        return recorded
    from diloco.store.codec import decode

    try:
        recorded.tensors, recorded.metadata = decode(data, source=url)
    except CorruptObjectError as exc:
        return WeightsCheck(identical=False, world_size=world_size, differing_rank=KEPT_RANK, detail=str(exc))
    return recorded


def _refresh_fingerprint(store: ObjectStore, marker: CompactionMarker, before: dict[str, str] | None) -> None:
    """The kept copy's bytes were just found to be the checked ones: record what the store says of it now (a
    marker from before fingerprints, or a store copied elsewhere), so the next look needs no read; only when the
    store said the same before the read (``before``), so the fingerprint is that of the bytes hashed. Best effort:
    a store that refuses the write (read-only credentials) only costs the next reader one more read."""
    now = object_fingerprint(store, marker.kept_key)
    if now is None or now != before or now == marker.fingerprint:
        return
    try:
        store.put(COMPACTED_KEY, marker.model_copy(update={"fingerprint": now}).model_dump_json(indent=2).encode())
    except (DilocoError, OSError):
        pass
