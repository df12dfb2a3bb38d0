"""Housekeeping: remove finished runs (``diloco rm``, ``diloco prune``).

A run leaves three things behind, and removing it removes all three, in this order, so that an interrupted removal
can simply be repeated (the record, which is what finds the rest, goes last):

1. its objects in the rendezvous store (``file://`` or ``s3://``, through ``ObjectStore``), and only those under its
   own prefix: a listing is of ``<prefix>/`` and never of a sibling such as ``<prefix>-2/``. Everything under the
   prefix is removed only when the store's ``run.json`` names this run (``launch`` refuses a prefix that is not
   empty, so then every object there arrived with or after this run); without that proof only the keys of the
   store layout (``diloco.store.layout``) are removed, and a prefix whose ``run.json`` names another run is left alone;
2. what its backend keeps of its own (the local backend: the run directory with logs and exit records), by asking
   the backend (``Backend.remove``): nothing here knows a backend's files;
3. its record in the run registry.

A run that is still going is never removed: every replica its backend reports on must have ended, and a replica
the backend can no longer tell about (its files deleted, a Job removed by a TTL) counts as ended only when the
record cached a terminal state (``final_state``) before.

A prefix can also be removed by its URI (``diloco rm --prefix``): what a launch wrote but could not take back
(its store went away while it rolled back), or a run recorded on another machine. A prefix whose ``run.json`` names
a run recorded here is removed through that record (as ``rm RUN``); otherwise the run's backend, rebuilt from the
config in ``run.json``, is asked whether it still sees the run going (``Backend.list_runs``), and a prefix whose
run is going, or whose backend cannot be asked, is kept.

Shrinking a finished run's store is ``diloco.launcher.compaction`` (``Run.collect`` runs it at a run's end).

Nothing here prints: every function returns a pydantic report that the CLI renders. torch is imported only by
the weight check, inside the functions that need it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from diloco.errors import ConfigError, DilocoError, ObjectNotFound
from diloco.executors.base import ReplicaState, RunState
from diloco.launcher.compaction import object_sizes, remove_empty_directories
from diloco.launcher.runs import RunRecord, RunRegistry
from diloco.store.layout import RUN_INFO_KEY

if TYPE_CHECKING:
    from diloco.executors.base import RunHandle, ServerlessExecutor
    from diloco.store.objects import ObjectStore

#: Keys the replicas and the launcher write (``diloco.store.layout``, ``diloco.collectives.allreduce``): the only ones removed from
#: a prefix whose ``run.json`` does not prove it belongs to the run.
_LAYOUT_KEY = re.compile(r"((p\d+/)?round_\d{6}/((rank|shard)_\d{4}|rank_\d{4}/part_\d{4})\.safetensors|round_\d{6}/manifest\.json|metrics/rank_\d{4}\.jsonl|progress/rank_\d{4}\.json"
                         r"|final/rank_\d{4}\.safetensors|final/compacted\.json|spec\.json"
                         r"|committed/round_\d{6}/(state\.safetensors|COMMITTED|parts_\d{4}/part_\d{4}\.safetensors)|(relaunch|rejoin)/rank_\d{4}\.json)")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# ---------------------------------------------------------------------------------------------- reports
class RunRemoval(BaseModel):
    """One run that ``rm``/``prune`` removed (or, with ``dry_run``, would remove), or kept and why.

    The run's own fields use the words of ``diloco runs`` and ``diloco status`` (``replicas`` is a count)."""

    run_id: str
    backend: str
    state: RunState
    replicas: int
    created_at: float
    ended_at: float | None = None  # when its last replica ended, when the backend still knows
    rendezvous_uri: str
    removed: bool  # True: gone (dry run: would be); False: kept, see ``reason``
    reason: str | None = None  # why it was kept
    going: list[int] = Field(default_factory=list)  # replicas its backend sees not ended yet (stop: diloco cancel)
    record_path: str  # its registry record
    files: list[str] = Field(default_factory=list)  # what its backend removed of its own (local: the run directory)
    store_objects: int = 0  # objects removed from its rendezvous prefix
    store_bytes: int = 0  # their size
    store_kept: list[str] = Field(default_factory=list)  # objects left under the prefix (not provably the run's)
    warnings: list[str] = Field(default_factory=list)  # e.g. a backend that could not be asked to remove its files


