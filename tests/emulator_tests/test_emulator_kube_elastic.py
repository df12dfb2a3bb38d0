"""The Kubernetes emulator resizes Jobs as the API server and the job controller do (KEP-3715, elastic Indexed Jobs,
GA in 1.31): an Indexed Job's ``completions`` changes only together with ``parallelism``, to the same value, and the
controller then runs the new indexes; a NonIndexed Job's ``completions`` never changes. Each refusal is the API
server's 422 in its words (``validateCompletions``, pkg/apis/batch/validation/validation.go)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.kubernetes import KubernetesEmulator
from kubernetes import client, config
from kubernetes.client.rest import ApiException

NS = "elastic"


@pytest.fixture
def batch(tmp_path: Path) -> Iterator[tuple[KubernetesEmulator, client.BatchV1Api]]:
    with KubernetesEmulator(tmp_path / "kube", namespace=NS) as kube:
        api = config.new_client_from_config(config_file=str(kube.kubeconfig))
        yield kube, client.BatchV1Api(api)


def _job(name: str, mode: str, count: int) -> dict[str, Any]:
    container = {"name": "main", "image": "python:3.11-slim",
                 "command": ["python", "-c", "import time; time.sleep(60)"]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"completionMode": mode, "completions": count, "parallelism": count,
                     "template": {"spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                                           "containers": [container]}}}}


def _indexes(kube: KubernetesEmulator, name: str) -> set[str]:
    return {p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] for p in kube.pods(name)
            if p["status"].get("phase") == "Running"}


def test_an_indexed_job_grows_with_completions_and_parallelism_together(
    batch: tuple[KubernetesEmulator, client.BatchV1Api]
) -> None:
    kube, api = batch
    api.create_namespaced_job(NS, _job("grows", "Indexed", 2))
    kube.wait_for(lambda: _indexes(kube, "grows") == {"0", "1"})
    for patch in ({"completions": 4}, {"completions": 4, "parallelism": 3}):
        with pytest.raises(ApiException) as refused:
            api.patch_namespaced_job("grows", NS, {"spec": patch})
        assert refused.value.status == 422
        assert json.loads(refused.value.body)["message"] == ('Job.batch "grows" is invalid: spec.completions: Invalid '
                                                             'value: 4: can only be modified in tandem with '
                                                             'spec.parallelism')
    api.patch_namespaced_job("grows", NS, {"spec": {"completions": 4, "parallelism": 4}})
    assert kube.wait_for(lambda: _indexes(kube, "grows") == {"0", "1", "2", "3"})
    api.delete_namespaced_job("grows", NS, propagation_policy="Foreground")


def test_a_non_indexed_jobs_completions_never_change(batch: tuple[KubernetesEmulator, client.BatchV1Api]) -> None:
    kube, api = batch
    api.create_namespaced_job(NS, _job("fixed", "NonIndexed", 2))
    with pytest.raises(ApiException) as refused:
        api.patch_namespaced_job("fixed", NS, {"spec": {"completions": 3, "parallelism": 3}})
    assert json.loads(refused.value.body)["message"] == \
        'Job.batch "fixed" is invalid: spec.completions: Invalid value: 3: field is immutable'
    job = kube.job("fixed")
    assert job is not None and job["spec"]["completions"] == 2
    api.delete_namespaced_job("fixed", NS, propagation_policy="Foreground")
