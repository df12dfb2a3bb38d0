"""The Kubernetes API emulator, driven only through the official ``kubernetes`` client.

Every test starts its own emulator and talks to it through the kubeconfig it writes, with ``BatchV1Api``,
``CoreV1Api``, ``AuthorizationV1Api`` and ``watch.Watch``: nothing in the client is patched, so what passes here
is what the backend will see. Containers are real ``python -c`` processes; the assertions are about what the
API answers (conditions, counters, interval strings, error bodies) and about the processes themselves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.kube_cluster import format_intervals  # tests/ is on sys.path
from emulators.kubernetes import KubernetesEmulator
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

NS = "default"
TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z (.*)$")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubernetesEmulator]:
    with KubernetesEmulator(tmp_path / "kube") as emulator:
        yield emulator


@pytest.fixture
def api(kube: KubernetesEmulator) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(kube.kubeconfig))


@pytest.fixture
def batch(api: client.ApiClient) -> client.BatchV1Api:
    return client.BatchV1Api(api)


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


def job_body(name: str, code: str, *, completions: int = 3, env: dict[str, str] | None = None,
             **spec: Any) -> dict[str, Any]:
    """An Indexed Job whose every index runs ``python -c code`` (``restartPolicy: Never``)."""
    container: dict[str, Any] = {"name": "main", "image": "python:3.11-slim", "command": ["python", "-c", code]}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    template_spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": spec.pop("grace", 5),
                     "containers": [container]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"completionMode": "Indexed", "completions": completions, "parallelism": completions,
                     "template": {"spec": template_spec}, **spec}}


def wait_job(batch: client.BatchV1Api, name: str, *types: str, timeout: float = 30) -> client.V1Job:
    """Poll the Job until one of the condition ``types`` is true."""
    deadline = time.monotonic() + timeout
    while True:
        job = batch.read_namespaced_job(name, NS)
        found = [c.type for c in job.status.conditions or [] if c.status == "True"]
        if any(t in found for t in types):
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {name} never reached {types}: {job.status}")
        time.sleep(0.05)


def job_pods(core: client.CoreV1Api, name: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(NS, label_selector=f"batch.kubernetes.io/job-name={name}").items


def running_pods(kube: KubernetesEmulator, name: str, count: int) -> list[dict[str, Any]]:
    """Wait until ``count`` pods of the Job have a running container."""
    def running() -> list[dict[str, Any]]:
        pods = [p for p in kube.pods(name) if p["status"].get("phase") == "Running"]
        return pods if len(pods) >= count else []
    return kube.wait_for(running)


def read_log(core: client.CoreV1Api, pod: str, **options: Any) -> str:
    """A pod's log as text on both client majors (36.x returns the ``repr`` of the bytes from the plain call)."""
    response = core.read_namespaced_pod_log(pod, NS, _preload_content=False, **options)
    return response.data.decode()


def error_body(exc: ApiException) -> dict[str, Any]:
    return json.loads(exc.body)


def condition_of(job: client.V1Job, kind: str) -> client.V1JobCondition:
    return next(c for c in job.status.conditions if c.type == kind)


# ------------------------------------------------------------------------------------------ the happy path


