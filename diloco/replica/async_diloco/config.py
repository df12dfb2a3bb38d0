"""The coordinator's settings (``async_diloco:`` in a full config) and the node's identity."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from diloco.errors import ConfigError
from diloco.replica.async_diloco.record import DEFAULT_PREFIX

#: The seed's word for this node (its own state at startup; the last-resort node id): not a backend name.
LOCAL = "local"  # not a backend

SECTION = "async_diloco"
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class AsyncDiLoCoConfig(BaseModel):
    """The coordinator's own config section (``async_diloco:`` in a full config)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    role: Literal["master", "worker"] = "worker"
    node_id: str | None = None  # default: replica-<rank>, else $USER, else LOCAL
    store_uri: str | None = None  # the rendezvous; a store passed to the constructor wins
    prefix: str = DEFAULT_PREFIX  # where this coordinator's objects live in the store
    inner_steps: int = Field(50, ge=1)  # upload a delta every inner_steps optimizer steps
    poll_interval_s: float = Field(5.0, ge=0)  # between global polls away from boundaries
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    staleness_policy: Literal["weight", "accept"] = "weight"  # weight 1/(1+s), or 1
    max_staleness: int = Field(8, ge=0)  # deltas staler than this are rejected
    staleness_grace: int = Field(0, ge=0)  # staleness up to this counts as fresh (weight 1) under "weight"
    async_delta_upload: bool = True  # v2: uploads run on a background thread behind a one-slot queue
    async_global_poll: bool = True  # v2: polls run on a background thread
    reset_inner_optimizer: bool = True  # advice to trainers: reset on loaded_global
    master_poll_interval_s: float = Field(0.2, gt=0)  # how often the outer thread lists new deltas
    keep_versions: int = Field(3, ge=1)  # global versions (and committed master states) kept in the store
    stop_timeout_s: float = Field(10.0, gt=0)  # stop() waits this long for background threads

    @field_validator("node_id")
    @classmethod
    def _valid_node_id(cls, value: str | None) -> str | None:
        if value is not None and not _NODE_ID.match(value):
            raise ValueError(f"must be 1-64 letters, digits, '.', '_' or '-' starting with a letter or digit "
                             f"(got {value!r})")
        return value

    @field_validator("prefix")
    @classmethod
    def _valid_prefix(cls, value: str) -> str:
        value = value.strip("/")
        if not value or ".." in value.split("/"):
            raise ValueError(f"must be a non-empty relative key prefix such as 'async' (got {value!r})")
        return value


def coordinator_config(config: Any) -> AsyncDiLoCoConfig:
    """``config`` as the section: the section itself, an object with ``.async_diloco``, a mapping holding an
    ``async_diloco`` key, or the section's own mapping. One-line ``ConfigError`` naming the field otherwise."""
    if isinstance(config, AsyncDiLoCoConfig):
        return config
    section = getattr(config, SECTION, None)
    if isinstance(section, AsyncDiLoCoConfig):
        return section
    if isinstance(config, Mapping):
        data = config.get(SECTION, config)
        prefix = f"{SECTION}." if SECTION in config else ""
        try:
            return AsyncDiLoCoConfig.model_validate(dict(data or {}))
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = prefix + ".".join(str(p) for p in err["loc"])
            raise ConfigError(f"{where}: {err['msg']} (got {err.get('input')!r})") from None
    raise ConfigError(f"config: expected an AsyncDiLoCoConfig, a config with an {SECTION!r} section or a mapping "
                      f"(got {type(config).__name__})")


def resolve_node_id(config: AsyncDiLoCoConfig, environ: Mapping[str, str] | None = None) -> str:
    """config.node_id (validated), else ``replica-<REPLICA_RANK>``, else ``$USER``, else ``local``; derived ids
    are made safe for store keys and file names."""
    from diloco.envvars import REPLICA_RANK

    env = os.environ if environ is None else environ
    if config.node_id:
        return config.node_id
    rank = env.get(REPLICA_RANK, "").strip()
    raw = f"replica-{rank}" if rank else env.get("USER", "").strip() or LOCAL
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-._")[:64]
    return safe or LOCAL
