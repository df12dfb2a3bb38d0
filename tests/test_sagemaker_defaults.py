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
