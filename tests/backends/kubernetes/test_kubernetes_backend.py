"""The Kubernetes backend (``--backend eks``) against the conformance suite, through the real ``kubernetes`` client
and the Kubernetes API emulator (tests/emulators/kubernetes.py), which runs every pod as a local process.

``max_failed_indexes`` is raised to the replica count here, so a failing replica does not make the Job stop its
peers (the suite checks each replica's own outcome); the default (0, the cluster's own fail-fast) is covered in
tests/test_kubernetes_e2e.py. The grace period is one second so the SIGTERM-ignoring replicas of the cancel tests
are killed quickly.

After the suite, what is particular to this backend, in-process and fast: the one-line errors of refused submits
(RBAC, quota, webhook, missing namespace), the manifest's strict validity for Kubernetes 1.29 and 1.33, settings
refused before anything starts, pending reasons, disruptions and OOM retries, the time limit, ``list_runs``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.kubernetes import KubernetesEmulator

from diloco.executors.base import LaunchPlan, LaunchSpec, ServerlessExecutor
from diloco.executors.kubernetes import KubernetesBackend, KubernetesBackendConfig
from diloco.executors.testing import BackendCase, BackendConformance

NAMESPACE = "conformance"


class KubernetesCase(BackendCase):
    #: One Job per run: the API accepts it whole or not at all.
    per_replica_submit = False
    patience_s = 30.0

    def __init__(self, emulator: KubernetesEmulator, root: Path) -> None:
        self.emulator = emulator
        self.root = root

    def backend(self) -> ServerlessExecutor[Any, Any]:
        return KubernetesBackend(KubernetesBackendConfig(
            image="python:3.11-slim", namespace=NAMESPACE, kubeconfig=str(self.emulator.kubeconfig),
            grace_period_s=1, max_failed_indexes=2, state_dir=str(self.root / "state"), log_poll_interval_s=0.2))

    @contextlib.contextmanager
    def break_submit_at(self, backend: ServerlessExecutor[Any, Any], plan: LaunchPlan,
                        k: int) -> Iterator[LaunchPlan]:
        """The namespace's ResourceQuota refuses the Job (admission's 403), as a full namespace does."""
        self.emulator.deny_quota("jobs", times=1)
        yield plan

    def live(self, run_id: str) -> list[str]:
        """The run's Job, its pods and their processes, while any of them exists."""
        job = next((j for j in self._jobs() if j["metadata"].get("annotations", {}).get("diloco.dev/run-id")
                    == run_id), None)
        if job is None:
            return []
        pods = [p["metadata"]["name"] for p in self.emulator.pods(job["metadata"]["name"], namespace=NAMESPACE)]
        return [f"job/{job['metadata']['name']}", *(f"pod/{p}" for p in pods)]

    def _jobs(self) -> list[dict[str, Any]]:
        with self.emulator.cluster.store.lock:
            return [dict(j) for j in self.emulator.cluster.store.items("jobs", NAMESPACE)]

    def documented_states(self, backend: ServerlessExecutor[Any, Any]) -> list[str]:
        """Every pod phase and Job condition type of the Kubernetes API (what the backend maps from)."""
        return ["Pending", "Running", "Succeeded", "Failed", "Unknown",
                "Complete", "Failed", "FailureTarget", "SuccessCriteriaMet", "Suspended"]


class TestKubernetesBackend(BackendConformance):
    @pytest.fixture
    def case(self, tmp_path: Path) -> Iterator[KubernetesCase]:
        with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE) as emulator:
            yield KubernetesCase(emulator, tmp_path)


# ---------------------------------------------------------------------------------------------- beyond the suite
@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[KubernetesEmulator]:
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE) as kube:
        yield kube


