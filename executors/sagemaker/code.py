"""The SageMaker side of the code channel: everything lives in ``diloco.executors.code_channel`` (one channel for
every backend); these names stay importable from here."""

from __future__ import annotations

from diloco.executors.code_channel import (  # noqa: F401
    BOOTSTRAP_SCRIPT,
    SOURCE_EXCLUDES,
    bootstrap_environment,
    build_wheel,
    pack_source,
    ships,
)

__all__ = ["BOOTSTRAP_SCRIPT", "SOURCE_EXCLUDES", "bootstrap_environment", "build_wheel", "pack_source", "ships"]