def test_three_index_job_completes_with_the_controllers_labels_env_and_logs(batch: client.BatchV1Api,
                                                                          core: client.CoreV1Api) -> None:
    code = ("import os; print('rank', os.environ['JOB_COMPLETION_INDEX'], os.environ['RANK'], "
            "os.environ['POD'].rsplit('-', 1)[0], os.environ['GREETING'], flush=True)")
    body = job_body("hello", code, env={"GREETING": "hi-$(RANK)"})
    body["spec"]["template"]["spec"]["containers"][0]["env"][:0] = [
        {"name": "RANK", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    created = batch.create_namespaced_job(NS, body)
    assert created.spec.backoff_limit == 6 and created.spec.completion_mode == "Indexed"
    assert created.metadata.labels["batch.kubernetes.io/job-name"] == "hello"
    assert created.spec.selector.match_labels == {"batch.kubernetes.io/controller-uid": created.metadata.uid}

    job = wait_job(batch, "hello", "Complete")
    assert job.status.completed_indexes == "0-2" and job.status.succeeded == 3 and not job.status.failed
    assert [c.type for c in job.status.conditions] == ["SuccessCriteriaMet", "Complete"]
    assert condition_of(job, "Complete").reason == "CompletionsReached"
    assert job.status.completion_time is not None and job.status.active is None

    pods = sorted(job_pods(core, "hello"), key=lambda p: p.metadata.name)
    assert len(pods) == 3
    for index, pod in enumerate(pods):
        assert re.fullmatch(rf"hello-{index}-[bcdfghjklmnpqrstvwxz2456789]{{5}}", pod.metadata.name)
        assert pod.metadata.annotations["batch.kubernetes.io/job-completion-index"] == str(index)
        assert pod.metadata.labels["batch.kubernetes.io/job-completion-index"] == str(index)
        assert pod.metadata.labels["job-name"] == "hello" and pod.metadata.labels["controller-uid"]
        assert pod.metadata.owner_references[0].kind == "Job" and pod.metadata.owner_references[0].controller
        assert not pod.metadata.finalizers, "the job controller removes its tracking finalizer once counted"
        assert pod.spec.hostname == f"hello-{index}"
        assert pod.status.phase == "Succeeded"
        terminated = pod.status.container_statuses[0].state.terminated
        assert (terminated.exit_code, terminated.reason) == (0, "Completed")
        log = read_log(core, pod.metadata.name)
        assert log == f"rank {index} {index} hello-{index} hi-{index}\n"


def test_a_job_built_from_client_models_is_accepted(batch: client.BatchV1Api) -> None:
    """The client's own models serialize to what the emulator accepts (both major versions)."""
    container = client.V1Container(name="main", image="python:3.11-slim", command=["python", "-c", "pass"])
    spec = client.V1JobSpec(completion_mode="Indexed", completions=2, parallelism=2, backoff_limit_per_index=0,
                            template=client.V1PodTemplateSpec(spec=client.V1PodSpec(restart_policy="Never",
                                                                                  containers=[container])))
    batch.create_namespaced_job(NS, client.V1Job(api_version="batch/v1", kind="Job",
                                                 metadata=client.V1ObjectMeta(name="models"), spec=spec))
    job = wait_job(batch, "models", "Complete")
    assert job.status.completed_indexes == "0,1" and job.status.failed_indexes == ""


def test_intervals_use_the_api_servers_format() -> None:
    assert format_intervals({0, 1, 2, 4}) == "0-2,4"
    assert format_intervals({1, 2}) == "1,2"
    assert format_intervals({0, 2, 3, 4, 7, 8}) == "0,2-4,7,8"
    assert format_intervals(set()) == ""


# ------------------------------------------------------------------------------------------ retries and policies


RETRY_ONCE = """
import os, pathlib, sys
index = os.environ['JOB_COMPLETION_INDEX']
marker = pathlib.Path(os.environ['STATE']) / f'attempt-{index}'
first = not marker.exists()
marker.write_text('seen')
print(f'index {index} ' + ('first attempt' if first else 'retry'), flush=True)
sys.exit(1 if index == '1' and first else 0)
"""


def test_a_failed_index_is_retried_and_the_previous_attempts_log_stays_readable(
        batch: client.BatchV1Api, core: client.CoreV1Api, tmp_path: Path) -> None:
    batch.create_namespaced_job(NS, job_body("retry", RETRY_ONCE, env={"STATE": str(tmp_path)},
                                             backoffLimitPerIndex=1, maxFailedIndexes=0))
    job = wait_job(batch, "retry", "Complete")
    assert job.status.completed_indexes == "0-2" and job.status.failed == 1 and job.status.failed_indexes == ""

    attempts = sorted((p for p in job_pods(core, "retry")
                       if p.metadata.labels["batch.kubernetes.io/job-completion-index"] == "1"),
                      key=lambda p: p.metadata.annotations["batch.kubernetes.io/job-index-failure-count"])
    assert [p.status.phase for p in attempts] == ["Failed", "Succeeded"]
    first, second = attempts
    assert first.status.container_statuses[0].state.terminated.exit_code == 1
    assert first.status.container_statuses[0].state.terminated.reason == "Error"
    assert second.metadata.annotations["batch.kubernetes.io/job-index-failure-count"] == "1"
    assert read_log(core, first.metadata.name) == "index 1 first attempt\n"
    assert read_log(core, second.metadata.name) == "index 1 retry\n"
    with pytest.raises(ApiException) as caught:
        read_log(core, second.metadata.name, previous=True)
    assert caught.value.status == 400
    assert error_body(caught.value)["message"] == \
        f'previous terminated container "main" in pod "{second.metadata.name}" not found'


def test_an_index_out_of_retries_fails_the_job_past_max_failed_indexes(batch: client.BatchV1Api,
                                                                        core: client.CoreV1Api) -> None:
    code = "import os, sys, time; i = os.environ['JOB_COMPLETION_INDEX']; sys.exit(2 if i == '2' else 0)"
    batch.create_namespaced_job(NS, job_body("exhaust", code, backoffLimitPerIndex=1, maxFailedIndexes=0))
    job = wait_job(batch, "exhaust", "Failed")
    assert job.status.failed_indexes == "2" and job.status.failed == 2
    assert condition_of(job, "FailureTarget").reason == "MaxFailedIndexesExceeded"
    failed = condition_of(job, "Failed")
    assert (failed.reason, failed.message) == ("MaxFailedIndexesExceeded",
                                               "Job has exceeded the specified maximal number of failed indexes")
    index_two = [p for p in job_pods(core, "exhaust")
                 if p.metadata.labels["batch.kubernetes.io/job-completion-index"] == "2"]
    assert len(index_two) == 2, "backoffLimitPerIndex=1 allows exactly one retry"


def test_fail_index_on_a_configuration_exit_code_is_not_retried(batch: client.BatchV1Api,
                                                                 core: client.CoreV1Api) -> None:
    code = "import os, sys; sys.exit(3 if os.environ['JOB_COMPLETION_INDEX'] == '1' else 0)"
    policy = {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailIndex", "onExitCodes": {"operator": "In", "values": [3]}}]}
    batch.create_namespaced_job(NS, job_body("config-error", code, backoffLimitPerIndex=4, maxFailedIndexes=1,
                                             podFailurePolicy=policy))
    job = wait_job(batch, "config-error", "Failed")
    assert job.status.failed_indexes == "1" and job.status.completed_indexes == "0,2"
    failed = condition_of(job, "Failed")
    assert (failed.reason, failed.message) == ("FailedIndexes", "Job has failed indexes")
    assert len(job_pods(core, "config-error")) == 3, "FailIndex must not create a second pod for index 1"


def test_fail_job_rule_fails_the_job_and_stops_the_other_pods(batch: client.BatchV1Api, kube: KubernetesEmulator,
                                                              core: client.CoreV1Api) -> None:
    code = ("import os, sys, time\nif os.environ['JOB_COMPLETION_INDEX'] == '0':\n    time.sleep(0.5)\n"
            "    sys.exit(42)\ntime.sleep(60)")
    policy = {"rules": [{"action": "FailJob", "onExitCodes": {"containerName": "main", "operator": "In",
                                                              "values": [42]}}]}
    batch.create_namespaced_job(NS, job_body("fatal", code, podFailurePolicy=policy))
    job = wait_job(batch, "fatal", "Failed")
    pod = next(p for p in job_pods(core, "fatal")
               if p.metadata.labels["batch.kubernetes.io/job-completion-index"] == "0")
    assert condition_of(job, "Failed").reason == "PodFailurePolicy"
    assert condition_of(job, "Failed").message == (
        f"Container main for pod {NS}/{pod.metadata.name} failed with exit code 42 matching FailJob rule at index 0")
    assert kube.live_processes() == []


def test_backoff_limit_counts_failures_across_indexes(batch: client.BatchV1Api) -> None:
    batch.create_namespaced_job(NS, job_body("flaky", "import sys; sys.exit(1)", completions=1, backoffLimit=1))
    job = wait_job(batch, "flaky", "Failed")
    assert job.status.failed == 2
    assert condition_of(job, "Failed").message == "Job has reached the specified backoff limit"


WAIT_FOR_GO = """
import os, pathlib, sys, time
go = pathlib.Path(os.environ['STATE']) / 'go'
print('started', os.environ['JOB_COMPLETION_INDEX'], flush=True)
while not go.exists():
    time.sleep(0.05)
print('done', flush=True)
"""


def test_an_evicted_pod_is_replaced_without_counting_as_a_failure(batch: client.BatchV1Api, core: client.CoreV1Api,
                                                                  kube: KubernetesEmulator, tmp_path: Path) -> None:
    policy = {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}
    batch.create_namespaced_job(NS, job_body("evict", WAIT_FOR_GO, completions=2, env={"STATE": str(tmp_path)},
                                             backoffLimitPerIndex=0, podFailurePolicy=policy))
    victim = next(p for p in running_pods(kube, "evict", 2)
                  if p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "1")
    core.create_namespaced_pod_eviction(victim["metadata"]["name"], NS, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=victim["metadata"]["name"], namespace=NS)))
    replacement = kube.wait_for(lambda: [p for p in kube.pods("evict")
                                         if p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "1"
                                         and p["metadata"]["name"] != victim["metadata"]["name"]])
    assert replacement[0]["metadata"]["annotations"]["batch.kubernetes.io/job-index-ignored-failure-count"] == "1"
    (tmp_path / "go").write_text("")
    job = wait_job(batch, "evict", "Complete")
    assert job.status.completed_indexes == "0,1" and not job.status.failed and job.status.failed_indexes == ""


def test_eviction_marks_the_pod_with_a_disruption_condition(core: client.CoreV1Api, batch: client.BatchV1Api,
                                                            kube: KubernetesEmulator, tmp_path: Path) -> None:
    """Watch the evicted pod to its end: DisruptionTarget, phase Failed, SIGTERM's exit code."""
    batch.create_namespaced_job(NS, job_body("drain", WAIT_FOR_GO, completions=1, env={"STATE": str(tmp_path)}))
    pod = running_pods(kube, "drain", 1)[0]["metadata"]["name"]
    stream = watch.Watch()
    seen: list[client.V1Pod] = []
    kube.evict(pod, reason="TerminationByKubelet", message="Pod was terminated in response to imminent node "
                                                           "shutdown.")
    for event in stream.stream(core.list_namespaced_pod, NS, field_selector=f"metadata.name={pod}",
                               timeout_seconds=20):
        seen.append(event["object"])
        if event["object"].status.phase == "Failed":
            stream.stop()
    final = seen[-1]
    disruption = next(c for c in final.status.conditions if c.type == "DisruptionTarget")
    assert (disruption.status, disruption.reason) == ("True", "TerminationByKubelet")
    assert final.status.container_statuses[0].state.terminated.exit_code == 143


def test_oom_killed_container_reports_its_reason(batch: client.BatchV1Api, core: client.CoreV1Api,
                                                 kube: KubernetesEmulator) -> None:
    batch.create_namespaced_job(NS, job_body("oom", "import time; time.sleep(60)", completions=1, backoffLimit=0))
    kube.oom_kill(running_pods(kube, "oom", 1)[0]["metadata"]["name"])
    wait_job(batch, "oom", "Failed")
    terminated = job_pods(core, "oom")[0].status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (137, "OOMKilled")


def test_active_deadline_fails_the_job_and_kills_its_processes(batch: client.BatchV1Api,
                                                               kube: KubernetesEmulator) -> None:
    batch.create_namespaced_job(NS, job_body("slow", "import time; time.sleep(60)", completions=2,
                                             activeDeadlineSeconds=1))
    job = wait_job(batch, "slow", "Failed")
    assert condition_of(job, "Failed").reason == "DeadlineExceeded"
    assert kube.live_processes() == []


# ------------------------------------------------------------------------------------------ deletion and TTL


def test_foreground_delete_waits_for_the_pods_and_leaves_no_process(batch: client.BatchV1Api, core: client.CoreV1Api,
                                                                    kube: KubernetesEmulator) -> None:
    batch.create_namespaced_job(NS, job_body("long", "import time; time.sleep(60)"))
    running_pods(kube, "long", 3)
    pids = kube.live_processes()
    assert len(pids) == 3
    # The raw answer: 37.x returns it as a dict, 36.x squeezes it into a V1Status and loses the metadata.
    raw = batch.delete_namespaced_job("long", NS, propagation_policy="Foreground", _preload_content=False)
    answer = json.loads(raw.data)
    assert answer["kind"] == "Job" and answer["metadata"]["deletionTimestamp"]
    assert "foregroundDeletion" in answer["metadata"]["finalizers"]

    def gone() -> bool:
        try:
            batch.read_namespaced_job("long", NS)
        except ApiException as exc:
            return exc.status == 404
        return False
    kube.wait_for(gone)
    assert job_pods(core, "long") == [] and kube.live_processes() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_delete_without_a_policy_orphans_the_pods_like_the_api_server(batch: client.BatchV1Api,
                                                                       core: client.CoreV1Api,
                                                                       kube: KubernetesEmulator, api: Any) -> None:
    batch.create_namespaced_job(NS, job_body("orphans", "import time; time.sleep(60)", completions=1))
    running_pods(kube, "orphans", 1)
    response = batch.delete_namespaced_job_with_http_info("orphans", NS)
    warning = response.headers.get("Warning", "") if hasattr(response, "headers") else response[2].get("Warning")
    assert "child pods are preserved by default when jobs are deleted" in warning
    kube.wait_for(lambda: kube.job("orphans") is None)
    pods = job_pods(core, "orphans")
    assert len(pods) == 1 and not pods[0].metadata.owner_references and pods[0].status.phase == "Running"
    assert len(kube.live_processes()) == 1, "an orphaned pod keeps running"
    core.delete_namespaced_pod(pods[0].metadata.name, NS, grace_period_seconds=0)
    kube.wait_for(lambda: not kube.live_processes())


def test_grace_period_ends_in_sigkill_for_a_process_that_ignores_sigterm(core: client.CoreV1Api,
                                                                          batch: client.BatchV1Api,
                                                                          kube: KubernetesEmulator) -> None:
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)")
    batch.create_namespaced_job(NS, job_body("stubborn", code, completions=1, grace=1, backoffLimit=0))
    pod = running_pods(kube, "stubborn", 1)[0]["metadata"]["name"]
    kube.wait_for(lambda: read_log(core, pod) == "ready\n")
    stream = watch.Watch()
    core.delete_namespaced_pod(pod, NS)
    last = None
    for event in stream.stream(core.list_namespaced_pod, NS, field_selector=f"metadata.name={pod}",
                               timeout_seconds=20):
        last = event["object"]
        if event["type"] == "DELETED":
            stream.stop()
    assert last is not None and last.status.container_statuses[0].state.terminated.exit_code == 137


