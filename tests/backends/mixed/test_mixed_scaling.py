"""Growing one part of a run split over backends (``add_ranks_on``, ``diloco scale --part KIND:+K``): a local part
(real processes) and a Kubernetes part (the API emulator, its pods local processes), each replica the torch-free
``fake_replica``. New ranks come after every rank of the run, whichever part runs them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from emulators.kubernetes import KubernetesEmulator

from diloco.errors import ConfigError
from diloco.executors.base import ReplicaState, RunState
from diloco.executors.local_supervisor import processes_with_env
from diloco.executors.mixed import MixedBackend, MixedBackendConfig
from diloco.executors.testing import BackendCase, wait_for_output, wait_until

NAMESPACE = "mixed-scaling"
PATIENCE_S = 30.0


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[KubernetesEmulator]:
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE) as kube:
        yield kube


def _backend(emulator: KubernetesEmulator, tmp_path: Path) -> MixedBackend:
    return MixedBackend(MixedBackendConfig(parts=[
        {"kind": "local", "replicas": 1, "log_root": str(tmp_path / "runs"), "grace_period_s": 1.0},
        {"kind": "eks", "replicas": 1, "image": "python:3.11-slim", "namespace": NAMESPACE,
         "kubeconfig": str(emulator.kubeconfig), "grace_period_s": 1, "max_failed_indexes": 1,
         "state_dir": str(tmp_path / "state"), "log_poll_interval_s": 0.2}]))


def _nothing_left(emulator: KubernetesEmulator, run_id: str) -> bool:
    return not processes_with_env("DILOCO_RUN_ID", run_id) and not emulator.live_processes()


def test_a_named_part_grows_and_the_run_covers_its_new_ranks(emulator: KubernetesEmulator, tmp_path: Path) -> None:
    backend = _backend(emulator, tmp_path)
    run_id = f"grow-mixed-{int(time.time() * 1000) % 10**6}"
    spec = BackendCase().spec(run_id, 2, sleep=120, lines=1, announce_world=True, env_out=str(tmp_path))
    handle = backend.submit(backend.plan(spec))
    try:
        wait_until(backend, handle, {ReplicaState.RUNNING}, PATIENCE_S)
        handle = backend.add_ranks_on(handle, "eks", [2, 3], spec)
        assert [(p.backend, p.ranks) for p in handle.parts] == [("local", [0]), ("eks", [1, 2, 3])]
        handle = backend.add_ranks_on(handle, "local", [4], spec)  # local's ranks are now 0 and 4
        assert [(p.backend, p.ranks) for p in handle.parts] == [("local", [0, 4]), ("eks", [1, 2, 3])]
        assert handle.own_ranks == [0, 1, 2, 3, 4]
        assert backend.ask_again_for_capacity(handle) is handle, "no part of it was refused capacity"
        status = wait_until(backend, handle, {ReplicaState.RUNNING}, PATIENCE_S)
        assert [(r.rank, r.backend) for r in status.replicas] == [
            (0, "local"), (1, "eks"), (2, "eks"), (3, "eks"), (4, "local")], status
        wait_for_output(backend, handle, "line 0", PATIENCE_S)
        assert "rank 3 of world size 4" in [r.text for r in backend.logs(handle, [3])]
        assert "rank 4 of world size 5" in [r.text for r in backend.logs(handle, [4])]
        env = json.loads((tmp_path / "rank_4.json").read_text())["env"]
        assert (env["REPLICA_RANK"], env["WORLD_SIZE"]) == ("4", "5")

        backend.cancel(handle, ranks=[2, 4])
        some = wait_until(backend, handle, {ReplicaState.RUNNING, ReplicaState.CANCELLED}, PATIENCE_S)
        assert [r.rank for r in some.replicas if r.state == ReplicaState.CANCELLED] == [2, 4], some
    finally:
        backend.cancel(handle)
    assert backend.wait(handle, timeout_s=PATIENCE_S, poll_interval_s=0.2).state == RunState.CANCELLED
    emulator.wait_for(lambda: _nothing_left(emulator, run_id), timeout=PATIENCE_S)
    removed = backend.remove(handle)
    assert any("-r2-3" in path for path in removed) and any("part-r0" in path for path in removed), removed


def test_a_part_must_be_named_unambiguously_before_anything_starts(tmp_path: Path) -> None:
    part = {"kind": "local", "log_root": str(tmp_path / "runs"), "grace_period_s": 1.0}
    backend = MixedBackend(MixedBackendConfig(parts=[{**part, "replicas": 1}, {**part, "replicas": 1}]))
    run_id = f"grow-mixed-ambiguous-{int(time.time() * 1000) % 10**6}"
    spec = BackendCase().spec(run_id, 2, sleep=60, lines=1)
    handle = backend.submit(backend.plan(spec))
    try:
        for name, why in (("local", "several parts run on it"), ("sagemaker", "no part of the run is that"),
                          ("7", "no part of the run is that")):
            with pytest.raises(ConfigError, match=f"--part: '{name}' does not name one part.*{why}"):
                backend.add_ranks_on(handle, name, [2], spec)
        assert [r.rank for r in backend.describe(handle).replicas] == [0, 1], "a refused add starts nothing"
        assert {env["REPLICA_RANK"] for env in processes_with_env("DILOCO_RUN_ID", run_id).values()} <= {"0", "1"}
        grown = backend.add_ranks_on(handle, "0", [2], spec)
        assert [p.ranks for p in grown.parts] == [[0, 2], [1]]
        grown = backend.add_ranks(grown, [3], spec)  # unnamed: the part running the highest rank (2: part 0)
        assert [p.ranks for p in grown.parts] == [[0, 2, 3], [1]]
        assert len(wait_until(backend, grown, {ReplicaState.RUNNING}, PATIENCE_S).replicas) == 4
    finally:
        backend.cancel(grown if "grown" in locals() else handle)
    backend.wait(grown, timeout_s=PATIENCE_S, poll_interval_s=0.2)
    deadline = time.monotonic() + PATIENCE_S
    while processes_with_env("DILOCO_RUN_ID", run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_with_env("DILOCO_RUN_ID", run_id)




def test_a_spot_part_refused_capacity_is_asked_again_through_the_run(
    aws_env: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mixed run's SageMaker spot part grows by rank 2, which SageMaker refuses for capacity once: through the
    mixed run the rank reads pending, and the run's ``ask_again_for_capacity`` reaches the part, whose next job
    for the rank gets an instance."""
    from emulators.sagemaker import SageMakerEmulator

    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=1.0,
                           log_flush_s=0.1) as sm:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", sm.url)
        backend = MixedBackend(MixedBackendConfig(parts=[
            {"kind": "local", "replicas": 1, "log_root": str(tmp_path / "runs"), "grace_period_s": 1.0},
            {"kind": "sagemaker", "replicas": 1, "role_arn": f"arn:aws:iam::{sm.account_id}:role/diloco-mixed",
             "region": "us-east-1", "image_uri": "diloco-ready-image:test", "use_spot": True,
             "capacity_retry_s": 0.2, "log_poll_interval_s": 0.2}]))
        run_id = f"grow-mixed-spot-{int(time.time() * 1000) % 10**6}"
        spec = BackendCase().spec(run_id, 2, sleep=60, lines=1)
        args = spec.entrypoint_args.model_copy(update={"rendezvous_uri": f"s3://{s3_bucket}/mixed/{run_id}"})
        spec = spec.model_copy(update={"max_replicas": 3, "entrypoint_args": args})
        handle = backend.submit(backend.plan(spec))
        try:
            sm.refuse_capacity(1)
            handle = backend.add_ranks_on(handle, "sagemaker", [2], spec)
            deadline = time.monotonic() + PATIENCE_S
            while "waiting for capacity" not in ((waiting := backend.describe(handle).replica(2)).reason or ""):
                assert time.monotonic() < deadline, waiting
                time.sleep(0.1)
            assert waiting.state == ReplicaState.PENDING and waiting.backend == "sagemaker"
            while sm.job(f"{run_id}-r2").running or (asked := backend.ask_again_for_capacity(handle)) is handle:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert asked.parts[1].handle is not None and asked.parts[1].handle["job_names"][-1] == f"{run_id}-r2-1"
            handle = asked
            running = wait_until(backend, handle, {ReplicaState.RUNNING}, PATIENCE_S)
            assert (running.replica(2).state, running.replica(2).restarts) == (ReplicaState.RUNNING, 0), running
        finally:
            backend.cancel(handle)
        assert backend.wait(handle, timeout_s=PATIENCE_S, poll_interval_s=0.2).state == RunState.CANCELLED
