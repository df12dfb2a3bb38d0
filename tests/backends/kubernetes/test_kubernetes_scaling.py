"""Growing a live Kubernetes run (``add_ranks``: a second Indexed Job for the new ranks), through the real
``kubernetes`` client against the API emulator, whose pods are local processes running the torch-free
``fake_replica``; and the API server's rules for resizing an Indexed Job in place (KEP-3715), which the emulator
enforces as ``validateCompletions`` does (the reason this backend adds a Job instead: docs/backends/kubernetes.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.kubernetes import KubernetesEmulator

from diloco.executors.base import LaunchSpec, ReplicaState, RunState
from diloco.executors.kubernetes import KubernetesBackend, KubernetesBackendConfig
from diloco.executors.testing import BackendCase, wait_for_output, wait_until

NAMESPACE = "scaling"
PATIENCE_S = 30.0


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[KubernetesEmulator]:
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE) as kube:
        yield kube


def _backend(emulator: KubernetesEmulator, tmp_path: Path) -> KubernetesBackend:
    return KubernetesBackend(KubernetesBackendConfig(
        image="python:3.11-slim", namespace=NAMESPACE, kubeconfig=str(emulator.kubeconfig), grace_period_s=1,
        max_failed_indexes=2, state_dir=str(tmp_path / "state"), log_poll_interval_s=0.2))


def _spec(run_id: str, **behaviour: Any) -> LaunchSpec:
    return BackendCase().spec(run_id, 2, **behaviour)


def _jobs_of(emulator: KubernetesEmulator, run_id: str) -> list[str]:
    with emulator.cluster.store.lock:
        return sorted(j["metadata"]["name"] for j in emulator.cluster.store.items("jobs", NAMESPACE)
                      if (j["metadata"].get("annotations") or {}).get("diloco.dev/run-id") == run_id)


def test_new_ranks_run_as_a_second_indexed_job_that_describe_logs_retries_and_cancel_cover(
    emulator: KubernetesEmulator, tmp_path: Path
) -> None:
    backend = _backend(emulator, tmp_path)
    run_id = "grow-kube"
    spec = _spec(run_id, sleep=120, lines=1, announce_world=True, env_out=str(tmp_path))
    handle = backend.submit(backend.plan(spec))
    wait_until(backend, handle, {ReplicaState.RUNNING}, PATIENCE_S)
    grown = backend.add_ranks(handle, [2, 3], spec)
    assert [(a.job_name, a.ranks) for a in grown.added] == [(f"{run_id}-r2-3", [2, 3])]
    assert _jobs_of(emulator, run_id) == [run_id, f"{run_id}-r2-3"]
    added = emulator.job(f"{run_id}-r2-3")
    assert added is not None and added["spec"]["completions"] == added["spec"]["parallelism"] == 2
    first = emulator.job(run_id)
    assert first is not None and added["spec"]["podFailurePolicy"] == first["spec"]["podFailurePolicy"]
    assert added["spec"]["backoffLimitPerIndex"] == first["spec"]["backoffLimitPerIndex"]

    status = wait_until(backend, grown, {ReplicaState.RUNNING}, PATIENCE_S)
    assert [r.rank for r in status.replicas] == [0, 1, 2, 3], status
    wait_for_output(backend, grown, "line 0", PATIENCE_S)
    for rank in (2, 3):
        assert f"rank {rank} of world size 4" in [r.text for r in backend.logs(grown, [rank])]
        env = json.loads((tmp_path / f"rank_{rank}.json").read_text())["env"]
        assert (env["JOB_COMPLETION_INDEX"], env["DILOCO_RANK_OFFSET"], env["WORLD_SIZE"]) == (str(rank - 2), "2", "4")
    assert [r.run_id for r in backend.list_runs()] == [run_id]
    assert backend.list_runs()[0].replicas == 4

    # an added replica killed (the OOM killer): the cluster retries its index, as for the first replicas
    [pod] = [p["metadata"]["name"] for p in emulator.pods(f"{run_id}-r2-3")
             if p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == "1"]
    emulator.oom_kill(pod)
    deadline = time.monotonic() + PATIENCE_S
    while not ((again := backend.describe(grown).replica(3)).restarts == 1 and again.state == ReplicaState.RUNNING):
        assert time.monotonic() < deadline, again
        time.sleep(0.2)
    assert [r.state for r in backend.describe(grown).replicas[:3]] == [ReplicaState.RUNNING] * 3

    backend.cancel(grown, ranks=[3])
    some = wait_until(backend, grown, {ReplicaState.RUNNING, ReplicaState.CANCELLED}, PATIENCE_S)
    assert [r.state for r in some.replicas] == [ReplicaState.RUNNING] * 3 + [ReplicaState.CANCELLED], some
    backend.cancel(grown)
    final = backend.wait(grown, timeout_s=PATIENCE_S, poll_interval_s=0.2)
    assert final.state == RunState.CANCELLED and len(final.replicas) == 4, final
    emulator.wait_for(lambda: not emulator.live_processes(), timeout=PATIENCE_S)
    removed = backend.remove(grown)
    assert any("-r2-3" in path for path in removed), removed
    emulator.wait_for(lambda: not _jobs_of(emulator, run_id), timeout=PATIENCE_S)


def test_the_api_server_resizes_an_indexed_job_only_with_completions_and_parallelism_together(
    emulator: KubernetesEmulator, tmp_path: Path
) -> None:
    """KEP-3715 (elastic Indexed Jobs): ``completions`` may change only in tandem with ``parallelism``, to the
    same value; anything else is the API server's 422 in its own words."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    backend = _backend(emulator, tmp_path)
    run_id = "resize-kube"
    handle = backend.submit(backend.plan(_spec(run_id, sleep=120, lines=1)))
    batch = client.BatchV1Api(backend.api_client())
    with pytest.raises(ApiException) as refused:
        batch.patch_namespaced_job(run_id, NAMESPACE, {"spec": {"completions": 3}})
    assert refused.value.status == 422
    assert json.loads(refused.value.body)["message"] == (
        f'Job.batch "{run_id}" is invalid: spec.completions: Invalid value: 3: can only be modified in tandem '
        "with spec.parallelism")
    with pytest.raises(ApiException, match="can only be modified in tandem"):
        batch.patch_namespaced_job(run_id, NAMESPACE, {"spec": {"completions": 3, "parallelism": 4}})
    with pytest.raises(ApiException, match="spec.template: Invalid value"):  # why a resized Job cannot say WORLD_SIZE=3
        batch.patch_namespaced_job(run_id, NAMESPACE, [{"op": "replace", "path": "/spec/template/spec/containers/0/env",
                                                        "value": [{"name": "WORLD_SIZE", "value": "3"}]}])
    job = emulator.job(run_id)
    assert job is not None and (job["spec"]["completions"], job["spec"]["parallelism"]) == (2, 2)
    batch.patch_namespaced_job(run_id, NAMESPACE, {"spec": {"completions": 3, "parallelism": 3}})
    job = emulator.job(run_id)
    assert job is not None and (job["spec"]["completions"], job["spec"]["parallelism"]) == (3, 3)
    assert job["metadata"]["generation"] == 2
    backend.cancel(handle)
    backend.wait(handle, timeout_s=PATIENCE_S, poll_interval_s=0.2)
