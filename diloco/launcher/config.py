"""Run configuration: pydantic models are the single source of truth for every knob and its default.

Precedence, lowest first: the defaults below < the YAML file (``--config``) < named CLI flags (``--replicas``,
``--steps``, ...) < ``--set dotted.key=value`` (applied in order; values are parsed as YAML, so ``--set
train.trainer_kwargs.lr=0.01`` is a float). Unknown keys are rejected. Every invalid value raises a one-line
``ConfigError`` naming the field, what is allowed and what was given, before anything is launched.

``store.rendezvous`` may contain ``{run_id}``; it is expanded at launch so each run gets a fresh prefix. For the
local backend it defaults to ``file://$DILOCO_HOME/runs/<run_id>/store``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, model_validator

from diloco.config_errors import format_validation_error as _format_validation_error
from diloco.config_errors import placeholder_problem, short
from diloco.defaults import DEFAULT_MAX_RESTARTS, DEFAULT_TRAINER
from diloco.errors import ConfigError
from diloco.executors import DEFAULT_BACKEND
from diloco.executors.base import BackendConfig
from diloco.executors.flags import cli_flag
from diloco.executors.user_env import masked_env, name_problem, value_problem
from diloco.replica.settings import TrainerRef
from diloco.store.settings import StoreSettings, min_replicas_problem
from diloco.trainers.preflight import INJECTED

DEFAULT_TIMEOUT_S = 86400.0
#: Trainer keyword arguments the launcher owns: set by ``train.steps``/``train.sync_every`` or injected.
RESERVED_TRAINER_KWARGS = {"total_steps": "train.steps", "sync_every": "train.sync_every", "mode": "train.mode",
                           "eval_every": "train.eval_every (--eval-every)", **dict.fromkeys(INJECTED)}
_BRACES_RE = re.compile(r"\{[^{}]*\}")
_SCHEMES = ("file", "s3")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StoreConfig(StoreSettings):
    """Where the replicas meet (``rendezvous``), and how they exchange and wait for each other: every other field
    is the replicas' own store settings (``diloco.store.settings.StoreSettings``, declared there once)."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    #: Local default: file://$DILOCO_HOME/runs/<id>/store.
    rendezvous: str | None = Field(None, description="Store URI the replicas meet in; {run_id} expands.",
                                   json_schema_extra=cli_flag("--rendezvous", metavar="URI", note=""))


class TrainConfig(_Strict):
    """What each replica runs: ``trainer`` is called with ``total_steps``, ``sync_every`` and ``trainer_kwargs``."""

    trainer: TrainerRef = Field(DEFAULT_TRAINER, description="Trainer function, module:fn.",
                         json_schema_extra=cli_flag("--trainer", metavar="MODULE:FN"))
    steps: int = Field(200, ge=1, description="Inner steps per replica (the trainer's total_steps).",
                       json_schema_extra=cli_flag("--steps", metavar="N"))
    sync_every: int = Field(50, ge=1, description="Inner steps per outer round (DiLoCo's H).",
                            json_schema_extra=cli_flag("--sync-every", metavar="H"))
    eval_every: int | None = Field(None, ge=1, description="Evaluate the committed global model every K rounds "
                                   "(and after the last) on replica 0 alone, instead of on every replica after "
                                   "every round (the trainer's eval_every).",
                                   json_schema_extra=cli_flag("--eval-every", metavar="K"))
    trainer_kwargs: dict[str, Any] = Field(default_factory=dict)  # model/data knobs of the trainer
    #: "sync": DiLoCo rounds; "async": rank 0 is a master applying each replica's delta as it arrives
    #: (diloco.replica.async_diloco); passed to the trainer as ``mode`` only when "async".
    mode: Literal["sync", "async"] = Field("sync", description="sync (DiLoCo rounds) or async (rank 0 is a "
                                           "master applying deltas as they arrive).",
                                           json_schema_extra=cli_flag("--mode", metavar="MODE"))
    #: Local processes per replica (inner data parallelism over the instance's devices); ``null``: every GPU of
    #: the instance, 1 on a CPU-only machine.
    procs_per_replica: int | None = Field(None, ge=1, description="Local processes per replica, data-parallel "
                                          "over its devices.", json_schema_extra=cli_flag(
                                              "--procs-per-replica", metavar="K",
                                              note="train.procs_per_replica; default: every GPU, 1 on CPU"))


