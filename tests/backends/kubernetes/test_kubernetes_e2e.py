"""``diloco`` on the Kubernetes backend (``--backend eks``), end to end: the real CLI, the real ``kubernetes``
client, the Kubernetes API emulator and moto's S3.

Nothing is patched: the CLI finds the cluster through ``KUBECONFIG`` (the emulator's kubeconfig) and S3 through
``AWS_ENDPOINT_URL``. The emulator runs every pod as a local process from the Job's pod template, so each replica
is the real ``python -m diloco.replica.entrypoint``; the environment the emulator gives every container (the S3
endpoint, credentials, a ``PYTHONPATH`` with the test trainers) stands for what IRSA and the image provide.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.kubernetes import KubernetesEmulator
from support.async_kill_trainer import recorded_kill
from support.commands import killed_if_still_running, start_cli
from support.commands import run_cli as cli
from support.run_processes import processes_of

pytestmark = pytest.mark.slow

TESTS_DIR = str(Path(__file__).resolve().parents[2])
NAMESPACE = "diloco"
IMAGE = "registry.example/diloco:e2e"

#: Trainers baked into the "image" (a folder on the pods' PYTHONPATH).
TRAINERS = '''
import pathlib
import time

from diloco.errors import ConfigError


def gated(*, gate, **kwargs):
    """The paced trainer (paced_trainer.py, beside this file), once ``gate`` exists: a test can disrupt a replica
    before its first round, and one after a committed round that must still end with identical weights."""
    print("waiting for the gate", flush=True)
    while not pathlib.Path(gate).exists():
        time.sleep(0.05)
    from paced_trainer import train

    return train(**kwargs)


def bad_config_on(*, manager, rank, world_size, total_steps, sync_every, bad_rank=1):
    """Rank ``bad_rank`` finds its configuration invalid (the entrypoint exits 2); the others wait for it."""
    if rank == bad_rank:
        raise ConfigError(f"rank {rank}: learning rate must be positive (got -1)")
    time.sleep(120)
'''


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "image"
    folder.mkdir()
    (folder / "k8s_trainers.py").write_text(TRAINERS)
    (folder / "paced_trainer.py").write_text((Path(__file__).resolve().parents[2] / "support" / "paced_trainer.py").read_text())
    return folder


@pytest.fixture
def kube(aws_env: str, s3_bucket: str, tmp_path: Path, image_dir: Path,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[KubernetesEmulator]:
    """The emulator, its pods reaching moto like IRSA-credentialed pods reach S3; the CLI finds it by KUBECONFIG."""
    node_env = {key: os.environ[key] for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                                 "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL",
                                                 "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
                                                 "AWS_EC2_METADATA_DISABLED")}
    node_env["PYTHONPATH"] = os.pathsep.join([str(image_dir), TESTS_DIR])
    node_env["OMP_NUM_THREADS"] = "1"
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE, node_env=node_env) as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig))
        yield emulator


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def launch_args(bucket: str, *extra: str) -> list[str]:
    return ["launch", "--backend", "eks", "--image", IMAGE, "--namespace", NAMESPACE,
            "--rendezvous", f"s3://{bucket}/e2e/{{run_id}}", "--set", "store.poll_interval_s=0.2",
            "--set", "backend.grace_period_s=2", "--set", "backend.log_poll_interval_s=0.2", *extra]


def by_index(kube: KubernetesEmulator, job: str) -> dict[int, list[dict[str, Any]]]:
    found: dict[int, list[dict[str, Any]]] = {}
    for pod in kube.pods(job):
        found.setdefault(int(pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]),
                         []).append(pod)
    return found


def running(kube: KubernetesEmulator, job: str, count: int) -> dict[int, dict[str, Any]]:
    """Wait until ``count`` indexes have a running pod; the running pod of each."""
    def check() -> dict[int, dict[str, Any]]:
        found = {i: p for i, pods in by_index(kube, job).items() for p in pods
                 if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")}
        return found if len(found) >= count else {}
    return kube.wait_for(check, timeout=90)



def container_pid(kube: KubernetesEmulator, pod: dict[str, Any]) -> int:
    """The pid of the pod's running replica container: what ``kill -9`` on its node would hit."""
    with kube.cluster.store.lock:
        runtime = kube.cluster.runtimes[pod["metadata"]["uid"]]
        run = runtime.runs["replica"][-1]
        assert run.process is not None and run.exit_code is None
        return run.process.pid


