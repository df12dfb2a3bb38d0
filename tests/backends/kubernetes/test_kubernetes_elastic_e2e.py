"""A live Kubernetes run grown from 2 to 3 replicas (``Run.scale``) on the API emulator, through the real launcher and
real replica processes (the gated ``support.elastic_trainer``, its pods local processes reaching moto's S3): the
second Indexed Job's pod adopts the committed global model, joins at the next round, and the run ends with every
replica's weights identical."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from emulators.kubernetes import KubernetesEmulator
from support.elastic_scaleup import scale_up_run
from support.kube_nodes import node_env

pytestmark = pytest.mark.slow

TESTS_DIR = str(Path(__file__).resolve().parents[2])
NAMESPACE = "elastic"
IMAGE = "registry.example/diloco:e2e"


@pytest.fixture
def kube(aws_env: str, tmp_path: Path) -> Iterator[KubernetesEmulator]:
    """The emulator, its pods reaching moto as IRSA-credentialed pods reach S3."""
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE, node_env=node_env(TESTS_DIR)) as emulator:
        yield emulator


def test_a_kubernetes_run_scaled_from_2_to_3_ends_with_identical_weights(
    kube: KubernetesEmulator, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0")
    backend = {"kind": "eks", "image": IMAGE, "namespace": NAMESPACE, "kubeconfig": str(kube.kubeconfig),
               "grace_period_s": 2, "log_poll_interval_s": 0.2, "state_dir": str(tmp_path / "state")}
    done = scale_up_run(backend, f"s3://{s3_bucket}/elastic/{{run_id}}", tmp_path / "gates")
    report = done.report
    assert report.state.value == "succeeded", report
    assert [(r.rank, r.exit_code) for r in report.ranks] == [(r, 0) for r in range(3)], report.ranks
    assert report.weights_identical is True, report.weights_detail
    assert done.grown.added == [2]
    assert [a["job_name"] for a in done.handle["added"]] == [f"{done.run_id}-r2"]
    assert kube.job(f"{done.run_id}-r2") is not None
