"""Every rank's checkpoint prefix is its own: SageMaker restores everything under a ``CheckpointConfig.S3Uri`` as a
string prefix (syne-tune/syne-tune#363), so ``.../rank_1`` would also pull ``rank_10`` .. ``rank_19`` into a
restarted or relaunched job of rank 1. The emulator restores the same way; the backend ends every prefix with ``/``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from emulators.sagemaker import SageMakerEmulator

from diloco.executors.base import EntrypointArgs, LaunchSpec, ReplicaState
from diloco.executors.sagemaker import SageMakerBackend, SageMakerBackendConfig, SageMakerRunHandle

TESTS_DIR = str(Path(__file__).resolve().parents[2])
REPLICAS = 12


def backend_for(emulator: SageMakerEmulator) -> SageMakerBackend:
    return SageMakerBackend(SageMakerBackendConfig(
        role_arn=f"arn:aws:iam::{emulator.account_id}:role/diloco-checkpoints", region="us-east-1",
        image_uri="diloco-ready-image:test", log_poll_interval_s=0.2))


def spec(bucket: str, run_id: str, **behaviour: Any) -> LaunchSpec:
    """Twelve fake replicas (tests/support/fake_replica.py) of one run, meeting in S3."""
    args = EntrypointArgs(rendezvous_uri=f"s3://{bucket}/ckpt/{run_id}", world_size=REPLICAS, trainer="fake:train",
                          trainer_kwargs=dict(behaviour))
    return LaunchSpec(run_id=run_id, replicas=REPLICAS, entrypoint="support.fake_replica", entrypoint_args=args,
                      env={"PYTHONPATH": TESTS_DIR})


def test_no_ranks_checkpoint_prefix_is_a_string_prefix_of_another(emulator: SageMakerEmulator) -> None:
    plan = backend_for(emulator).plan(spec("any-bucket", "ckpt-plan", exit=0))
    uris = [request["CheckpointConfig"]["S3Uri"] for request in plan.requests]
    assert all(uri.endswith(f"/checkpoints/rank_{rank}/") for rank, uri in enumerate(uris)), uris
    assert [(a, b) for a in uris for b in uris if a != b and b.startswith(a)] == []


def _restored(emulator: SageMakerEmulator, name: str) -> dict[str, bytes]:
    """What the job found in its checkpoint directory: SageMaker's restore, before the replica ran."""
    job = emulator.job(name)
    assert job.wait(timeout=60), f"{name} did not end"
    assert job.opt_ml is not None
    root = job.opt_ml / "checkpoints"
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_relaunched_job_of_rank_1_restores_only_rank_1s_checkpoints(
    emulator: SageMakerEmulator, s3_bucket: str
) -> None:
    """Objects under rank_1/, rank_10/ and rank_11/; rank 1's first job fails, its relaunch (a new job with the
    same CheckpointConfig) gets rank 1's objects back, and nothing of ranks 10 and 11."""
    import boto3

    backend = backend_for(emulator)
    run_id = f"ckpt-{int(time.time() * 1000) % 10**8}"
    plan = backend.plan(spec(s3_bucket, run_id, exit=1))
    base = plan.requests[1]["CheckpointConfig"]["S3Uri"].rsplit("/checkpoints/", 1)[0]
    bucket, _, prefix = base[len("s3://"):].partition("/")
    s3 = boto3.client("s3")
    for rank in (1, 10, 11):
        s3.put_object(Bucket=bucket, Key=f"{prefix}/checkpoints/rank_{rank}/inner/state.pt", Body=f"rank {rank}".encode())

    # only rank 1's job exists: submit would start all twelve, which this restore needs none of
    boto3.client("sagemaker").create_training_job(**plan.requests[1])
    first = plan.requests[1]["TrainingJobName"]
    handle = SageMakerRunHandle(run_id=run_id, replicas=REPLICAS, region="us-east-1",
                                job_names=[r["TrainingJobName"] for r in plan.requests])
    assert _restored(emulator, first) == {"inner/state.pt": b"rank 1"}
    deadline = time.monotonic() + 30
    while backend.describe(handle).replica(1).state != ReplicaState.FAILED:
        assert time.monotonic() < deadline
        time.sleep(0.1)

    handle = backend.relaunch(handle, 1)
    assert handle.job_names[1] == f"{run_id}-r1-1"
    assert _restored(emulator, handle.job_names[1]) == {"inner/state.pt": b"rank 1"}
