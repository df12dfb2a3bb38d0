"""The SageMaker emulator refuses capacity as the service does: CreateTrainingJob succeeds (capacity is not a request
error; a quota is, ``ResourceLimitExceeded``), then the job fails while ``Starting``, before any instance is billed,
with ``FailureReason`` "CapacityError: Unable to provision requested ML compute capacity. Please retry using a
different ML instance type." (DIAGNijmegen/rse-grand-challenge#2631, aws/sagemaker-pytorch-training-toolkit#171).
The ``refuse-capacity`` knob, also from a shell through the admin endpoint, refuses the next N spot jobs."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.sagemaker import SageMakerEmulator

CAPACITY = ("CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML "
            "instance type.")


@pytest.fixture
def emulator(aws_env: str, tmp_path: Path) -> Iterator[SageMakerEmulator]:
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=1.0,
                           log_flush_s=0.1) as emu:
        yield emu


def _request(emulator: SageMakerEmulator, bucket: str, name: str, *, spot: bool) -> dict[str, Any]:
    request: dict[str, Any] = {
        "TrainingJobName": name, "RoleArn": f"arn:aws:iam::{emulator.account_id}:role/diloco-test",
        "AlgorithmSpecification": {"TrainingImage": "training-image:latest", "TrainingInputMode": "File",
                                   "ContainerEntrypoint": ["python"],
                                   "ContainerArguments": ["-c", "import time; time.sleep(30)"]},
        "OutputDataConfig": {"S3OutputPath": f"s3://{bucket}/output"},
        "ResourceConfig": {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 5},
        "StoppingCondition": {"MaxRuntimeInSeconds": 60, **({"MaxWaitTimeInSeconds": 120} if spot else {})}}
    if spot:
        request["EnableManagedSpotTraining"] = True
    return request


def _settled(sm: Any, name: str) -> dict[str, Any]:
    """The job once it has failed or is training."""
    deadline = time.monotonic() + 30
    while True:
        desc = sm.describe_training_job(TrainingJobName=name)
        if desc["TrainingJobStatus"] == "Failed" or desc["SecondaryStatus"] == "Training":
            return desc
        assert time.monotonic() < deadline, desc
        time.sleep(0.05)


def test_no_capacity_fails_the_next_spot_jobs_while_starting_unbilled(
    emulator: SageMakerEmulator, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emulator.url)
    sm = boto3.client("sagemaker")
    knob = urllib.request.Request(f"{emulator.url}/_emulator/refuse-capacity", data=json.dumps({"jobs": 1}).encode(),
                                  method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(knob, timeout=10) as answer:
        assert answer.status == 200
    sm.create_training_job(**_request(emulator, s3_bucket, "on-demand", spot=False))  # spot only: it runs
    sm.create_training_job(**_request(emulator, s3_bucket, "spot-1", spot=True))  # the create itself succeeds
    sm.create_training_job(**_request(emulator, s3_bucket, "spot-2", spot=True))  # the count is spent: it runs
    refused = _settled(sm, "spot-1")
    assert (refused["TrainingJobStatus"], refused["FailureReason"]) == ("Failed", CAPACITY)
    assert [t["Status"] for t in refused["SecondaryStatusTransitions"]][-2:] == ["Starting", "Failed"]
    assert not refused.get("BillableTimeInSeconds") and "TrainingStartTime" not in refused
    assert _settled(sm, "on-demand")["SecondaryStatus"] == "Training"
    assert _settled(sm, "spot-2")["SecondaryStatus"] == "Training"
    for name in ("on-demand", "spot-2"):
        sm.stop_training_job(TrainingJobName=name)
