"""Pending that ends: a replica the cluster cannot start says why at the next poll, and after
``backend.pending_timeout_s`` (counted from its pod's creation, or the Job's) it fails with the reason and the fix,
and the Job is deleted, instead of waiting out ``activeDeadlineSeconds`` (a day).

What cannot heal by waiting, as the cluster reports it: the scheduler's ``Unschedulable`` (PodScheduled False and
a FailedScheduling event), the kubelet's ``ErrImagePull``/``ImagePullBackOff``, and pods refused at admission: a
missing service account makes the job controller record ``FailedCreate`` on the Job and create no pod. Each is
driven through the real ``kubernetes`` client against the emulator, and the launch through the real CLI.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.kube_nodes import stock_eks_nodes
from emulators.kubernetes import KubernetesEmulator
from support.commands import run_cli, start_cli
from support.polling import until

from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.executors.kubernetes import KubernetesBackend, KubernetesBackendConfig

NAMESPACE = "pending"
TIMEOUT_S = 1.5  # the pending timeout these tests set; every wait below is bounded by a multiple of it


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubernetesEmulator]:
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE) as emulator:
        yield emulator


def _backend(kube: KubernetesEmulator, tmp_path: Path, **settings: Any) -> KubernetesBackend:
    return KubernetesBackend(KubernetesBackendConfig(**{
        "image": "python:3.11-slim", "namespace": NAMESPACE, "kubeconfig": str(kube.kubeconfig), "grace_period_s": 1,
        "state_dir": str(tmp_path / "state"), "pending_timeout_s": TIMEOUT_S, **settings}))


def _spec(run_id: str, replicas: int = 1) -> LaunchSpec:
    args = EntrypointArgs(rendezvous_uri=f"file:///nowhere/{run_id}", world_size=replicas)  # never starts
    return LaunchSpec(run_id=run_id, replicas=replicas, entrypoint_args=args, timeout_s=3600)


def _until(check: Any, limit_s: float = 20 * TIMEOUT_S) -> Any:
    return until(check, limit_s)


def test_an_unschedulable_replica_says_why_then_fails_after_the_timeout_and_its_job_is_deleted(
        kube: KubernetesEmulator, tmp_path: Path) -> None:
    patient, backend = _backend(kube, tmp_path, pending_timeout_s=3600), _backend(kube, tmp_path)
    kube.hold_pending(job="unschedulable-1")
    handle = backend.submit(backend.plan(_spec("unschedulable-1").model_copy(update={"gpu": "A10G:4"})))
    # describe is stateless: a launcher with a longer timeout reads the same Job as still pending, with the reason
    pending = _until(lambda: (s := patient.describe(handle).replica(0)).reason and s)
    assert pending.state.value == "pending", "within the timeout it is still pending"
    assert pending.reason.startswith("Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu")
    failed = _until(lambda: (s := backend.describe(handle).replica(0)).state.value == "failed" and s)
    assert failed, "the pending timeout ended it"
    assert failed.reason.startswith(f"pending for over {TIMEOUT_S:g}s (backend.pending_timeout_s): Unschedulable: ")
    assert "node.kubernetes.io/instance-type in [g5.12xlarge,g5.24xlarge,g5.48xlarge]" in failed.reason, \
        "the fix names the selector"
    assert "with 4 allocatable nvidia.com/gpu" in failed.reason
    assert failed.failure is not None and not failed.failure.relaunch, "a new attempt would wait the same way"
    assert _until(lambda: kube.job("unschedulable-1") is None), "the Job it gave up on is deleted"
    assert _until(lambda: not kube.pods("unschedulable-1"))
    again = backend.describe(handle).replica(0)
    assert (again.state.value, again.reason) == ("failed", failed.reason), "what it ended as is kept"


def test_an_image_that_cannot_be_pulled_fails_after_the_timeout_naming_the_pull_error(
        kube: KubernetesEmulator, tmp_path: Path) -> None:
    kube.image_pull_error("bad:*")
    backend = _backend(kube, tmp_path, image="bad:tag")
    handle = backend.submit(backend.plan(_spec("unpullable-1")))
    failed = _until(lambda: (s := backend.describe(handle).replica(0)).state.value == "failed" and s)
    assert failed, "the pending timeout ended it"
    assert ("(backend.pending_timeout_s): ImagePullBackOff: Back-off pulling image" in failed.reason
            or "(backend.pending_timeout_s): ErrImagePull: " in failed.reason), failed.reason
    assert "check the image reference (--image)" in failed.reason
    assert _until(lambda: kube.job("unpullable-1") is None)


def test_a_missing_service_account_shows_the_refusal_at_once_then_fails_and_leaves_no_job(
        kube: KubernetesEmulator, tmp_path: Path) -> None:
    patient = _backend(kube, tmp_path, service_account="ghost", pending_timeout_s=3600)
    backend = _backend(kube, tmp_path, service_account="ghost")
    handle = backend.submit(backend.plan(_spec("no-account-1", replicas=2)))
    first = _until(lambda: (s := patient.describe(handle).replica(1)).reason and s)
    assert first.state.value == "pending" and re.fullmatch(
        f'FailedCreate: Error creating: pods "no-account-1-[01]-" is forbidden: error looking up service account '
        f'{NAMESPACE}/ghost: serviceaccount "ghost" not found', first.reason or ""), first.reason
    failed = _until(lambda: (s := backend.describe(handle)).terminal and s)
    assert failed and [r.state.value for r in failed.replicas] == ["failed", "failed"]
    assert f"create service account 'ghost' in namespace {NAMESPACE!r}" in (failed.replicas[0].reason or "")
    assert _until(lambda: kube.job("no-account-1") is None)
    assert kube.pods("no-account-1") == []


def test_a_replica_that_is_merely_slow_to_start_is_not_failed(kube: KubernetesEmulator, tmp_path: Path) -> None:
    """Pulling its image (ContainerCreating) is on the way to running, however long it takes."""
    kube.hold_pending(job="slow-1", reason="ContainerCreating")
    backend = _backend(kube, tmp_path)
    handle = backend.submit(backend.plan(_spec("slow-1")))
    started = time.monotonic()
    while time.monotonic() - started < 3 * TIMEOUT_S:
        assert backend.describe(handle).replica(0).state.value == "pending"
        time.sleep(0.1)
    assert kube.job("slow-1") is not None
    backend.cancel(handle)
    assert backend.wait(handle, timeout_s=30, poll_interval_s=0.1).state.value == "cancelled"


# ---------------------------------------------------------------------------------------------- the CLI
@pytest.fixture
def cluster(aws_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubernetesEmulator]:
    """The emulator, its pods reaching moto like IRSA-credentialed pods do; the CLI finds it by KUBECONFIG."""
    node_env = {key: os.environ[key] for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                                 "AWS_REGION", "AWS_ENDPOINT_URL") if key in os.environ}
    # A stock EKS cluster without GPU nodes: two CPU nodes of a managed node group.
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE, node_env=node_env,
                            nodes=stock_eks_nodes(gpu_nodes=0)) as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig))
        yield emulator


def _launch(bucket: str, *extra: str) -> list[str]:
    return ["launch", "--backend", "eks", "--namespace", NAMESPACE, "--replicas", "2", "--rendezvous",
            f"s3://{bucket}/pending/{{run_id}}", "--set", "store.poll_interval_s=0.2", "--set",
            f"backend.pending_timeout_s={TIMEOUT_S}", "--set", "backend.grace_period_s=1", "--steps", "2",
            "--sync-every", "1", *extra]


def test_launch_with_an_unpullable_image_exits_1_naming_the_pull_error_and_leaves_no_job(
        cluster: KubernetesEmulator, s3_bucket: str, tmp_path: Path) -> None:
    cluster.image_pull_error("bad:*")
    out = run_cli(*_launch(s3_bucket, "--image", "bad:tag"), home=tmp_path / "home", cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "ImagePullBackOff" in out.stderr or "ErrImagePull" in out.stderr, out.stderr[-3000:]
    assert "backend.pending_timeout_s" in out.stderr and "Traceback" not in out.stderr
    with cluster.cluster.store.lock:
        assert cluster.cluster.store.items("jobs") == [] and cluster.cluster.store.items("pods") == []


def test_status_shows_the_schedulers_reason_and_launch_gives_up_naming_the_selector(
        cluster: KubernetesEmulator, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from diloco.cli.main import app

    home = tmp_path / "home"
    monkeypatch.setenv("DILOCO_HOME", str(home))
    scheduler_says = "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector."
    launch = start_cli(*_launch(s3_bucket, "--image", "registry.example/diloco:1", "--gpu", "A10G:4", "--set",
                                "backend.pending_timeout_s=6"), home=home, cwd=tmp_path)
    try:
        # `diloco status` of the latest run, while the launch waits: the scheduler's words, pending or given up on
        shown = _until(lambda: (r := CliRunner().invoke(app, ["status", "-o", "json"])).exit_code == 0 and
                       scheduler_says in r.stdout and r, limit_s=120)
        assert shown, "status shows the scheduler's reason"
        _, stderr = launch.communicate(timeout=240)
    finally:
        launch.kill()
    assert launch.returncode == 1, stderr[-3000:]
    assert scheduler_says in stderr and "g5.12xlarge" in stderr and "backend.pending_timeout_s" in stderr, \
        stderr[-3000:]
    assert "Traceback" not in stderr
    with cluster.cluster.store.lock:
        assert cluster.cluster.store.items("jobs") == []


# ---------------------------------------------------------------------------------------------- nothing left behind
def test_rm_deletes_the_finished_job_at_once_instead_of_at_its_ttl(kube: KubernetesEmulator, tmp_path: Path) -> None:
    backend = _backend(kube, tmp_path)
    args = EntrypointArgs(rendezvous_uri="file:///unused", world_size=1, trainer="fake:train",
                          trainer_kwargs={"lines": 1})
    spec = LaunchSpec(run_id="finished-1", replicas=1, entrypoint="support.fake_replica", entrypoint_args=args,
                      env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])})  # tests/support/fake_replica.py: exits 0
    handle = backend.submit(backend.plan(spec))
    assert backend.wait(handle, timeout_s=60, poll_interval_s=0.1).state.value == "succeeded"
    job = kube.job("finished-1")
    assert job is not None and job["spec"]["ttlSecondsAfterFinished"] == 86400, "the cluster would keep it a day"
    assert backend.remove(handle, dry_run=True) == [f"job {NAMESPACE}/finished-1", str(tmp_path / "state" /
                                                                                       "finished-1")]
    assert kube.job("finished-1") is not None, "a dry run removes nothing"
    backend.remove(handle)
    assert _until(lambda: kube.job("finished-1") is None and not kube.pods("finished-1")), "Job and pods are gone"
    assert backend.remove(handle) == [], "removing again is a no-op"


def test_smoke_on_eks_leaves_no_job(cluster: KubernetesEmulator, s3_bucket: str, tmp_path: Path) -> None:
    config = tmp_path / "eks.yaml"
    config.write_text(f"backend:\n  kind: eks\n  namespace: {NAMESPACE}\n  image: registry.example/diloco:1\n")
    out = run_cli("smoke", "-c", str(config), "--s3", f"s3://{s3_bucket}/smoke", "-o", "json", home=tmp_path / "home",
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["ok"] is True
    with cluster.cluster.store.lock:
        assert cluster.cluster.store.items("jobs") == [], "the smoke's finished Job is deleted, not left to its TTL"
    assert _until(lambda: not cluster.pods())
