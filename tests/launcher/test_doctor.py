"""`diloco doctor` against moto's real AWS APIs on loopback (S3, STS, IAM, CloudWatch Logs, ECR).

What these prove: a healthy setup passes and leaves nothing behind; a missing bucket, denied access (403 through
the fault proxy) and a bad endpoint each become a failed check with a fix, and a non-zero exit; the SageMaker
checks find a missing role, the bucket-name gotcha of AmazonSageMakerFullAccess, and a missing image.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import pytest
from support.faultproxy import FaultProxy
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.executors.sagemaker import grants_object_access
from diloco.launcher.doctor import DoctorContext, Status, run_doctor

ROLE_TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"}, "Action": "sts:AssumeRole"}]}
FULL_ACCESS = "arn:aws:iam::aws:policy/AmazonSageMakerFullAccess"


def doctor(*args: str) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(app, ["doctor", "-o", "json", *args])
    payload = json.loads(result.stdout) if result.stdout.strip() else {}
    return result.exit_code, payload, result.stderr


def by_name(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in payload["checks"]}


def test_healthy_s3_passes_and_cleans_up(s3_bucket: str, bucket_keys: Callable[[str], list[str]]) -> None:
    import boto3

    boto3.client("s3").put_object(Bucket=s3_bucket, Key="team/data.txt", Body=b"not ours")
    code, payload, stderr = doctor("--backend", "local", "--s3", f"s3://{s3_bucket}/team/diloco")
    checks = by_name(payload)
    assert code == 0 and payload["ok"] is True, payload
    for name in ("aws credentials", "aws region", "s3 bucket", "s3 read/write", "s3 conditional create"):
        assert checks[name]["status"] == "pass", checks[name]
    assert "123456789012" in checks["aws credentials"]["detail"]  # moto's account, via STS
    assert "sagemaker execution role" not in checks  # another backend's checks are not this one's business
    assert "kubernetes client" not in checks
    assert bucket_keys(s3_bucket) == ["team/data.txt"]  # probe objects gone, nothing else touched
    assert "failed" not in stderr


def test_missing_bucket_fails_with_fix(aws_env: str) -> None:
    code, payload, stderr = doctor("--s3", "s3://no-such-bucket-anywhere/diloco")
    checks = by_name(payload)
    assert code == 1 and payload["ok"] is False
    assert checks["s3 bucket"]["status"] == "fail"
    assert "does not exist" in checks["s3 bucket"]["detail"]
    assert "aws s3 mb s3://no-such-bucket-anywhere" in checks["s3 bucket"]["fix"]
    assert checks["s3 read/write"]["status"] == "skip"
    assert "1 check(s) failed" in stderr


def test_denied_bucket_fails_with_fix(s3_bucket: str, fault_proxy: FaultProxy) -> None:
    fault_proxy.add("status", path=rf"^/{s3_bucket}", status=403, code="AccessDenied")
    code, payload, _ = doctor("--s3", f"s3://{s3_bucket}/diloco")
    checks = by_name(payload)
    assert code == 1
    assert checks["aws credentials"]["status"] == "pass"  # STS is not the bucket
    assert checks["s3 bucket"]["status"] == "fail" and "denied (403)" in checks["s3 bucket"]["detail"]
    assert "s3:ListBucket" in checks["s3 bucket"]["fix"]


def test_denied_writes_fail_read_write_with_iam_fix(s3_bucket: str, fault_proxy: FaultProxy) -> None:
    fault_proxy.add("status", method="PUT", path=rf"^/{s3_bucket}/", status=403, code="AccessDenied")
    code, payload, _ = doctor("--s3", f"s3://{s3_bucket}/diloco")
    checks = by_name(payload)
    assert code == 1
    assert checks["s3 bucket"]["status"] == "pass"
    rw = checks["s3 read/write"]
    assert rw["status"] == "fail" and rw["detail"].startswith("put failed: S3AccessDenied")
    assert "s3:PutObject" in rw["fix"]
    assert fault_proxy.count("status:403") == 1  # a 403 is never retried


def test_bad_endpoint_fails_with_fix(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    code, payload, _ = doctor("--s3", f"s3://{s3_bucket}/diloco")
    checks = by_name(payload)
    assert code == 1
    assert checks["s3 bucket"]["status"] == "fail"
    assert "cannot reach" in checks["s3 bucket"]["detail"]
    assert "AWS_ENDPOINT_URL (now http://127.0.0.1:9)" in checks["s3 bucket"]["fix"]
    # An S3-compatible endpoint need not offer STS, so for the local backend that is only a warning.
    assert checks["aws credentials"]["status"] == "warn"


def test_bad_input_is_a_usage_error(aws_env: str) -> None:
    result = CliRunner().invoke(app, ["doctor", "--s3", "s3://Not_A_Bucket/x"])
    assert result.exit_code == 2 and "--s3 has an invalid bucket name" in result.stderr
    result = CliRunner().invoke(app, ["doctor", "--backend", "nomad"])
    assert result.exit_code == 2 and "backend: must be one of" in result.stderr


def _sagemaker_account(bucket: str, *, inline_for: str | None = None) -> str:
    import boto3

    iam = boto3.client("iam")
    role = iam.create_role(RoleName="diloco-exec", AssumeRolePolicyDocument=json.dumps(ROLE_TRUST),
                           Path="/service-role/")["Role"]
    iam.attach_role_policy(RoleName="diloco-exec", PolicyArn=FULL_ACCESS)
    if inline_for:
        iam.put_role_policy(RoleName="diloco-exec", PolicyName="rendezvous", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"],
                                                    "Resource": f"arn:aws:s3:::{inline_for}/diloco/*"}]}))
    boto3.client("logs").create_log_group(logGroupName="/aws/sagemaker/TrainingJobs")
    ecr = boto3.client("ecr")
    ecr.create_repository(repositoryName="diloco")
    ecr.put_image(repositoryName="diloco", imageTag="v1", imageManifest=json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 1,
                   "digest": "sha256:" + "a" * 64}, "layers": []}))
    return role["Arn"]


def test_sagemaker_checks_find_the_bucket_name_gotcha(managed_policies: str, s3_bucket: str) -> None:
    role_arn = _sagemaker_account(s3_bucket)
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco:v1"
    code, payload, _ = doctor("--backend", "sagemaker", "--s3", f"s3://{s3_bucket}/diloco", "--role", role_arn,
                              "--image", image)
    checks = by_name(payload)
    assert checks["sagemaker execution role"]["status"] == "pass", checks["sagemaker execution role"]
    gotcha = checks["role can reach bucket"]
    assert gotcha["status"] == "warn" and "only on buckets whose name contains 'sagemaker'" in gotcha["detail"]
    assert f"arn:aws:s3:::{s3_bucket}" in gotcha["fix"]
    assert checks["cloudwatch logs"]["status"] == "pass" and "exists" in checks["cloudwatch logs"]["detail"]
    assert checks["training image"]["status"] == "pass"
    assert "kubernetes client" not in checks
    assert code == 0  # warnings do not fail

    missing = image.replace(":v1", ":v2")
    code, payload, _ = doctor("--backend", "sagemaker", "--s3", f"s3://{s3_bucket}/diloco",
                              "--role", role_arn.replace("diloco-exec", "nope"), "--image", missing)
    checks = by_name(payload)
    assert code == 1
    assert checks["sagemaker execution role"]["status"] == "fail"
    assert "does not exist" in checks["sagemaker execution role"]["detail"]
    assert checks["role can reach bucket"]["status"] == "skip"
    assert checks["training image"]["status"] == "fail" and "docker push" in checks["training image"]["fix"]


def test_sagemaker_role_passes_with_inline_policy_or_sagemaker_bucket(managed_policies: str,
                                                                     s3_bucket: str) -> None:
    import boto3

    role_arn = _sagemaker_account(s3_bucket, inline_for=s3_bucket)
    ctx = DoctorContext.for_backend("sagemaker", f"s3://{s3_bucket}/diloco", role_arn=role_arn)
    checks = {c.name: c for c in run_doctor(ctx).checks}
    assert checks["role can reach bucket"].status == Status.PASS
    assert "inline policy 'rendezvous'" in checks["role can reach bucket"].detail

    boto3.client("s3").create_bucket(Bucket="amazon-sagemaker-rdv-test")
    boto3.client("iam").delete_role_policy(RoleName="diloco-exec", PolicyName="rendezvous")
    ctx = DoctorContext.for_backend("sagemaker", "s3://amazon-sagemaker-rdv-test/diloco", role_arn=role_arn)
    report = run_doctor(ctx)
    checks = {c.name: c for c in report.checks}
    assert checks["role can reach bucket"].status == Status.PASS
    assert "AmazonSageMakerFullAccess" in checks["role can reach bucket"].detail
    assert report.ok


def test_grants_object_access_reads_iam_wildcards() -> None:
    doc = {"Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "arn:aws:s3:::team-*/diloco/*"}]}
    assert grants_object_access(doc, "team-a", "diloco")
    assert not grants_object_access(doc, "team-a", "other")
    assert not grants_object_access(doc, "other-a", "diloco")
    deny = {"Statement": [{"Effect": "Deny", "Action": "s3:*", "Resource": "*"}]}
    assert not grants_object_access(deny, "team-a", "diloco")
    read_only = {"Statement": [{"Effect": "Allow", "Action": ["s3:Get*", "s3:List*"], "Resource": "*"}]}
    assert not grants_object_access(read_only, "team-a", "diloco")
    assert grants_object_access(json.dumps({"Statement": {"Effect": "Allow", "Action": "*", "Resource": "*"}}),
                                "b", "")


def test_eks_without_kubernetes_package_says_what_to_install(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # unimportable, as when the extra is not installed
    code, payload, _ = doctor("--backend", "eks", "--s3", f"s3://{s3_bucket}/diloco")
    checks = by_name(payload)
    assert code == 1
    assert checks["kubernetes client"]["status"] == "fail"
    assert checks["kubernetes client"]["fix"] == "pip install 'diloco[k8s]'"
    assert checks["kubernetes context"]["status"] == "skip"
    assert checks["s3 read/write"]["status"] == "pass"
    assert "sagemaker execution role" not in checks  # another backend's checks are not this one's business


def test_local_backend_checks_the_replica_environment_and_run_directory(tmp_path: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DILOCO_S3_URI", raising=False)
    monkeypatch.setenv("DILOCO_HOME", str(tmp_path / "home"))
    code, payload, _ = doctor("--backend", "local")
    checks = by_name(payload)
    assert code == 0 and payload["ok"] is True, payload
    assert checks["replica environment"]["status"] == "pass" and "torch" in checks["replica environment"]["detail"]
    assert checks["run directory"]["status"] == "pass"
    assert not (tmp_path / "home").exists()  # judged, not created

    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("DILOCO_HOME", str(tmp_path / "file" / "home"))
    code, payload, stderr = doctor("--backend", "local")
    checks = by_name(payload)
    assert code == 1 and checks["run directory"]["status"] == "fail"
    assert "DILOCO_HOME" in checks["run directory"]["fix"] and "1 check(s) failed" in stderr


def test_a_replica_interpreter_without_diloco_fails_with_the_fix() -> None:
    checks = run_doctor(DoctorContext.for_backend("local", python="/usr/bin/false")).checks
    check = next(c for c in checks if c.name == "replica environment")
    assert check.name == "replica environment" and check.status == Status.FAIL
    assert "install diloco" in (check.fix or "")
