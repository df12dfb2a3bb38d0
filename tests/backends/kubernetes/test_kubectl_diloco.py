"""``kubectl`` beside ``diloco`` during a real run on the Kubernetes emulator: both read the same cluster and agree.

Every Kubernetes user keeps kubectl open beside a launcher. Here the machine's own kubectl (only ``KUBECONFIG``
and a private ``HOME``) lists the run's Job and pods, describes the Job, reads a replica's log and deletes the Job
while ``diloco status`` and ``diloco logs`` read the same run; what one shows, the other must too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from backends.kubernetes.test_kubernetes_e2e import (  # noqa: F401 - the e2e module's fixtures, shared
    NAMESPACE,
    cli,
    home,
    image_dir,
    kube,
    launch_args,
    processes_of,
    running,
)
from emulator_tests.test_emulator_kubectl import KUBECTL, table
from emulators.kubernetes import KubernetesEmulator

pytestmark = [pytest.mark.slow, pytest.mark.skipif(KUBECTL is None, reason="kubectl is not on PATH")]


def kubectl(kube: KubernetesEmulator, tmp_path: Path, *args: str) -> str:  # noqa: F811 - the fixture's value
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path / "kubectl-home"),
           "KUBECONFIG": str(kube.kubeconfig)}
    done = subprocess.run([str(KUBECTL), "--namespace", NAMESPACE, *args], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def status_of(run_id: str, home: Path, cwd: Path) -> dict[str, Any]:  # noqa: F811
    done = cli("status", run_id, "-o", "json", home=home, cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_kubectl_and_diloco_agree_on_a_running_run_and_on_its_deletion(
        kube: KubernetesEmulator, s3_bucket: str, home: Path, tmp_path: Path) -> None:  # noqa: F811
    gate = tmp_path / "gate"  # never opened: the replicas stay running until the Job is deleted
    launch = cli(*launch_args(s3_bucket, "--replicas", "2", "--trainer", "k8s_trainers:gated", "-k",
                              f"gate={gate}", "--steps", "20", "--sync-every", "10", "--detach", "-o", "json"),
                 home=home, cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    pods = running(kube, run_id, 2)
    kube.wait_for(lambda: all("waiting for the gate" in kube.pod_log(p["metadata"]["name"]) for p in pods.values()),
                  timeout=90)

    report = status_of(run_id, home, tmp_path)
    assert [r["state"] for r in report["ranks"]] == ["running", "running"]
    pod_of_rank = {r["rank"]: r["job_id"] for r in report["ranks"]}
    assert pod_of_rank == {i: p["metadata"]["name"] for i, p in pods.items()}

    rows = table(kubectl(kube, tmp_path, "get", "jobs,pods"))
    job_rows = [r for r in rows if r["NAME"].startswith("job.batch/")]
    pod_rows = [r for r in rows if r["NAME"].startswith("pod/")]
    assert [r["NAME"] for r in job_rows] == [f"job.batch/{run_id}"]
    assert (job_rows[0]["STATUS"], job_rows[0]["COMPLETIONS"]) == ("Running", "0/2")
    assert sorted(r["NAME"] for r in pod_rows) == sorted(f"pod/{name}" for name in pod_of_rank.values())
    assert {(r["READY"], r["STATUS"], r["RESTARTS"]) for r in pod_rows} == {("1/1", "Running", "0")}
    assert {r["restarts"] for r in report["ranks"]} == {0}

    described = kubectl(kube, tmp_path, "describe", "job", run_id)
    assert re.search(r"Pods Statuses:\s+2 Active \(2 Ready\) / 0 Succeeded / 0 Failed", described), described
    assert re.search(r"Completion Mode:\s+Indexed", described)
    for name in pod_of_rank.values():
        assert f"Created pod: {name}" in described

    logs = cli("logs", run_id, home=home, cwd=tmp_path)
    assert logs.returncode == 0, logs.stderr[-2000:]
    for rank, name in pod_of_rank.items():
        printed = kubectl(kube, tmp_path, "logs", name)
        assert "waiting for the gate" in printed
        ours = [line[len(f"[r{rank}] "):] for line in logs.stdout.splitlines() if line.startswith(f"[r{rank}] ")]
        assert [line for line in printed.splitlines() if line.strip()][:len(ours)] == ours, (printed, ours)

    kubectl(kube, tmp_path, "delete", "job", run_id)
    kube.wait_for(lambda: kube.job(run_id) is None and not kube.pods(run_id), timeout=90)
    assert table(kubectl(kube, tmp_path, "get", "jobs,pods") or "NAME\n") == []
    after = status_of(run_id, home, tmp_path)
    assert after["state"] not in ("running", "pending"), after
    assert all(r["state"] not in ("running", "pending") for r in after["ranks"]), after
    kube.wait_for(lambda: not processes_of(run_id), timeout=60)