def committed(s3: Any, s3_bucket: str, run_id: str, round_number: int) -> bool:
    """Whether round ``round_number`` is committed (``s3``: one client for the whole wait, not one per poll)."""
    key = f"e2e/{run_id}/committed/round_{round_number:06d}/COMMITTED"
    return s3.list_objects_v2(Bucket=s3_bucket, Prefix=key).get("KeyCount", 0) > 0


def job_of(kube: KubernetesEmulator) -> str:
    """The one Job the test's launch creates (named after the run), once it exists."""
    def find() -> str | None:
        with kube.cluster.store.lock:
            jobs = kube.cluster.store.items("jobs", NAMESPACE)
            return jobs[0]["metadata"]["name"] if jobs else None
    return kube.wait_for(find, timeout=120)


def ended_because(pod: dict[str, Any]) -> str | None:
    """Why the pod's container ended (``Completed``, ``Error``, ``OOMKilled``); None while it runs."""
    statuses = pod["status"].get("containerStatuses") or [{}]
    return (statuses[0].get("state", {}).get("terminated") or {}).get("reason")


# ---------------------------------------------------------------------------------------------------- tests
@pytest.mark.long
def test_replicas_survive_evictions_a_sigkill_and_an_oom_kill_the_job_counts_only_the_kills_and_weights_agree(
        kube: KubernetesEmulator, s3_bucket: str, home: Path, tmp_path: Path) -> None:
    """Every way a node takes a replica, in one run with the default flags: replica 1 is evicted before the first
    round (once `logs -f` has shown it waiting); once round 1 is committed replica 2 is evicted and replica 1's
    container is SIGKILLed (exit 137); once round 3 is committed replica 0 is OOM-killed. The Job retries every
    index, counting the two kills against ``backoffLimitPerIndex`` and neither eviction; `logs -f` goes on with
    each index's new pod; every pod started after round 1 rejoins from the latest committed round, and the run
    ends as if nothing happened (weights bitwise identical)."""

    gate = tmp_path / "gate"
    with killed_if_still_running(start_cli(  # it waits, saying what happens to the replicas on its stderr
            *launch_args(s3_bucket, "--replicas", "3", "--trainer", "k8s_trainers:gated", "-k", f"gate={gate}",
                         "--steps", "40", "--sync-every", "5", "-o", "json"), home=home, cwd=tmp_path)) as launch:
        run_id = job_of(kube)
        follow = disrupt(kube, s3_bucket, run_id, gate, home, tmp_path)
        launched, said = launch.communicate(timeout=240)
    assert launch.returncode == 0, said[-3000:]
    assert json.loads(launched)["weights_identical"] is True, launched[-3000:]
    retried = [re.fullmatch(r"replica (\d) preempted \(.+\); the cluster brings it back \(restart (\d)\)", line)
               for line in said.splitlines() if line.startswith("replica ")]
    assert sorted((int(m[1]), int(m[2])) for m in retried if m) == [(0, 1), (1, 1), (1, 2), (2, 1)], said[-3000:]

    lines = follow
    assert lines and all(line[:4] in {"[r0]", "[r1]", "[r2]"} for line in lines), lines[:5]
    attempts = {rank: sum(1 for line in lines if line.startswith(f"[r{rank}] waiting for the gate"))
                for rank in range(3)}
    assert attempts == {0: 2, 1: 3, 2: 2}, ("every attempt of every index, in one stream", attempts)

    status = cli("status", run_id, "-o", "json", home=home, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["state"] == "succeeded" and report["backend"] == "eks"
    assert [r["state"] for r in report["ranks"]] == ["succeeded"] * 3
    assert [r["restarts"] for r in report["ranks"]] == [1, 2, 1]
    assert all(r["job_id"].startswith(f"{run_id}-{r['rank']}-") for r in report["ranks"])

    collect = cli("collect", run_id, "--output", str(tmp_path / "model.safetensors"), "-o", "json", home=home,
                  cwd=tmp_path)
    assert collect.returncode == 0, collect.stderr[-3000:]
    result = json.loads(collect.stdout)
    assert result["weights_identical"] is True, result["weights_detail"]
    assert [r["restarts"] for r in result["ranks"]] == [1, 2, 1]
    assert Path(result["model_path"]).is_file()
    pods = by_index(kube, run_id)  # an evicted pod is deleted by its eviction; a killed one stays, failed
    reasons = {i: sorted(str(ended_because(p)) for p in tries) for i, tries in pods.items()}
    assert reasons == {0: ["Completed", "OOMKilled"], 1: ["Completed", "Error"], 2: ["Completed"]}, reasons
    assert kube.job(run_id)["status"].get("failed") == 2, "the kills count against the retries, no eviction does"
    for rank, tries in pods.items():
        [last] = [p["metadata"]["name"] for p in tries if ended_because(p) == "Completed"]
        assert f"rank {rank} rejoined at step" in kube.pod_log(last), (rank, kube.pod_log(last)[-2000:])


def disrupt(kube: KubernetesEmulator, s3_bucket: str, run_id: str, gate: Path, home: Path,
            tmp_path: Path) -> list[str]:
    """The run's Job as the launch creates it, then its disruptions with `logs -f` following them; every line
    `logs -f` printed, once the run has ended."""
    job = kube.job(run_id)
    assert job is not None, "the Job is named after the run"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    assert spec["backoffLimitPerIndex"] == 3 and spec["maxFailedIndexes"] == 0, "--max-restarts' default"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    container = spec["template"]["spec"]["containers"][0]
    assert container["image"] == IMAGE and container["command"] == ["python", "-m", "diloco.replica.entrypoint"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["WORLD_SIZE"] == "3" and env["DILOCO_RUN_ID"] == run_id
    assert env["RENDEZVOUS_URI"] == f"s3://{s3_bucket}/e2e/{run_id}"
    assert env["REPLICA_RANK"] == {"fieldRef": {"apiVersion": "v1", "fieldPath":
                                                "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}

    follow = start_cli("logs", run_id, "-f", home=home, cwd=tmp_path)
    assert follow.stdout is not None and follow.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(follow.stdout.readline, "")), daemon=True)
    reader.start()
    # A node drain evicts replica 1 before the first round (once `logs -f` has shown it waiting): the job
    # controller retries it, not counted, and `logs -f` goes on with the new pod of the same index.
    victim = running(kube, run_id, 3)[1]["metadata"]["name"]
    kube.wait_for(lambda: any(line.startswith("[r1] waiting for the gate") for line in list(lines)), timeout=90)
    kube.evict(victim)
    kube.wait_for(lambda: any(p["metadata"]["name"] != victim and "waiting for the gate" in kube.pod_log(
        p["metadata"]["name"]) for p in by_index(kube, run_id).get(1, [])), timeout=90)
    gate.write_text("open")
    # Once round 1 is committed, another drain evicts replica 2 and replica 1's node kills its container: both
    # new pods rejoin from that round; once round 3 is, replica 0 is OOM-killed and rejoins from there.
    import boto3

    s3 = boto3.client("s3")
    kube.wait_for(lambda: committed(s3, s3_bucket, run_id, 1), timeout=120)
    pods = running(kube, run_id, 3)
    late_victim = pods[2]["metadata"]["name"]
    kube.evict(late_victim)
    os.kill(container_pid(kube, pods[1]), signal.SIGKILL)  # kill -9 of replica 1's container by its node
    kube.wait_for(lambda: committed(s3, s3_bucket, run_id, 3), timeout=120)
    kube.oom_kill(running(kube, run_id, 3)[0]["metadata"]["name"])
    follow.wait(timeout=240)
    reader.join(timeout=10)
    assert follow.returncode == 0, follow.stderr.read()[-3000:]
    return [line.rstrip("\n") for line in lines]


@pytest.mark.long
def test_an_async_master_killed_while_publishing_is_retried_and_resumes_from_its_committed_state(
        kube: KubernetesEmulator, s3_bucket: str, home: Path, tmp_path: Path) -> None:
    """Asynchronous DiLoCo through Kubernetes: the master's container is SIGKILLed (exit 137) in the middle of
    publishing a version, after its commit; the Job retries the index and the new pod resumes from that committed
    version in S3, at the step it had recorded, and every replica exports the same final version."""
    done = tmp_path / "done"
    done.mkdir()
    plan = [{"trial": 0, "rank": 0, "moment": "publish", "version": 5, "point": "data"}]
    launch = cli(*launch_args(s3_bucket, "--mode", "async", "--replicas", "2", "--trainer",
                              "support.async_kill_trainer:train", "--steps", "60", "--sync-every", "10", "-k",
                              "n_layer=1", "-k", "n_embd=16", "-k", "block_size=16", "-k", "batch_size=8", "-k",
                              "eval_batches=1", "-k", "max_corpus_bytes=50000", "-k", "threads=1", "-k",
                              f"kills={json.dumps(plan)}", "-k", f"done_dir={done}", "-o", "json"),
                 home=home, cwd=tmp_path, timeout=400)
    assert launch.returncode == 0, launch.stderr[-3000:]
    report = json.loads(launch.stdout)
    run_id = report["run_id"]
    assert report["state"] == "succeeded" and report["weights_identical"] is True, report["weights_detail"]
    assert [r["restarts"] for r in report["ranks"]] == [1, 0]
    logs = [kube.pod_log(p["metadata"]["name"]) for p in by_index(kube, run_id)[0]]
    assert len(logs) == 2, logs
    killed = recorded_kill(str(done), 0)
    assert killed["where"].startswith("publishing version 5") and killed["rank"] == 0, killed
    retried_log = next(log for log in logs if "rejoins the run" in log)
    assert "startup selection committed (committed 5, remote 4)" in retried_log, retried_log[-3000:]
    assert f"rejoins the run at step {killed['position']} of 60" in retried_log, retried_log[-3000:]


def test_cancel_mid_run_deletes_the_job_and_leaves_no_process(kube: KubernetesEmulator, s3_bucket: str,
                                                               home: Path, tmp_path: Path) -> None:
    # 400 steps of 1 s: the run cannot end by itself before the cancel, however slow the machine (it is stopped)
    launch = cli(*launch_args(s3_bucket, "--replicas", "2", "--trainer", "support.cli_trainers:slow", "--steps", "400",
                              "--sync-every", "100", "-k", "step_s=1.0", "--detach", "-o", "json"),
                 home=home, cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    running(kube, run_id, 2)
    assert processes_of(run_id)

    cancel = cli("cancel", run_id, "-o", "json", home=home, cwd=tmp_path)
    assert cancel.returncode == 0, cancel.stderr
    assert json.loads(cancel.stdout)["state"] == "cancelled"
    kube.wait_for(lambda: kube.job(run_id) is None, timeout=30)
    assert kube.pods(run_id) == [] and kube.live_processes() == [] and processes_of(run_id) == []


def test_a_configuration_error_fails_its_replica_at_once_and_stops_the_run(kube: KubernetesEmulator,
                                                                             s3_bucket: str, home: Path,
                                                                             tmp_path: Path) -> None:
    """Exit code 2 fails the index whatever backoffLimitPerIndex allows, and maxFailedIndexes=0 makes the Job
    stop the others itself (--no-fail-fast: the CLI leaves that to the cluster)."""
    launch = cli(*launch_args(s3_bucket, "--replicas", "2", "--trainer", "k8s_trainers:bad_config_on",
                              "--set", "backend.backoff_limit_per_index=3", "--no-fail-fast"), home=home, cwd=tmp_path)
    assert launch.returncode == 1, launch.stderr[-3000:]
    assert "replica 1 failed with exit code 2: configuration error (exit code 2, not retried): rank 1: learning " \
           "rate must be positive (got -1)" in launch.stderr
    run_id = launch.stderr.split("launched ", 1)[1].split(":", 1)[0]

    def failed_job() -> dict[str, Any] | None:
        job = kube.job(run_id)
        return job if job and any(c["type"] == "Failed" for c in job["status"].get("conditions", [])) else None
    job = kube.wait_for(failed_job, timeout=60)
    # The replica the Job stopped ends with SIGTERM's 143, which the failure policy counts too: "0,1".
    assert job["status"]["failedIndexes"] in ("1", "0,1")
    assert next(c for c in job["status"]["conditions"] if c["type"] == "Failed")["reason"] == \
        "MaxFailedIndexesExceeded"
    assert len(by_index(kube, run_id)[1]) == 1, "exit code 2 is not retried"
    kube.wait_for(lambda: not kube.live_processes(), timeout=30)

    collect = cli("collect", run_id, "-o", "json", home=home, cwd=tmp_path)
    assert collect.returncode == 1
    report = json.loads(collect.stdout)
    assert [r["state"] for r in report["ranks"]] == ["cancelled", "failed"]
    assert report["ranks"][1]["exit_code"] == 2 and report["ranks"][1]["restarts"] == 0
    assert "stopped because the Job failed (MaxFailedIndexesExceeded" in report["ranks"][0]["reason"]
    assert "replica 1 failed with exit code 2" in collect.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_input_is_one_line_and_creates_nothing(kube: KubernetesEmulator, s3_bucket: str, home: Path,
                                                    tmp_path: Path) -> None:
    unreachable = kube.write_kubeconfig(tmp_path / "unreachable.yaml", server=f"http://127.0.0.1:{_closed_port()}")
    rendezvous = ["--rendezvous", f"s3://{s3_bucket}/bad/{{run_id}}"]
    cases: list[tuple[list[str], dict[str, str], int, str]] = [
        (["launch", "--backend", "eks", "--set", "backend.shm_size=1GB", *rendezvous], {}, 2,
         "backend.shm_size: must be a Kubernetes quantity"),
        (["launch", "--backend", "eks", "--image", IMAGE, "--namespace", "Team_A", *rendezvous], {}, 2,
         "backend.namespace: must be a DNS-1123 label"),
        (["launch", "--backend", "eks", "--image", IMAGE, "--set", "backend.memory=8GB", *rendezvous], {}, 2,
         "backend.memory: must be a Kubernetes quantity"),
        (["launch", "--backend", "eks", "--image", IMAGE, *rendezvous], {"KUBECONFIG": str(tmp_path / "missing")}, 2,
         f"backend.kubeconfig: {tmp_path / 'missing'} does not exist"),
        (["launch", "--backend", "eks", "--image", IMAGE, *rendezvous], {"KUBECONFIG": str(unreachable)}, 3,
         "the Kubernetes API at 127.0.0.1:"),
    ]
    started = [(args, code, message, start_cli(*args, home=home, cwd=tmp_path, env=env))
               for args, env, code, message in cases]  # independent: run them side by side
    for args, code, message, process in started:
        _, stderr = process.communicate(timeout=240)
        errors = [line for line in stderr.splitlines() if line.startswith("diloco: error:")]
        assert (process.returncode, len(errors)) == (code, 1), (args, stderr)
        assert message in errors[0], (args, errors[0])
    with kube.cluster.store.lock:
        assert kube.cluster.store.items("jobs") == [], "nothing was created"
    assert not list((home / "runs").glob("*.json")) if (home / "runs").exists() else True


def test_dry_run_prints_a_job_valid_for_kubernetes_1_29_and_1_33_and_contacts_no_cluster(tmp_path: Path,
                                                                                          home: Path) -> None:
    import kubernetes_validate

    result = cli("launch", "--backend", "eks", "--image", IMAGE, "--namespace", NAMESPACE, "--replicas", "4",
                 "--gpu", "NVIDIA-A10G:2", "--rendezvous", "s3://bucket/prefix/{run_id}", "--set",
                 "backend.service_account=diloco-trainer", "--set", "backend.backoff_limit_per_index=2",
                 "--dry-run", "-o", "json", home=home, cwd=tmp_path,
                 env={"KUBECONFIG": str(tmp_path / "no-cluster-here")})
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["backend"] == "eks" and len(plan["requests"]) == 1
    job = plan["requests"][0]
    for version in ("1.29.0", "1.33.0"):
        kubernetes_validate.validate(job, version, strict=True)
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["requests"] == {"cpu": "2", "memory": container["resources"]["limits"]["memory"],
                                                  "nvidia.com/gpu": "2"}
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-A10G"]} in terms[-1][
        "matchExpressions"] and "nodeSelector" not in pod
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["serviceAccountName"] == "diloco-trainer"
    assert job["spec"]["podFailurePolicy"]["rules"][0] == {
        "action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert job["spec"]["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"] == [1, 2, 143]
    assert job["spec"]["activeDeadlineSeconds"] == 86400 and job["spec"]["ttlSecondsAfterFinished"] == 86400
    assert job["metadata"]["annotations"]["diloco.dev/run-id"] == plan["spec"]["run_id"]
    assert not (home / "runs").exists() or not list((home / "runs").iterdir()), "a dry run records nothing"


def test_doctor_checks_context_api_namespace_identity_and_permissions(kube: KubernetesEmulator, home: Path,
                                                                      tmp_path: Path) -> None:
    from moto.core import DEFAULT_ACCOUNT_ID

    from diloco.executors.kubernetes import KubernetesBackend, check_cluster
    from diloco.launcher.doctor import DoctorContext

    result = cli("doctor", "--backend", "eks", "--namespace", NAMESPACE, "--image", IMAGE, "-o", "json",
                 home=home, cwd=tmp_path)
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["kubernetes context"]["status"] == "pass"
    assert checks["kubernetes API"]["status"] == "pass" and "v1.33" in checks["kubernetes API"]["detail"]
    assert checks["kubernetes namespace"]["status"] == "pass"
    assert checks["kubernetes permissions"]["status"] == "pass"
    assert checks["service account"]["status"] == "warn", "no service account: pods run as 'default'"

    # The identity the pods get: an IRSA role annotation on the configured service account.
    role = f"arn:aws:iam::{DEFAULT_ACCOUNT_ID}:role/diloco-e2e"
    kube.add_service_account("diloco-trainer", annotations={"eks.amazonaws.com/role-arn": role})
    kube.add_service_account("plain")
    for account, status, words in (("diloco-trainer", "pass", f"IRSA role {role}"),
                                   ("plain", "warn", "has no eks.amazonaws.com/role-arn annotation"),
                                   ("absent", "fail", "does not exist")):
        ctx = DoctorContext.for_backend("eks", namespace=NAMESPACE, image=IMAGE, service_account=account)
        found = {c.name: c for c in check_cluster(ctx)}["service account"]
        assert (found.status.value, words in found.detail) == (status, True), found

    kube.deny("create", "jobs", group="batch")
    kube.deny("get", "pods", subresource="log")
    ctx = DoctorContext.for_backend("eks", namespace="nowhere", image="Bad Image")
    found = {c.name: c for c in KubernetesBackend.doctor_checks(ctx)}
    assert found["kubernetes permissions"].status.value == "fail"
    assert "create jobs.batch" in found["kubernetes permissions"].detail
    assert "get pods/log" in found["kubernetes permissions"].detail
    assert found["kubernetes namespace"].status.value == "fail"
    assert "kubectl create namespace nowhere" in (found["kubernetes namespace"].fix or "")
    assert found["training image"].status.value == "fail"

    unreachable = kube.write_kubeconfig(tmp_path / "down.yaml", server=f"http://127.0.0.1:{_closed_port()}")
    ctx = DoctorContext.for_backend("eks", namespace=NAMESPACE, image=IMAGE, kubeconfig=str(unreachable))
    found = {c.name: c for c in check_cluster(ctx)}
    assert found["kubernetes API"].status.value == "fail" and "unreachable" in found["kubernetes API"].detail
    assert found["kubernetes namespace"].status.value == "skip"
