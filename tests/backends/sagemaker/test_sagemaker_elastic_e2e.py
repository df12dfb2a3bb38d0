"""A live SageMaker run grown from 2 to 3 replicas (``Run.scale``) on the emulator, through the real launcher and real
replica processes (the gated ``support.elastic_trainer`` on a ready image): the new training job adopts the
committed global model, joins at the next round, and the run ends with every replica's weights identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.elastic_scaleup import scale_up_run
from support.sagemaker_jobs import role

pytestmark = pytest.mark.slow

TESTS_DIR = str(Path(__file__).resolve().parents[2])


def test_a_sagemaker_run_scaled_from_2_to_3_ends_with_identical_weights(
    emulator: Any, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0")
    backend = {"kind": "sagemaker", "role_arn": role(emulator), "region": "us-east-1",
               "image_uri": "diloco-ready-image:test", "log_poll_interval_s": 0.2}
    done = scale_up_run(backend, f"s3://{s3_bucket}/elastic/{{run_id}}", tmp_path / "gates",
                        env={"PYTHONPATH": TESTS_DIR, "OMP_NUM_THREADS": "1"})
    report = done.report
    assert report.state.value == "succeeded", report
    assert [(r.rank, r.exit_code) for r in report.ranks] == [(r, 0) for r in range(3)], report.ranks
    assert report.weights_identical is True, report.weights_detail
    assert done.grown.added == [2]
    assert done.handle["job_names"] == [f"{done.run_id}-r{r}" for r in range(3)]
    assert {j.name for j in emulator.jobs()} == {f"{done.run_id}-r{r}" for r in range(3)}