class MetricsConfig(_Strict):
    """Where metrics go besides the store (which always holds them)."""

    tensorboard: str | None = Field(None, description="Also write metrics as TensorBoard events to DIR (a "
                                    "directory or URI).",
                                    json_schema_extra=cli_flag("--tensorboard", metavar="DIR"))
    mlflow: str | None = Field(None, description="Also log metrics, the run's settings and the collected model to "
                               "this MLflow tracking server (one MLflow run per run; credentials from "
                               "MLFLOW_TRACKING_TOKEN in env).", json_schema_extra=cli_flag("--mlflow", metavar="URI"))
    wandb: str | None = Field(None, description="Also log metrics and the run's settings to this Weights & Biases "
                              "project (one W&B run per run; WANDB_API_KEY in env).",
                              json_schema_extra=cli_flag("--wandb", metavar="PROJECT"))
    #: Set by the launcher when it creates the tracker runs (``diloco.launcher.tracking``), kept in the run record
    #: so that relaunched replicas and ``diloco collect`` log into the same runs.
    mlflow_run_id: str | None = Field(None, description="The run's MLflow run (set by the launcher).")
    wandb_run_id: str | None = Field(None, description="The run's W&B run id (set by the launcher).")


class RunConfig(_Strict):
    """One DiLoCo run: N replicas of one trainer on one backend, meeting in one store."""

    replicas: int = Field(2, ge=1, description="Number of replicas.",
                          json_schema_extra=cli_flag("--replicas", "-n", metavar="N", note=""))
    backend: SerializeAsAny[BackendConfig] = Field(
        default_factory=lambda: _backend_section({}),
        description="Where replicas run (local, sagemaker, eks, mixed: several of them at once, or an installed "
                    "third-party backend).",
        json_schema_extra=cli_flag("--backend", "-b", metavar="NAME", note="", type="str"))
    store: StoreConfig = Field(default_factory=StoreConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    gpu: str | None = Field(None, description="Accelerator per replica, e.g. A10G (backends that place "
                            "replicas).", json_schema_extra=cli_flag("--gpu", metavar="TYPE", note=""))
    #: Wall-clock limit per replica job (default one day, SageMaker's own default MaxRuntimeInSeconds), so a trainer
    #: that hangs before its first sync cannot run for ever; ``null`` in YAML removes the limit.
    timeout_s: float | None = Field(DEFAULT_TIMEOUT_S, gt=0, description="Wall-clock limit per replica, seconds.",
                                    json_schema_extra=cli_flag("--timeout", metavar="SECONDS",
                                                               note="timeout_s; default 86400 = one day"))
    #: How many times a replica killed or lost (a signal, the OOM killer) is started again for its rank
    #: (``--max-restarts``); a replica that failed with its own error is never (it would fail the same way).
    max_restarts: int = Field(DEFAULT_MAX_RESTARTS, ge=0, description="Start a killed or lost replica again up "
                              "to N times (it rejoins at its peers' round; on EKS the Job's per-index retry); 0 "
                              "never.", json_schema_extra=cli_flag("--max-restarts", metavar="N", minimum=0,
                                                                  note="max_restarts; default 3"))
    #: Extra environment for every replica on every backend (a package index, a model hub token, a store's
    #: credentials off AWS). Names diloco sets itself are refused; values that look secret are masked in the dry
    #: run and the run record (``diloco.executors.user_env``). On Kubernetes a Secret (``--env-from-secret``) keeps
    #: credentials out of the Job's manifest.
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables for every replica, on "
                                "every backend; values that look secret are masked in the dry run and the run "
                                "record.", json_schema_extra=cli_flag("--env", metavar="KEY=VALUE", multiple=True,
                                                                      note="env; repeatable"))


    @model_validator(mode="before")
    @classmethod
    def _env_as_text(cls, data: Any) -> Any:
        """A YAML number in ``env`` is the text it reads as (``OMP_NUM_THREADS: 4``); anything else but text is
        refused with the fix, a boolean included (YAML's ``yes`` would otherwise reach the replica as ``True``)."""
        env = data.get("env") if isinstance(data, dict) else None
        if not isinstance(env, dict):
            return data
        out: dict[str, str] = {}
        for name, item in env.items():
            if isinstance(item, int) and not isinstance(item, bool):
                item = str(item)
            elif not isinstance(item, str):
                raise ValueError(f"env.{name}: must be text (got {short(item)}); quote it in YAML, e.g. "
                                 f"{name}: \"{item}\"")
            out[str(name)] = item
        return {**data, "env": out}

    @model_validator(mode="before")
    @classmethod
    def _backend_shorthand(cls, data: Any) -> Any:
        """``backend: local`` means ``backend: {kind: local}``; a backend mapping without ``kind`` is local."""
        if isinstance(data, dict) and isinstance(data.get("backend"), str):
            data = {**data, "backend": {"kind": data["backend"]}}
        if isinstance(data, dict) and isinstance(data.get("backend"), dict):
            data = {**data, "backend": _backend_section(data["backend"])}
        if isinstance(data, dict) and "replicas" not in data and isinstance(data.get("backend"), BackendConfig):
            fixed = data["backend"].fixed_replicas()  # e.g. the parts of a run split over backends
            if fixed is not None:
                data = {**data, "replicas": fixed}
        return data

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        """Cross-field rules; messages start with the dotted field name (see ``format_validation_error``)."""
        t = self.train
        for key, owner in RESERVED_TRAINER_KWARGS.items():
            if key in t.trainer_kwargs:
                fix = f"set {owner} instead" if owner else "the replica entrypoint injects it"
                raise ValueError(f"train.trainer_kwargs.{key}: not allowed here ({fix})")
        if t.steps % t.sync_every:
            raise ValueError(f"train.steps: must be a multiple of train.sync_every ({t.sync_every}) so the run "
                             f"ends on an outer sync (got {t.steps})")
        problem = min_replicas_problem(self.store.min_replicas, self.replicas)
        if problem:
            raise ValueError(f"store.min_replicas: {problem}")
        if self.store.max_replicas is not None:
            if self.store.max_replicas < self.replicas:
                raise ValueError(f"store.max_replicas: must be at least the replicas launched ({self.replicas}) "
                                 f"(got {self.store.max_replicas})")
            if t.mode == "async":
                raise ValueError("store.max_replicas: an elastic run is synchronous (its rounds' manifests name "
                                 "their members); drop --max-replicas or --mode async")
            if (t.procs_per_replica or 1) > 1:
                raise ValueError(f"store.max_replicas: an elastic run has one process per replica (got "
                                 f"train.procs_per_replica {t.procs_per_replica}); drop one of the two")
        problem = self.backend.replicas_problem(self.replicas)
        if problem:
            raise ValueError(problem)
        uri = self.store.rendezvous
        kind = self.backend.kind
        if uri is not None:
            unknown = [p for p in _BRACES_RE.findall(uri) if p != "{run_id}"]
            if unknown:
                raise ValueError(f"store.rendezvous: unknown placeholder {unknown[0]} (only {{run_id}} is expanded; "
                                 f"got {uri!r})")
            scheme = uri.split("://", 1)[0] if "://" in uri else "file"
            if scheme == "memory":
                raise ValueError("store.rendezvous: memory:// lives inside one process, so replicas cannot meet "
                                 "there; use file:// or s3://")
            if scheme not in _SCHEMES:
                raise ValueError(f"store.rendezvous: scheme must be one of {', '.join(_SCHEMES)} (got {uri!r})")
            unreachable = self.backend.rendezvous_problem(scheme)
            if unreachable:
                raise ValueError(f"store.rendezvous: {unreachable} (got {uri!r})")
        elif self.backend.default_rendezvous("<run_id>") is None:
            raise ValueError(f"store.rendezvous: required for the {kind} backend (an s3:// URI, e.g. "
                             f"s3://<bucket>/diloco/{{run_id}})")
        if not self.backend.places_some_replicas() and self.gpu is not None:
            raise ValueError(f"gpu: the {kind} backend runs on this machine and does not place replicas; leave it "
                             f"unset (got {self.gpu!r})")
        for name, value in self.env.items():
            problem = env_problem(name, value)
            if problem:
                raise ValueError(f"env.{name}: {problem}")
        problem = placeholder_problem(self.model_dump())
        if problem:
            raise ValueError(problem)
        return self

    def recorded(self) -> dict[str, Any]:
        """The config as the run record and the store's ``run.json`` keep it: plain JSON, with every ``env`` value
        that looks secret masked (the replicas got the real ones; a later command never needs them)."""
        data = self.model_dump(mode="json")
        data["env"] = masked_env(self.env)
        return data


