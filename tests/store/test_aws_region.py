"""The AWS region as the AWS tools resolve it: ``--region``, then ``AWS_REGION``, then ``AWS_DEFAULT_REGION``, then
the profile in the AWS config file. botocore itself reads only ``AWS_DEFAULT_REGION`` (its configprovider maps the
``region`` setting to that variable alone; boto/boto3#3620), so a launcher that asks boto3 alone ignores the
``AWS_REGION`` the AWS CLI and the other SDKs honour. Each test sets one source at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.errors import ConfigError
from diloco.executors.base import EntrypointArgs, LaunchSpec

ROLE = "arn:aws:iam::000000000000:role/diloco-region"


@pytest.fixture
def no_region(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No region anywhere: neither variable, no profile, an empty AWS config file (returned, to write one)."""
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "aws-config"
    config.write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return config


def backend(region: str | None = None):  # type: ignore[no-untyped-def]
    from diloco.executors.sagemaker import SageMakerBackend, SageMakerBackendConfig

    return SageMakerBackend(SageMakerBackendConfig(role_arn=ROLE, region=region))


def doctor_row(region: str | None = None):  # type: ignore[no-untyped-def]
    from diloco.launcher.doctor import DoctorContext, check_region

    return check_region(DoctorContext.for_backend("sagemaker", "s3://any-bucket/x", region=region))


def plan_request(region: str | None = None) -> dict:  # type: ignore[type-arg]
    args = EntrypointArgs(rendezvous_uri="s3://any-bucket/region/run", world_size=1)
    return backend(region).plan(LaunchSpec(run_id="region-run", replicas=1, entrypoint_args=args)).requests[0]


def test_aws_region_alone_is_used_and_named(no_region: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    assert backend().region() == "eu-west-1"
    request = plan_request()
    assert request["Environment"]["AWS_DEFAULT_REGION"] == "eu-west-1"  # the jobs' own boto3 reads this one
    assert ".dkr.ecr.eu-west-1.amazonaws.com/" in request["AlgorithmSpecification"]["TrainingImage"]
    row = doctor_row()
    assert row.status.value == "pass" and row.detail == "eu-west-1 (from AWS_REGION)", row


def test_aws_default_region_alone_is_used_and_named(no_region: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    assert backend().region() == "ap-south-1"
    row = doctor_row()
    assert row.status.value == "pass" and row.detail == "ap-south-1 (from AWS_DEFAULT_REGION)", row


def test_aws_region_wins_over_aws_default_region(no_region: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")  # the AWS CLI's order too
    assert backend().region() == "eu-west-1"
    assert doctor_row().detail == "eu-west-1 (from AWS_REGION)"


@pytest.mark.parametrize("profile", [None, "work"])
def test_the_profiles_region_is_used_and_named(no_region: Path, monkeypatch: pytest.MonkeyPatch,
                                               profile: str | None) -> None:
    no_region.write_text("[default]\nregion = us-west-2\n\n[profile work]\nregion = eu-central-1\n")
    if profile:
        monkeypatch.setenv("AWS_PROFILE", profile)
    expected = "eu-central-1" if profile else "us-west-2"
    assert backend().region() == expected
    row = doctor_row()
    assert row.status.value == "pass", row
    assert row.detail == f"{expected} (from profile {profile or 'default'!r} in {no_region})", row


def test_the_flag_wins_over_everything(no_region: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_region.write_text("[default]\nregion = us-west-2\n")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    assert backend("sa-east-1").region() == "sa-east-1"
    assert doctor_row("sa-east-1").detail == "sa-east-1 (from --region / backend.region)"


def test_no_region_says_every_way_to_set_one(no_region: Path) -> None:
    with pytest.raises(ConfigError) as err:
        backend().region()
    assert "backend.region" in str(err.value)
    assert err.value.hint is not None
    for way in ("--region", "AWS_REGION", "AWS_DEFAULT_REGION", "aws configure set region"):
        assert way in err.value.hint
    row = doctor_row()
    assert row.status.value == "fail" and row.fix is not None and "AWS_REGION" in row.fix, row


def test_a_dry_run_with_only_aws_region_plans_in_that_region(no_region: Path, monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    env = {**os.environ, "DILOCO_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    out = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", "--backend", "sagemaker", "--role", ROLE,
                          "--replicas", "1", "--rendezvous", "s3://any-bucket/x/{run_id}", "--dry-run", "-o", "json"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    [request] = json.loads(out.stdout)["requests"]
    assert request["Environment"]["AWS_DEFAULT_REGION"] == "eu-west-1"