def test_ttl_after_finished_deletes_the_job_and_its_pods(batch: client.BatchV1Api, core: client.CoreV1Api,
                                                         kube: KubernetesEmulator) -> None:
    batch.create_namespaced_job(NS, job_body("ephemeral", "print('bye')", completions=2, ttlSecondsAfterFinished=0))
    kube.wait_for(lambda: kube.job("ephemeral") is None)
    with pytest.raises(ApiException) as caught:
        batch.read_namespaced_job("ephemeral", NS)
    assert caught.value.status == 404
    assert job_pods(core, "ephemeral") == []
    reasons = {e.reason for e in core.list_namespaced_event(NS, field_selector="involvedObject.name=ephemeral").items}
    assert {"SuccessfulCreate", "Completed"} <= reasons


# ------------------------------------------------------------------------------------------ logs and watches


def test_follow_streams_timestamped_lines_until_the_container_ends(batch: client.BatchV1Api,
                                                                    core: client.CoreV1Api,
                                                                    kube: KubernetesEmulator) -> None:
    code = "import time\nfor i in range(5):\n    print('line', i, flush=True)\n    time.sleep(0.1)"
    batch.create_namespaced_job(NS, job_body("chatty", code, completions=1))
    pod = running_pods(kube, "chatty", 1)[0]["metadata"]["name"]
    lines = list(watch.Watch().stream(core.read_namespaced_pod_log, pod, NS, timestamps=True))
    bodies = [TIMESTAMPED.match(line) for line in lines]
    assert all(bodies), lines
    assert [m.group(1) for m in bodies if m] == [f"line {i}" for i in range(5)]
    stamps = [line.split(" ", 1)[0] for line in lines]
    assert stamps == sorted(stamps)
    assert read_log(core, pod, tail_lines=2) == "line 3\nline 4\n"
    assert read_log(core, pod, since_seconds=3600).count("\n") == 5