def _backend(emulator: KubernetesEmulator, tmp_path: Path, **overrides: Any) -> KubernetesBackend:
    settings: dict[str, Any] = {"image": "python:3.11-slim", "namespace": NAMESPACE,
                                "kubeconfig": str(emulator.kubeconfig), "grace_period_s": 1,
                                "state_dir": str(tmp_path / "state"), **overrides}
    return KubernetesBackend(KubernetesBackendConfig(**settings))


def _spec(run_id: str, replicas: int = 2, **behaviour: Any) -> LaunchSpec:
    return BackendCase().spec(run_id, replicas, **behaviour)


def test_refused_submits_name_the_apis_reason_and_create_nothing(emulator: KubernetesEmulator,
                                                                 tmp_path: Path) -> None:
    from diloco.errors import BackendError

    backend = _backend(emulator, tmp_path)
    plan = backend.plan(_spec("refused-1"))
    emulator.deny("create", "jobs", group="batch")
    with pytest.raises(BackendError) as denied:
        backend.submit(plan)
    assert str(denied.value) == (
        f"could not create Job {NAMESPACE}/refused-1: Forbidden: jobs.batch is forbidden: User \"emulator-user\" "
        f"cannot create resource \"jobs\" in API group \"batch\" in the namespace \"{NAMESPACE}\"")
    assert "RBAC" in (denied.value.hint or "")
    emulator.allow_all()

    emulator.deny_quota("jobs", times=1)
    with pytest.raises(BackendError) as quota:
        backend.submit(plan)
    assert 'Forbidden: jobs.batch "refused-1" is forbidden: exceeded quota: compute, requested: ' \
           "count/jobs.batch=1" in str(quota.value)
    assert "ResourceQuota" in (quota.value.hint or "")

    emulator.reject_creates("jobs", 'admission webhook "images.policy.example" denied the request: images must '
                                    "come from the team registry", times=1)
    with pytest.raises(BackendError) as webhook:
        backend.submit(plan)
    assert 'admission webhook "images.policy.example" denied the request' in str(webhook.value)

    elsewhere = _backend(emulator, tmp_path, namespace="absent")
    with pytest.raises(BackendError) as missing:
        elsewhere.submit(elsewhere.plan(_spec("refused-2")))
    assert 'NotFound: namespaces "absent" not found' in str(missing.value)
    assert "kubectl create namespace absent" in (missing.value.hint or "")
    with emulator.cluster.store.lock:
        assert emulator.cluster.store.items("jobs") == []


