"""A first job on stock EKS infrastructure: what stock nodes give and what Karpenter does with them.

* Karpenter (and EKS Auto Mode) consolidates and replaces drifted nodes on its own; every pod carries
  ``karpenter.sh/do-not-disrupt: "true"``, which it honours against both, so a replica is not restarted cold.

Driven through the real ``kubernetes`` client against the emulator; nothing is patched.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.kubernetes import KubernetesEmulator
from support.polling import until

from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.executors.kubernetes import KubernetesBackend, KubernetesBackendConfig

NAMESPACE = "stock"


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubernetesEmulator]:
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE) as emulator:
        yield emulator


def _backend(kube: KubernetesEmulator, tmp_path: Path, **settings: Any) -> KubernetesBackend:
    return KubernetesBackend(KubernetesBackendConfig(**{
        "image": "python:3.11-slim", "namespace": NAMESPACE, "kubeconfig": str(kube.kubeconfig), "grace_period_s": 1,
        "state_dir": str(tmp_path / "state"), **settings}))


def _spec(run_id: str, replicas: int = 1) -> LaunchSpec:
    args = EntrypointArgs(rendezvous_uri=f"file:///nowhere/{run_id}", world_size=replicas)
    return LaunchSpec(run_id=run_id, replicas=replicas, entrypoint_args=args, timeout_s=3600)


def test_every_pod_asks_karpenter_not_to_disrupt_it_and_a_user_may_say_otherwise(
        kube: KubernetesEmulator, tmp_path: Path) -> None:
    backend = _backend(kube, tmp_path)
    handle = backend.submit(backend.plan(_spec("nodisrupt-1", replicas=2)))
    try:
        pods = until(lambda: len(found := kube.pods("nodisrupt-1")) == 2 and found, 60)
        assert pods, "the job controller created both pods"
        for pod in pods:
            assert pod["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true", pod["metadata"]
        job = kube.job("nodisrupt-1")
        assert job is not None
        assert job["spec"]["template"]["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    finally:
        backend.cancel(handle)
    allowed = _backend(kube, tmp_path, annotations={"karpenter.sh/do-not-disrupt": "false"})
    manifest = allowed.manifest(_spec("nodisrupt-2"))
    assert manifest["spec"]["template"]["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "false"


# ---------------------------------------------------------------------------------------------- the default image
def test_the_default_image_is_the_newest_ec2_release_still_patched_that_diloco_admits() -> None:
    import datetime as dt

    from diloco.executors.kubernetes.code import EC2_RELEASES, default_image, default_image_versions

    config = KubernetesBackendConfig()
    assert default_image(config, 0).endswith("pytorch-training:2.10.0-cpu-py313-ec2")
    assert default_image(config, 1).endswith("pytorch-training:2.10.0-gpu-py313-ec2")
    assert ("2.9.0", "py312", "2026-10-15") in EC2_RELEASES, "the table is DLC's, end of patch included"
    releases = (("2.9.0", "py312", "2026-10-15"), ("2.10.0", "py313", "2027-01-21"), ("2.99.0", "py313", "2026-01-01"))
    assert default_image_versions(dt.date(2026, 12, 4), releases) == ("2.10.0", "py313"), \
        "a newer release past its end of patch is not the default"
    assert default_image_versions(dt.date(2025, 12, 1), releases) == ("2.99.0", "py313")
    assert default_image_versions(dt.date(2030, 1, 1), releases) == ("2.99.0", "py313"), \
        "when every release is out of patch, the newest is still the best there is"
    pinned = KubernetesBackendConfig(framework_version="2.9.0")
    assert default_image(pinned, 1).endswith("pytorch-training:2.9.0-gpu-py312-ec2"), "its Python from the table"
