"""What a user types for SageMaker is checked before anything is uploaded, recorded or sent, and the plan says
what the run may cost and which bucket permission it relies on.

Through the real CLI (a subprocess) against the SageMaker emulator and moto's S3/IAM, nothing patched:

* a malformed role ARN, an unknown instance type or region is refused at plan time, by ``--dry-run`` and by a real
  launch alike: exit 2, one line naming the setting and the fix, no object under the prefix, no run record, no
  SageMaker call (the service would refuse them only after the code was uploaded);
* the price per hour of the run and its cost at the time limit are in ``--dry-run -o json`` and printed before a
  real submit;
* a bucket outside ``AmazonSageMakerFullAccess``' S3 scope gets a warning at plan time; doctor's fix matches the
  bucket's case;
* a missing role is reported after one bounded attempt to list the account's roles, even when IAM never answers.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.sagemaker import SageMakerEmulator
from support.commands import run_cli as cli

ROLE = "arn:aws:iam::000000000000:role/diloco-inputs"
IMAGE = "000000000000.dkr.ecr.us-east-1.amazonaws.com/diloco:1"  # a ready image: nothing to ship
TABLE_A100 = 37.688  # diloco's price table, ml.p4d.24xlarge (us-east-1); the Price List API is not asked here


def launch(bucket: str, *extra: str) -> list[str]:
    return ["launch", "--backend", "sagemaker", "--replicas", "2", "--rendezvous", f"s3://{bucket}/in/{{run_id}}",
            "--steps", "2", "--sync-every", "1", *extra]


def error_lines(out: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.strip()]


def recorded_runs(home: Path, cwd: Path) -> list[Any]:
    out = cli("runs", "-o", "json", home=home, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["runs"]


# ---------------------------------------------------------------------------------------------------- inputs
BAD_INPUTS = [
    pytest.param(["--role", "arn:aws:iam::role/any"], ["backend.role_arn", "12-digit account",
                                                        "arn:aws:iam::<account>:role/any"], id="role-without-account"),
    pytest.param(["--role", "MySageMakerRole"], ["backend.role_arn", "a role name, not its ARN",
                                                 "arn:aws:iam::<account>:role/MySageMakerRole"], id="bare-role-name"),
    pytest.param(["--role", ROLE, "--instance-type", "ml.m5.huge"],
                 ["backend.instance_type", "'ml.m5.huge'", "did you mean ml.m5.large"], id="unknown-instance-type"),
    pytest.param(["--role", ROLE, "--instance-type", "m5.xlarge"],
                 ["backend.instance_type", "did you mean ml.m5.xlarge"], id="instance-type-without-ml"),
    pytest.param(["--role", ROLE, "--region", "us-east1", "--image", IMAGE],
                 ["backend.region", "'us-east1'", "did you mean us-east-1"], id="unknown-region-with-image"),
    pytest.param(["--role", ROLE, "--region", "us-east1"], ["backend.region", "did you mean us-east-1"],
                 id="unknown-region"),
]


@pytest.mark.parametrize(("extra", "expected"), BAD_INPUTS)
def test_bad_input_is_refused_at_plan_time_by_dry_run_and_launch_alike(
    emulator: SageMakerEmulator, s3_bucket: str, bucket_keys: Callable[[str], list[str]], tmp_path: Path,
    extra: list[str], expected: list[str],
) -> None:
    home = tmp_path / "home"
    for mode in (["--dry-run", "-o", "json"], ["--detach"]):
        out = cli(*launch(s3_bucket, *extra, *mode), home=home, cwd=tmp_path)
        lines = error_lines(out)
        assert out.returncode == 2, out.stderr
        assert len(lines) == 1 and lines[0].startswith("diloco: error: "), out.stderr
        for part in expected:
            assert part in lines[0], lines[0]
        assert "bug in the request diloco built" not in lines[0]
        assert out.stdout == ""
    assert bucket_keys(s3_bucket) == []  # nothing uploaded: no code, no run.json
    assert recorded_runs(home, tmp_path) == []
    assert emulator.calls == []


def test_a_request_field_the_service_would_refuse_names_the_setting_not_a_bug(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path,
) -> None:
    """A value only the service's model constrains (a tag key's pattern) is the user's, and the line says which
    setting holds it, before anything is sent."""
    out = cli(*launch(s3_bucket, "--role", ROLE, "--set", "backend.tags={'bad key!': 'x'}", "--dry-run"),
              home=tmp_path / "home", cwd=tmp_path)
    lines = error_lines(out)
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "backend.tags" in lines[0] and "Tags" in lines[0] and "bug" not in lines[0], lines[0]
    assert emulator.calls == []


def test_a_bare_role_name_is_answered_with_that_roles_arn_when_iam_knows_it(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path,
) -> None:
    import boto3

    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                     "Principal": {"Service": "sagemaker.amazonaws.com"}}]}
    arn = boto3.client("iam").create_role(RoleName="MySageMakerRole", Path="/service-role/",
                                          AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    out = cli(*launch(s3_bucket, "--role", "MySageMakerRole", "--dry-run"), home=tmp_path / "home", cwd=tmp_path)
    lines = error_lines(out)
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert f"pass --role {arn}" in lines[0] and "service-role/MySageMakerRole" in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------------- hints
class SilentServer:
    """A loopback TCP server that accepts connections, reads, and never answers: an IAM endpoint that hangs.
    ``connections`` counts the attempts a client made."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self._held: list[socket.socket] = []
        self._done = threading.Event()
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._done.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self.connections += 1
            self._held.append(conn)  # kept open and unanswered until the server stops

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        for conn in self._held:
            conn.close()
        self._sock.close()