def test_the_manifest_is_strictly_valid_for_the_oldest_and_current_supported_kubernetes(
        emulator: KubernetesEmulator, tmp_path: Path) -> None:
    import kubernetes_validate

    backend = _backend(emulator, tmp_path, service_account="trainer", node_selector={"pool": "gpu"},
                       tolerations=[{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
                       cpu_limit="4", backoff_limit_per_index=2, max_failed_indexes=1)
    spec = _spec("valid-1", replicas=3).model_copy(update={"gpu": "NVIDIA-L4:1", "timeout_s": 90.5})
    job = backend.plan(spec).requests[0]
    for version in ("1.29.0", "1.33.0"):
        kubernetes_validate.validate(job, version, strict=True)
    assert job["spec"]["activeDeadlineSeconds"] == 91 and job["spec"]["maxFailedIndexes"] == 1
    assert backend.plan(spec).model_dump() == backend.plan(spec).model_dump()


def test_bad_settings_fail_before_anything_with_the_field_named() -> None:
    from diloco.errors import ConfigError
    from diloco.executors.kubernetes import job_name_for, parse_gpu
    from diloco.launcher.config import backend_config

    cases = {
        "image": ("registry.example/Diloco:latest", "backend.image: not a valid image reference"),
        "namespace": ("Team_A", "backend.namespace: must be a DNS-1123 label"),
        "memory": ("8GB", "backend.memory: must be a Kubernetes quantity"),
        "cpu": ("two", "backend.cpu: must be a Kubernetes quantity"),
        "service_account": ("Trainer!", "backend.service_account: must be a DNS-1123 subdomain"),
    }
    for field, (value, message) in cases.items():
        section = {"kind": "eks", "image": "registry.example/diloco:1", field: value}
        with pytest.raises(ConfigError) as caught:
            backend_config(section)
        assert str(caught.value).startswith(message), str(caught.value)
    assert backend_config({"kind": "eks"}).image is None, "no image: the public PyTorch image and the code channel"
    assert parse_gpu("2") == (2, None) and parse_gpu("NVIDIA-A10G") == (1, "A10G")
    assert parse_gpu("NVIDIA-A10G:4") == (4, "A10G") and parse_gpu(None) == (0, None)
    for bad in ("0", "A10G:0", "bad gpu:1"):
        with pytest.raises(ConfigError):
            parse_gpu(bad)
    assert job_name_for("diloco-20261130-120000-ab12", 4) == "diloco-20261130-120000-ab12"
    odd = job_name_for("My_Run.Name", 2)
    assert odd.startswith("my-run-name-") and odd != job_name_for("my-run-name", 2)
    long = job_name_for("r" * 100, 1000)
    assert len(f"{long}-999") <= 63


def test_list_runs_finds_the_runs_jobs_without_the_registry(emulator: KubernetesEmulator, tmp_path: Path) -> None:
    backend = _backend(emulator, tmp_path)
    handle = backend.submit(backend.plan(_spec("listed-1", lines=1)))
    backend.wait(handle, timeout_s=30, poll_interval_s=0.1)
    runs = {r.run_id: r for r in backend.list_runs()}
    assert runs["listed-1"].state.value == "succeeded" and runs["listed-1"].replicas == 2


def _wait_state(backend: KubernetesBackend, handle: Any, rank: int, state: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = backend.describe(handle).replica(rank)
        if found.state.value == state or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _wait_gone(emulator: KubernetesEmulator, pod: str, timeout: float = 30) -> None:
    """Until the pod ``pod`` is deleted from the cluster (the job controller has counted it)."""
    deadline = time.monotonic() + timeout
    while emulator.cluster.store.get("pods", NAMESPACE, pod) is not None:
        assert time.monotonic() < deadline, f"pod {pod} still exists"
        time.sleep(0.05)


def _wait_retried(backend: KubernetesBackend, handle: Any, rank: int, ended: str, timeout: float = 30) -> Any:
    """The replica once the attempt ``ended`` is over: ``preempted`` while the next pod comes, or already running as
    the next attempt (a quick job controller leaves no window a poll must catch); both say why ``ended`` ended."""
    deadline = time.monotonic() + timeout
    while True:
        found = backend.describe(handle).replica(rank)
        if found.state.value == "preempted" or (found.state.value == "running" and found.job_id != ended) \
                or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_pending_replicas_say_why_and_their_logs_show_the_events(emulator: KubernetesEmulator,
                                                                 tmp_path: Path) -> None:
    backend = _backend(emulator, tmp_path)
    hold = emulator.hold_pending(job="pending-1", index=1)
    handle = backend.submit(backend.plan(_spec("pending-1", sleep=60)))
    assert _wait_state(backend, handle, 0, "running").state.value == "running"
    pending = _wait_state(backend, handle, 1, "pending")
    assert pending.reason is not None and pending.reason.startswith("Unschedulable: 0/1 nodes are available")
    events = [r for r in backend.replica_logs(handle, 1) if r.text.startswith("[event] FailedScheduling")]
    assert events and events[0].stream == "err" and events[0].rank == 1
    emulator.release(hold)
    assert _wait_state(backend, handle, 1, "running").state.value == "running"
    backend.cancel(handle)
    assert backend.wait(handle, timeout_s=30, poll_interval_s=0.1).state.value == "cancelled"

    emulator.image_pull_error("registry.invalid/*")
    unpullable = _backend(emulator, tmp_path, image="registry.invalid/diloco:1")
    stuck = unpullable.submit(unpullable.plan(_spec("pending-2", replicas=1)))
    deadline = time.monotonic() + 30
    while "ImagePullBackOff" not in (unpullable.describe(stuck).replica(0).reason or "") and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert unpullable.describe(stuck).replica(0).state.value == "pending"
    assert (unpullable.describe(stuck).replica(0).reason or "").startswith("ImagePullBackOff: Back-off pulling image")
    unpullable.cancel(stuck)


def test_the_run_time_limit_is_the_jobs_active_deadline(emulator: KubernetesEmulator, tmp_path: Path) -> None:
    backend = _backend(emulator, tmp_path)
    spec = _spec("deadline-1", sleep=60).model_copy(update={"timeout_s": 1.0})
    status = backend.wait(backend.submit(backend.plan(spec)), timeout_s=30, poll_interval_s=0.1)
    assert [(r.state.value, r.timed_out) for r in status.replicas] == [("failed", True), ("failed", True)]
    assert "activeDeadlineSeconds=1" in (status.replicas[0].reason or "")


def test_an_evicted_replica_is_preempted_then_back_and_an_oom_is_retried_then_failed(tmp_path: Path) -> None:
    # The job controller waits before recreating a failed (not a disrupted) pod; one second here.
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE, pod_backoff_s=1.0) as emulator:
        _evict_then_oom(emulator, tmp_path)


def _evict_then_oom(emulator: KubernetesEmulator, tmp_path: Path) -> None:
    backend = _backend(emulator, tmp_path, backoff_limit_per_index=1, max_failed_indexes=2)
    handle = backend.submit(backend.plan(_spec("disrupted-1", sleep=60)))
    first = _wait_state(backend, handle, 1, "running")
    emulator.evict(first.job_id)
    preempted = _wait_retried(backend, handle, 1, first.job_id)
    assert preempted.state.value in ("preempted", "running"), preempted
    # Its pod says why while it exists; the backend remembers what it saw; without either (the pod deleted before
    # a poll came) the counters on the next pod still say it was a disruption.
    assert preempted.reason is not None and (
        "EvictionByEvictionAPI" in preempted.reason or preempted.reason.startswith("attempt 1 disrupted")), preempted
    back = _wait_state(backend, handle, 1, "running")
    assert back.job_id != first.job_id and back.restarts == 1
    _wait_gone(emulator, first.job_id)
    if "EvictionByEvictionAPI" in preempted.reason:
        assert back.reason == "attempt 1 ended (EvictionByEvictionAPI: Eviction API: evicting); this is attempt 2"
    elsewhere = _backend(emulator, tmp_path, backoff_limit_per_index=1, max_failed_indexes=2).describe(handle)
    assert elsewhere.replica(1).reason == ("attempt 1 disrupted (drained, evicted or reclaimed; not counted against "
                                           "backoffLimitPerIndex); this is attempt 2"), "another process: counters"

    emulator.oom_kill(back.job_id)
    retrying = _wait_retried(backend, handle, 1, back.job_id)
    assert retrying.state.value in ("preempted", "running"), retrying
    assert retrying.reason is not None and "OOMKilled" in retrying.reason, "within backoffLimitPerIndex: retried"
    retried = _wait_state(backend, handle, 1, "running")
    assert retried.job_id not in (first.job_id, back.job_id) and retried.restarts == 2
    emulator.oom_kill(retried.job_id)
    failed = _wait_state(backend, handle, 1, "failed")
    assert failed.exit_code == 137 and failed.reason is not None and failed.reason.startswith("OOMKilled")
    assert backend.describe(handle).replica(0).state.value == "running", "maxFailedIndexes=2: the Job goes on"
    backend.cancel(handle)
    status = backend.wait(handle, timeout_s=30, poll_interval_s=0.1)
    assert [r.state.value for r in status.replicas] == ["cancelled", "failed"]
