"""The record of a replica's settings that the launcher writes and the replica reads: ``EntrypointArgs``, and the
spec object (``ReplicaSpec``) that carries it through the run's store.

It is defined on the replica side because the replica is its reader and must not import a backend to read it;
the backend contract (``diloco.executors.base``) re-exports it for the backends that build it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from diloco.defaults import DEFAULT_TRAINER


class EntrypointArgs(BaseModel):
    """What the replica entrypoint needs: the one record of a replica's settings. ``diloco launch`` publishes it
    as the run's spec object (``ReplicaSpec``, ``spec.json`` in the store) and every replica reads it from there
    (``--spec``); ``to_argv`` renders the same settings as the entrypoint's own flags, for running it by hand and
    for specs without a spec object. A field this version does not know is refused, never silently dropped."""

    model_config = ConfigDict(extra="forbid")

    rendezvous_uri: str
    world_size: int = Field(ge=1)
    trainer: str = DEFAULT_TRAINER  # "module:function"
    trainer_kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = None  # all-reduce poll timeout inside the replica
    poll_interval_s: float | None = None  # how often a waiting replica polls the store (entrypoint default: 1 s)
    allreduce: str = "gather"  # store.allreduce
    compression: str = "none"  # store.compression
    error_feedback: bool = True  # store.error_feedback
    spread: int = 1  # store.spread
    min_replicas: int | None = None  # partial participation (None: every round needs every replica)
    procs_per_replica: int | None = None  # local processes per replica (None: the replica's own default)
    tensorboard: str | None = None  # metrics.tensorboard

    def to_argv(self) -> list[str]:
        """The entrypoint's arguments, one token per list element (as SageMaker's ContainerArguments wants)."""
        module, fn = self.trainer.split(":", 1)
        argv = [
            "--rendezvous", self.rendezvous_uri,
            "--world-size", str(self.world_size),
            "--trainer-module", module,
            "--trainer-fn", fn,
            "--trainer-kwargs-json", json.dumps(self.trainer_kwargs, sort_keys=True, separators=(",", ":")),
        ]
        if self.timeout_s is not None:
            argv += ["--timeout", f"{self.timeout_s:g}"]
        if self.poll_interval_s is not None:
            argv += ["--poll-interval", f"{self.poll_interval_s:g}"]
        # Only settings that differ from the entrypoint's defaults, so a plain run's command stays short.
        if self.allreduce != "gather":
            argv += ["--allreduce", self.allreduce]
        if self.compression != "none":
            argv += ["--compression", self.compression]
        if not self.error_feedback:
            argv += ["--no-error-feedback"]
        if self.spread != 1:
            argv += ["--spread", str(self.spread)]
        if self.min_replicas is not None:
            argv += ["--min-replicas", str(self.min_replicas)]
        if self.procs_per_replica is not None:
            argv += ["--procs-per-replica", str(self.procs_per_replica)]
        if self.tensorboard is not None:
            argv += ["--tensorboard", self.tensorboard]
        return argv


#: The format tag of the spec object (``ReplicaSpec``), checked by the replica that reads it.
SPEC_FORMAT = "diloco.replica-spec/1"


class ReplicaSpec(BaseModel):
    """The spec object: the run's ``EntrypointArgs``, published in its store before any replica starts.

    Why an object and not arguments: a backend's command line can be short (SageMaker allows 256 characters per
    ContainerArguments element), and trainer settings are any length. A replica finds it through one short
    argument, ``--spec URI``, and checks it like every object it reads: the format, the run it belongs to, the
    SHA-256 its command line names (``--spec-sha256``), that its rendezvous is the folder it lies in, and every
    setting's type."""

    model_config = ConfigDict(extra="forbid")

    format: str = SPEC_FORMAT
    run_id: str
    entrypoint_args: EntrypointArgs

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys), so its SHA-256 is a pure function of the settings."""
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True).encode()
