"""Replica logs on Kubernetes as real kubelets serve them: read from a time (inclusive, whole seconds), rotated,
deleted with the pod, followed from any phase of a run.

Through the real ``kubernetes`` client and the Kubernetes API emulator (tests/emulators/kubernetes.py), whose pods
are real local processes (``tests/support/fake_replica.py``, which ships its own log like the real entrypoint does), with a
``file://`` store under the test's folder standing for the run's S3 prefix. Each test builds a fresh backend where
the real ``diloco logs`` would be a new shell, so nothing read by one process helps another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.kubernetes import KubernetesEmulator
from support.polling import wait_for

from diloco.executors.base import EntrypointArgs, LaunchSpec, LogRecord
from diloco.executors.kubernetes import KubernetesBackend, KubernetesBackendConfig
from diloco.executors.kubernetes.pods import _Boundary, _PodLog, split_log_line

NAMESPACE = "logs"
TESTS_DIR = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubernetesEmulator]:
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE) as emulator:
        yield emulator


def backend_for(kube: KubernetesEmulator, tmp_path: Path, **overrides: Any) -> KubernetesBackend:
    """A backend as a new ``diloco`` process builds it (same kubeconfig and state folder, nothing read yet)."""
    settings: dict[str, Any] = {"image": "python:3.11-slim", "namespace": NAMESPACE,
                                "kubeconfig": str(kube.kubeconfig), "grace_period_s": 1, "max_failed_indexes": 2,
                                "state_dir": str(tmp_path / "state"), "log_poll_interval_s": 0.1, **overrides}
    return KubernetesBackend(KubernetesBackendConfig(**settings))


def spec_for(tmp_path: Path, run_id: str, replicas: int = 2, **behaviour: Any) -> LaunchSpec:
    """Replicas running ``tests/support/fake_replica.py`` (``behaviour``: lines, line_gap, sleep, ...), meeting in a
    ``file://`` store under ``tmp_path`` (where they ship their logs)."""
    args = EntrypointArgs(rendezvous_uri=(tmp_path / "store" / run_id).as_uri(), world_size=replicas,
                          trainer="fake:train", trainer_kwargs=dict(behaviour))
    return LaunchSpec(run_id=run_id, replicas=replicas, entrypoint="support.fake_replica", entrypoint_args=args,
                      env={"PYTHONPATH": TESTS_DIR})


def expected(rank: int, lines: int) -> list[str]:
    return [f"rank {rank} line {i}" for i in range(lines)] + [f"rank {rank} says hello on stderr"]


def texts(records: list[LogRecord], rank: int) -> list[str]:
    return [r.text for r in records if r.rank == rank and not r.text.startswith("[")]


def pod_of(kube: KubernetesEmulator, job: str, rank: int, phase: str | None = None) -> dict[str, Any] | None:
    pods = [p for p in kube.pods(job) if p["metadata"]["annotations"].get(
        "batch.kubernetes.io/job-completion-index") == str(rank) and (phase is None or p["status"].get("phase")
                                                                       == phase)]
    return pods[-1] if pods else None


# ---------------------------------------------------------------------------------------------- reading from a time
def test_a_read_from_a_time_skips_exactly_the_lines_read_before() -> None:
    """The kubelet's ``since`` is inclusive and in whole seconds: the repeated lines, including two identical
    lines at the very last nanosecond read (one of them read before), are told apart from new ones."""
    log = _PodLog()
    first = ["2026-12-01T10:00:00.100000000Z step 1", "2026-12-01T10:00:00.200000001Z same",
             "2026-12-01T10:00:00.200000001Z same"]
    for line in first[:2]:
        ns, text = split_log_line(line)
        assert ns is not None
        log.add_line(ns, text, 0)
    assert split_log_line(first[1])[0] == 1796119200_200000001
    reread = [*first, "2026-12-01T10:00:00.300000000Z step 2", "no timestamp at all"]
    boundary = _Boundary(log)
    new = [split_log_line(line) for line in reread if (lambda p: p[0] is None or boundary.is_new(*p))(
        split_log_line(line))]
    assert [text for _, text in new] == ["same", "step 2", "no timestamp at all"]
    assert boundary.overlapped, "the re-read still held the last line read: nothing was rotated away"

    after_rotation = _Boundary(log)
    assert after_rotation.is_new(1796119200_300000000, "step 2") and not after_rotation.overlapped


