"""The replica settings: the whole contract between the launcher and a replica, declared once.

``ReplicaSettings`` is the one model of what every rank of a run trains with. Each field carries, beside its type,
default, rule and description, how it reads on the command line (``replica_flag``): the entrypoint's parser, the
argv a replica started without a settings object gets (``to_argv``), the hints it prints and its ``--help`` are
all generated from the fields, so a new setting is one new field. The store settings
(``diloco.store.settings.StoreSettings``: how a round is exchanged and averaged) are also the run config's
``store:`` section (``diloco.launcher.config`` subclasses them), so a store setting is declared once for the YAML
config, ``diloco launch``'s flags, the generated configuration reference, the published settings object and the
entrypoint alike.

The launcher builds one ``ReplicaSettings`` from the validated run config, publishes it in the run's store as one
JSON object (``SettingsObject``, at ``diloco.store.layout.SETTINGS_KEY``) before any replica starts, and names it
to every replica with one short argument and its SHA-256. The replica reads and validates the same model, so no
backend's argument limit (SageMaker allows 256 characters per argument) bounds the trainer kwargs. What differs
between replicas (the rank) stays in the environment (``diloco.envvars``), with the world size and rendezvous
that every backend also exports.

This module is replica-side: it imports only pydantic and the shared basics, never the launcher or a backend.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from diloco import envvars
from diloco.defaults import DEFAULT_PROGRESS_INTERVAL_S, DEFAULT_TRAINER
from diloco.errors import validation_line
from diloco.flags import REPLICA_FLAG_KEY, replica_flag
from diloco.store.settings import StoreSettings, min_replicas_problem

#: The format tag of the settings object, checked by the replica that reads it.
SETTINGS_FORMAT = "diloco.replica-settings/1"

_TRAINER_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def _check_trainer_ref(value: str) -> str:
    if not _TRAINER_RE.match(value):
        raise ValueError(f"must look like 'package.module:function' (got {value!r})")
    return value


#: A trainer named as ``package.module:function``: the same rule wherever a trainer is named.
TrainerRef = Annotated[str, AfterValidator(_check_trainer_ref)]


class ReplicaSettings(StoreSettings):
    """Every setting a replica needs, identical for every rank of a run. A field this version does not know is
    refused, never silently dropped: a launcher newer than the replica's image fails loudly."""

    rendezvous_uri: str = Field(min_length=1, description="The store URI the replicas meet in.",
                                json_schema_extra=replica_flag("--rendezvous", metavar="URI",
                                                               env=(envvars.RENDEZVOUS_URI,)))
    world_size: int = Field(ge=1, description="Number of replicas in the run.",
                            json_schema_extra=replica_flag(metavar="N", env=(envvars.WORLD_SIZE,)))
    trainer: TrainerRef = Field(DEFAULT_TRAINER, description="The trainer function, module:function.",
                                json_schema_extra=replica_flag(metavar="MODULE:FN"))
    trainer_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the trainer, "
                                           "as one JSON object.",
                                           json_schema_extra=replica_flag("--trainer-kwargs-json", metavar="JSON"))
    progress_interval_s: float = Field(DEFAULT_PROGRESS_INTERVAL_S, gt=0, description="Seconds between progress "
                                       "rows written between outer rounds.",
                                       json_schema_extra=replica_flag("--progress-interval", metavar="S"))
    procs_per_replica: int | None = Field(None, ge=1, description="Local processes in this replica (null: every "
                                          "GPU, 1 without one).", json_schema_extra=replica_flag(metavar="K"))
    tensorboard: str | None = Field(None, description="Also write the metrics as TensorBoard events under this "
                                    "run directory.", json_schema_extra=replica_flag(metavar="DIR"))
    mlflow: str | None = Field(None, description="Also log the metrics to this MLflow tracking server (needs "
                               "mlflow_run_id).", json_schema_extra=replica_flag(metavar="URI"))
    mlflow_run_id: str | None = Field(None, description="The run's MLflow run, created by the launcher: every "
                                      "replica, relaunched ones too, logs into it.",
                                      json_schema_extra=replica_flag(metavar="ID"))
    wandb: str | None = Field(None, description="Also log the metrics to this Weights & Biases project (needs "
                              "wandb_run_id).", json_schema_extra=replica_flag(metavar="PROJECT"))
    wandb_run_id: str | None = Field(None, description="The run's stable W&B run id, chosen by the launcher: "
                                     "every replica, relaunched ones too, resumes it.",
                                     json_schema_extra=replica_flag(metavar="ID"))

    @model_validator(mode="after")
    def _fits_the_world(self) -> ReplicaSettings:
        problem = min_replicas_problem(self.min_replicas, self.world_size)
        if problem:
            raise ValueError(f"min_replicas: {problem}")
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

    def to_argv(self) -> list[str]:
        """The settings that differ from their defaults as the entrypoint's own flags, one token per element
        (as SageMaker's ContainerArguments wants): for a replica started without a settings object."""
        argv: list[str] = []
        for name, value in self.model_dump(exclude_defaults=True).items():
            flag = FLAGS[name]
            if isinstance(value, bool):
                argv.append(flag.name if value else flag.negative)
            else:
                argv += [flag.name, flag.render(value)]
        return argv