# ---------------------------------------------------------------------------------------------- errors
def env_problem(name: str, value: str) -> str | None:
    """Why ``name=value`` cannot go into every replica's environment (None: it can)."""
    return name_problem(name) or value_problem(value)


def parse_env_flags(items: list[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` items as a mapping, in order (a later one wins). The value is taken verbatim, never
    parsed as YAML (a URL, a token or ``007`` stays what was typed); a one-line ``ConfigError`` naming ``--env``
    for an item without ``=`` or a name that cannot be given."""
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--env: expected KEY=VALUE (got {short(item)})",
                              hint="e.g. --env PIP_INDEX_URL=https://pypi.example/simple")
        problem = env_problem(name, value)
        if problem:
            raise ConfigError(f"--env {name}: {problem}", hint="fix or drop that --env")
        env[name] = value
    return env


def _backend_section(section: dict[str, Any]) -> BackendConfig:
    """The ``backend:`` mapping validated by its own backend's model (looked up in the backend registry).

    Raises ``ValueError`` with the one-line message (``backend.<field>: ...``) so the run config reports it as is.
    """
    from diloco.executors.sections import backend_section

    return backend_section(section, "backend")


def backend_config(section: dict[str, Any]) -> BackendConfig:
    """A ``backend:`` mapping as its backend's validated config, or a one-line ``ConfigError``."""
    try:
        return _backend_section(section)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def format_validation_error(exc: ValidationError, *, root: type[BaseModel] | None = None,
                            prefix: tuple[str, ...] = (), kind: str | None = None) -> str:
    """The first error as one line (``diloco.config_errors.format_validation_error``); ``root`` defaults to the
    run config."""
    return _format_validation_error(exc, root=root or RunConfig, prefix=prefix, kind=kind)


# ---------------------------------------------------------------------------------------------- loading
#: YAML 1.2's float syntax: ``3e-4`` and ``1E5`` are numbers (PyYAML follows YAML 1.1, where they are strings).
_FLOAT_12 = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$|"
                       r"^\.(?:nan|NaN|NAN)$")


def _yaml_loader() -> type:
    """PyYAML's safe loader with YAML 1.2 number rules, so ``lr: 3e-4`` is the float every user means."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:float"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
    return Loader


def yaml_load(text: str) -> Any:
    """Parse YAML text with YAML 1.2 number rules (see ``_yaml_loader``)."""
    import yaml

    return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in ``path``; one-line ``ConfigError`` for a missing file, bad syntax or a non-mapping."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {str(p)!r}") from None
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {str(p)!r}: {exc.strerror}") from None
    try:
        data = yaml_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{p}:{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: must be a mapping of keys to values at the top level "
                          f"(got a {type(data).__name__})")
    return data


def parse_assignment(text: str, flag: str = "--set") -> tuple[str, Any]:
    """``"a.b=value"`` -> ``("a.b", yaml(value))``."""
    import yaml

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"{flag}: expected key=value (got {text!r})")
    try:
        value = yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: take it as a plain string
    return key, value


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """``data["a"]["b"] = value`` for ``key="a.b"``, creating mappings on the way."""
    parts = key.split(".")
    cur = data
    for i, part in enumerate(parts[:-1]):
        nxt = cur.get(part)
        if part == "backend" and i == 0 and isinstance(nxt, str):
            nxt = {"kind": nxt}
            cur[part] = nxt
        if nxt is None:
            nxt = cur[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a mapping (it is {short(nxt)})")
        cur = nxt
    cur[parts[-1]] = value


def validate(data: dict[str, Any]) -> RunConfig:
    """``RunConfig`` from plain data, or a one-line ``ConfigError``."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def merge_sources(
    config_path: str | Path | None = None,
    flags: dict[str, Any] | None = None,
    sets: list[str] | None = None,
    trainer_kwargs: list[str] | None = None,
    backend_flags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """YAML < flags (dotted keys; ``None`` means not given) < ``--trainer-kwargs`` < ``--set``, as plain data.

    ``flags["backend"]`` switching to a different kind than the YAML's drops the YAML's backend options (they
    belong to the other backend); ``--set backend.kind=...`` keeps them, and unknown ones are then reported.
    """
    data: dict[str, Any] = load_yaml(config_path) if config_path is not None else {}
    for key, value in (flags or {}).items():
        if value is None:
            continue
        if key == "backend":
            if backend_kind(data) != value or not isinstance(data.get("backend"), dict):
                data["backend"] = {"kind": value}
            continue
        if key == "env":  # added to the YAML's mapping, not replacing it
            given = data.get("env") or {}
            if not isinstance(given, dict):
                raise ConfigError(f"env: must be a mapping of names to values (got {short(given)})",
                                  hint="write env: {NAME: value} in the config, or drop it and use --env")
            data["env"] = {**given, **parse_env_flags(list(value))}
            continue
        set_dotted(data, key, value)
    _apply_backend_flags(data, backend_flags or {})
    for item in trainer_kwargs or []:
        key, value = parse_assignment(item, "--trainer-kwargs")
        set_dotted(data, "train.trainer_kwargs", {**(_get(data, "train.trainer_kwargs") or {}), key: value})
    for item in sets or []:
        set_dotted(data, *parse_assignment(item))
    return data


def _apply_backend_flags(data: dict[str, Any], given: dict[str, Any]) -> None:
    """Set the backend flags given (``{"role": ARN}``) in the chosen backend's section (``backend.role_arn``), or,
    for a run split over backends, in the sections of the parts that take them (``BackendConfig.apply_flags``);
    a flag nobody takes is a ``ConfigError`` (``diloco.executors.flags``)."""
    from diloco.executors import config_type

    if not any(v is not None for v in given.values()):
        return
    kind = backend_kind(data)
    section = data.get("backend")
    section = dict(section) if isinstance(section, dict) else {"kind": kind}
    data["backend"] = config_type(kind).apply_flags(kind, section, given)


def backend_kind(data: dict[str, Any]) -> str:
    """The backend named in (unvalidated) merged data; the default backend when none is."""
    backend = data.get("backend")
    kind = backend.get("kind") if isinstance(backend, dict) else backend
    return kind if isinstance(kind, str) else DEFAULT_BACKEND


def resolve_config(
    config_path: str | Path | None = None,
    flags: dict[str, Any] | None = None,
    sets: list[str] | None = None,
    trainer_kwargs: list[str] | None = None,
) -> RunConfig:
    """Defaults < YAML < flags < ``--trainer-kwargs`` < ``--set``, validated (see ``merge_sources``)."""
    return validate(merge_sources(config_path, flags, sets, trainer_kwargs))


def _get(data: dict[str, Any], key: str) -> Any:
    cur: Any = data
    for part in key.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur
