"""The waiting ``launch`` says so when the cluster retries a killed replica itself: on EKS the Indexed Job brings
the replica back (``backoffLimitPerIndex``), not the launcher, so the "relaunching it" line the launcher prints when
it relaunches a replica never came, and a kill went by in silence. The line the docs promise names the replica
``preempted``, why, and its restart. Through the real CLI against the Kubernetes emulator (the fixtures of
test_kubernetes_e2e.py); the kill is a SIGKILL of the replica container's process, what a node does."""

# ruff: noqa: F811 - the e2e module's fixtures are imported, and test parameters name them
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from backends.kubernetes.test_kubernetes_e2e import (  # noqa: F401 - fixtures, used by name
    committed,
    container_pid,
    home,
    image_dir,
    kube,
    launch_args,
    running,
    start_cli,
)
from backends.kubernetes.test_kubernetes_retries import PACED, _job_of
from emulators.kubernetes import KubernetesEmulator

pytestmark = pytest.mark.slow


def test_the_waiting_launch_says_a_killed_replica_is_preempted_and_retried_by_the_cluster(
        kube: KubernetesEmulator, s3_bucket: str, home: Path, tmp_path: Path) -> None:
    launch = start_cli(*launch_args(s3_bucket, "--replicas", "2", *PACED), home=home, cwd=tmp_path)
    try:
        run_id = _job_of(kube)
        kube.wait_for(lambda: committed(s3_bucket, run_id, 1), timeout=120)
        os.kill(container_pid(kube, running(kube, run_id, 2)[1]), signal.SIGKILL)
        _, stderr = launch.communicate(timeout=240)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
    assert launch.returncode == 0, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("replica 1 preempted")]
    assert len(said) == 1, stderr[-3000:]
    assert "the cluster brings it back (restart 1)" in said[0], said
