"""The run's bucket and its jobs in different regions, found before anything is launched: a SageMaker job cannot use
a bucket in another region (its S3 inputs and outputs stay in its own), so that launch is refused (exit 2, one line
with the fix); a local or cluster replica can, at the inter-region transfer price, so it is warned of it. ``doctor``
says the same. moto's server holds a bucket in another region (CreateBucketConfiguration's LocationConstraint) and
answers HeadBucket with its ``x-amz-bucket-region``, as S3 does."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
from support.commands import run_cli

ROLE = "arn:aws:iam::123456789012:role/diloco-region"
ELSEWHERE = "eu-west-1"


@pytest.fixture
def far_bucket(aws_env: str) -> str:
    """A bucket in eu-west-1 while the jobs' region (AWS_REGION) is us-east-1."""
    name = "diloco-far-bucket"
    boto3.client("s3", region_name=ELSEWHERE).create_bucket(
        Bucket=name, CreateBucketConfiguration={"LocationConstraint": ELSEWHERE})
    return name


def test_a_sagemaker_launch_with_its_bucket_in_another_region_is_refused_before_anything_exists(
        far_bucket: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = run_cli("launch", "--backend", "sagemaker", "--role", ROLE, "--region", "us-east-1",
                     "--rendezvous", f"s3://{far_bucket}/runs/{{run_id}}", "--steps", "2", "--sync-every", "1",
                     home=home)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("diloco: error: ")]
    assert len(errors) == 1, result.stderr
    assert f"backend.region: the sagemaker jobs run in us-east-1 but bucket {far_bucket!r} is in {ELSEWHERE}" \
        in errors[0]
    assert f"pass --region {ELSEWHERE}" in errors[0]
    assert boto3.client("s3").list_objects_v2(Bucket=far_bucket).get("KeyCount") == 0, "nothing written"
    assert not list((home / "runs").glob("*.json")) if (home / "runs").exists() else True


def test_a_local_run_with_its_bucket_in_another_region_is_warned_of_the_transfer_price_and_runs(
        far_bucket: str, tmp_path: Path) -> None:
    result = run_cli("launch", "--backend", "local", "--replicas", "2", "--rendezvous",
                     f"s3://{far_bucket}/runs/{{run_id}}", "--trainer", "support.cli_trainers:agreed", "--steps",
                     "2", "--sync-every", "1", "-o", "json", home=tmp_path / "home")  # torch-free: the store is tested
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "crosses regions" in line]
    assert len(said) == 1, result.stderr
    assert said[0].startswith(f"warning: the local jobs run in us-east-1 but bucket {far_bucket!r} is in {ELSEWHERE}")
    assert "$0.02/GB" in said[0]
    assert json.loads(result.stdout)["state"] == "succeeded"
    written = boto3.client("s3", region_name=ELSEWHERE).list_objects_v2(Bucket=far_bucket, Prefix="runs/")
    keys = [o["Key"] for o in written.get("Contents", [])]
    assert {"final/rank_0000.safetensors", "metrics/rank_0001.jsonl"} <= {k.split("/", 2)[2] for k in keys}, keys


def test_doctor_refuses_the_sagemaker_bucket_in_another_region_and_warns_for_a_local_run(far_bucket: str) -> None:
    home = Path("/nonexistent-home-unused")
    doctor = run_cli("doctor", "--backend", "sagemaker", "--role", ROLE, "--region", "us-east-1", "--s3",
                     f"s3://{far_bucket}/runs", "-o", "json", home=home)
    rows = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert rows["s3 bucket"]["status"] == "fail", rows["s3 bucket"]
    assert ELSEWHERE in rows["s3 bucket"]["detail"] and f"--region {ELSEWHERE}" in rows["s3 bucket"]["fix"]
    assert doctor.returncode == 1
    local = run_cli("doctor", "--backend", "local", "--s3", f"s3://{far_bucket}/runs", "-o", "json", home=home)
    rows = {c["name"]: c for c in json.loads(local.stdout)["checks"]}
    assert rows["s3 bucket"]["status"] == "warn", rows["s3 bucket"]
    assert "$0.02/GB" in rows["s3 bucket"]["detail"]


def test_doctor_of_a_mixed_run_refuses_its_sagemaker_part_in_another_region(far_bucket: str, tmp_path: Path) -> None:
    config = tmp_path / "mixed.yaml"
    config.write_text(json.dumps({
        "backend": {"kind": "mixed", "parts": [{"kind": "local", "replicas": 1},
                                               {"kind": "sagemaker", "replicas": 1, "role_arn": ROLE,
                                                "region": "us-east-1"}]},
        "store": {"rendezvous": f"s3://{far_bucket}/mixed/{{run_id}}"}}))
    doctor = run_cli("doctor", "-c", str(config), "-o", "json", home=tmp_path / "home")
    rows = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert rows["s3 bucket"]["status"] == "fail", rows["s3 bucket"]
    assert rows["s3 bucket"]["detail"].startswith("backend.parts[1].region: the sagemaker jobs run in us-east-1")
