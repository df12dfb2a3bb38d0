"""The local backend against the conformance suite, plus the registry's third-party entry points."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco.executors.base import LaunchPlan, ServerlessExecutor
from diloco.executors.local import LocalBackend, LocalBackendConfig
from diloco.executors.local_supervisor import processes_with_env
from diloco.executors.testing import BackendCase, BackendConformance


def processes_of_run(run_id: str) -> list[str]:
    """Live processes whose environment carries ``DILOCO_RUN_ID=run_id`` (replicas and their children)."""
    return [str(pid) for pid in sorted(processes_with_env("DILOCO_RUN_ID", run_id))]


class LocalCase(BackendCase):
    patience_s = 30.0

    def __init__(self, root: Path) -> None:
        self.root = root

    def backend(self) -> ServerlessExecutor[Any, Any]:
        return LocalBackend(LocalBackendConfig(log_root=str(self.root / "runs"), grace_period_s=1.0))

    @contextlib.contextmanager
    def break_submit_at(self, backend: ServerlessExecutor[Any, Any], plan: LaunchPlan,
                        k: int) -> Iterator[LaunchPlan]:
        broken = plan.model_copy(deep=True)
        broken.requests[k]["cwd"] = str(self.root / "no-such-directory")  # the spawn of replica k fails
        yield broken

    def live(self, run_id: str) -> list[str]:
        return processes_of_run(run_id)


class TestLocalBackend(BackendConformance):
    @pytest.fixture
    def case(self, tmp_path: Path) -> LocalCase:
        return LocalCase(tmp_path)


TOY_BACKEND = '''
from typing import ClassVar, Literal

from diloco.executors.local import LocalBackend, LocalBackendConfig
from diloco.executors.local_supervisor import processes_with_env


class ToyConfig(LocalBackendConfig):
    kind: Literal["toy"] = "toy"
    flavour: str = "vanilla"


class ToyBackend(LocalBackend):
    """A third party's backend: local processes under another name, with a setting of its own."""

    name: ClassVar[str] = "toy"
    config_type = ToyConfig
'''


def test_a_third_party_backend_registers_through_the_entry_point_group(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "toy_diloco-0.1.dist-info").mkdir(parents=True)
    (site / "toy_diloco_backend.py").write_text(textwrap.dedent(TOY_BACKEND))
    (site / "toy_diloco-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-diloco\n"
                                                                 "Version: 0.1\n")
    (site / "toy_diloco-0.1.dist-info" / "entry_points.txt").write_text(
        "[diloco.backends]\ntoy = toy_diloco_backend:ToyBackend\nlocal = toy_diloco_backend:ToyBackend\n")
    env = {**os.environ, "PYTHONPATH": str(site), "DILOCO_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    diloco = [sys.executable, "-m", "diloco.cli.main"]

    bad = subprocess.run([*diloco, "launch", "--backend", "toy", "--set", "backend.flavor=x"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "backend.flavor: unknown key for the toy backend" in bad.stderr

    # A torch-free trainer from tests/ (on the replicas' path): the backend's registration is under test.
    trained = {**env, "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).resolve().parents[2])])}
    out = subprocess.run([*diloco, "launch", "--backend", "toy", "--set", "backend.flavour=mint", "-n", "2",
                          "--steps", "20", "--sync-every", "10", "--trainer", "support.cli_trainers:agreed",
                          "-o", "json"], env=trained, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["backend"] == "toy" and report["state"] == "succeeded" and report["weights_identical"] is True
    status = subprocess.run([*diloco, "status", "-o", "json"], env=env, capture_output=True, text=True, timeout=60)
    assert json.loads(status.stdout)["backend"] == "toy"
    # A third-party entry point reusing a built-in name does not replace the built-in.
    code = "from diloco.executors import backend_class; print(backend_class('local').__module__)"
    which = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert which.stdout.strip() == "diloco.executors.local"
