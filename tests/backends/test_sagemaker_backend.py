"""The SageMaker backend against the conformance suite, through real boto3 and the SageMaker emulator.

The emulator (tests/emulators/sagemaker.py) really runs each job as a local process and keeps SageMaker's
statuses, errors and CloudWatch logs; S3 and CloudWatch Logs are moto's. Jobs use a "ready image" (``image_uri``
set): the emulator's stand-in interpreter already has diloco, so these tests do not pay for shipping code; the
no-image path is covered end to end in tests/test_sagemaker_e2e.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from conformance import TESTS_DIR, BackendCase, BackendConformance
from emulators.sagemaker import SageMakerEmulator

from diloco.executors.base import Backend, EntrypointArgs, LaunchPlan, LaunchSpec
from diloco.executors.sagemaker import SageMakerBackend, SageMakerBackendConfig


class SageMakerCase(BackendCase):
    patience_s = 45.0

    def __init__(self, emulator: SageMakerEmulator, bucket: str) -> None:
        self.emulator = emulator
        self.bucket = bucket

    def backend(self) -> Backend[Any, Any]:
        return SageMakerBackend(SageMakerBackendConfig(
            role_arn=f"arn:aws:iam::{self.emulator.account_id}:role/diloco-conformance", region="us-east-1",
            image_uri="diloco-ready-image:test", log_poll_interval_s=0.2))

    def spec(self, run_id: str, replicas: int = 2, **behaviour: Any) -> LaunchSpec:
        """The suite's fake replicas, meeting (nominally) in S3: SageMaker jobs cannot reach a file:// store."""
        args = EntrypointArgs(rendezvous_uri=f"s3://{self.bucket}/conformance/{run_id}", world_size=replicas,
                              trainer="fake:train", trainer_kwargs=dict(behaviour))
        return LaunchSpec(run_id=run_id, replicas=replicas, entrypoint="fake_replica", entrypoint_args=args,
                          env={"PYTHONPATH": TESTS_DIR})

    @contextlib.contextmanager
    def break_submit_at(self, backend: Backend[Any, Any], plan: LaunchPlan, k: int) -> Iterator[LaunchPlan]:
        """The service refuses replica k's job for quota (ResourceLimitExceeded), as an exhausted account does."""
        self.emulator.refuse_create(nth=k + 1)
        yield plan

    def live(self, run_id: str) -> list[str]:
        """Jobs of the run still InProgress or Stopping, and any of their processes still alive."""
        return [j.name for j in self.emulator.jobs() if j.name.startswith(run_id) and (j.running or j.pid())]

    def documented_states(self, backend: Backend[Any, Any]) -> list[str]:
        """Every SecondaryStatus and TrainingJobStatus in botocore's SageMaker model."""
        import botocore.session

        model = botocore.session.get_session().get_service_model("sagemaker")
        return [*model.shape_for("SecondaryStatus").enum, *model.shape_for("TrainingJobStatus").enum]

    def restart_env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL_SAGEMAKER": self.emulator.url}


class TestSageMakerBackend(BackendConformance):
    @pytest.fixture
    def case(self, aws_env: str, s3_bucket: str, tmp_path: Any,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[SageMakerCase]:
        with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=1.0,
                               log_flush_s=0.1) as emulator:
            monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emulator.url)
            yield SageMakerCase(emulator, s3_bucket)


# ---------------------------------------------------------------------------------------------- doctor: quotas
QUOTAS = {"ml.m5.xlarge for training job usage": 4, "ml.m5.xlarge for spot training job usage": 2,
          "ml.m5.xlarge for training warm pool usage": 0, "ml.g5.xlarge for training job usage": 0,
          "ml.g5.xlarge for training warm pool usage": 1}


@pytest.fixture
def quotas(aws_env: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from emulators.sagemaker_quotas import QuotasEmulator

    server = QuotasEmulator(QUOTAS).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL_SERVICE_QUOTAS", server.url)
    yield server
    server.stop()


@pytest.mark.parametrize(("options", "expected"), [
    ({"instance_type": "ml.m5.xlarge"},
     {"training quota": ("pass", "'ml.m5.xlarge for training job usage' is 4")}),
    ({"instance_type": "ml.m5.xlarge", "use_spot": True},
     {"training quota": ("pass", "'ml.m5.xlarge for spot training job usage' is 2")}),
    ({"instance_type": "ml.m5.xlarge", "keep_alive_period_s": 600},
     {"training quota": ("pass", "is 4"), "warm pool quota": ("warn", "--keep-alive 600 would be ignored")}),
    ({"instance_type": "ml.g5.xlarge", "keep_alive_period_s": 600},
     {"training quota": ("fail", "every job would be refused (ResourceLimitExceeded)"),
      "warm pool quota": ("pass", "is 1")}),
    ({"instance_type": "ml.p5.48xlarge"}, {"training quota": ("warn", "no quota named")}),
])
def test_doctor_reads_the_accounts_training_and_warm_pool_quotas(
    quotas: Any, options: dict[str, Any], expected: dict[str, tuple[str, str]]
) -> None:
    from diloco.doctor import DoctorContext
    from diloco.executors.sagemaker import check_quotas

    ctx = DoctorContext.for_backend("sagemaker", None, region="us-east-1", **options)
    checks = {c.name: c for c in check_quotas(ctx)}
    assert set(checks) == set(expected)
    for name, (status, text) in expected.items():
        assert checks[name].status.value == status and text in checks[name].detail, checks[name]
    assert quotas.calls == 3  # five quotas, two per page: every page was read


def test_doctor_warns_when_the_quotas_cannot_be_read(aws_env: str) -> None:
    from diloco.doctor import DoctorContext
    from diloco.executors.sagemaker import check_quotas

    [check] = check_quotas(DoctorContext.for_backend("sagemaker", None, region="us-east-1"))
    assert check.status.value == "warn" and check.detail.startswith("cannot read the SageMaker quotas")