def test_log_requests_before_the_container_starts_get_the_kubelets_400(batch: client.BatchV1Api,
                                                                        core: client.CoreV1Api,
                                                                        kube: KubernetesEmulator) -> None:
    unschedulable = kube.hold_pending(job="waiting", index=0)
    creating = kube.hold_pending(job="waiting", index=1, reason="ContainerCreating")
    kube.image_pull_error("registry.invalid/*")
    batch.create_namespaced_job(NS, job_body("waiting", "print('up')", completions=2))
    body = job_body("nopull", "print('never')", completions=1)
    body["spec"]["template"]["spec"]["containers"][0]["image"] = "registry.invalid/diloco:1"
    batch.create_namespaced_job(NS, body)

    def by_index(job: str, index: int) -> client.V1Pod:
        return next(p for p in job_pods(core, job)
                    if p.metadata.labels["batch.kubernetes.io/job-completion-index"] == str(index))

    pending = kube.wait_for(lambda: [p for p in job_pods(core, "waiting") if p.status.conditions and any(
        c.type == "PodScheduled" and c.reason == "Unschedulable" for c in p.status.conditions)])[0]
    assert pending.status.phase == "Pending"
    events = core.list_namespaced_event(NS, field_selector=f"involvedObject.name={pending.metadata.name}").items
    assert any(e.reason == "FailedScheduling" and e.type == "Warning" and "Insufficient" in e.message
               for e in events)
    expected = {
        ("waiting", 0): f"pod {pending.metadata.name} does not have a host assigned",
        ("waiting", 1): 'container "main" in pod "{}" is waiting to start: ContainerCreating',
        ("nopull", 0): 'container "main" in pod "{}" is waiting to start: trying and failing to pull image',
    }
    kube.wait_for(lambda: by_index("nopull", 0).status.container_statuses and by_index(
        "nopull", 0).status.container_statuses[0].state.waiting.reason == "ImagePullBackOff")
    for (job, index), message in expected.items():
        pod = by_index(job, index).metadata.name
        with pytest.raises(ApiException) as caught:
            read_log(core, pod)
        assert caught.value.status == 400 and error_body(caught.value)["reason"] == "BadRequest"
        assert error_body(caught.value)["message"] == message.format(pod)
    kube.release(unschedulable)
    kube.release(creating)
    assert wait_job(batch, "waiting", "Complete").status.completed_indexes == "0,1"