# ---------------------------------------------------------------------------------------------- rotation
def _rotation_case(kube: KubernetesEmulator, tmp_path: Path, run_id: str, **overrides: Any) -> tuple[
        list[LogRecord], KubernetesBackend, Any]:
    """Read the running replica's log, let it write on, rotate it away unread, read again, then to the end; what
    the last read (which repeats every earlier record first) gave."""
    backend = backend_for(kube, tmp_path, **overrides)
    handle = backend.submit(backend.plan(spec_for(tmp_path, run_id, replicas=1, lines=60, line_gap=0.1)))
    return _read_across_a_rotation(kube, backend, handle, run_id), backend, handle


def _read_across_a_rotation(kube: KubernetesEmulator, backend: KubernetesBackend, handle: Any,
                            run_id: str) -> list[LogRecord]:
    backend.describe(handle)  # the client's first calls are slow on a loaded machine; not during the reads
    list(backend.replica_logs(wait_for(lambda: _ran(kube, run_id, handle, 5), "5 lines", 60), 0))
    pod = pod_of(kube, run_id, 0)
    assert pod is not None
    wait_for(lambda: "line 35" in kube.pod_log(pod["metadata"]["name"]), "35 lines", 60)
    kube.rotate_log(pod["metadata"]["name"])  # the lines since the first read are no longer served
    list(backend.replica_logs(handle, 0))
    backend.wait(handle, timeout_s=60, poll_interval_s=0.1)
    return list(backend.replica_logs(handle, 0))


def _ran(kube: KubernetesEmulator, run_id: str, handle: Any, lines: int) -> Any:
    pod = pod_of(kube, run_id, 0)
    return handle if pod is not None and f"line {lines}" in kube.pod_log(pod["metadata"]["name"]) else None


def test_a_rotated_log_loses_no_line_written_after_it_and_fills_the_rest_from_the_shipped_log(
        kube: KubernetesEmulator, tmp_path: Path) -> None:
    seen, _, _ = _rotation_case(kube, tmp_path, "rotated-1")
    assert texts(seen, 0) == expected(0, 60), "every line once, in order: the rotated ones from the store"
    assert not [r for r in seen if r.text.startswith("[diloco] gap")]


