"""The backend's Kubernetes calls (executors/kubernetes/rest.py) send what the client's generated API classes
send for the same call: method, URL with its query, headers and body, byte for byte, and raise the same
``ApiException`` for an answer outside 2xx. The generated classes cost half a second of CPU to import in every
command that talks to a cluster; what goes on the wire must not change with them gone."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from diloco.executors.kubernetes.rest import batch_v1, core_v1

SENT = "sent"


class Answer:
    """What ``call_api`` returns: a urllib3-like response (what ``_preload_content=False`` hands back)."""

    def __init__(self, status: int, data: bytes = b"{}") -> None:
        self.status, self.data, self.reason = status, data, "Reason"
        self.response, self.headers = self, {"Content-Type": "application/json"}

    def read(self) -> bytes:
        return self.data

    def getheaders(self) -> dict[str, str]:
        return {"Content-Type": "application/json"}


def recording_client(status: int = 200) -> tuple[client.ApiClient, list[tuple[Any, ...]]]:
    configuration = client.Configuration(host="https://cluster.example:6443", api_key={"authorization": "t"},
                                         api_key_prefix={"authorization": "Bearer"})
    api = client.ApiClient(configuration)
    seen: list[tuple[Any, ...]] = []

    def call_api(method: str, url: str, header_params: Any = None, body: Any = None, post_params: Any = None,
                 _request_timeout: Any = None) -> Answer:
        seen.append((method, url, dict(header_params or {}), body, post_params, _request_timeout))
        return Answer(status)

    api.call_api = call_api  # type: ignore[method-assign]  # records the request instead of sending it
    return api, seen


CALLS = [
    ("batch", "read_namespaced_job", ("job-a", "team"), {}),
    ("batch", "list_namespaced_job", ("team",), {"label_selector": "app.kubernetes.io/managed-by=diloco"}),
    ("batch", "create_namespaced_job", ("team", {"kind": "Job", "metadata": {"name": "job-a"}}), {}),
    ("batch", "patch_namespaced_job", ("job-a", "team", [{"op": "add", "path": "/x", "value": "1"}]), {}),
    ("batch", "delete_namespaced_job", ("job-a", "team"), {"propagation_policy": "Foreground"}),
    ("core", "list_namespaced_pod", ("team",), {"label_selector": "batch.kubernetes.io/job-name=job-a"}),
    ("core", "delete_namespaced_pod", ("pod-0", "team"), {"grace_period_seconds": 0}),
    ("core", "read_namespaced_pod_log", ("pod-0", "team"),
     {"container": "replica", "timestamps": True, "follow": True, "since_seconds": 5}),
    ("core", "list_namespaced_event", ("team",), {"field_selector": "involvedObject.name=pod-0"}),
    ("core", "read_node", ("node-1",), {}),
]


@pytest.mark.parametrize(("group", "name", "args", "options"), CALLS, ids=[c[1] for c in CALLS])
def test_each_call_sends_what_the_generated_method_sends(group: str, name: str, args: tuple[Any, ...],
                                                         options: dict[str, Any]) -> None:
    generated_api, generated = recording_client()
    ours_api, ours = recording_client()
    generated_cls = client.BatchV1Api if group == "batch" else client.CoreV1Api
    ours_calls = batch_v1(ours_api) if group == "batch" else core_v1(ours_api)
    assert type(ours_calls).__module__ == "diloco.executors.kubernetes.rest"
    getattr(generated_cls(generated_api), name)(*args, _preload_content=False, _request_timeout=(3, 7), **options)
    answer = getattr(ours_calls, name)(*args, _preload_content=False, _request_timeout=(3, 7), **options)
    assert ours == generated and len(ours) == 1
    assert isinstance(answer, Answer)


def test_an_answer_outside_2xx_raises_the_same_api_exception() -> None:
    generated_api, _ = recording_client(status=404)
    ours_api, _ = recording_client(status=404)
    with pytest.raises(ApiException) as generated:
        client.BatchV1Api(generated_api).read_namespaced_job("job-a", "team", _preload_content=False)
    with pytest.raises(ApiException) as ours:
        batch_v1(ours_api).read_namespaced_job("job-a", "team", _preload_content=False)
    assert (ours.value.status, ours.value.reason) == (generated.value.status, generated.value.reason) == (404, "Reason")


def test_an_option_the_calls_do_not_know_is_refused_not_dropped() -> None:
    api, seen = recording_client()
    with pytest.raises(TypeError, match="pretty"):
        core_v1(api).read_node("node-1", pretty="true", _preload_content=False)
    assert seen == []
