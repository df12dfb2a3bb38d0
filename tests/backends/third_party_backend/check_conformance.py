"""diloco-subproc's own test module: its backend against diloco's shipped conformance suite."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from diloco_subproc import SubprocBackend, SubprocConfig
from diloco_subproc.backend import live_pids

from diloco.executors.base import LaunchPlan, ServerlessExecutor
from diloco.executors.testing import BackendCase, BackendConformance


class SubprocCase(BackendCase):
    def __init__(self, root: Path) -> None:
        self.root = root

    def backend(self) -> ServerlessExecutor[Any, Any]:
        # A grace period a loaded machine cannot overrun between a cancel and the describe after it (the suite
        # checks that a SIGTERM-ignoring replica is still "cancelling" then).
        return SubprocBackend(SubprocConfig(root=str(self.root), grace_s=5.0))

    @contextlib.contextmanager
    def break_submit_at(self, backend: ServerlessExecutor[Any, Any], plan: LaunchPlan,
                        k: int) -> Iterator[LaunchPlan]:
        broken = plan.model_copy(deep=True)
        broken.requests[k]["cwd"] = str(self.root / "no-such-directory")  # replica k cannot start
        yield broken

    def live(self, run_id: str) -> list[str]:
        return [str(pid) for pid in live_pids(str(self.root), run_id)]


class TestSubprocBackend(BackendConformance):
    @pytest.fixture
    def case(self, tmp_path: Path) -> SubprocCase:
        return SubprocCase(tmp_path)
