"""The replica settings: the whole contract between the launcher and a replica, declared once.

The launcher builds one ``ReplicaSettings`` from the validated run config, publishes it in the run's store as one
JSON object (``SettingsObject``, at ``diloco.store.layout.SETTINGS_KEY``) before any replica starts, and names it
to every replica with one short argument and its SHA-256. The replica reads and validates the same model, so a
setting exists in one place whatever the backend, and no backend's argument limit (SageMaker allows 256
characters per argument) bounds the trainer kwargs. What differs between replicas (rank, and the world size and
rendezvous each backend also exports) stays in the environment (``diloco.envvars``).

This module is replica-side: it imports only pydantic and the shared basics, never the launcher or a backend.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from diloco.defaults import DEFAULT_TRAINER

#: The format tag of the settings object, checked by the replica that reads it.
SETTINGS_FORMAT = "diloco.replica-settings/1"


class ReplicaSettings(BaseModel):
    """Every setting a replica needs, identical for every rank of a run. A field this version does not know is
    refused, never silently dropped: a launcher newer than the replica's image fails loudly."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rendezvous_uri: str = Field(min_length=1)
    world_size: int = Field(ge=1)
    trainer: str = DEFAULT_TRAINER  # "module:function"
    trainer_kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(None, gt=0)  # all-reduce wait per round (None: the entrypoint's default)
    poll_interval_s: float | None = Field(None, gt=0)  # how often a waiting replica polls the store
    progress_interval_s: float | None = Field(None, gt=0)  # seconds between progress rows between rounds
    allreduce: Literal["gather", "sharded"] = "gather"  # store.allreduce
    compression: Literal["none", "bf16", "int8", "int4"] = "none"  # store.compression
    error_feedback: bool = True  # store.error_feedback
    spread: int = Field(1, ge=1)  # store.spread
    min_replicas: int | None = Field(None, ge=1)  # partial participation (None: every round needs every replica)
    procs_per_replica: int | None = Field(None, ge=1)  # local processes per replica (None: the replica's default)
    tensorboard: str | None = None  # metrics.tensorboard: the run's own event directory

    @model_validator(mode="after")
    def _consistent(self) -> ReplicaSettings:
        if self.trainer.count(":") != 1 or not all(self.trainer.split(":")):
            raise ValueError(f"trainer: {self.trainer!r} is not MODULE:FN (e.g. {DEFAULT_TRAINER})")
        if self.min_replicas is not None and self.min_replicas > self.world_size:
            raise ValueError(f"min_replicas: must be in 1..{self.world_size} (the world size), got "
                             f"{self.min_replicas}")
        return self

    @property
    def trainer_module(self) -> str:
        return self.trainer.split(":", 1)[0]

    @property
    def trainer_fn(self) -> str:
        return self.trainer.split(":", 1)[1]

    def to_json(self) -> str:
        """One compact JSON object of the settings that differ from their defaults: the ``--settings-json``
        token a replica started without a settings object receives."""
        return self.model_dump_json(exclude_defaults=True)


class SettingsObject(BaseModel):
    """The settings as published in the run's store: tagged with their format and the run they belong to, so a
    replica can refuse an object of another version or another run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = SETTINGS_FORMAT
    run_id: str
    settings: ReplicaSettings

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys), so its SHA-256 is a pure function of the settings."""
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True).encode()

    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()


class SettingsRefused(ValueError):
    """Settings a replica must not run with: ``what`` names the field or the object, ``fix`` the cure."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what} ({fix})")
        self.what, self.fix = what, fix


def first_error(exc: ValidationError) -> str:
    """``field: message`` for the first problem pydantic found, the one line a user reads."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "the settings"
    return f"{where}: {first.get('msg')}"


def parse_settings_json(text: str) -> ReplicaSettings:
    """``--settings-json``: the settings given inline, validated by the same model as the published object."""
    try:
        return ReplicaSettings.model_validate_json(text)
    except ValidationError as exc:
        raise SettingsRefused(f"--settings-json: {first_error(exc)}",
                              "pass one JSON object of replica settings, see docs/replica-settings.md") from None


def verify_settings_object(data: bytes, uri: str, *, sha256: str | None, run_id: str | None) -> ReplicaSettings:
    """The settings in the bytes read from ``uri``, refused when they are not the bytes ``sha256`` names, not
    of this format or run, or name another rendezvous than the folder they lie in."""
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256.lower():
        raise SettingsRefused(f"the run's settings at {uri} are not the ones this replica was started with (their "
                              f"SHA-256 is not --settings-sha256 {sha256})",
                              "the object was replaced; launch the run again")
    try:
        obj = SettingsObject.model_validate_json(data)
    except ValidationError as exc:
        raise SettingsRefused(f"the run's settings at {uri} are unreadable: {first_error(exc)}",
                              "launch the run with the same diloco version as the replica's image") from None
    if obj.format != SETTINGS_FORMAT:
        raise SettingsRefused(f"{uri} is a {obj.format!r} object, not {SETTINGS_FORMAT!r}",
                              "launch the run with the same diloco version as the replica's image")
    if run_id is not None and obj.run_id != run_id:
        raise SettingsRefused(f"{uri} holds the settings of run {obj.run_id}, not of this replica's run {run_id}",
                              "give each run its own rendezvous prefix (diloco launch does)")
    folder = uri.rstrip("/").rpartition("/")[0]
    if obj.settings.rendezvous_uri.rstrip("/") != folder:
        raise SettingsRefused(f"{uri} names rendezvous {obj.settings.rendezvous_uri}, not the folder it lies in "
                              f"({folder})", "the object was copied from another run; launch the run again")
    return obj.settings