def test_pod_watch_reports_added_modified_and_deleted(batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    resource_version = core.list_namespaced_pod(NS).metadata.resource_version
    batch.create_namespaced_job(NS, job_body("watched", "print('hi')", completions=2))
    stream = watch.Watch()
    types: list[str] = []
    succeeded: set[str] = set()
    deleted: set[str] = set()
    for event in stream.stream(core.list_namespaced_pod, NS, label_selector="job-name=watched",
                               resource_version=resource_version, timeout_seconds=30):
        pod = event["object"]
        assert isinstance(pod, client.V1Pod)
        types.append(event["type"])
        if pod.status.phase == "Succeeded" and pod.metadata.name not in succeeded:
            succeeded.add(pod.metadata.name)
            if len(succeeded) == 2:
                batch.delete_namespaced_job("watched", NS, propagation_policy="Background")
        if event["type"] == "DELETED":
            deleted.add(pod.metadata.name)
            if deleted == succeeded:
                stream.stop()
    assert types[:2] == ["ADDED", "ADDED"] and "MODIFIED" in types and types.count("DELETED") == 2


# ------------------------------------------------------------------------------------------ errors and access


def test_errors_are_the_api_servers_status_bodies(batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    cases: list[tuple[Any, int, str, str]] = [
        (lambda: batch.read_namespaced_job("missing", NS), 404, "NotFound", 'jobs.batch "missing" not found'),
        (lambda: core.read_namespace("nowhere"), 404, "NotFound", 'namespaces "nowhere" not found'),
        (lambda: core.read_namespaced_pod("ghost", NS), 404, "NotFound", 'pods "ghost" not found'),
        (lambda: batch.create_namespaced_job("nowhere", job_body("lost", "pass")), 404, "NotFound",
         'namespaces "nowhere" not found'),
    ]
    for call, status, reason, message in cases:
        with pytest.raises(ApiException) as caught:
            call()
        body = error_body(caught.value)
        assert (caught.value.status, body["kind"], body["status"], body["reason"], body["message"], body["code"]) \
            == (status, "Status", "Failure", reason, message, status)

    batch.create_namespaced_job(NS, job_body("twice", "pass", completions=1))
    with pytest.raises(ApiException) as caught:
        batch.create_namespaced_job(NS, job_body("twice", "pass", completions=1))
    assert caught.value.status == 409
    assert error_body(caught.value)["details"] == {"name": "twice", "group": "batch", "kind": "jobs"}
    assert error_body(caught.value)["message"] == 'jobs.batch "twice" already exists'


def raw_request(kube: KubernetesEmulator, method: str, path: str, body: Any,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """A request the client library would not send (it validates bodies), straight over HTTPS."""
    answer = raw_response(kube, method, path, body, headers)
    return answer[0], answer[1]


def raw_response(kube: KubernetesEmulator, method: str, path: str, body: Any,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], list[str]]:
    """The status, the JSON body and the ``Warning`` headers of a raw request (the client drops the warnings)."""
    request = urllib.request.Request(kube.url + path, data=json.dumps(body).encode() if body is not None else None,
                                     method=method, headers={"Authorization": f"Bearer {kube.token}",
                                                             **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10, context=kube.ssl_context()) as response:
            return response.status, json.loads(response.read()), response.headers.get_all("Warning") or []
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers.get_all("Warning") or []


def test_invalid_jobs_are_rejected_with_field_paths(batch: client.BatchV1Api, kube: KubernetesEmulator) -> None:
    no_completions = job_body("bad", "pass")
    del no_completions["spec"]["completions"]
    with pytest.raises(ApiException) as caught:
        batch.create_namespaced_job(NS, no_completions)
    body = error_body(caught.value)
    assert caught.value.status == 422 and body["reason"] == "Invalid"
    assert body["message"] == 'Job.batch "bad" is invalid: spec.completions: Required value: when completion mode ' \
                              'is Indexed'
    assert body["details"]["causes"] == [{"reason": "FieldValueRequired", "field": "spec.completions",
                                          "message": "Required value: when completion mode is Indexed"}]

    gpu = job_body("gpu", "pass")
    gpu["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"},
                                                                      "requests": {"nvidia.com/gpu": "2"}}
    with pytest.raises(ApiException) as caught:
        batch.create_namespaced_job(NS, gpu)
    assert error_body(caught.value)["message"] == (
        'Job.batch "gpu" is invalid: spec.template.spec.containers[0].resources.requests: Invalid value: "2": '
        "must be equal to nvidia.com/gpu limit of 1")

    memory = job_body("mem", "pass")
    memory["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"memory": "2GB"}}
    with pytest.raises(ApiException) as caught:
        batch.create_namespaced_job(NS, memory)
    assert caught.value.status == 400 and error_body(caught.value)["message"] == (
        'Job in version "v1" cannot be handled as a Job: quantities must match the regular expression '
        "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")

    unknown = job_body("typo", "pass")
    unknown["spec"]["backoffLimitPerIndx"] = 1  # the 37.x client refuses to send this: post it raw
    status, body = raw_request(kube, "POST", f"/apis/batch/v1/namespaces/{NS}/jobs?fieldValidation=Strict", unknown)
    assert status == 400 and body["message"] == (
        'Job in version "v1" cannot be handled as a Job: strict decoding error: unknown field '
        '"spec.backoffLimitPerIndx"')
    wrong_type = job_body("typed", "pass", completions="3")
    status, body = raw_request(kube, "POST", f"/apis/batch/v1/namespaces/{NS}/jobs", wrong_type)
    assert status == 400 and body["message"] == (
        'Job in version "v1" cannot be handled as a Job: json: cannot unmarshal string into Go struct field '
        "JobSpec.spec.completions of type int32")

    fail_index = job_body("policy", "pass", podFailurePolicy={"rules": [
        {"action": "FailIndex", "onExitCodes": {"operator": "In", "values": [0, 3]}}]})
    with pytest.raises(ApiException) as caught:
        batch.create_namespaced_job(NS, fail_index)
    assert error_body(caught.value)["message"] == (
        'Job.batch "policy" is invalid: [spec.podFailurePolicy.rules[0].action: Invalid value: "FailIndex": '
        "requires the backoffLimitPerIndex to be set, spec.podFailurePolicy.rules[0].onExitCodes.values[0]: "
        'Invalid value: 0: must not be 0 for the In operator]')


def test_unknown_fields_are_dropped_with_a_warning_by_default_as_the_api_server_does(
        kube: KubernetesEmulator) -> None:
    """``fieldValidation`` defaults to ``Warn`` (1.27+): the Job is created without the unknown field and the answer
    carries one ``Warning: 299`` header per field; ``Ignore`` drops it silently; ``Strict`` refuses (above)."""
    path = f"/apis/batch/v1/namespaces/{NS}/jobs"
    typo = job_body("warned", "pass", completions=1)
    typo["spec"]["backoffLimitPerIndx"] = 1
    typo["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    status, body, warnings = raw_response(kube, "POST", path, typo)
    assert status == 201 and "backoffLimitPerIndx" not in body["spec"]
    assert warnings == ['299 - "unknown field \\"spec.backoffLimitPerIndx\\""',
                        '299 - "unknown field \\"spec.template.spec.containers[0].resourcez\\""']
    assert "backoffLimitPerIndx" not in (kube.job("warned") or {}).get("spec", {"backoffLimitPerIndx": 1})
    ignored = job_body("ignored", "pass", completions=1)
    ignored["spec"]["backoffLimitPerIndx"] = 1
    status, body, warnings = raw_response(kube, "POST", path + "?fieldValidation=Ignore", ignored)
    assert (status, warnings) == (201, []) and "backoffLimitPerIndx" not in body["spec"]
    status, body, _ = raw_response(kube, "POST", path + "?fieldValidation=strict", job_body("bad", "pass"))
    assert (status, body["reason"]) == (422, "Invalid")
    assert body["message"] == 'CreateOptions.meta.k8s.io "" is invalid: fieldValidation: Unsupported value: ' \
                              '"strict": supported values: "", "Ignore", "Strict", "Warn"'
    assert kube.job("bad") is None


def test_patches_change_mutable_fields_and_refuse_immutable_ones(batch: client.BatchV1Api,
                                                                  kube: KubernetesEmulator) -> None:
    """What a backend may change on a running Job (maxFailedIndexes, annotations) and what it may not."""
    batch.create_namespaced_job(NS, job_body("patched", "import time; time.sleep(60)", completions=2,
                                             backoffLimitPerIndex=0, maxFailedIndexes=0))
    patch = [{"op": "add", "path": "/metadata/annotations/example.com~1note", "value": "hello"},
             {"op": "replace", "path": "/spec/maxFailedIndexes", "value": 1}]
    raw = batch.patch_namespaced_job("patched", NS, patch, _preload_content=False)
    patched = json.loads(raw.data)
    assert patched["spec"]["maxFailedIndexes"] == 1 and patched["metadata"]["annotations"]["example.com/note"] == \
        "hello"
    assert patched["metadata"]["generation"] == 2
    running_pods(kube, "patched", 2)
    victim = next(p for p in kube.pods("patched")
                  if p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "1")
    kube.fail_pod(victim["metadata"]["name"], exit_code=7)
    job = kube.wait_for(lambda: (kube.job("patched") or {}).get("status", {}).get("failedIndexes") == "1" and
                        kube.job("patched"))
    assert not any(c["type"] in ("Failed", "FailureTarget") for c in job["status"].get("conditions", [])), \
        "one failed index is within the raised maxFailedIndexes"
    with pytest.raises(ApiException) as caught:
        batch.patch_namespaced_job("patched", NS, [{"op": "replace", "path": "/spec/completions", "value": 5}])
    assert caught.value.status == 422  # an Indexed Job is resized with parallelism (KEP-3715), never alone
    assert error_body(caught.value)["message"] == \
        'Job.batch "patched" is invalid: spec.completions: Invalid value: 5: can only be modified in tandem with ' \
        'spec.parallelism'


def test_rbac_denials_answer_403_and_self_subject_access_review_agrees(batch: client.BatchV1Api,
                                                                         api: Any,
                                                                         kube: KubernetesEmulator) -> None:
    auth = client.AuthorizationV1Api(api)

    def allowed(verb: str, resource: str, group: str = "", subresource: str = "") -> bool:
        review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
            resource_attributes=client.V1ResourceAttributes(namespace=NS, verb=verb, group=group,
                                                            resource=resource, subresource=subresource)))
        return auth.create_self_subject_access_review(review).status.allowed

    assert allowed("create", "jobs", "batch") and allowed("get", "pods", subresource="log")
    kube.deny("create", "jobs", group="batch")
    kube.deny("get", "pods", subresource="log")
    assert not allowed("create", "jobs", "batch") and not allowed("get", "pods", subresource="log")
    assert allowed("delete", "jobs", "batch")
    with pytest.raises(ApiException) as caught:
        batch.create_namespaced_job(NS, job_body("denied", "pass"))
    body = error_body(caught.value)
    assert caught.value.status == 403 and body["reason"] == "Forbidden"
    assert body["message"] == ('jobs.batch is forbidden: User "emulator-user" cannot create resource "jobs" in API '
                               f'group "batch" in the namespace "{NS}"')


def test_admission_refusals_and_service_accounts(batch: client.BatchV1Api, core: client.CoreV1Api,
                                                 kube: KubernetesEmulator) -> None:
    kube.add_service_account("trainer", annotations={"eks.amazonaws.com/role-arn": "arn:aws:iam::000000000000:"
                                                                                   "role/example"})
    account = core.read_namespaced_service_account("trainer", NS)
    assert account.metadata.annotations["eks.amazonaws.com/role-arn"].endswith("role/example")
    assert core.read_namespaced_service_account("default", NS).metadata.name == "default"
    assert NS in [n.metadata.name for n in core.list_namespace().items]
    kube.deny_quota("jobs", times=1)
    with pytest.raises(ApiException) as caught:
        batch.create_namespaced_job(NS, job_body("quota", "pass", completions=1))
    assert caught.value.status == 403 and "exceeded quota" in error_body(caught.value)["message"]
    batch.create_namespaced_job(NS, job_body("quota", "pass", completions=1))


def test_a_wrong_token_is_unauthorized(kube: KubernetesEmulator, tmp_path: Path) -> None:
    other = KubernetesEmulator(tmp_path / "other", token="another-token")
    other.start()
    try:
        kube_config = other.write_kubeconfig(tmp_path / "wrong.yaml")
        text = kube_config.read_text().replace('"another-token"', json.dumps(kube.token))
        kube_config.write_text(text)
        with pytest.raises(ApiException) as caught:
            client.CoreV1Api(config.new_client_from_config(config_file=str(kube_config))).list_namespace()
        assert caught.value.status == 401 and error_body(caught.value)["reason"] == "Unauthorized"
    finally:
        other.stop()


def test_runs_on_its_own_from_the_command_line(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc.yaml"
    process = subprocess.Popen([sys.executable, "-m", "tests.emulators.kubernetes", "--port", "0", "--kubeconfig",
                                str(kubeconfig), "--namespace", "team", "--service-account", "trainer"],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        assert "Kubernetes API emulator on https://127.0.0.1:" in banner
        core_api = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
        assert core_api.read_namespaced_service_account("trainer", "team").metadata.name == "trainer"
        contexts, active = config.list_kube_config_contexts(config_file=str(kubeconfig))
        assert active["context"]["namespace"] == "team"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0


def test_stop_kills_running_containers(tmp_path: Path) -> None:
    emulator = KubernetesEmulator(tmp_path / "k").start()
    batch_api = client.BatchV1Api(config.new_client_from_config(config_file=str(emulator.kubeconfig)))
    batch_api.create_namespaced_job(NS, job_body("left", "import time; time.sleep(60)", completions=2))
    running_pods(emulator, "left", 2)
    pids = emulator.live_processes()
    threading.Thread(target=emulator.stop).start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