# ---------------------------------------------------------------------------------------------- flags
@dataclass(frozen=True)
class ReplicaFlag:
    """How one settings field reads on the entrypoint's command line (from its ``replica_flag`` declaration)."""

    field: str
    name: str  # "--world-size"
    metavar: str | None
    env: tuple[str, ...]  # read, first set wins, when neither the flag nor a settings object gives the value
    help: str
    kind: str  # "bool", "json" (a mapping, given as one JSON object) or "value" (pydantic parses the text)
    required: bool

    @property
    def negative(self) -> str:
        """``--no-error-feedback`` for a boolean ``--error-feedback``."""
        return "--no-" + self.name[2:]

    def render(self, value: Any) -> str:
        if self.kind == "json":
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        return repr(value) if isinstance(value, float) else str(value)

    def parse(self, raw: str) -> Any:
        """The flag's text as the value pydantic validates: a JSON object for a mapping, else the text."""
        if self.kind != "json":
            return raw
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"is a JSON {type(value).__name__}, not an object")
        return value


def _flag_of(name: str, field: FieldInfo) -> ReplicaFlag:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    spec = extra.get(REPLICA_FLAG_KEY) or {}
    annotation = field.annotation
    kind = "bool" if annotation is bool else "json" if getattr(annotation, "__origin__", None) is dict else "value"
    return ReplicaFlag(field=name, name=spec.get("name") or "--" + name.replace("_", "-"),
                       metavar=spec.get("metavar"), env=tuple(spec.get("env") or ()),
                       help=(field.description or "").strip(), kind=kind, required=field.is_required())


def replica_flags() -> Iterator[ReplicaFlag]:
    """Every settings field's entrypoint flag: the replica's own fields (rendezvous, world size, trainer, ...)
    first, then the store settings, each group in field order."""
    fields = ReplicaSettings.model_fields
    own = [name for name in fields if name not in StoreSettings.model_fields]
    for name in [*own, *StoreSettings.model_fields]:
        yield _flag_of(name, fields[name])


#: field name -> its entrypoint flag.
FLAGS: dict[str, ReplicaFlag] = {flag.field: flag for flag in replica_flags()}


# ---------------------------------------------------------------------------------------------- the object
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


def parse_settings_json(text: str) -> ReplicaSettings:
    """``--settings-json``: the settings given inline, validated by the same model as the published object."""
    try:
        return ReplicaSettings.model_validate_json(text)
    except ValidationError as exc:
        raise SettingsRefused(f"--settings-json: {validation_line(exc)}",
                              "pass one JSON object of replica settings, see docs/replica-settings.md") from None


def verify_settings_object(data: bytes, uri: str, *, sha256: str | None, run_id: str | None) -> ReplicaSettings:
    """The settings in the bytes read from ``uri``, refused when they are not the bytes ``sha256`` names, not
    of this format or run, or name another rendezvous than the folder they lie in."""
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256.lower():
        raise SettingsRefused(f"the run's settings at {uri} are not the ones this replica was started with (their "
                              f"SHA-256 is not --spec-sha256 {sha256})",
                              "the object was replaced; launch the run again")
    try:
        obj = SettingsObject.model_validate_json(data)
    except ValidationError as exc:
        raise SettingsRefused(f"the run's settings at {uri} are unreadable: {validation_line(exc)}",
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