@pytest.fixture
def silent_iam() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.stop()


def test_a_missing_role_is_reported_after_one_bounded_attempt_when_iam_never_answers(
    aws_env: str, silent_iam: SilentServer, tmp_path: Path,
) -> None:
    out = cli("launch", "--backend", "sagemaker", "--region", "us-east-1", "--rendezvous", "s3://b/x/{run_id}",
              "--dry-run", home=tmp_path / "home", cwd=tmp_path, env={"AWS_ENDPOINT_URL_IAM": silent_iam.url},
              timeout=90)  # one attempt is bounded by seconds; botocore's defaults retry for minutes
    lines = error_lines(out)
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "backend.role_arn: the SageMaker execution role is required" in lines[0]
    assert lines[0].endswith("(pass --role arn:aws:iam::<account>:role/<name> or set backend.role_arn)"), lines[0]
    assert silent_iam.connections == 1  # one attempt, no retry


# ---------------------------------------------------------------------------------------------------- cost
def test_the_dry_run_carries_the_hourly_price_and_the_cost_at_the_time_limit(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path,
) -> None:
    out = cli(*launch(s3_bucket, "--role", ROLE, "--gpu", "A100", "--dry-run", "-o", "json"),
              home=tmp_path / "home", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cost = json.loads(out.stdout)["cost"]
    assert cost["usd_per_hour"] == pytest.approx(2 * TABLE_A100)
    assert cost["time_limit_s"] == 86400  # the default timeout_s, every job's MaxRuntimeInSeconds
    assert cost["usd_at_time_limit"] == pytest.approx(2 * TABLE_A100 * 24)
    assert cost["spot_upper_bound"] is False and "price table" in cost["source"]
    assert f"${2 * TABLE_A100:,.2f} per hour" in out.stderr and f"${2 * TABLE_A100 * 24:,.2f}" in out.stderr

    spot = cli(*launch(s3_bucket, "--role", ROLE, "--gpu", "A100", "--spot", "--timeout", "3600", "--dry-run",
                       "-o", "json"), home=tmp_path / "home", cwd=tmp_path)
    assert spot.returncode == 0, spot.stderr
    cost = json.loads(spot.stdout)["cost"]
    assert cost["spot_upper_bound"] is True and cost["usd_at_time_limit"] == pytest.approx(2 * TABLE_A100)
    assert "upper bound" in spot.stderr
    assert emulator.calls == []


def test_a_real_launch_prints_the_same_cost_before_it_submits(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path,
) -> None:
    args = launch(s3_bucket, "--role", ROLE, "--gpu", "A100", "--image", IMAGE)
    plan = cli(*args, "--dry-run", "-o", "json", home=tmp_path / "home", cwd=tmp_path)
    cost = json.loads(plan.stdout)["cost"]
    emulator.refuse_create(nth=1)  # the service refuses the first job: whatever was printed came before submitting
    out = cli(*args, "--detach", home=tmp_path / "home", cwd=tmp_path)
    assert out.returncode != 0, out.stderr
    lines = error_lines(out)
    [cost_line] = [i for i, line in enumerate(lines) if line.startswith("estimated cost:")]
    [error] = [i for i, line in enumerate(lines) if line.startswith("diloco: error:")]
    assert cost_line < error and "ResourceLimitExceeded" in lines[error], out.stderr
    assert f"${cost['usd_per_hour']:,.2f} per hour" in lines[cost_line]
    [warning] = [i for i, line in enumerate(lines) if line.startswith("warning:")]
    assert warning < error and "AmazonSageMakerFullAccess" in lines[warning]  # the bucket gotcha, before submit
    assert f"${cost['usd_at_time_limit']:,.2f} if every job runs to its time limit" in lines[cost_line]
    assert emulator.operation_calls("CreateTrainingJob")


# ---------------------------------------------------------------------------------------------------- bucket gotcha
def test_a_bucket_outside_the_managed_policys_scope_is_warned_about_at_plan_time(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path,
) -> None:
    assert "sagemaker" not in s3_bucket
    out = cli(*launch(s3_bucket, "--role", ROLE, "--dry-run", "-o", "json"), home=tmp_path / "home", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    [warning] = json.loads(out.stdout)["warnings"]
    assert warning.startswith("if the execution role relies on AmazonSageMakerFullAccess") and s3_bucket in warning
    assert f"warning: {warning}" in out.stderr.splitlines()

    named = cli(*launch("sagemaker-diloco-inputs", "--role", ROLE, "--dry-run", "-o", "json"),
                home=tmp_path / "home", cwd=tmp_path)
    assert named.returncode == 0, named.stderr
    assert json.loads(named.stdout)["warnings"] == [] and "warning:" not in named.stderr

    elsewhere = cli(*launch("sagemaker-diloco-inputs", "--role", ROLE, "--set",
                            f"backend.output_s3_uri=s3://{s3_bucket}/out", "--dry-run", "-o", "json"),
                    home=tmp_path / "home", cwd=tmp_path)  # code, checkpoints and model go to the output bucket
    assert [s3_bucket in w for w in json.loads(elsewhere.stdout)["warnings"]] == [True]
    assert emulator.calls == []


ROLE_TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


@pytest.mark.parametrize(("bucket", "wanted", "unwanted"), [
    pytest.param("sagemaker-diloco-bucket", ["inline policy", "attach AmazonSageMakerFullAccess (it covers"],
                 ["use a bucket whose name contains"], id="sagemaker-named-bucket"),
    pytest.param("plain-diloco-bucket",
                 ["inline policy", "attach AmazonSageMakerFullAccess and use a bucket whose name contains"], [],
                 id="plain-bucket"),
])
def test_doctors_fix_for_a_role_without_s3_access_matches_the_buckets_name(
    aws_env: str, bucket: str, wanted: list[str], unwanted: list[str],
) -> None:
    """(A role with AmazonSageMakerFullAccess and a plain bucket: tests/test_doctor.py.)"""
    import boto3

    from diloco.launcher.doctor import DoctorContext, Status, run_doctor

    boto3.client("s3").create_bucket(Bucket=bucket)
    arn = boto3.client("iam").create_role(RoleName="diloco-fix",
                                          AssumeRolePolicyDocument=json.dumps(ROLE_TRUST))["Role"]["Arn"]
    report = run_doctor(DoctorContext.for_backend("sagemaker", f"s3://{bucket}/diloco", role_arn=arn))
    check = next(c for c in report.checks if c.name == "role can reach bucket")
    assert check.status == Status.WARN, check
    for part in wanted:
        assert part in check.fix, check.fix
    for part in unwanted:
        assert part not in check.fix, check.fix


# ---------------------------------------------------------------------------------------------------- doctor
def test_doctors_quota_row_is_one_line_when_the_endpoint_is_not_the_quotas_api(aws_env: str) -> None:
    """moto (``AWS_ENDPOINT_URL``) has no Service Quotas API and answers HTTP 500 with an HTML page."""
    from diloco.executors.sagemaker import check_quotas
    from diloco.launcher.doctor import DoctorContext, Status

    [check] = check_quotas(DoctorContext.for_backend("sagemaker", None, region="us-east-1"))
    assert check.status == Status.WARN
    assert "\n" not in check.detail and "<" not in check.detail, check.detail
    assert "HTTP 500" in check.detail and aws_env in check.detail, check.detail
    assert "AWS_ENDPOINT_URL_SERVICE_QUOTAS" in check.fix
