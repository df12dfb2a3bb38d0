"""A spot run launched with ``--max-replicas`` whose first job SageMaker refuses for capacity, through the real CLI
against the SageMaker emulator: the waiting launch keeps asking (``backend.capacity_retry_s``) instead of failing,
the refused rank reads as pending meanwhile and counts no restart, and the run ends with identical weights.

The refusal is the service's (``SageMakerEmulator.refuse_capacity``: CreateTrainingJob succeeds, the job fails while
Starting with ``CapacityError``, unbilled)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from emulators.sagemaker import SageMakerEmulator
from support.commands import run_cli as cli
from support.run_processes import processes_of

pytestmark = pytest.mark.slow

#: A torch-free trainer that ends with one model (the launcher's asking again, not training, is under test).
TRAINERS = (Path(__file__).resolve().parents[2] / "support" / "cli_trainers.py").read_text()


def test_a_spot_job_refused_for_capacity_is_asked_for_again_by_the_waiting_launch(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "trainers.py").write_text(TRAINERS)
    emulator.refuse_capacity(1)  # the next spot job: rank 0's, the first created
    launch = cli("launch", "--backend", "sagemaker", "--role", f"arn:aws:iam::{emulator.account_id}:role/diloco-e2e",
                 "--region", "us-east-1", "--rendezvous", f"s3://{s3_bucket}/capacity/{{run_id}}", "--source-dir",
                 str(source), "--replicas", "2", "--max-replicas", "2", "--spot", "--trainer", "trainers:agreed",
                 "--steps", "6", "--sync-every", "3", "--set", "backend.capacity_retry_s=0.5", "-o", "json",
                 home=tmp_path / "home", cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    report = json.loads(launch.stdout)
    run_id = report["run_id"]
    assert report["state"] == "succeeded" and report["weights_identical"] is True, report["weights_detail"]
    refused = emulator.job(f"{run_id}-r0").describe()
    assert refused["TrainingJobStatus"] == "Failed" and refused["FailureReason"].startswith("CapacityError"), refused
    # the rank was asked for again as a new job, not relaunched: no restart counted, nothing billed for the refusal
    assert [r["job_id"] for r in report["ranks"]] == [f"{run_id}-r0-1", f"{run_id}-r1"], report["ranks"]
    assert [r["restarts"] for r in report["ranks"]] == [0, 0], report["ranks"]
    assert "BillableTimeInSeconds" not in refused or not refused["BillableTimeInSeconds"], refused
    assert processes_of(run_id) == []
