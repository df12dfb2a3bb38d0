"""``diloco doctor`` for a run split over backends, against moto's IAM/S3/STS and the Kubernetes emulator: the common
checks, every part's own checks, and per part whether the identity its replicas run as can use the run's prefix
(the SageMaker execution role, the EKS service account's IRSA role, this machine's credentials)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from emulators.kubernetes import KubernetesEmulator
from typer.testing import CliRunner

from diloco.cli.main import app

SAGEMAKER_TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"}, "Action": "sts:AssumeRole"}]}
IRSA_TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Federated": "arn:aws:iam::123456789012:oidc-provider/oidc.eks.example"},
     "Action": "sts:AssumeRoleWithWebIdentity"}]}


@pytest.fixture
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubernetesEmulator]:
    with KubernetesEmulator(tmp_path / "kube", namespace="ml") as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig))
        yield emulator


def role(name: str, trust: dict[str, Any], bucket: str | None) -> str:
    """An IAM role; with ``bucket``, an inline policy granting object access under ``diloco/`` there."""
    import boto3

    iam = boto3.client("iam")
    arn = iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    if bucket:
        iam.put_role_policy(RoleName=name, PolicyName="rendezvous", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"],
                                                    "Resource": f"arn:aws:s3:::{bucket}/diloco/*"}]}))
    return arn


def test_doctor_checks_every_part_and_each_parts_identity_on_the_store(
        kube: KubernetesEmulator, s3_bucket: str, tmp_path: Path) -> None:
    execution = role("diloco-exec", SAGEMAKER_TRUST, s3_bucket)
    pods = role("diloco-pods", IRSA_TRUST, None)  # the pods' role reaches no bucket
    kube.add_service_account("trainer", "ml", {"eks.amazonaws.com/role-arn": pods})
    config = tmp_path / "mixed.yaml"
    config.write_text(yaml.safe_dump({
        "backend": {"kind": "mixed", "parts": [
            {"kind": "eks", "replicas": 2, "namespace": "ml", "service_account": "trainer",
             "image": "registry.example/diloco:1"},
            {"kind": "sagemaker", "replicas": 1, "role_arn": execution, "region": "us-east-1"},
            {"kind": "local", "replicas": 1}]},
        "store": {"rendezvous": f"s3://{s3_bucket}/diloco/{{run_id}}"}}))
    result = CliRunner().invoke(app, ["doctor", "-c", str(config), "--s3", f"s3://{s3_bucket}/diloco", "-o", "json"])
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["s3 read/write"]["status"] == "pass"
    assert checks["parts[0] eks: service account"]["status"] == "pass", checks["parts[0] eks: service account"]
    assert checks["parts[1] sagemaker: sagemaker execution role"]["status"] == "pass"
    assert checks["parts[2] local: replica environment"]["status"] == "pass"
    sagemaker = checks["parts[1] sagemaker: identity can use the store"]
    assert sagemaker["status"] == "pass" and "inline policy 'rendezvous'" in sagemaker["detail"], sagemaker
    eks = checks["parts[0] eks: identity can use the store"]
    assert eks["status"] == "warn" and "the service account's role" in eks["detail"], eks
    assert "diloco-pods" in eks["detail"] and "diloco-pods" in eks["fix"]
    local = checks["parts[2] local: identity can use the store"]
    assert local["status"] == "pass" and "this machine's credentials" in local["detail"]
    assert result.exit_code == 0, result.stderr  # a role whose access cannot be proven warns, it does not fail


def test_doctor_for_a_mixed_run_without_parts_says_how_to_give_them(aws_env: str) -> None:
    result = CliRunner().invoke(app, ["doctor", "--backend", "mixed", "-o", "json"])
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["parts"]["status"] == "fail" and "--part KIND:N" in checks["parts"]["fix"]
    assert checks["s3 bucket"]["status"] == "fail", "a run split over backends meets in S3"
    assert result.exit_code == 1
