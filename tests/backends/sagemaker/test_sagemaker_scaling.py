"""Growing a live SageMaker run (``add_ranks``) and keeping asking for spot capacity, through real boto3 against the
SageMaker emulator, whose jobs are real local processes running the torch-free ``fake_replica``.

The conformance suite (``test_sagemaker_backend.py``) checks what every backend's ``add_ranks`` does; here: the new
jobs are SageMaker jobs like the first ones (names, tags, checkpoint prefixes, no code shipped again), and a spot
replica refused for capacity (``CapacityError``) under ``--max-replicas`` waits as pending and is asked for again,
instead of failing the run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from emulators.sagemaker import SageMakerEmulator

from diloco.errors import BackendError, ConfigError
from diloco.executors.base import EntrypointArgs, LaunchSpec, ReplicaState, RunState
from diloco.executors.sagemaker import SageMakerBackend, SageMakerBackendConfig
from diloco.executors.testing import FAKE_REPLICA, wait_for_output, wait_until

PATIENCE_S = 45.0


@pytest.fixture
def emulator(aws_env: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[SageMakerEmulator]:
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=1.0,
                           log_flush_s=0.1) as emu:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emu.url)
        yield emu


def _backend(emulator: SageMakerEmulator, **config: Any) -> SageMakerBackend:
    return SageMakerBackend(SageMakerBackendConfig(
        role_arn=f"arn:aws:iam::{emulator.account_id}:role/diloco-scaling", region="us-east-1",
        image_uri="diloco-ready-image:test", log_poll_interval_s=0.2, **config))


def _spec(bucket: str, run_id: str, max_replicas: int | None = None, **behaviour: Any) -> LaunchSpec:
    args = EntrypointArgs(rendezvous_uri=f"s3://{bucket}/scaling/{run_id}", world_size=2, trainer="fake:train",
                          trainer_kwargs=dict(behaviour))
    return LaunchSpec(run_id=run_id, replicas=2, entrypoint=FAKE_REPLICA, entrypoint_args=args,
                      max_replicas=max_replicas)


def _live(emulator: SageMakerEmulator, run_id: str) -> list[str]:
    return [j.name for j in emulator.jobs() if j.name.startswith(run_id) and (j.running or j.pid())]


def test_new_ranks_are_jobs_like_the_first_ones_and_cancel_reaches_them(
    emulator: SageMakerEmulator, s3_bucket: str
) -> None:
    backend = _backend(emulator)
    run_id = "grow-sm"
    spec = _spec(s3_bucket, run_id, sleep=60, lines=1, announce_world=True)
    handle = backend.submit(backend.plan(spec))
    wait_until(backend, handle, {ReplicaState.RUNNING}, PATIENCE_S)
    grown = backend.add_ranks(handle, [2, 3], spec)
    assert grown.job_names == [f"{run_id}-r{r}" for r in range(4)] and grown.own_ranks == [0, 1, 2, 3]
    first, added = emulator.job(f"{run_id}-r1").request, emulator.job(f"{run_id}-r3").request
    assert {t["Key"]: t["Value"] for t in added["Tags"]}["diloco:rank"] == "3"
    assert added["CheckpointConfig"]["S3Uri"].endswith("/sagemaker/checkpoints/rank_3/")
    assert (added["Environment"]["REPLICA_RANK"], added["Environment"]["WORLD_SIZE"]) == ("3", "4")
    same = ("AlgorithmSpecification", "ResourceConfig", "StoppingCondition", "OutputDataConfig", "RoleArn")
    assert {k: added[k] for k in same} == {k: first[k] for k in same}
    assert len(emulator.operation_calls("CreateTrainingJob")) == 4

    wait_for_output(backend, grown, "line 0", PATIENCE_S)
    assert "rank 3 of world size 4" in [r.text for r in backend.logs(grown, [3])]
    with pytest.raises(ConfigError, match="ranks"):
        backend.add_ranks(grown, [3, 4], spec)
    backend.cancel(grown)
    assert wait_until(backend, grown, {ReplicaState.CANCELLED}, PATIENCE_S).state == RunState.CANCELLED
    deadline = time.monotonic() + PATIENCE_S
    while _live(emulator, run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _live(emulator, run_id) == []


def test_a_refused_add_stops_what_it_created_and_leaves_the_run_as_it_was(
    emulator: SageMakerEmulator, s3_bucket: str
) -> None:
    """The account's quota refuses rank 3's job (ResourceLimitExceeded): rank 2's job, created by the same call, is
    stopped; ranks 0 and 1 train on."""
    backend = _backend(emulator)
    run_id = "grow-sm-quota"
    spec = _spec(s3_bucket, run_id, sleep=60, lines=1)
    handle = backend.submit(backend.plan(spec))
    wait_until(backend, handle, {ReplicaState.RUNNING}, PATIENCE_S)
    emulator.refuse_create(nth=2)
    with pytest.raises(BackendError, match="new replica 3"):
        backend.add_ranks(handle, [2, 3], spec)
    deadline = time.monotonic() + PATIENCE_S
    while emulator.job(f"{run_id}-r2").running and time.monotonic() < deadline:
        time.sleep(0.2)
    assert emulator.job(f"{run_id}-r2").describe()["TrainingJobStatus"] == "Stopped"
    assert [r.state for r in backend.describe(handle).replicas] == [ReplicaState.RUNNING] * 2
    backend.cancel(handle)
    wait_until(backend, handle, {ReplicaState.CANCELLED}, PATIENCE_S)


def test_a_spot_replica_refused_for_capacity_waits_and_is_asked_for_again(
    emulator: SageMakerEmulator, s3_bucket: str
) -> None:
    """Spot with ``--max-replicas``: SageMaker refuses capacity for the added rank 2 twice (its job fails while
    Starting with ``CapacityError``). The rank reads as pending, the run as running, nothing counts as a restart,
    and ``ask_again_for_capacity`` creates a new job for it once ``capacity_retry_s`` has passed, until one gets
    an instance. Without the policy, the same refusal is a failure (relaunched within --max-restarts)."""
    backend = _backend(emulator, use_spot=True, capacity_retry_s=0.5)
    run_id = "grow-sm-spot"
    spec = _spec(s3_bucket, run_id, max_replicas=4, sleep=60, lines=1)
    handle = backend.submit(backend.plan(spec))
    assert handle.capacity_retry_s == 0.5
    wait_until(backend, handle, {ReplicaState.RUNNING}, PATIENCE_S)
    emulator.refuse_capacity(2)
    handle = backend.add_ranks(handle, [2], spec)
    refused = f"{run_id}-r2"
    deadline = time.monotonic() + PATIENCE_S
    while emulator.job(refused).describe()["TrainingJobStatus"] != "Failed":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert emulator.job(refused).describe()["FailureReason"].startswith("CapacityError: Unable to provision")
    status = backend.describe(handle)
    waiting = status.replica(2)
    assert waiting.state == ReplicaState.PENDING and waiting.restarts == 0, waiting
    assert "waiting for capacity" in (waiting.reason or "") and status.state == RunState.PENDING
    asked: list[str] = []
    while (current := handle.job_of(2)) is not None and not emulator.job(current).running:
        assert time.monotonic() < deadline, [j.describe().get("FailureReason") for j in emulator.jobs()]
        handle = backend.ask_again_for_capacity(handle)
        if handle.job_of(2) != current:
            asked.append(handle.job_of(2) or "")
        time.sleep(0.2)
    assert asked == [f"{run_id}-r2-1", f"{run_id}-r2-2"], asked  # refused twice, the third job got capacity
    running = wait_until(backend, handle, {ReplicaState.RUNNING}, PATIENCE_S)
    assert running.state == RunState.RUNNING and running.replica(2).restarts == 0, running
    assert running.replica(2).job_id == f"{run_id}-r2-2"

    # the same refusal without --max-replicas: a failure, as before
    plain = _backend(emulator, use_spot=True, capacity_retry_s=0.5)
    emulator.refuse_capacity(1)
    other = plain.submit(plain.plan(_spec(s3_bucket, "grow-sm-plain", sleep=60, lines=1).model_copy(
        update={"replicas": 1})))
    assert other.capacity_retry_s is None
    while (failed := plain.describe(other).replica(0)).state != ReplicaState.FAILED:
        assert time.monotonic() < deadline, failed
        time.sleep(0.1)
    assert failed.failure is not None and failed.failure.failure_class.value == "capacity"
    assert plain.ask_again_for_capacity(other) == other
    backend.cancel(handle)
    wait_until(backend, handle, {ReplicaState.CANCELLED}, PATIENCE_S)
