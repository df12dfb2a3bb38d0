"""What a backend's own tests use: the shipped conformance suite and its stand-in replica.

``from diloco.executors.testing import BackendCase, BackendConformance`` needs pytest (the suite is pytest tests);
``python -m diloco.executors.testing.fake_replica`` (the replica every suite test runs) needs only diloco, so the
names below are imported on first use and a replica never imports pytest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diloco.executors.testing.conformance import (
        FAKE_REPLICA,
        BackendCase,
        BackendConformance,
        wait_for_output,
        wait_until,
    )

__all__ = ["FAKE_REPLICA", "BackendCase", "BackendConformance", "wait_for_output", "wait_until"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("diloco.executors.testing.conformance"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
