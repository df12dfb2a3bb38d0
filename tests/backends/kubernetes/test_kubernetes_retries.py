"""A killed replica on EKS is retried by the Indexed Job itself, as many times as ``--max-restarts`` says (the same
flag, with the same default, as on every backend): here the flag's mapping and a kill that ``--max-restarts 0``
turns into a failed run. That a SIGKILL and an OOM kill with the default flags end in a completed run with
identical weights is shown by the e2e run in test_kubernetes_e2e.py, with the evictions.

End to end through the real CLI, the real ``kubernetes`` client, the Kubernetes API emulator and moto's S3 (the
fixtures of tests/test_kubernetes_e2e.py). A kill is what a node does to a container: SIGKILL of the container's
process (``kill -9``), or the kernel's OOM killer (the emulator's ``oom_kill``: exit 137, reason ``OOMKilled``).
"""

# ruff: noqa: F811 - the e2e module's fixtures are imported, and test parameters name them
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from backends.kubernetes.test_kubernetes_e2e import (  # noqa: F401 - fixtures, used by name
    cli,
    container_pid,
    home,
    image_dir,
    job_of,
    kube,
    launch_args,
    running,
    start_cli,
)
from emulators.kubernetes import KubernetesEmulator
from support.commands import killed_if_still_running

pytestmark = pytest.mark.slow

PACED = ["--trainer", "support.paced_trainer:train", "--steps", "40", "--sync-every", "5"]


def test_max_restarts_is_the_jobs_per_index_retry_limit(tmp_path: Path, home: Path) -> None:
    def limit(*extra: str) -> int:
        result = cli("launch", "--backend", "eks", "--image", "registry.example/diloco:1", "--rendezvous",
                     "s3://bucket/prefix/{run_id}", *extra, "--dry-run", "-o", "json", home=home, cwd=tmp_path,
                     env={"KUBECONFIG": str(tmp_path / "no-cluster")})
        assert result.returncode == 0, result.stderr
        return int(json.loads(result.stdout)["requests"][0]["spec"]["backoffLimitPerIndex"])

    assert limit() == 3, "the default recovers, as on every backend"
    assert limit("--max-restarts", "5") == 5
    assert limit("--max-restarts", "0") == 0
    assert limit("--max-restarts", "5", "--set", "backend.backoff_limit_per_index=1") == 1, "the backend's own wins"


def test_with_max_restarts_0_the_same_kill_fails_the_run(kube: KubernetesEmulator, s3_bucket: str, home: Path,
                                                         tmp_path: Path) -> None:
    with killed_if_still_running(start_cli(*launch_args(s3_bucket, "--replicas", "2", *PACED, "--max-restarts", "0"),
                                           home=home, cwd=tmp_path)) as launch:
        pods = running(kube, job_of(kube), 2)
        os.kill(container_pid(kube, pods[1]), signal.SIGKILL)
        _, stderr = launch.communicate(timeout=240)
    assert launch.returncode == 1, stderr[-3000:]
    assert "replica 1 failed with exit code 137" in stderr, stderr[-3000:]
    run_id = stderr.split("launched ", 1)[1].split(":", 1)[0]
    kube.wait_for(lambda: not kube.live_processes(), timeout=60)
    status = cli("status", run_id, "-o", "json", home=home, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    ranks = json.loads(status.stdout)["ranks"]
    assert (ranks[1]["state"], ranks[1]["exit_code"], ranks[1]["restarts"]) == ("failed", 137, 0), ranks[1]
