"""``diloco smoke`` on a backend that bills: the real CLI, real boto3, the SageMaker emulator, moto's S3 and Logs.

What these prove: without ``--yes`` a smoke that would spend money says how much and starts nothing (not one
SageMaker call, not one object written); with ``--yes`` two jobs run the tiny trainer through the no-image
bootstrap, meet in S3, agree bitwise, and the report carries their billable seconds and estimated cost, after
which the smoke's prefix (the store, the shipped code, the uploaded model.tar.gz) is gone; a job refused at
creation rolls the smoke back; and the backend section is built from the flags the chosen backend takes.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from emulators.sagemaker import SageMakerEmulator
from rich.console import Console
from support.commands import DILOCO_MODULE as DILOCO
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.executors.sagemaker import BOOTSTRAP_S, IMAGE_START_S, PRICE_TABLE_USD_PER_HOUR
from diloco.launcher.smoke import EXPECTED_WORK_S, ROUNDS, SmokeReport, format_usd

INSTANCE = "ml.m5.xlarge"


def smoke_cli(emulator: SageMakerEmulator, bucket: str, tmp_path: Path, *extra: str,
              timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``diloco smoke --backend sagemaker`` as a user runs it, from a directory of their own."""
    args = ["smoke", "--backend", "sagemaker", "--s3", f"s3://{bucket}/smoke", "--role",
            f"arn:aws:iam::{emulator.account_id}:role/diloco-smoke", "--region", "us-east-1", *extra]
    env = {**os.environ, "DILOCO_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    env.pop("DILOCO_DEBUG", None)
    return subprocess.run([*DILOCO, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)


def expected_usd(replicas: int = 2) -> float:
    """The estimate the message must quote: the shipped price (the Price List API is not asked when
    AWS_ENDPOINT_URL points elsewhere) times the assumed start-up plus the smoke's work, per job."""
    billed_s = IMAGE_START_S + BOOTSTRAP_S + EXPECTED_WORK_S
    return round(replicas * PRICE_TABLE_USD_PER_HOUR[INSTANCE] * billed_s / 3600.0, 4)


def test_without_yes_a_billed_smoke_says_what_it_would_cost_and_starts_nothing(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path, bucket_keys: Callable[[str], list[str]]
) -> None:
    out = smoke_cli(emulator, s3_bucket, tmp_path, "-o", "json")
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco: error: smoke:"), out.stderr
    line = lines[0]
    assert f"would cost about {format_usd(expected_usd())}" in line, line
    assert f"2 x {INSTANCE} training job(s)" in line and "image download and start-up, assumed" in line
    assert "nothing was started" in line and "pass --yes" in line
    assert emulator.calls == [] and emulator.jobs() == []  # not even a describe
    assert bucket_keys(s3_bucket) == []  # no code uploaded, no smoke.json written


def test_with_yes_two_jobs_pass_report_billing_and_leave_nothing_behind(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path, bucket_keys: Callable[[str], list[str]]
) -> None:
    import boto3

    boto3.client("s3").put_object(Bucket=s3_bucket, Key="smoke/other-run/keep.txt", Body=b"not ours")
    out = smoke_cli(emulator, s3_bucket, tmp_path, "--yes", "-o", "json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["backend"] == "sagemaker"
    assert [c["status"] for c in report["checks"]] == ["pass"] * 4, report["checks"]
    checks = {c["name"]: c for c in report["checks"]}
    assert f"2 rank(s) x {ROUNDS} round(s)" in checks["every rank completed every round"]["detail"]
    assert checks["final weights bitwise identical"]["detail"].startswith("2 replica(s) hold identical")
    assert report["expected_cost_usd"] == expected_usd()
    assert f"expected cost: about {format_usd(expected_usd())}" in out.stderr

    run_id = report["uri"].rsplit("/", 1)[1]
    assert report["uri"] == f"s3://{s3_bucket}/smoke/{run_id}" and run_id.startswith("smoke-")
    jobs = {job.name: job.describe() for job in emulator.jobs()}
    assert sorted(jobs) == [f"{run_id}-r0", f"{run_id}-r1"]
    for desc in jobs.values():
        assert desc["TrainingJobStatus"] == "Completed" and desc["ResourceConfig"]["InstanceType"] == INSTANCE
        assert desc["StoppingCondition"]["MaxRuntimeInSeconds"] == 600  # --timeout caps what a job can bill
    billable = sum(desc["BillableTimeInSeconds"] for desc in jobs.values())
    assert report["billable_s"] == billable >= 2
    assert report["cost_usd"] == pytest.approx(PRICE_TABLE_USD_PER_HOUR[INSTANCE] * billable / 3600, abs=1e-5)
    assert "price table" in report["cost_source"] and "an estimate" in report["cost_source"]
    # the store's objects, the shipped code and both jobs' model.tar.gz were under the smoke's prefix: all gone
    assert bucket_keys(s3_bucket) == ["smoke/other-run/keep.txt"]
    assert emulator.running_pids() == []


def test_a_job_refused_at_creation_rolls_the_smoke_back(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path, bucket_keys: Callable[[str], list[str]]
) -> None:
    emulator.refuse_create(nth=2)
    out = smoke_cli(emulator, s3_bucket, tmp_path, "--yes")
    assert out.returncode == 1, out.stderr[-3000:]
    error = [line for line in out.stderr.splitlines() if line.startswith("diloco: error:")]
    assert len(error) == 1 and "replica 1" in error[0] and "ResourceLimitExceeded" in error[0], out.stderr
    [job] = emulator.jobs()
    assert job.name.endswith("-r0") and job.describe()["TrainingJobStatus"] == "Stopped"
    assert bucket_keys(s3_bucket) == []  # the smoke waited for the stop, then deleted everything it wrote
    assert emulator.running_pids() == []


def test_the_backend_section_comes_from_the_flags_it_takes(aws_env: str, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["smoke", "--role", "arn:aws:iam::000000000000:role/x"])
    assert result.exit_code == 2
    assert "--role: the local backend has no such setting" in result.stderr, result.stderr
    result = runner.invoke(app, ["smoke", "--backend", "sagemaker", "--role", "arn:aws:iam::000000000000:role/x"])
    assert result.exit_code == 2 and "--s3: the sagemaker backend's replicas cannot reach this machine's files" \
        in result.stderr, result.stderr
    config = tmp_path / "run.yaml"
    config.write_text("backend:\n  kind: sagemaker\n  region: us-east-1\n  instance_type: ml.c5.xlarge\n"
                      "store:\n  rendezvous: s3://diloco-test-bucket/cfg/{run_id}\n")
    result = runner.invoke(app, ["smoke", "--config", str(config)])  # no role: the plan refuses, nothing created
    assert result.exit_code == 2 and "backend.role_arn: the SageMaker execution role is required" in result.stderr


def test_the_table_shows_billable_time_and_cost() -> None:
    report = SmokeReport(uri="s3://b/smoke/x", backend="sagemaker", replicas=2, rounds=ROUNDS, checks=[],
                         round_stats=[], observed_round_objects=4, seconds=31.5, kept=False, ok=True,
                         billable_s=12.0, cost_usd=0.0123, cost_source="diloco's price table, an estimate")
    from diloco.cli.s3_commands import _render_smoke

    buf = io.StringIO()
    _render_smoke(Console(file=buf, width=200, no_color=True), report)
    text = buf.getvalue()
    assert "2 replica(s) on sagemaker via s3://b/smoke/x" in " ".join(text.split())  # the title may wrap
    assert "billable: 12 s over 2 replica(s); estimated cost $0.0123 (diloco's price table, an estimate)" in text
    assert "smoke PASSED in 31.5s" in text
