"""``kubectl``, a second real client nobody here wrote, against the Kubernetes emulator.

The machine's own ``kubectl`` is given only ``KUBECONFIG`` (plus a private ``HOME`` so its discovery cache stays
in the test's folder): it has to verify the emulator's TLS certificate against the kubeconfig's CA, send the
bearer token (client-go sends none over plain HTTP), find ``jobs`` and ``pods`` through discovery, and print the
server's ``Table``s. Every answer is checked against what the ``kubernetes`` Python client reads from the same
emulator at the same moment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.kubernetes import KubernetesEmulator  # tests/ is on sys.path
from kubernetes import client, config
from kubernetes.client.rest import ApiException

NS = "default"
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not on PATH")

#: Each index prints three lines, then waits for ``release`` to exist and prints one more.
WORKER = ("import os, sys, time\n"
          "index = os.environ['JOB_COMPLETION_INDEX']\n"
          "for n in range(3):\n"
          "    print(f'index {index} line {n}', flush=True)\n"
          "while not os.path.exists(sys.argv[1]):\n"
          "    time.sleep(0.05)\n"
          "print(f'index {index} done', flush=True)\n")


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubernetesEmulator]:
    with KubernetesEmulator(tmp_path / "kube") as emulator:
        yield emulator


@pytest.fixture
def kubectl(kube: KubernetesEmulator, tmp_path: Path) -> Any:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path / "home"), "KUBECONFIG": str(kube.kubeconfig)}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(KUBECTL), *args], env=env, capture_output=True, text=True, timeout=60)
        if check:
            assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done
    return run


def table(text: str) -> list[dict[str, str]]:
    """kubectl's printed tables as rows keyed by column name (blank-line separated tables, one per kind)."""
    rows: list[dict[str, str]] = []
    for block in text.strip().split("\n\n"):
        header, *lines = block.splitlines()
        starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", header)]
        names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        for line in lines:
            cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
            rows.append(dict(zip(names, cells, strict=True)))
    return rows


def job_body(release: Path) -> dict[str, Any]:
    container = {"name": "main", "image": "python:3.11-slim", "command": ["python", "-c", WORKER, str(release)]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "demo"},
            "spec": {"completionMode": "Indexed", "completions": 2, "parallelism": 2,
                     "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}}


def test_kubectl_reads_the_job_its_pods_their_events_and_logs_as_the_client_does(
        kube: KubernetesEmulator, kubectl: Any, tmp_path: Path) -> None:
    api = config.new_client_from_config(config_file=str(kube.kubeconfig))
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
    release = tmp_path / "release"
    batch.create_namespaced_job(NS, job_body(release))

    def printed_all() -> list[Any]:
        pods = core.list_namespaced_pod(NS, label_selector="job-name=demo").items
        return len(pods) == 2 and all(kube.pod_log(p.metadata.name).count("\n") == 3 for p in pods) and pods
    pods = kube.wait_for(printed_all)
    names = sorted(p.metadata.name for p in pods)

    assert table(kubectl("get", "ns").stdout)[0].keys() == {"NAME", "STATUS", "AGE"}
    rows = table(kubectl("get", "jobs,pods").stdout)
    assert rows[0]["NAME"] == "job.batch/demo" and (rows[0]["STATUS"], rows[0]["COMPLETIONS"]) == ("Running", "0/2")
    assert list(rows[0]) == ["NAME", "STATUS", "COMPLETIONS", "DURATION", "AGE"]
    assert list(rows[1]) == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert sorted(r["NAME"] for r in rows[1:]) == [f"pod/{n}" for n in names]
    assert {(r["READY"], r["STATUS"], r["RESTARTS"]) for r in rows[1:]} == {("1/1", "Running", "0")}

    described = kubectl("describe", "job", "demo").stdout
    assert re.search(r"Pods Statuses:\s+2 Active \(2 Ready\) / 0 Succeeded / 0 Failed", described)
    assert re.search(r"Completion Mode:\s+Indexed", described)
    events = core.list_namespaced_event(NS, field_selector="involvedObject.name=demo").items
    assert sorted(e.message for e in events) == [f"Created pod: {n}" for n in names]
    for name in names:
        assert f"Created pod: {name}" in described

    for name in names:
        assert kubectl("logs", name).stdout == core.read_namespaced_pod_log(name, NS) != ""
    previous = kubectl("logs", names[0], "--previous", check=False)
    with pytest.raises(ApiException) as caught:
        core.read_namespaced_pod_log(names[0], NS, previous=True)
    assert previous.returncode == 1 and caught.value.status == 400
    assert previous.stderr.strip() == f'Error from server (BadRequest): previous terminated container "main" in ' \
                                      f'pod "{names[0]}" not found'

    env_follow = subprocess.Popen([str(KUBECTL), "logs", "-f", names[1]], stdout=subprocess.PIPE, text=True,
                                  env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path / "home"),
                                       "KUBECONFIG": str(kube.kubeconfig)})
    try:
        assert env_follow.stdout is not None
        first = env_follow.stdout.readline()  # following: the backlog arrives before the container ends
        release.touch()
        rest = env_follow.stdout.read()  # to the end of the stream, which ends with the container
        env_follow.wait(timeout=60)
    finally:
        if env_follow.poll() is None:
            env_follow.kill()
            env_follow.wait()
    index = pods[[p.metadata.name for p in pods].index(names[1])].metadata.labels[
        "batch.kubernetes.io/job-completion-index"]
    assert env_follow.returncode == 0
    assert first + rest == "".join(f"index {index} line {n}\n" for n in range(3)) + f"index {index} done\n"

    kube.wait_for(lambda: (batch.read_namespaced_job("demo", NS).status.succeeded or 0) == 2)
    kube.wait_for(lambda: any(c.type == "Complete" and c.status == "True"
                              for c in batch.read_namespaced_job("demo", NS).status.conditions or []))
    rows = table(kubectl("get", "jobs,pods").stdout)
    assert (rows[0]["STATUS"], rows[0]["COMPLETIONS"]) == ("Complete", "2/2")
    assert {(r["READY"], r["STATUS"]) for r in rows[1:]} == {("0/1", "Completed")}
    assert re.search(r"Pods Statuses:\s+0 Active \(0 Ready\) / 2 Succeeded / 0 Failed",
                     kubectl("describe", "job", "demo").stdout)

    deleted = kubectl("delete", "job", "demo")
    assert deleted.stdout.strip() == 'job.batch "demo" deleted'
    with pytest.raises(ApiException) as caught:
        batch.read_namespaced_job("demo", NS)
    assert caught.value.status == 404
    kube.wait_for(lambda: not core.list_namespaced_pod(NS, label_selector="job-name=demo").items)  # Background
    assert kubectl("get", "jobs,pods").stderr.strip() == "No resources found in default namespace."
    assert not kube.live_processes()
