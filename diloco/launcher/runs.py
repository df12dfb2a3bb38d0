"""The local run registry: one JSON record per launch, so later commands need only the run id.

Layout under ``$DILOCO_HOME`` (default ``~/.diloco``)::

    runs/<run_id>.json          the record: backend, handles, resolved config, rendezvous URI, created time
    runs/<run_id>/store/        the default file:// rendezvous of a local run
    runs/<run_id>/logs/rank_<r> a local replica's logs and exit record

``status``, ``logs``, ``collect`` and ``cancel`` take a run id, ``latest`` (the default), or an unambiguous
prefix or part of a run id (e.g. its 8-character suffix, or a few characters of it). An unknown id raises
``RunNotFound`` with a hint to list runs.
"""

from __future__ import annotations

import datetime as _dt
import errno
import os
import secrets
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from diloco.errors import ConfigError, RunNotFound
from diloco.launcher.lifecycle import RunPolicy
from diloco.run_dirs import default_local_rendezvous, diloco_home, runs_dir

RECORD_VERSION = 3  # 2: one run-level backend handle; "replicas" is the count. 3: the typed run policy
LATEST = "latest"

__all__ = ["LATEST", "RunRecord", "RunRegistry", "default_local_rendezvous", "diloco_home", "new_run_id",
           "runs_dir"]


#: The suffix's alphabet: digits and lowercase letters without i, l, o and u (Crockford's base 32), so a suffix
#: read off a terminal is typed back right (no 1/l or 0/o) and never spells a word.
SUFFIX_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
#: Suffix length: 40 random bits. The suffix alone is what users type, so it must be unique across a home's runs,
#: whenever they were created: among 10,000 runs the chance that any two share one is about 1 in 20,000.
SUFFIX_LENGTH = 8


def new_run_id(now: float | None = None) -> str:
    """``diloco-<yyyymmdd-hhmmss>-<8 characters>`` (UTC): sorts by time, and its random suffix is a short handle
    that stays unique across thousands of runs (``SUFFIX_LENGTH``), typed as it reads (``SUFFIX_ALPHABET``).

    Also a valid SageMaker job name prefix and Kubernetes name (lowercase letters, digits, dashes).
    """
    stamp = _dt.datetime.fromtimestamp(now if now is not None else time.time(), tz=_dt.timezone.utc)
    suffix = "".join(secrets.choice(SUFFIX_ALPHABET) for _ in range(SUFFIX_LENGTH))
    return f"diloco-{stamp:%Y%m%d-%H%M%S}-{suffix}"


class RunRecord(BaseModel):
    """Everything needed to manage a run from a later process."""

    version: int = RECORD_VERSION
    run_id: str
    backend: str
    created_at: float
    rendezvous_uri: str
    replicas: int
    config: dict[str, Any]  # the resolved RunConfig, as JSON (its ``backend`` section rebuilds the backend)
    handle: dict[str, Any] | None = None  # the backend's RunHandle as JSON; None until the first replica started
    final_state: str | None = None  # cached once observed terminal, so `diloco runs` needs no polling
    #: The settings the run is judged and relaunched by (``diloco.launcher.lifecycle``), typed; its
    #: ``max_restarts`` is the one ``watch --max-restarts`` changes. Read from the config for an older record.
    policy: RunPolicy
    #: Cached with ``final_state``: the replicas a ``min_replicas`` run finished without (they failed for good).
    left_behind: list[int] = Field(default_factory=list)
    #: Set when the weights check found the replicas' final weights different (its finding): every replica
    #: exited 0, but the run has no one model, so it is ``failed`` and every later command says why.
    weights_disagree: str | None = None

    @property
    def train_mode(self) -> str | None:
        """``train.mode`` as launched (``sync`` or ``async``); None when the record does not say."""
        train = self.config.get("train")
        mode = train.get("mode") if isinstance(train, dict) else None
        return str(mode) if mode is not None else None

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        """A record without a policy (version 2, whose ``max_restarts`` was at the top, ``None`` when older still;
        or one built without it) gets the one its config and ``max_restarts`` say, so every later command judges the
        run as it was launched."""
        if not isinstance(data, dict) or data.get("policy") is not None:
            return data
        data = dict(data)
        config = data.get("config") if isinstance(data.get("config"), dict) else {}
        data["policy"] = RunPolicy.of_config(config, max_restarts=data.pop("max_restarts", None))
        data["version"] = RECORD_VERSION
        return data