class RemovalReport(BaseModel):
    """What ``diloco rm`` / ``diloco prune`` did; ``-o json`` prints exactly this (plus ``schema_version``)."""

    dry_run: bool
    older_than_s: float | None = None  # prune only: the age limit in seconds
    runs: list[RunRemoval]  # every run considered, in the order given (rm) or oldest first (prune)
    removed: int  # how many runs were (dry run: would be) removed
    kept: int  # how many were not (still running, or an error)
    store_bytes: int  # bytes of store objects removed (dry run: that would be)

    @classmethod
    def of(cls, runs: list[RunRemoval], *, dry_run: bool, older_than_s: float | None = None) -> RemovalReport:
        removed = [r for r in runs if r.removed]
        return cls(dry_run=dry_run, older_than_s=older_than_s, runs=runs, removed=len(removed),
                   kept=len(runs) - len(removed), store_bytes=sum(r.store_bytes for r in removed))


# ---------------------------------------------------------------------------------------------- durations
def parse_duration(text: str, *, field: str = "duration") -> float:
    """``30m``, ``12h``, ``7d``, ``2w`` (also ``90s``, ``1.5h``) in seconds; ``ConfigError`` naming ``field``.

    A unit is required: a bare ``7`` could mean days or seconds, and guessing wrong deletes the wrong runs."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise ConfigError(f"{field}: expected a duration such as 30m, 12h, 7d or 2w (got {text!r})",
                          hint="units: s, m, h, d, w")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


# ---------------------------------------------------------------------------------------------- run state
@dataclass
class RunCondition:
    """Whether a recorded run has ended, as its backend says (or, where it cannot tell, as its record remembers)."""

    state: RunState
    going: list[int] = field(default_factory=list)  # replicas the backend reports as not ended yet
    unknown: list[int] = field(default_factory=list)  # replicas whose state the backend cannot tell
    ended_at: float | None = None
    backend: ServerlessExecutor[Any, Any] | None = None
    handle: RunHandle | None = None
    problem: str | None = None  # why the backend could not be asked

    @property
    def removable(self) -> bool:
        return self.state.is_terminal and not self.going


def run_condition(record: RunRecord) -> RunCondition:
    """Whether ``record``'s run has ended: every replica the backend reports on has ended, and one it cannot tell
    about (its files deleted, a Job removed by a TTL, another host) is covered by the terminal state the record
    cached once every replica had ended (a run that ended cannot resume). A replica still going always keeps the
    run, whatever the cache says (a run is "failed" as soon as one replica fails, while the others may still run).
    The backend is asked in any case: it knows when the run ended, and it removes its own files."""
    from diloco.launcher.run import Run

    cached = RunState(record.final_state) if record.final_state else None
    final = cached if cached is not None and cached.is_terminal else None
    try:
        run = Run(record)
        handle = run.handle
    except (DilocoError, ImportError, ValueError) as exc:  # no such backend here, or a handle it cannot read
        return RunCondition(state=final or RunState.UNKNOWN, problem=_problem(exc))
    try:
        status = run.replica_status()
    except (DilocoError, ImportError, OSError) as exc:  # the backend cannot be reached now
        return RunCondition(state=final or RunState.UNKNOWN, backend=run.executor, handle=handle,
                            problem=_problem(exc))
    going = [r.rank for r in status.replicas if not r.state.is_terminal and r.state != ReplicaState.UNKNOWN]
    unknown = [r.rank for r in status.replicas if r.state == ReplicaState.UNKNOWN]
    if going:
        state = status.state
    elif unknown and final is None:
        state = RunState.UNKNOWN
    else:
        state = final or status.state
    ended = [r.ended_at for r in status.replicas if r.ended_at is not None]
    reasons = {r.reason for r in status.replicas if r.state == ReplicaState.UNKNOWN and r.reason}
    return RunCondition(state=state, going=going, unknown=unknown, backend=run.executor, handle=handle,
                        ended_at=max(ended) if not going and not unknown and ended else None,
                        problem="; ".join(sorted(reasons)) or None)


def _problem(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def kept_reason(condition: RunCondition) -> str:
    """Why a run that has not (provably) ended is kept: one short phrase for a table cell."""
    if condition.going:
        return f"replica(s) {', '.join(map(str, condition.going))} have not ended"
    if condition.state == RunState.UNKNOWN or condition.unknown:
        return "not known to have ended" + (f" ({condition.problem})" if condition.problem else "")
    return f"it is {condition.state.value}"


# ---------------------------------------------------------------------------------------------- rm / prune
def remove_runs(refs: Sequence[str], *, registry: RunRegistry | None = None, dry_run: bool = False,
                prefixes: Sequence[str] = ()) -> RemovalReport:
    """``diloco rm``: every ref is resolved first (an unknown or ambiguous one raises ``RunNotFound`` and nothing is
    removed), then each run that has ended is removed; one still going is kept with the reason. ``prefixes``: store
    URIs to remove as ``remove_prefix`` does, after the runs."""
    from diloco.store.objects import split_uri

    registry = registry or RunRegistry()
    records: dict[str, RunRecord] = {}
    for ref in refs:
        record = registry.resolve(ref)
        records.setdefault(record.run_id, record)
    for uri in prefixes:
        protocol, path = split_uri(uri)
        if protocol not in ("file", "s3", "memory") or not path.strip("/"):
            raise ConfigError(f"--prefix: {uri!r} is not a run's store prefix",
                              hint="give the run's rendezvous URI, e.g. s3://bucket/diloco/<run_id>")
    runs = [remove_run(record, run_condition(record), registry=registry, dry_run=dry_run)
            for record in records.values()]
    runs += [remove_prefix(uri, registry=registry, dry_run=dry_run) for uri in prefixes]
    return RemovalReport.of(runs, dry_run=dry_run)


def remove_prefix(uri: str, *, registry: RunRegistry, dry_run: bool = False) -> RunRemoval:
    """Remove the objects under one store prefix that has no run record here (see the module docstring)."""
    from diloco.store.objects import ObjectStore

    uri = uri.rstrip("/")
    store = ObjectStore(uri)
    info = _run_info(store)
    run_id = info.get("run_id") if isinstance(info.get("run_id"), str) else None
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    if run_id is not None and registry.path(run_id).exists():
        record = registry.load(run_id)
        if record.rendezvous_uri.rstrip("/") == uri:
            return remove_run(record, run_condition(record), registry=registry, dry_run=dry_run)
    out = RunRemoval(run_id=run_id or "", backend=str((config.get("backend") or {}).get("kind") or "unknown"),
                     state=RunState.UNKNOWN, replicas=int(config.get("replicas") or 0), created_at=0.0,
                     rendezvous_uri=uri, removed=False, record_path="")
    if run_id is not None:
        listing, problem = _backend_listing(run_id, config)
        if problem is not None:
            out.reason = f"cannot tell whether run {run_id} has ended: {problem}"
            return out
        if listing is not None:
            out.state, out.created_at = listing.state, listing.created_at or 0.0
            if not listing.state.is_terminal:
                out.reason = f"its backend ({out.backend}) sees run {run_id} {listing.state.value}"
                return out
    out.removed = _remove_store_into(out, uri, run_id or "", dry_run=dry_run, where="")
    return out


def _run_info(store: ObjectStore) -> dict[str, Any]:
    """The prefix's ``run.json`` as a dict (``{}`` when missing or unreadable: ``remove_store_objects`` then
    removes only the layout's keys and says why)."""
    try:
        info = json.loads(store.get(RUN_INFO_KEY))
    except ObjectNotFound:
        return {}
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _backend_listing(run_id: str, config: dict[str, Any]) -> tuple[Any, str | None]:
    """What the run's backend (rebuilt from its recorded config) sees of it: ``(listing or None, problem)``."""
    from diloco.executors import create_backend
    from diloco.launcher.config import backend_config

    try:
        backend = create_backend(backend_config(config.get("backend") or {}))
        listings = backend.list_runs()
    except (DilocoError, ImportError, OSError, ValueError) as exc:
        return None, _problem(exc)
    return next((r for r in listings if r.run_id == run_id), None), None


