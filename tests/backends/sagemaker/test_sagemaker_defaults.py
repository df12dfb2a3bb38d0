"""Defaults of the SageMaker backend that decide what a first real run gets: how long a spot job may wait for
capacity, and which AWS PyTorch training image runs the jobs. All pure planning: no emulator, nothing created."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.executors.sagemaker import SageMakerBackend, SageMakerBackendConfig

ROLE = "arn:aws:iam::000000000000:role/diloco-defaults"


def plan_request(timeout_s: float | None = 3600, **config: Any) -> dict[str, Any]:
    """Replica 0's CreateTrainingJob request for a one-replica run."""
    backend = SageMakerBackend(SageMakerBackendConfig(role_arn=ROLE, region="us-east-1", **config))
    args = EntrypointArgs(rendezvous_uri="s3://any-bucket/defaults/run", world_size=1)
    spec = LaunchSpec(run_id="defaults-run", replicas=1, entrypoint_args=args, timeout_s=timeout_s)
    return backend.plan(spec).requests[0]


# ---------------------------------------------------------------------------------------------- spot waiting time
@pytest.mark.parametrize(("timeout_s", "expected_wait"), [
    (3600, 7200),                   # as long again for capacity and interruptions as for training
    (None, 2 * 86400),              # the default time limit (1 day)
    (20 * 86400, 28 * 86400),       # never above the 28 days a job may run at most
    (28 * 86400, 28 * 86400),       # and never below the time limit (the service refuses that)
])
def test_spot_jobs_may_wait_for_capacity_beyond_their_time_limit(timeout_s: float | None,
                                                                 expected_wait: int) -> None:
    stopping = plan_request(timeout_s, image_uri="ready:1", use_spot=True)["StoppingCondition"]
    assert stopping["MaxWaitTimeInSeconds"] == expected_wait
    assert stopping["MaxWaitTimeInSeconds"] >= stopping["MaxRuntimeInSeconds"]


def test_an_explicit_spot_wait_is_sent_as_given() -> None:
    stopping = plan_request(3600, image_uri="ready:1", use_spot=True, max_wait_s=4000)["StoppingCondition"]
    assert stopping == {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 4000}


def test_on_demand_jobs_send_no_wait_time() -> None:
    assert plan_request(3600, image_uri="ready:1")["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600}


def test_the_dry_run_shows_the_spot_wait(tmp_path: Path) -> None:
    env = {**os.environ, "DILOCO_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    out = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", "--backend", "sagemaker", "--role", ROLE,
                          "--region", "us-east-1", "--image", "ready:1", "--spot", "--timeout", "3600", "--replicas", "1",
                          "--rendezvous", "s3://any-bucket/x/{run_id}", "--dry-run", "-o", "json"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    [request] = json.loads(out.stdout)["requests"]
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}


# ---------------------------------------------------------------------------------------------- the default image
def _installed_table() -> dict[str, Any]:
    import importlib.metadata

    dist = importlib.metadata.distribution("sagemaker-core")
    path = Path(str(dist.locate_file("sagemaker/core/image_uri_config/pytorch.json")))
    return json.loads(path.read_text())["training"]


def _expected_default() -> tuple[str, str]:
    """Worked out here from the installed table and diloco's own metadata: the newest PyTorch version whose
    image has a Python that diloco supports, within diloco's torch requirement."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    torch = next(Requirement(r).specifier for r in importlib.metadata.requires("diloco") or []
                 if Requirement(r).name == "torch")
    python = SpecifierSet(importlib.metadata.metadata("diloco")["Requires-Python"])
    fits = [(Version(v), v, [p for p in c["py_versions"] if len(p) > 3 and python.contains(f"{p[2]}.{p[3:]}")])
            for v, c in _installed_table()["versions"].items() if torch.contains(v)]
    _, version, pys = max(f for f in fits if f[2])
    return version, pys[-1]


def test_the_default_image_is_the_newest_the_installed_tables_list_within_the_torch_range() -> None:
    from packaging.version import Version

    version, py = _expected_default()
    assert Version(version) >= Version("2.9")  # 2.8's image is out of patch support
    image = plan_request()["AlgorithmSpecification"]["TrainingImage"]
    assert image.endswith(f"/pytorch-training:{version}-cpu-{py}"), image
    assert plan_request(instance_type="ml.g5.xlarge")["AlgorithmSpecification"]["TrainingImage"].endswith(f":{version}-gpu-{py}")


def test_a_pinned_framework_version_gets_its_own_python() -> None:
    image = plan_request(framework_version="2.8")["AlgorithmSpecification"]["TrainingImage"]
    assert image.endswith("/pytorch-training:2.8.0-cpu-py312"), image


@pytest.mark.parametrize(("torch", "python", "expected"), [
    (">=2.2", ">=3.10", ("2.10.0", "py313")),
    (">=2.2,<2.10", ">=3.10", ("2.9.0", "py312")),     # the torch range decides
    (">=2.2", ">=3.10,<3.13", ("2.9.0", "py312")),     # so does the Python diloco supports
    (">=2.2", ">=3.10,!=3.12.*", ("2.10.0", "py313")),
])
def test_the_newest_admitted_image_follows_both_ranges(torch: str, python: str, expected: tuple[str, str]) -> None:
    from packaging.specifiers import SpecifierSet

    from diloco.executors.sagemaker.config import newest_admitted_image

    table = {"versions": {
        "2.8.0": {"py_versions": ["py312"], "registries": {"us-east-1": "1"}},
        "2.9.0": {"py_versions": ["py312"], "registries": {"us-east-1": "1", "eu-west-1": "1"}},
        "2.10.0": {"py_versions": ["py313"], "registries": {"us-east-1": "1"}},
    }}
    assert newest_admitted_image(table, SpecifierSet(torch), SpecifierSet(python), "us-east-1") == expected
    # a region the newest image is not published in gets the newest one that is
    assert newest_admitted_image(table, SpecifierSet(">=2.2"), SpecifierSet(">=3.10"), "eu-west-1") == ("2.9.0", "py312")


def test_the_dry_run_and_doctor_name_the_default_image(tmp_path: Path) -> None:
    from diloco.executors.sagemaker.doctor import check_training_image
    from diloco.launcher.doctor import DoctorContext

    version, py = _expected_default()
    env = {**os.environ, "DILOCO_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    out = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", "--backend", "sagemaker", "--role", ROLE,
                          "--region", "eu-west-1", "--replicas", "1", "--rendezvous", "s3://any-bucket/x/{run_id}",
                          "--dry-run"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"/pytorch-training:{version}-cpu-{py}" in out.stdout

    check = check_training_image(DoctorContext.for_backend("sagemaker", None, region="eu-west-1"))
    assert check.status.value == "pass", check
    assert f".dkr.ecr.eu-west-1.amazonaws.com/pytorch-training:{version}-cpu-{py}" in check.detail
    assert f"PyTorch {version}" in check.detail and "torch>=2.2" in check.detail
