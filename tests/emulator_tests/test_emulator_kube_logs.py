"""Pod logs from the Kubernetes emulator as a real kubelet serves them: rotated files, the reader's filters, and
a kubelet the API server cannot reach. Driven through the official ``kubernetes`` client, as the backend reads
logs; containers are real ``python -c`` processes whose phases the test releases with files.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from emulators.kube_nodes import eks_node  # tests/ is on sys.path
from emulators.kubernetes import KubernetesEmulator
from kubernetes import client, config
from kubernetes.client.rest import ApiException

NS = "default"
STAMPED = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.(\d{9})Z (.*)$")

#: Prints ``a0..a{n-1}``, waits for the file in argv[1], prints ``b0..b{n-1}``, waits for argv[2], exits.
PHASED = ("import os, sys, time\n"
          "def wait(path):\n"
          "    while not os.path.exists(path):\n"
          "        time.sleep(0.02)\n"
          "n = int(sys.argv[3])\n"
          "for i in range(n):\n"
          "    print(f'a{i}', flush=True)\n"
          "wait(sys.argv[1])\n"
          "for i in range(n):\n"
          "    print(f'b{i}', flush=True)\n"
          "wait(sys.argv[2])\n")


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubernetesEmulator]:
    with KubernetesEmulator(tmp_path / "kube") as emulator:
        yield emulator


def core_api(kube: KubernetesEmulator) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(kube.kubeconfig)))


def start(kube: KubernetesEmulator, tmp_path: Path, lines: int = 3, padding: int = 0) -> tuple[str, Path, Path]:
    """One pod running ``PHASED``; its name once phase ``a`` is printed, and the two release files."""
    first, second = tmp_path / "first", tmp_path / "second"
    code = PHASED.replace("print(f'a{i}'", f"print(f'a{{i}}' + '.' * {padding}").replace(
        "print(f'b{i}'", f"print(f'b{{i}}' + '.' * {padding}")
    container = {"name": "main", "image": "python:3.11-slim",
                 "command": ["python", "-c", code, str(first), str(second), str(lines)]}
    batch = client.BatchV1Api(config.new_client_from_config(config_file=str(kube.kubeconfig)))
    batch.create_namespaced_job(NS, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "logs"}, "spec": {
        "completionMode": "Indexed", "completions": 1, "parallelism": 1,
        "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}})
    pod = kube.wait_for(lambda: next((p["metadata"]["name"] for p in kube.pods("logs")
                                      if kube.pod_log(p["metadata"]["name"]).count("\n") == lines), None))
    return pod, first, second


def names(text: str) -> list[str]:
    return [line.split(".")[0] for line in text.splitlines()]


def raw_log(kube: KubernetesEmulator, pod: str, **query: Any) -> Any:
    """``pods/log`` with options the client's ``read_namespaced_pod_log`` does not take (``sinceTime``)."""
    url = f"{kube.url}/api/v1/namespaces/{NS}/pods/{pod}/log?{urllib.parse.urlencode(query)}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {kube.token}"})
    return urllib.request.urlopen(request, timeout=30, context=kube.ssl_context())


class Follower:
    """A ``follow=true`` stream read line by line, as the backend reads it."""

    def __init__(self, core: client.CoreV1Api, pod: str, **options: Any) -> None:
        self.response = core.read_namespaced_pod_log(pod, NS, follow=True, _preload_content=False, **options)
        self.buffer = b""
        self.chunks = self.response.stream(1024)

    def line(self) -> str | None:
        """The next line, or None at the end of the stream."""
        while b"\n" not in self.buffer:
            chunk = next(self.chunks, None)
            if chunk is None:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def lines(self, count: int) -> list[str]:
        got = [self.line() for _ in range(count)]
        assert None not in got, f"the stream ended after {got}"
        return [str(g).split(".")[0] for g in got]

    def close(self) -> None:
        self.response.release_conn()


def test_a_read_after_rotation_returns_only_the_new_file_and_follow_goes_on(kube: KubernetesEmulator,
                                                                          tmp_path: Path) -> None:
    core = core_api(kube)
    pod, first, second = start(kube, tmp_path)
    follower = Follower(core, pod)
    try:
        assert follower.lines(3) == ["a0", "a1", "a2"]
        kube.rotate_log(pod)
        assert core.read_namespaced_pod_log(pod, NS) == "", "the current file is new and empty"
        first.touch()
        kube.wait_for(lambda: kube.pod_log(pod).count("\n") == 6)
        assert names(core.read_namespaced_pod_log(pod, NS)) == ["b0", "b1", "b2"]
        assert follower.lines(3) == ["b0", "b1", "b2"], "the follower goes on into the new file"
        second.touch()
        assert follower.line() is None
    finally:
        follower.close()
    assert names(kube.pod_log(pod)) == ["a0", "a1", "a2", "b0", "b1", "b2"], "the container printed everything"