def check_home() -> None:
    """``ConfigError`` naming DILOCO_HOME unless runs can be recorded under it, checked without creating anything
    (``--dry-run`` runs it too). A local run's default store is there as well, so a read-only home would otherwise
    be reported as a ``store.rendezvous`` the user never set."""
    from diloco.local_dirs import check_writable_dir

    where = runs_dir()
    try:
        check_writable_dir(str(where), "DILOCO_HOME")
    except ConfigError as exc:
        message = str(exc).replace(f"DILOCO_HOME: cannot create or write {where}", f"DILOCO_HOME: cannot record "
                                                                                  f"runs in {where}")
        raise ConfigError(message, hint="set DILOCO_HOME to a writable directory (default ~/.diloco): runs are "
                                        "recorded there, and a local run's store and logs kept") from None


class RunRegistry:
    """Run records under ``<home>/runs``; writes are atomic so a concurrent reader never sees half a record."""

    def __init__(self, home: Path | str | None = None) -> None:
        self.home = Path(home) if home is not None else diloco_home()
        self.dir = self.home / "runs"
        existing = self.dir
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():  # every command fails here, clearly, not with "no runs recorded"
            what = "is a file, not a directory" if existing in (self.home, self.dir) else "is a file"
            raise ConfigError(f"DILOCO_HOME: cannot record runs in {self.dir}: {existing} {what}",
                              hint="set DILOCO_HOME to a writable directory (default ~/.diloco)")

    def path(self, run_id: str) -> Path:
        return self.dir / f"{run_id}.json"

    def prepare(self) -> None:
        """Create the runs directory; a one-line ``ConfigError`` naming DILOCO_HOME if it is not writable."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.dir, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable")
        except OSError as exc:
            raise ConfigError(f"DILOCO_HOME: cannot record runs in {self.dir}: {exc.strerror or exc}",
                              hint="set DILOCO_HOME to a writable directory") from None

    def save(self, record: RunRecord) -> None:
        from diloco.store.objects import write_file_atomic

        self.prepare()
        write_file_atomic(str(self.path(record.run_id)), record.model_dump_json(indent=2).encode())

    def delete(self, run_id: str) -> None:
        self.path(run_id).unlink(missing_ok=True)

    def load(self, run_id: str) -> RunRecord:
        try:
            text = self.path(run_id).read_text()
        except FileNotFoundError:
            raise self._not_found(run_id) from None
        except OSError as exc:
            raise RunNotFound(f"run record {self.path(run_id)} is unreadable: {exc.strerror or exc}") from None
        try:
            return RunRecord.model_validate_json(text)
        except ValueError as exc:
            if '"version": 1' in text:
                raise RunNotFound(f"run {run_id} was recorded by an older diloco (record version 1)",
                                  hint=f"manage it with that version, or delete {self.path(run_id)}") from None
            raise RunNotFound(f"run record {self.path(run_id)} is unreadable: {exc}",
                              hint="delete it, or list runs with `diloco runs`") from exc

    def ids(self) -> list[str]:
        """Recorded run ids, oldest first (ids embed their creation time)."""
        if not self.dir.is_dir():
            return []
        return sorted(p.stem for p in self.dir.glob("*.json") if not p.name.startswith("."))

    def list(self) -> list[RunRecord]:
        """Every readable record, oldest first by creation time."""
        records = []
        for run_id in self.ids():
            try:
                records.append(self.load(run_id))
            except RunNotFound:
                continue
        return sorted(records, key=lambda r: (r.created_at, r.run_id))

    def resolve(self, ref: str | None = None) -> RunRecord:
        """A run by id, ``latest``/None (the most recently created), or a unique prefix or part of an id."""
        if ref is None or ref == LATEST:
            records = self.list()
            if not records:
                raise RunNotFound(f"no runs recorded in {self.dir}",
                                  hint="start one with `diloco launch`, or set DILOCO_HOME to where your runs are")
            return records[-1]
        if self.path(ref).exists():
            return self.load(ref)
        ref = ref.lower()  # case-insensitive: a suffix copied from a capitalised note still matches
        ids = self.ids()
        # A prefix ("diloco-20240101-1203"), else any unique part, e.g. a few characters of the suffix ("k7q2").
        matches = [i for i in ids if i.lower().startswith(ref)] or [i for i in ids if ref in i.lower()]
        if len(matches) == 1:
            return self.load(matches[0])
        if len(matches) > 1:
            raise RunNotFound(f"run id {ref!r} is ambiguous ({', '.join(matches[:5])})",
                              hint="give more of the id; `diloco runs` lists them")
        raise self._not_found(ref)

    def _not_found(self, run_id: str) -> RunNotFound:
        return RunNotFound(f"no run {run_id!r} in {self.dir}", hint="list runs with `diloco runs`")

