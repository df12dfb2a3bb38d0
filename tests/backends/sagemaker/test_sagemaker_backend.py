"""The SageMaker backend against the conformance suite, through real boto3 and the SageMaker emulator.

The emulator (tests/emulators/sagemaker.py) really runs each job as a local process and keeps SageMaker's
statuses, errors and CloudWatch logs; S3 and CloudWatch Logs are moto's. Jobs use a "ready image" (``image_uri``
set): the emulator's stand-in interpreter already has diloco, so these tests do not pay for shipping code; the
no-image path is covered end to end in tests/test_sagemaker_e2e.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from emulators.sagemaker import SageMakerEmulator

from diloco.executors.base import EntrypointArgs, LaunchPlan, LaunchSpec, ServerlessExecutor
from diloco.executors.sagemaker import SageMakerBackend, SageMakerBackendConfig
from diloco.executors.testing import FAKE_REPLICA, BackendCase, BackendConformance


class SageMakerCase(BackendCase):
    patience_s = 45.0

    def __init__(self, emulator: SageMakerEmulator, bucket: str) -> None:
        self.emulator = emulator
        self.bucket = bucket

    def backend(self) -> ServerlessExecutor[Any, Any]:
        return SageMakerBackend(SageMakerBackendConfig(
            role_arn=f"arn:aws:iam::{self.emulator.account_id}:role/diloco-conformance", region="us-east-1",
            image_uri="diloco-ready-image:test", log_poll_interval_s=0.2))

    def spec(self, run_id: str, replicas: int = 2, **behaviour: Any) -> LaunchSpec:
        """The suite's fake replicas, meeting (nominally) in S3: SageMaker jobs cannot reach a file:// store."""
        args = EntrypointArgs(rendezvous_uri=f"s3://{self.bucket}/conformance/{run_id}", world_size=replicas,
                              trainer="fake:train", trainer_kwargs=dict(behaviour))
        return LaunchSpec(run_id=run_id, replicas=replicas, entrypoint=FAKE_REPLICA, entrypoint_args=args)

    @contextlib.contextmanager
    def break_submit_at(self, backend: ServerlessExecutor[Any, Any], plan: LaunchPlan,
                        k: int) -> Iterator[LaunchPlan]:
        """The service refuses replica k's job for quota (ResourceLimitExceeded), as an exhausted account does."""
        self.emulator.refuse_create(nth=k + 1)
        yield plan

    def live(self, run_id: str) -> list[str]:
        """Jobs of the run still InProgress or Stopping, and any of their processes still alive."""
        return [j.name for j in self.emulator.jobs() if j.name.startswith(run_id) and (j.running or j.pid())]

    def documented_states(self, backend: ServerlessExecutor[Any, Any]) -> list[str]:
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
    from diloco.executors.sagemaker import check_quotas
    from diloco.launcher.doctor import DoctorContext

    ctx = DoctorContext.for_backend("sagemaker", None, region="us-east-1", **options)
    checks = {c.name: c for c in check_quotas(ctx)}
    assert set(checks) == set(expected)
    for name, (status, text) in expected.items():
        assert checks[name].status.value == status and text in checks[name].detail, checks[name]
    assert quotas.calls == 3  # five quotas, two per page: every page was read


def test_doctor_warns_when_the_quotas_cannot_be_read(aws_env: str) -> None:
    from diloco.executors.sagemaker import check_quotas
    from diloco.launcher.doctor import DoctorContext

    [check] = check_quotas(DoctorContext.for_backend("sagemaker", None, region="us-east-1"))
    assert check.status.value == "warn" and check.detail.startswith("cannot read the SageMaker quotas")


# ---------------------------------------------------------------------------------------------- relaunch
def test_a_failed_job_is_relaunched_as_a_new_job_with_the_same_request_and_followed(
    aws_env: str, s3_bucket: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crashed replica (exit 137, not a spot interruption) gets a new training job for its rank: the failed job's
    request under the next attempt's name; describe and logs follow the new job, cancel stops all of the rank's."""
    from diloco.executors.base import ReplicaState
    from diloco.executors.testing import wait_for_output, wait_until

    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=1.0,
                           log_flush_s=0.1) as emulator:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emulator.url)
        case = SageMakerCase(emulator, s3_bucket)
        backend = case.backend()
        assert backend.supports_relaunch
        run_id = "relaunch-test-run"
        handle = backend.submit(backend.plan(case.spec(run_id, replicas=2, sleep=60, lines=1)))
        wait_for_output(backend, handle, "line 0", timeout=45)
        first = handle.job_names[1]
        wait_until(backend, handle, {ReplicaState.RUNNING}, timeout=45)
        emulator.crash(first)
        deadline = time.monotonic() + 45
        while (failed := backend.describe(handle).replica(1)).state != ReplicaState.FAILED:
            assert time.monotonic() < deadline, failed
            time.sleep(0.1)
        assert failed.exit_code == 137 and failed.restarts == 0, failed

        handle = backend.relaunch(handle, 1)
        assert handle.job_names == [f"{run_id}-r0", f"{run_id}-r1-1"]
        old, new = emulator.job(first).request, emulator.job(f"{run_id}-r1-1").request
        def explicit(request: dict[str, Any]) -> dict[str, Any]:  # False is every flag's default
            return {k: v for k, v in request.items() if v is not False}

        assert explicit({**new, "TrainingJobName": first}) == explicit(old)  # the same request, a new name
        # on demand too, every job has the rank's checkpoint directory: the new job gets the old one's back
        assert new["CheckpointConfig"]["S3Uri"].endswith("/sagemaker/checkpoints/rank_1/")
        assert new["Environment"]["DILOCO_CHECKPOINT_DIR"] == new["CheckpointConfig"]["LocalPath"] == "/opt/ml/checkpoints"
        status = backend.describe(handle).replica(1)
        assert status.job_id == f"{run_id}-r1-1" and status.restarts == 1 and "relaunch 1" in (status.detail or "")
        deadline = time.monotonic() + 45  # rank 1's logs: the failed job's lines, then the new job's
        while [r.text for r in backend.logs(handle, [1])].count("rank 1 line 0") < 2:
            assert time.monotonic() < deadline, [r.text for r in backend.logs(handle, [1])]
            time.sleep(0.2)
        assert backend.rank_jobs(handle, 1) == [first, f"{run_id}-r1-1"]
        assert [r.run_id for r in backend.list_runs() if r.run_id == run_id] == [run_id]

        backend.cancel(handle)
        ended = wait_until(backend, handle, {ReplicaState.CANCELLED}, timeout=45)
        assert ended.state.value == "cancelled"
        assert case.live(run_id) == []
        billed = [emulator.job(n).describe().get("BillableTimeInSeconds", 0) for n in (first, f"{run_id}-r1-1")]
        assert ended.replica(1).billable_s == sum(billed)  # the failed job was billed too


def test_relaunch_job_names_fit_sagemakers_limit_and_pattern() -> None:
    from diloco.executors.sagemaker.backend import attempt_job_name, job_attempt
    from diloco.executors.sagemaker.config import JOB_NAME_MAX, JOB_NAME_RE

    for run_id in ("diloco-20261130-190915-0748", "x" * 70, "a-" * 40):
        names = [attempt_job_name(run_id, 17, attempt) for attempt in range(12)]
        assert len(set(names)) == 12
        for attempt, name in enumerate(names):
            assert len(name) <= JOB_NAME_MAX and JOB_NAME_RE.match(name), name
            assert job_attempt(name, 17) == attempt