#: Prints bursts of lines (``<burst>-<line>`` padded to about 100 bytes), each after the file of the burst before.
#: A burst is one write: on a loaded machine, line-by-line writes let a rotation check fall inside a burst, and
#: the rest of it (under the limit) would then never be rotated away.
BURSTS = ("import os, sys, time\n"
          "folder, sizes = sys.argv[1], [int(n) for n in sys.argv[2:]]\n"
          "for burst, n in enumerate(sizes):\n"
          "    while burst and not os.path.exists(os.path.join(folder, str(burst - 1))):\n"
          "        time.sleep(0.02)\n"
          "    sys.stdout.write(''.join(f'{burst}-{i}' + '.' * 95 + '\\n' for i in range(n)))\n"
          "    sys.stdout.flush()\n"
          "while not os.path.exists(os.path.join(folder, 'end')):\n"
          "    time.sleep(0.02)\n")


def test_the_kubelet_rotates_at_log_max_bytes_and_keeps_max_files(tmp_path: Path) -> None:
    """Bursts of 50 lines (about 7 KB in CRI format) against a 4 KiB limit: each is rotated away at the next
    check, and a read returns only what was written since; three files are kept, the oldest deleted."""
    with KubernetesEmulator(tmp_path / "kube", log_max_bytes=4096, log_max_files=3) as kube:
        core = core_api(kube)
        container = {"name": "main", "image": "python:3.11-slim",
                     "command": ["python", "-c", BURSTS, str(tmp_path), "50", "50", "50", "50", "3"]}
        client.BatchV1Api(core.api_client).create_namespaced_job(NS, {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "bursts"}, "spec": {
                "completionMode": "Indexed", "completions": 1, "parallelism": 1,
                "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}})
        pod = kube.wait_for(lambda: next((p["metadata"]["name"] for p in kube.pods("bursts")
                                          if p["status"].get("phase") == "Running"), None))
        for burst in range(4):
            kube.wait_for(lambda b=burst: kube.pod_log(pod).count("\n") == 50 * (b + 1))
            kube.wait_for(lambda: core.read_namespaced_pod_log(pod, NS) == "")  # rotated: a new, empty file
            (tmp_path / str(burst)).touch()
        kube.wait_for(lambda: kube.pod_log(pod).count("\n") == 203)
        assert names(core.read_namespaced_pod_log(pod, NS)) == ["4-0", "4-1", "4-2"], "only the current file"
        run = kube.cluster.log_source(NS, pod, None, False)
        assert len(run.file_starts) == 3, "containerLogMaxFiles: the current file and two rotated ones"
        assert names(b"".join(line for _, line in run.on_disk()).decode()) == \
            [f"{b}-{i}" for b in (2, 3) for i in range(50)] + ["4-0", "4-1", "4-2"], "bursts 0 and 1 were deleted"
        (tmp_path / "end").touch()


def stamped(text: str) -> list[tuple[dt.datetime, int, str]]:
    """Lines of a ``timestamps=true`` read: (whole second, nanoseconds, text)."""
    out = []
    for line in text.splitlines():
        match = STAMPED.match(line)
        assert match, line
        second = dt.datetime.fromisoformat(match.group(1)).replace(tzinfo=dt.timezone.utc)
        out.append((second, int(match.group(2)), match.group(3)))
    return out


def test_since_time_tail_lines_and_limit_bytes_filter_as_the_kubelet_does(kube: KubernetesEmulator,
                                                                           tmp_path: Path) -> None:
    core = core_api(kube)
    pod, first, second = start(kube, tmp_path, lines=6)
    lines = stamped(core.read_namespaced_pod_log(pod, NS, timestamps=True))
    assert [text for _, _, text in lines] == [f"a{i}" for i in range(6)]
    second_of, nanos, _ = lines[3]
    since = f"{second_of.strftime('%Y-%m-%dT%H:%M:%S')}.{nanos:09d}Z"
    # sinceTime reaches the kubelet as whole seconds (RFC3339): the fraction is dropped, the second is kept.
    kept = [text for when, _, text in lines if when >= second_of]
    with raw_log(kube, pod, sinceTime=since) as answer:
        assert names(answer.read().decode()) == kept
    assert "a3" in kept
    # tailLines first (the last 2 lines of the file), then sinceTime drops what is older.
    with raw_log(kube, pod, sinceTime=since, tailLines=len(kept) + 1) as answer:
        assert names(answer.read().decode()) == kept, "the extra tail line is older than sinceTime"
    whole = lines[0][0].strftime("%Y-%m-%dT%H:%M:%SZ")
    with raw_log(kube, pod, sinceTime=whole) as answer:
        assert names(answer.read().decode()) == [f"a{i}" for i in range(6)], \
            "a line stamped within the sinceTime second is kept (inclusive)"
    text = core.read_namespaced_pod_log(pod, NS, timestamps=True)
    assert core.read_namespaced_pod_log(pod, NS, timestamps=True, limit_bytes=40) == text[:40], \
        "limitBytes counts the timestamp prefix"
    with pytest.raises(ApiException) as caught:
        core.read_namespaced_pod_log(pod, NS, tail_lines=-1)
    assert (caught.value.status, json.loads(caught.value.body)["message"]) == (
        422, f'PodLogOptions "{pod}" is invalid: tailLines: Invalid value: -1: must be greater than or equal to 0')
    with pytest.raises(urllib.error.HTTPError) as refused:
        raw_log(kube, pod, sinceTime=since, sinceSeconds=5)
    assert refused.value.code == 422 and json.loads(refused.value.read())["message"] == (
        f'PodLogOptions "{pod}" is invalid: : Forbidden: at most one of `sinceTime` or `sinceSeconds` may be '
        "specified")
    with raw_log(kube, pod, sinceTime=since, follow="true") as follower:
        assert names(b"".join(follower.readline() for _ in kept).decode()) == kept
        first.touch()
        assert names(b"".join(follower.readline() for _ in range(6)).decode()) == [f"b{i}" for i in range(6)]
        second.touch()
        assert follower.readline() == b"", "the container ended: so does the stream"


def test_an_unreachable_kubelet_answers_500_and_cuts_open_streams(kube: KubernetesEmulator,
                                                                   tmp_path: Path) -> None:
    core = core_api(kube)
    pod, first, second = start(kube, tmp_path)
    follower = Follower(core, pod)
    try:
        assert follower.lines(3) == ["a0", "a1", "a2"]
        fault = kube.kubelet_unreachable(pod)
        assert follower.line() is None, "the API server ends the stream whose kubelet connection broke"
    finally:
        follower.close()
    with pytest.raises(ApiException) as caught:
        core.read_namespaced_pod_log(pod, NS, container="main", tail_lines=5)
    body = json.loads(caught.value.body)
    assert caught.value.status == 500 and "reason" not in body and body["code"] == 500
    assert body["message"] == (f'Get "https://127.0.0.1:10250/containerLogs/{NS}/{pod}/main?tailLines=5": '
                               "dial tcp 127.0.0.1:10250: i/o timeout")
    assert kube.pods("logs")[0]["status"]["phase"] == "Running", "the container itself goes on"
    kube.kubelet_reachable_again(fault)
    assert names(core.read_namespaced_pod_log(pod, NS)) == ["a0", "a1", "a2"]
    first.touch()
    second.touch()


def test_an_unreachable_kubelet_can_hang_until_the_client_gives_up(kube: KubernetesEmulator,
                                                                    tmp_path: Path) -> None:
    core = core_api(kube)
    pod, first, second = start(kube, tmp_path)
    follower = Follower(core, pod, _request_timeout=(10, 0.5))
    fault = kube.kubelet_unreachable(pod, hang_s=60)
    try:
        assert follower.lines(3) == ["a0", "a1", "a2"]
        with pytest.raises(urllib3.exceptions.ReadTimeoutError):
            follower.line()  # a dead node: the open stream goes silent
    finally:
        follower.close()
    with pytest.raises(urllib3.exceptions.MaxRetryError) as caught:  # the client retries a read timeout
        core.read_namespaced_pod_log(pod, NS, _request_timeout=(10, 0.5))
    assert isinstance(caught.value.reason, urllib3.exceptions.ReadTimeoutError)
    kube.kubelet_reachable_again(fault)
    short = kube.kubelet_unreachable(pod, hang_s=0.2)
    with pytest.raises(ApiException) as caught:
        core.read_namespaced_pod_log(pod, NS, _request_timeout=30)
    assert caught.value.status == 500 and "i/o timeout" in json.loads(caught.value.body)["message"]
    kube.kubelet_reachable_again(short)
    first.touch()
    second.touch()


def test_a_not_ready_node_answers_500_for_its_pods_logs_until_it_is_back(tmp_path: Path) -> None:
    """A lost node (spot reclaim): the API server's kubelet proxy cannot dial it, so ``pods/log`` is a 500 and an
    open follow ends; once the node is back its kubelet serves the log it kept."""
    with KubernetesEmulator(tmp_path / "kube", nodes=[eks_node("worker-1", "m5.xlarge")]) as kube:
        core = core_api(kube)
        pod, first, second = start(kube, tmp_path)
        follower = Follower(core, pod)
        try:
            assert follower.lines(3) == ["a0", "a1", "a2"]
            kube.set_node_ready("worker-1", False)
            assert follower.line() is None
        finally:
            follower.close()
        with pytest.raises(ApiException) as caught:
            core.read_namespaced_pod_log(pod, NS)
        assert caught.value.status == 500
        assert json.loads(caught.value.body)["message"] == (
            f'Get "https://127.0.0.1:10250/containerLogs/{NS}/{pod}/main": dial tcp 127.0.0.1:10250: i/o timeout')
        kube.set_node_ready("worker-1", True)
        assert names(core.read_namespaced_pod_log(pod, NS)) == ["a0", "a1", "a2"]