def test_a_rotated_log_without_a_shipped_copy_reports_the_gap_in_one_line(kube: KubernetesEmulator,
                                                                          tmp_path: Path) -> None:
    backend = backend_for(kube, tmp_path)
    plan = backend.plan(spec_for(tmp_path, "rotated-2", replicas=1, lines=60, line_gap=0.1))
    container = plan.requests[0]["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != "DILOCO_LOG_URI"]  # a replica that ships nothing
    seen = _read_across_a_rotation(kube, backend, backend.submit(plan), "rotated-2")
    lines = texts(seen, 0)
    assert len(lines) == len(set(lines)) and lines == [t for t in expected(0, 60) if t in lines], "in order, once"
    pod = pod_of(kube, "rotated-2", 0)
    assert pod is not None
    served = backend.read_pod_log(pod["metadata"]["name"], NAMESPACE, container="replica", _preload_content=False)
    after = served.data.decode().splitlines()  # what the kubelet still serves: its file since the rotation
    assert after and all(t in lines for t in after), "every line written after the rotation"
    assert len(lines) < 61, "the lines rotated away before they were read are not there"
    gaps = [r for r in seen if r.text.startswith("[diloco] gap")]
    assert len(gaps) == 1 and "rotated" in gaps[0].text and "are missing" in gaps[0].text, [r.text for r in seen]


# ---------------------------------------------------------------------------------------------- outliving the pods
def test_logs_and_restarts_outlive_the_job_for_a_new_process(kube: KubernetesEmulator, tmp_path: Path) -> None:
    """A cancel deletes the Job and every pod; a new process still prints every attempt's lines and counts the
    restarts, from the replicas' shipped logs and what the cancel recorded."""
    backend = backend_for(kube, tmp_path)
    handle = backend.submit(backend.plan(spec_for(tmp_path, "outlive-1", lines=3, sleep=60)))
    first = wait_for(lambda: pod_of(kube, "outlive-1", 1, "Running"), "rank 1 running", 60)
    shipped = tmp_path / "store" / "outlive-1" / "logs" / "rank_0001"
    wait_for(lambda: len({c.parent for c in shipped.glob("*/chunk_*")}) == 1, "rank 1's lines shipped", 30)
    kube.evict(first["metadata"]["name"])  # SIGTERM: the stand-in replica dies at once, as a SIGKILL would
    wait_for(lambda: len({c.parent for c in shipped.glob("*/chunk_*")}) == 2, "rank 1 retried and shipped", 60)
    backend.cancel(handle)
    wait_for(lambda: kube.job("outlive-1") is None, "the Job deleted", 60)
    assert kube.pods("outlive-1") == []

    later = backend_for(kube, tmp_path)
    records = list(later.logs(handle))
    assert texts(records, 0) == expected(0, 3)
    assert texts(records, 1) == expected(1, 3) * 2, "both attempts of replica 1"
    status = later.describe(handle)
    assert [r.state.value for r in status.replicas] == ["cancelled", "cancelled"]
    assert [r.restarts for r in status.replicas] == [0, 1]

    elsewhere = backend_for(kube, tmp_path, state_dir=str(tmp_path / "another-machine"))
    assert [r.restarts for r in elsewhere.describe(handle).replicas] == [0, 1], "from the store alone"
    bare = handle.model_copy(update={"log_uri": ""})
    empty = list(elsewhere.logs(bare))
    assert [r.rank for r in empty] == [0, 1] and all(
        r.text.startswith("[diloco] no log of replica") and "did not ship" in r.text for r in empty), empty


def test_a_finished_run_deleted_by_its_ttl_still_reads_as_succeeded_with_its_logs(kube: KubernetesEmulator,
                                                                                  tmp_path: Path) -> None:
    backend = backend_for(kube, tmp_path, ttl_seconds_after_finished=0)
    handle = backend.submit(backend.plan(spec_for(tmp_path, "ttl-1", lines=4)))
    wait_for(lambda: kube.job("ttl-1") is None, "the Job deleted by its TTL", 60)
    later = backend_for(kube, tmp_path, state_dir=str(tmp_path / "fresh"))
    status = later.describe(handle)
    assert [(r.state.value, r.exit_code, r.restarts) for r in status.replicas] == [("succeeded", 0, 0)] * 2
    records = list(later.logs(handle))
    assert texts(records, 0) == expected(0, 4) and texts(records, 1) == expected(1, 4)


# ---------------------------------------------------------------------------------------------- following
def test_follow_started_at_every_phase_gets_every_line_once_and_ends_with_the_run(kube: KubernetesEmulator,
                                                                                 tmp_path: Path) -> None:
    """Followers started before the pods exist, while they are pending, mid-run and after the end, each a new
    process: every line arrives once, in order, lines arrive while the replicas still write (not gathered until
    the end), and every follower ends by itself once the run has."""
    lines = 38
    backend = backend_for(kube, tmp_path)
    hold = kube.hold_pending(job="follow-1")
    plan = backend.plan(spec_for(tmp_path, "follow-1", lines=lines, line_gap=0.25))
    results: dict[str, list[LogRecord]] = {}
    live: dict[str, bool] = {}
    threads: list[threading.Thread] = []

    def follow(phase: str, handle: Any) -> None:
        def run() -> None:
            got: list[LogRecord] = []
            for record in backend_for(kube, tmp_path).logs(handle, follow=True):
                if record.text == "rank 0 line 20" and phase != "after the end":
                    pod = pod_of(kube, "follow-1", 0)
                    live[phase] = pod is not None and f"line {lines - 1}" not in kube.pod_log(pod["metadata"]["name"])
                got.append(record)
            results[phase] = got
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)

    handle = backend.submit(plan)
    follow("before the pods exist", handle)
    wait_for(lambda: len(kube.pods("follow-1")) == 2, "two pending pods", 30)
    follow("while pending", handle)
    time.sleep(0.5)
    kube.release(hold)
    wait_for(lambda: (p := pod_of(kube, "follow-1", 1)) is not None and "line 10" in kube.pod_log(
        p["metadata"]["name"]), "rank 1 mid-run", 60)
    follow("mid-run", handle)
    status = backend.wait(handle, timeout_s=60, poll_interval_s=0.1)
    assert status.state.value == "succeeded"
    follow("after the end", handle)
    for thread in threads:
        thread.join(timeout=60)  # the run has ended: each follower needs one more round of reads at most
    assert not [t for t in threads if t.is_alive()], "a follower did not end after the run had"
    for phase, records in results.items():
        for rank in (0, 1):
            assert texts(records, rank) == expected(rank, lines), (phase, rank)
    assert set(results) == {"before the pods exist", "while pending", "mid-run", "after the end"}
    assert live == dict.fromkeys(["before the pods exist", "while pending", "mid-run"], True), \
        "a follower got line 20 only after the replica had written its last line"