def prune_runs(older_than_s: float, *, registry: RunRegistry | None = None, dry_run: bool = False,
               now: float | None = None) -> RemovalReport:
    """``diloco prune``: remove every run that ended more than ``older_than_s`` seconds ago (by its last replica's
    end when the backend knows it, else by its creation time). Runs still going are listed as kept, never removed;
    runs created within the limit are not even asked about."""
    if older_than_s < 0:
        raise ConfigError(f"--older-than: must not be negative (got {older_than_s:g}s)")
    registry = registry or RunRegistry()
    cutoff = (time.time() if now is None else now) - older_than_s
    runs = []
    for record in registry.list():
        if record.created_at > cutoff:
            continue
        condition = run_condition(record)
        if condition.removable and (condition.ended_at or record.created_at) > cutoff:
            continue
        runs.append(remove_run(record, condition, registry=registry, dry_run=dry_run))
    return RemovalReport.of(runs, dry_run=dry_run, older_than_s=older_than_s)


def remove_run(record: RunRecord, condition: RunCondition, *, registry: RunRegistry,
               dry_run: bool = False) -> RunRemoval:
    """Remove one run that has ended: store objects, then the backend's files, then the record (see the module
    docstring for why in this order). A store error keeps the record, so ``rm`` can be run again."""
    out = RunRemoval(run_id=record.run_id, backend=record.backend, state=condition.state, replicas=record.replicas,
                     created_at=record.created_at, ended_at=condition.ended_at,
                     rendezvous_uri=record.rendezvous_uri, removed=False, record_path=str(registry.path(record.run_id)))
    if not condition.removable:
        out.reason, out.going = kept_reason(condition), list(condition.going)
        return out
    if not _remove_store_into(out, record.rendezvous_uri, record.run_id, dry_run=dry_run,
                              where=f" at {record.rendezvous_uri}"):
        return out
    out.files, problem = remove_backend_files(record, condition, dry_run=dry_run)
    if problem:
        out.warnings.append(problem)
    if not dry_run:
        registry.delete(record.run_id)
    out.removed = True
    return out


