"""The record of a replica's settings as the launcher hands it over: ``EntrypointArgs`` (the settings, declared in
``diloco.replica.settings``, with their rendering as the entrypoint's flags) and the spec object (``ReplicaSpec``)
that carries them through the run's store.

It is defined on the replica side because the replica is its reader and must not import a backend to read it;
the backend contract (``diloco.executors.base``) re-exports it for the backends that build it.
"""

from __future__ import annotations

import json

from diloco.replica.settings import SETTINGS_FORMAT, ReplicaSettings, SettingsObject

__all__ = ["SPEC_FORMAT", "EntrypointArgs", "ReplicaSpec"]


class EntrypointArgs(ReplicaSettings):
    """The replica settings (``diloco.replica.settings.ReplicaSettings``, where every field is declared), with
    their rendering as the entrypoint's own flags. ``diloco launch`` publishes them as the run's spec object
    (``ReplicaSpec``, ``spec.json`` in the store) and every replica reads them from there (``--spec``);
    ``to_argv`` is for running the entrypoint by hand and for specs without a spec object."""

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
        if self.progress_interval_s is not None:
            argv += ["--progress-interval", f"{self.progress_interval_s:g}"]
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


#: The spec object: the run's settings as published in its store (``diloco.replica.settings``).
ReplicaSpec = SettingsObject
SPEC_FORMAT = SETTINGS_FORMAT