# ---------------------------------------------------------------------------------------------- a node that is lost
def test_follow_goes_on_through_a_kubelet_that_does_not_answer(kube: KubernetesEmulator, tmp_path: Path) -> None:
    """Mid-run, replica 0's kubelet stops answering (the API server's 500 for a failed dial, the open stream
    ended): ``logs -f`` says so once, keeps following, and once the kubelet answers again has every line once."""
    backend = backend_for(kube, tmp_path)
    handle = backend.submit(backend.plan(spec_for(tmp_path, "lost-1", lines=40, line_gap=0.3)))
    records: list[LogRecord] = []
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            records.extend(backend_for(kube, tmp_path).logs(handle, follow=True))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    wait_for(lambda: any(r.rank == 0 and r.text == "rank 0 line 8" for r in list(records)),
               "replica 0 followed", 60)
    pod = pod_of(kube, "lost-1", 0)
    assert pod is not None
    fault = kube.kubelet_unreachable(pod["metadata"]["name"])
    wait_for(lambda: any(r.text.startswith("[diloco] the log of pod") for r in list(records)),
               "the follower noticed", 30)
    time.sleep(1.0)  # the follower backs off and tries again meanwhile; it must not give up
    kube.kubelet_reachable_again(fault)
    thread.join(timeout=90)
    assert not thread.is_alive() and not errors, errors
    assert texts(records, 0) == expected(0, 40) and texts(records, 1) == expected(1, 40)
    notes = [r.text for r in records if r.text.startswith("[diloco] the log of pod")]
    assert len(notes) == 1 and "cannot be read now" in notes[0] and "NotReady" in notes[0], notes


# ---------------------------------------------------------------------------------------------- the CLI, a lost node
CHATTY = '''
import pathlib
import time


def chatty(*, manager, rank, world_size, total_steps, sync_every, lines=60, gap=0.05, gate="", hold_at=20):
    """Numbered lines, one every ``gap`` seconds, waiting after line ``hold_at`` until ``gate`` exists: a log whose
    every line can be accounted for, and a moment the test chooses to disturb it."""
    for i in range(lines):
        print(f"rank {rank} line {i}", flush=True)
        while i == hold_at and gate and not pathlib.Path(gate).exists():
            time.sleep(0.05)
        time.sleep(gap)
'''


@pytest.fixture
def two_nodes(aws_env: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
              ) -> Iterator[KubernetesEmulator]:
    """The emulator with two nodes that hold one replica pod each, its pods reaching moto's S3 as IRSA pods reach
    S3, and lost pods evicted a second after their node goes NotReady; the CLI finds it through KUBECONFIG."""
    import os

    from emulators.kube_nodes import node

    image = tmp_path / "image"
    image.mkdir()
    (image / "k8s_logs_trainers.py").write_text(CHATTY)
    node_env = {key: os.environ[key] for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                                 "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL",
                                                 "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
                                                 "AWS_EC2_METADATA_DISABLED")}
    node_env.update(PYTHONPATH=os.pathsep.join([str(image), TESTS_DIR]), OMP_NUM_THREADS="1")
    nodes = [node(name, cpu="3", memory="64Gi") for name in ("node-a", "node-b")]
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE, node_env=node_env, nodes=nodes,
                            unreachable_eviction_s=1) as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig))
        yield emulator


