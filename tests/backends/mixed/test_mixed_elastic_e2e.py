"""A live run split over a local process and a Kubernetes part, grown from 2 to 3 replicas on its Kubernetes part
(``Run.scale(3, part="eks")``, what ``diloco scale RUN --part eks:+1`` does), through the real launcher and real
replica processes (the gated ``support.elastic_trainer``; the API emulator's pods are local processes reaching moto's
S3): the new rank starts as the part's second Indexed Job, adopts the committed global model, joins at the next round,
and every replica of both parts ends with identical weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from emulators.kubernetes import KubernetesEmulator
from support.elastic_scaleup import scale_up_run
from support.kube_nodes import node_env

pytestmark = pytest.mark.slow

TESTS_DIR = str(Path(__file__).resolve().parents[2])
NAMESPACE = "mixed-elastic"
IMAGE = "registry.example/diloco:e2e"


@pytest.fixture
def kube(aws_env: str, tmp_path: Path) -> Iterator[KubernetesEmulator]:
    """The emulator, its pods reaching moto as IRSA-credentialed pods reach S3."""
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE, node_env=node_env(TESTS_DIR)) as emulator:
        yield emulator


def test_a_mixed_runs_kubernetes_part_scaled_from_1_to_2_ends_with_identical_weights_everywhere(
    kube: KubernetesEmulator, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0")
    monkeypatch.chdir(TESTS_DIR)  # the local part's replica imports support.elastic_trainer from here
    backend = {"kind": "mixed", "parts": [
        {"kind": "local", "replicas": 1, "grace_period_s": 2},
        {"kind": "eks", "replicas": 1, "image": IMAGE, "namespace": NAMESPACE, "kubeconfig": str(kube.kubeconfig),
         "grace_period_s": 2, "log_poll_interval_s": 0.2, "state_dir": str(tmp_path / "state")},
    ]}
    done = scale_up_run(backend, f"s3://{s3_bucket}/mixed-elastic/{{run_id}}", tmp_path / "gates", part="eks")
    report = done.report
    assert report.state.value == "succeeded", report
    assert [(r.rank, r.exit_code) for r in report.ranks] == [(r, 0) for r in range(3)], report.ranks
    assert report.weights_identical is True, report.weights_detail
    assert done.grown.added == [2]
    assert [(p["backend"], p["ranks"]) for p in done.handle["parts"]] == [("local", [0]), ("eks", [1, 2])]
    assert kube.job(f"{done.run_id}-r2") is not None  # the Kubernetes part's new rank: a second Indexed Job
