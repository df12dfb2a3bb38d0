"""The account's SageMaker instance quota is read before the first CreateTrainingJob: a launch that could not fit is
refused in one line with nothing created; when the quotas cannot be read the launch goes on as before, and a
rollback then says each step as it takes it.

Real CLI and boto3; Service Quotas is ``emulators.sagemaker_quotas`` (found through
``AWS_ENDPOINT_URL_SERVICE_QUOTAS``), enforcing the same limit as the SageMaker emulator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from emulators.aws_iam import CallerPolicy
from emulators.sagemaker import SageMakerEmulator
from emulators.sagemaker_quotas import QuotasEmulator
from support.commands import run_cli as cli
from support.sagemaker_jobs import role

pytestmark = pytest.mark.slow

INSTANCE = "ml.m5.xlarge"


def start_quotas(monkeypatch: pytest.MonkeyPatch, quotas: dict[str, float],
                 policy: CallerPolicy | None = None) -> QuotasEmulator:
    """Service Quotas with these SageMaker quotas among a few others, in pages of 2 (a reader must follow them)."""
    others = {f"ml.c5.{n}xlarge for training job usage": 4.0 for n in (2, 4, 9)}
    service = QuotasEmulator({**others, **quotas}, page_size=2, policy=policy).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL_SERVICE_QUOTAS", service.url)
    return service


@pytest.fixture
def quotas_off() -> Iterator[list[QuotasEmulator]]:
    """The Service Quotas endpoints a test started, stopped at its end."""
    started: list[QuotasEmulator] = []
    yield started
    for service in started:
        service.stop()


def launch_args(emulator: SageMakerEmulator, bucket: str, *extra: str) -> list[str]:
    return ["launch", "--backend", "sagemaker", "--role", role(emulator), "--region", "us-east-1",
            "--instance-type", INSTANCE, "--rendezvous", f"s3://{bucket}/quota/{{run_id}}", *extra]


@pytest.mark.parametrize(("spot", "quota"), [(False, f"{INSTANCE} for training job usage"),
                                             (True, f"{INSTANCE} for spot training job usage")])
def test_more_replicas_than_the_quota_are_refused_before_any_job_is_created(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    bucket_keys: Callable[[str], list[str]], quotas_off: list[QuotasEmulator], spot: bool, quota: str
) -> None:
    """3 replicas against a quota of 2: exit 2 in one line naming the quota, the count and both fixes, and no
    CreateTrainingJob, no object (SageMaker would have taken 2 jobs, refused the third, and had them stopped)."""
    other = f"{INSTANCE} for {'' if spot else 'spot '}training job usage"
    quotas_off.append(start_quotas(monkeypatch, {quota: 2.0, other: 100.0}))
    emulator.set_instance_limit(INSTANCE, 2)
    out = cli(*launch_args(emulator, s3_bucket, "--replicas", "3", *(["--spot"] if spot else [])),
              home=tmp_path / "home", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco: error: --replicas: 3 replicas"), out.stderr
    assert f"over the account's quota '{quota}'" in lines[0] and "of 2 in us-east-1" in lines[0], lines[0]
    assert f"request an increase of '{quota}' in Service Quotas" in lines[0], lines[0]
    assert "launch at most 2 replica(s) of this type (--replicas)" in lines[0], lines[0]
    assert emulator.operation_calls("CreateTrainingJob") == [] and emulator.jobs() == []
    assert bucket_keys(s3_bucket) == []


def test_unreadable_quotas_launch_as_before_and_the_rollback_says_each_step(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    bucket_keys: Callable[[str], list[str]], quotas_off: list[QuotasEmulator]
) -> None:
    """Without servicequotas:ListServiceQuotas the launch goes on; SageMaker refuses the second job, and the
    rollback prints a line as it stops the first, as that job ends and as the prefix goes."""
    service = start_quotas(monkeypatch, {f"{INSTANCE} for training job usage": 1.0},
                           policy=CallerPolicy(["sagemaker:*"]))
    quotas_off.append(service)
    emulator.set_instance_limit(INSTANCE, 1)
    out = cli(*launch_args(emulator, s3_bucket, "--replicas", "2", "-o", "json"), home=tmp_path / "home",
              cwd=tmp_path)
    assert out.returncode == 3, out.stderr[-3000:]
    assert service.iam_actions.denied() == ["servicequotas:ListServiceQuotas"]  # it tried, and went on
    errors = [line for line in out.stderr.splitlines() if line.startswith("diloco: error:")]
    assert len(errors) == 1 and "ResourceLimitExceeded" in errors[0] and "replica 1" in errors[0], out.stderr
    first = emulator.jobs()[0].name
    steps = [line for line in out.stderr.splitlines() if line.startswith("diloco: rolling back:")]
    assert steps[:2] == [f"diloco: rolling back: stopping SageMaker training job {first} ...",
                         f"diloco: rolling back: {first} stopped"], out.stderr
    assert steps[2].startswith("diloco: rolling back: deleting s3://") and \
        steps[3].startswith("diloco: rolling back: deleted "), out.stderr
    assert len(steps) == 4, out.stderr  # the refused job was never created: nothing to stop
    assert [j.name for j in emulator.jobs()] == [first]
    assert bucket_keys(s3_bucket) == []