@pytest.mark.slow
def test_logs_follow_across_a_log_rotation_and_a_node_going_notready_shows_every_line_and_exits(
        two_nodes: KubernetesEmulator, s3_bucket: str, tmp_path: Path) -> None:
    from backends.kubernetes.test_kubernetes_e2e import cli, start_cli

    kube, home, lines = two_nodes, tmp_path / "home", 60
    launch = cli("launch", "--backend", "eks", "--image", "registry.example/diloco:e2e", "--namespace", NAMESPACE,
                 "--rendezvous", f"s3://{s3_bucket}/logs/{{run_id}}", "--replicas", "2", "--trainer",
                 "k8s_logs_trainers:chatty", "-k", f"lines={lines}", "-k", f"gate={tmp_path / 'gate'}",
                 "--steps", "20", "--sync-every", "10",
                 "--set", "backend.grace_period_s=2", "--set", "backend.log_poll_interval_s=0.2", "--detach",
                 "-o", "json", home=home, cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = launch.stdout and __import__("json").loads(launch.stdout)["run_id"]
    follow = start_cli("logs", run_id, "-f", home=home, cwd=tmp_path)
    assert follow.stdout is not None and follow.stderr is not None
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(follow.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: {"[r0] rank 0 line 20\n", "[r1] rank 1 line 20\n"} <= set(out),
                   "both replicas followed to the gate", 120)
        kept = pod_of(kube, run_id, 0)
        assert kept is not None
        kube.rotate_log(kept["metadata"]["name"])  # the kubelet rotates replica 0's log while it is followed
        lost = pod_of(kube, run_id, 1)
        assert lost is not None
        kube.set_node_ready(lost["spec"]["nodeName"], False)  # a spot reclaim: its process dies with the machine
        wait_for(lambda: (p := pod_of(kube, run_id, 1)) is not None and p["metadata"].get("deletionTimestamp"), "the lost pod evicted",
                   60)
        kube.set_node_ready(lost["spec"]["nodeName"], True)  # back: the pod ends Failed, the Job starts another
        (tmp_path / "gate").write_text("open")
        follow.wait(timeout=240)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    reader.join(timeout=10)
    stderr = follow.stderr.read()
    assert follow.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    got = [line.rstrip("\n") for line in out]
    r0 = [line[5:] for line in got if line.startswith("[r0] rank 0 line")]
    assert r0 == [f"rank 0 line {i}" for i in range(lines)], "replica 0: every line once, in order, across its rotation"
    r1 = [line[5:] for line in got if line.startswith("[r1] rank 1 line")]
    second = r1[r1.index("rank 1 line 0", 1):]
    assert second == [f"rank 1 line {i}" for i in range(lines)], "replica 1's new pod: every line once"
    assert r1[:len(r1) - lines] == [f"rank 1 line {i}" for i in range(len(r1) - lines)], "the lost pod's, in order"


# ---------------------------------------------------------------------------------------------- the replica's copy
def test_a_replica_ships_its_own_and_its_childrens_output_and_its_exit_code(tmp_path: Path) -> None:
    """What a pod's container log gets is unchanged; the store gets the same lines (a child process's too, shipped
    once, by the replica) with their times, and the exit code last."""
    import json
    import os
    import subprocess
    import sys

    from diloco.store.logs import read_attempts
    from diloco.store.objects import ObjectStore

    script = ("import subprocess, sys\n"
              "print('from the replica', flush=True)\n"
              "print('to stderr', file=sys.stderr, flush=True)\n"
              "subprocess.run([sys.executable, '-c', 'print(\"from a child\")'], check=True)\n"
              "print('no newline at the end', end='')\n")
    env = {**os.environ, "DILOCO_LOG_URI": (tmp_path / "logs").as_uri(), "REPLICA_RANK": "3",
           "DILOCO_LOG_ATTEMPT": "pod-3-abcde", "PYTHONUNBUFFERED": "1"}
    runner = ("import runpy, sys\nfrom diloco.store.logs import ship_output\nshipping = ship_output()\n"
              f"code = 0\ntry:\n    runpy.run_path({str(tmp_path / 'replica.py')!r})\nexcept SystemExit as e:\n"
              "    code = e.code or 0\nshipping.close(7)\n")
    (tmp_path / "replica.py").write_text(script)
    result = subprocess.run([sys.executable, "-c", runner], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    shown = ["from the replica", "to stderr", "from a child", "no newline at the end"]
    assert result.stdout.splitlines() == shown, "the container log gets every byte, unchanged"
    attempts = read_attempts(ObjectStore((tmp_path / "logs").as_uri()), 3)
    assert list(attempts) == ["pod-3-abcde"]
    attempt = attempts["pod-3-abcde"]
    assert [text for _, text in attempt.lines] == shown
    assert [ts for ts, _ in attempt.lines] == sorted(ts for ts, _ in attempt.lines)
    assert (attempt.ended, attempt.exit_code) == (True, 7)
    assert json.loads((tmp_path / "logs" / "rank_0003" / "pod-3-abcde" / "end.json").read_text())["exit_code"] == 7
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["rank_0003"], "the child shipped nothing itself"


def test_a_replica_of_one_part_of_a_run_ships_under_its_global_rank(tmp_path: Path) -> None:
    """Pod index 1 of a Job that runs ranks 2-3 of a run split over backends ships as rank 3, where its peers of
    other backends can never write (they all share the run's ``logs/`` prefix)."""
    import os
    import subprocess
    import sys

    from diloco.store.logs import read_attempts
    from diloco.store.objects import ObjectStore

    env = {**os.environ, "DILOCO_LOG_URI": (tmp_path / "logs").as_uri(), "JOB_COMPLETION_INDEX": "1",
           "DILOCO_RANK_OFFSET": "2", "DILOCO_LOG_ATTEMPT": "part-1-xyz"}
    env.pop("REPLICA_RANK", None)
    runner = ("from diloco.store.logs import ship_output\nshipping = ship_output()\n"
              "print('hello from the part', flush=True)\nshipping.close(0)\n")
    result = subprocess.run([sys.executable, "-c", runner], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["rank_0003"]
    attempt = read_attempts(ObjectStore((tmp_path / "logs").as_uri()), 3)["part-1-xyz"]
    assert [text for _, text in attempt.lines] == ["hello from the part"]



def test_the_bootstraps_lines_are_shipped_first_by_the_replica_it_execs(tmp_path: Path) -> None:
    """The bootstrap runs before the replica ships its own log, and cannot ship (nothing is installed yet): its
    lines were in the container log only, gone with the pod. The real bootstrap's ``say`` keeps each line where
    ``DILOCO_BOOTSTRAP_LOG`` names (``main`` names a file in its site directory, inherited by the exec), and the
    replica ships them first, with their own times, so ``diloco logs`` still has them once the pods are gone."""
    import os
    import subprocess
    import sys

    from diloco.store.logs import read_attempts
    from diloco.store.objects import ObjectStore

    bootstrap = Path(__file__).resolve().parents[3] / "executors" / "bootstrap.py"
    kept = tmp_path / "site" / ".diloco-bootstrap-log.jsonl"
    kept.parent.mkdir()
    env = {**os.environ, "DILOCO_LOG_URI": (tmp_path / "logs").as_uri(), "REPLICA_RANK": "1",
           "DILOCO_LOG_ATTEMPT": "pod-1-xyz", "PYTHONUNBUFFERED": "1", "DILOCO_BOOTSTRAP_LOG": str(kept)}
    booting = (f"import runpy\nboot = runpy.run_path({str(bootstrap)!r})\n"
               "boot['say']('installing what this image lacks: s3fs')\n"
               "boot['say']('installed diloco.whl into /opt/diloco/site; running python -m entry')\n")
    booted = subprocess.run([sys.executable, "-c", booting], env=env, capture_output=True, text=True, timeout=60)
    assert booted.returncode == 0, booted.stderr
    replica = ("from diloco.store.logs import ship_output\nshipping = ship_output()\n"
               "print('replica line', flush=True)\nshipping.close(0)\n")
    result = subprocess.run([sys.executable, "-c", replica], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["replica line"], "the container log already had the bootstrap's lines"
    lines = read_attempts(ObjectStore((tmp_path / "logs").as_uri()), 1)["pod-1-xyz"].lines
    assert [text for _, text in lines] == [
        "diloco bootstrap: installing what this image lacks: s3fs",
        "diloco bootstrap: installed diloco.whl into /opt/diloco/site; running python -m entry", "replica line"]
    assert [ts for ts, _ in lines] == sorted(ts for ts, _ in lines)