def _remove_store_into(out: RunRemoval, uri: str, run_id: str, *, dry_run: bool, where: str) -> bool:
    """Remove a run's store objects and record what went into ``out``; False (with ``out.reason``) when the store
    could not be cleared, so the caller keeps the run."""
    try:
        removal = remove_store_objects(uri, run_id, dry_run=dry_run)
    except (DilocoError, OSError) as exc:
        out.reason = f"its store objects{where} could not be removed: {exc}"
        return False
    out.store_objects, out.store_bytes, out.store_kept = len(removal.removed), removal.bytes, removal.kept
    if removal.note:
        out.warnings.append(removal.note)
    return True


def remove_backend_files(record: RunRecord, condition: RunCondition, *,
                         dry_run: bool) -> tuple[list[str], str | None]:
    """Ask the run's backend to remove what it keeps of its own; ``(removed, problem)``."""
    if record.handle is None:
        return [], None  # never submitted: the backend has nothing of it
    if condition.backend is None or condition.handle is None:
        return [], f"its backend could not be asked to remove its own files: {condition.problem}"
    try:
        return list(condition.backend.remove(condition.handle, dry_run=dry_run)), None
    except (DilocoError, OSError) as exc:
        return [], f"its backend could not remove its own files: {_problem(exc)}"


# ---------------------------------------------------------------------------------------------- the store
@dataclass
class StoreRemoval:
    """What ``remove_store_objects`` removed (or would) and left."""

    removed: list[str]
    bytes: int
    kept: list[str]
    note: str | None = None


def remove_store_objects(uri: str, run_id: str, *, dry_run: bool = False) -> StoreRemoval:
    """Delete run ``run_id``'s objects under ``uri`` (only there: see the module docstring for which)."""
    from diloco.store.objects import ObjectStore

    store = ObjectStore(uri)
    owner, note = store_owner(store)  # first: a denied or missing bucket fails here, explained and retried
    sizes = object_sizes(store)
    if owner is not None and owner != run_id:
        return StoreRemoval(removed=[], bytes=0, kept=sorted(sizes),
                            note=f"{uri} now belongs to run {owner} (its run.json says so): left alone")
    if owner == run_id:
        doomed = sorted(sizes, key=lambda k: (k == RUN_INFO_KEY, k))  # run.json last: the proof of ownership
    else:
        doomed = [k for k in sorted(sizes) if _LAYOUT_KEY.fullmatch(k)]
    kept = sorted(set(sizes) - set(doomed))
    if not dry_run:
        for key in doomed:
            store.delete(key)
        if store.protocol == "file":
            remove_empty_directories(store.path(""))
    return StoreRemoval(removed=doomed, bytes=sum(sizes[k] for k in doomed), kept=kept, note=note)


def store_owner(store: ObjectStore) -> tuple[str | None, str | None]:
    """The run id in the prefix's ``run.json`` (written by ``launch`` before any replica starts); ``(None, note)``
    when it is missing or unreadable."""
    try:
        info = json.loads(store.get(RUN_INFO_KEY))
    except ObjectNotFound:
        return None, None
    except ValueError:
        return None, f"{store.url(RUN_INFO_KEY)} is unreadable: only the store layout's keys were removed"
    run_id = info.get("run_id") if isinstance(info, dict) else None
    if not isinstance(run_id, str):
        return None, f"{store.url(RUN_INFO_KEY)} names no run: only the store layout's keys were removed"
    return run_id, None


