"""The names the backends and the launcher use for the replica settings (``diloco.replica.settings``):
``EntrypointArgs``, the settings a launch spec carries, and ``ReplicaSpec``, the object that carries them through
the run's store. Both are the settings module's own classes: the settings are declared once, there.

The backend contract (``diloco.executors.base``) re-exports them for the backends that build them.
"""

from __future__ import annotations

from diloco.replica.settings import SETTINGS_FORMAT, ReplicaSettings, SettingsObject

__all__ = ["SPEC_FORMAT", "EntrypointArgs", "ReplicaSpec"]

#: The settings of every replica of a run, as a launch spec holds them.
EntrypointArgs = ReplicaSettings
#: The spec object: the run's settings as published in its store.
ReplicaSpec = SettingsObject
SPEC_FORMAT = SETTINGS_FORMAT
