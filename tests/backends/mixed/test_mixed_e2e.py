"""One run over three backends at once, end to end: 2 replicas on the Kubernetes emulator, 1 on the SageMaker
emulator and 1 local process, meeting in one S3 prefix on moto, through the real CLI, boto3 and ``kubernetes``
clients. And a launch whose SageMaker part is refused (quota) after its Kubernetes part was created, which must
leave nothing anywhere.

Nothing is patched: the CLI finds the cluster by ``KUBECONFIG``, SageMaker by ``AWS_ENDPOINT_URL_SAGEMAKER`` and S3
by ``AWS_ENDPOINT_URL``. Both emulators run their replicas as local processes (pods from the Job's template, jobs
from the CreateTrainingJob request on a "ready image": this interpreter with the tests directory on its path), so
every replica is the real ``python -m diloco.replica.entrypoint`` with the paced trainer, on the real outer loop.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from emulators.kubernetes import KubernetesEmulator
from emulators.sagemaker import SageMakerEmulator
from support.commands import TESTS_DIR, run_cli, start_cli
from support.polling import wait_for
from support.run_processes import processes_of
from support.sagemaker_jobs import log_lines, role
from support.sagemaker_scenario import READY_IMAGE, image_interpreter

pytestmark = pytest.mark.slow

NAMESPACE = "diloco"
IMAGE = "registry.example/diloco:e2e"
#: Every wait below bounds a hang only (a run of four tiny replicas takes well under a minute here).
PATIENCE_S = 240.0


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture
def sagemaker(aws_env: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
              ) -> Iterator[SageMakerEmulator]:
    """The SageMaker emulator, its jobs on a ready image that holds diloco and the tests' trainers."""
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=2.0,
                           log_flush_s=0.1, restart_delay_s=0.2,
                           interpreter=image_interpreter(tmp_path / "image")) as emulator:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emulator.url)
        yield emulator


@pytest.fixture
def kube(aws_env: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
         ) -> Iterator[KubernetesEmulator]:
    """The Kubernetes emulator, its pods reaching moto as IRSA-credentialed pods reach S3."""
    node_env = {key: os.environ[key] for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                                 "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL",
                                                 "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
                                                 "AWS_EC2_METADATA_DISABLED")}
    node_env["PYTHONPATH"] = TESTS_DIR
    node_env["OMP_NUM_THREADS"] = "1"
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE, node_env=node_env) as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig))
        yield emulator


def run_config(path: Path, sagemaker: SageMakerEmulator, bucket: str, *, trainer: str, steps: int = 40,
               sync_every: int = 5, **kwargs: Any) -> Path:
    """The run config of docs/backends/mixed.md, on the emulators: eks 2, sagemaker 1, local 1."""
    config = {
        "backend": {"kind": "mixed", "parts": [
            {"kind": "eks", "replicas": 2, "image": IMAGE, "namespace": NAMESPACE, "grace_period_s": 2,
             "log_poll_interval_s": 0.2},
            {"kind": "sagemaker", "replicas": 1, "role_arn": role(sagemaker), "region": "us-east-1",
             "image_uri": READY_IMAGE, "log_poll_interval_s": 0.2},
            {"kind": "local", "replicas": 1, "grace_period_s": 2},
        ]},
        "store": {"rendezvous": f"s3://{bucket}/mixed/{{run_id}}", "poll_interval_s": 0.2},
        "train": {"trainer": trainer, "steps": steps, "sync_every": sync_every, "trainer_kwargs": kwargs},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def recorded_run(home: Path, alive: Any) -> Any:
    """The run record once its launch has submitted every part."""
    from diloco.launcher.runs import RunRegistry

    def complete() -> Any:
        return next((r for r in RunRegistry(home).list() if r.handle and r.handle.get("complete")), None)

    return wait_for(complete, "every part to be submitted", PATIENCE_S, alive=alive)


def follow(*args: str, home: Path) -> tuple[Any, list[str]]:
    """A CLI command in the background whose stdout lines are collected as they come."""
    proc = start_cli(*args, home=home, cwd=TESTS_DIR)
    lines: list[str] = []
    assert proc.stdout is not None
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    return proc, lines


def nothing_left(kube: KubernetesEmulator, sagemaker: SageMakerEmulator, run_id: str) -> bool:
    """No Job or pod of the run, no training job of it still in progress, no process carrying its id."""
    jobs = [j for j in sagemaker.jobs() if j.name.startswith(run_id)]
    return (kube.job(f"{run_id}-r0-1") is None and not kube.pods(f"{run_id}-r0-1")
            and all(j.status in ("Completed", "Failed", "Stopped") for j in jobs) and not processes_of(run_id))


# ---------------------------------------------------------------------------------------------------- tests
@pytest.mark.long
def test_a_run_over_eks_sagemaker_and_a_local_process_trains_as_one_and_is_managed_as_one(
        kube: KubernetesEmulator, sagemaker: SageMakerEmulator, s3_bucket: str, tmp_path: Path) -> None:
    """Four replicas on three backends reach bitwise-identical weights; ``status`` names each replica's backend,
    ``logs -f`` merges every part's lines, the SageMaker replica killed after round 1 is relaunched as a new job
    and rejoins (``logs -f`` following it into that job), ``collect`` writes the agreed model; then a second run on the same three backends is cancelled
    with one ``diloco cancel`` and nothing of it is left on any of them."""
    import boto3

    home = tmp_path / "home"
    config = run_config(tmp_path / "mixed.yaml", sagemaker, s3_bucket, trainer="support.paced_trainer:train",
                        steps=60, step_s=0.2)
    launch, summary = follow("launch", "-c", str(config), "-o", "json", home=home)
    alive = lambda: launch.poll() is None  # noqa: E731
    record = recorded_run(home, alive)
    run_id = record.run_id
    assert [(p["backend"], p["ranks"]) for p in record.handle["parts"]] == [
        ("eks", [0, 1]), ("sagemaker", [2]), ("local", [3])]

    logs, lines = follow("logs", run_id, "-f", home=home)
    s3 = boto3.client("s3")
    committed = f"mixed/{run_id}/committed/"  # any committed round: the store keeps only the last 3
    wait_for(lambda: any(obj["Key"].endswith("/COMMITTED")
                         for obj in s3.list_objects_v2(Bucket=s3_bucket, Prefix=committed).get("Contents", [])),
             "a round to commit", PATIENCE_S, alive=alive)
    sagemaker.crash(f"{run_id}-r2")  # its instance lost after round 1: the waiting launch relaunches it

    status = run_cli("status", run_id, "-o", "json", home=home)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["backend"] == "mixed"
    assert [(r["rank"], r["backend"], r["part"]) for r in report["ranks"]] == [
        (0, "eks", 0), (1, "eks", 0), (2, "sagemaker", 1), (3, "local", 2)]
    assert [(p["part"], p["backend"], p["ranks"]) for p in report["parts"]] == [
        (0, "eks", [0, 1]), (1, "sagemaker", [2]), (2, "local", [3])]
    table = run_cli("status", run_id, home=home, columns=160)
    assert "(4 replicas, mixed: eks r0-1, sagemaker r2, local r3)" in table.stdout, table.stdout

    launch.wait(timeout=PATIENCE_S)
    assert launch.returncode == 0, launch.stderr.read()[-3000:]
    result = json.loads("".join(summary))
    assert result["state"] == "succeeded" and result["weights_identical"] is True, result["weights_detail"]
    assert [(r["rank"], r["restarts"], r["job_id"]) for r in result["ranks"]][2] == (2, 1, f"{run_id}-r2-1")
    assert any("rank 2 rejoined at step" in line for line in log_lines(f"{run_id}-r2-1"))

    logs.wait(timeout=PATIENCE_S)
    assert logs.returncode == 0
    assert lines and all(line[:4] in {"[r0]", "[r1]", "[r2]", "[r3]"} for line in lines), lines[:5]
    for rank in range(4):  # every part's lines, merged, each with its replica's prefix
        assert any(line.startswith(f"[r{rank}] ") for line in lines), rank
    assert any(line.startswith("[r2] rank 2 rejoined at step") for line in lines), \
        "logs -f follows the SageMaker replica into its relaunched job"

    collect = run_cli("collect", run_id, "--output", str(tmp_path / "model.safetensors"), "-o", "json", home=home)
    assert collect.returncode == 0, collect.stderr[-3000:]
    collected = json.loads(collect.stdout)
    assert collected["weights_identical"] is True and Path(collected["model_path"]).is_file()
    shares = {p["backend"]: p for p in collected["parts"]}  # billing per part: only SageMaker bills here
    assert shares["sagemaker"]["billable_s"] > 0 and shares["eks"]["billable_s"] is None
    assert collected["billable_s"] == shares["sagemaker"]["billable_s"]
    assert processes_of(run_id) == [], "every replica of every part has ended"

    # One cancel stops every part.
    config = run_config(tmp_path / "talk.yaml", sagemaker, s3_bucket, trainer="support.watched_trainer:train",
                        steps=1, sync_every=1)
    detach = run_cli("launch", "-c", str(config), "--detach", "-o", "json", home=home)
    assert detach.returncode == 0, detach.stderr[-3000:]
    talker = json.loads(detach.stdout)["run_id"]
    wait_for(lambda: all(r["state"] == "running" for r in json.loads(run_cli(
        "status", talker, "-o", "json", home=home).stdout)["ranks"]), "every replica to run", PATIENCE_S)
    cancel = run_cli("cancel", talker, "-o", "json", home=home)
    assert cancel.returncode == 0, cancel.stderr
    wait_for(lambda: json.loads(run_cli("status", talker, "-o", "json", home=home).stdout)["state"] == "cancelled",
             "the run to be cancelled", PATIENCE_S)
    wait_for(lambda: nothing_left(kube, sagemaker, talker), "nothing of the cancelled run to be left", PATIENCE_S)


@pytest.mark.long
def test_a_sagemaker_part_refused_for_quota_after_the_eks_part_was_created_leaves_nothing(
        kube: KubernetesEmulator, sagemaker: SageMakerEmulator, s3_bucket: str, bucket_keys: Any,
        tmp_path: Path) -> None:
    """The eks part (ranks 0-1) is created first; SageMaker then refuses the next part's job for the account's
    instance quota. The launch exits 3 with the refusal's own words, after the Job was deleted and its pods were
    gone: no Job, pod, training job or process of the run anywhere, and nothing in its store prefix."""
    home = tmp_path / "home"
    sagemaker.set_instance_limit("ml.m5.xlarge", 0)
    config = run_config(tmp_path / "mixed.yaml", sagemaker, s3_bucket, trainer="support.watched_trainer:train",
                        steps=1, sync_every=1)
    launch = run_cli("launch", "-c", str(config), "-o", "json", home=home, timeout=PATIENCE_S)
    assert launch.returncode == 3, launch.stderr[-3000:]
    assert "ResourceLimitExceeded" in launch.stderr, launch.stderr[-3000:]
    assert "backend.parts[1] (sagemaker, rank 2)" in launch.stderr, launch.stderr[-3000:]
    assert "the part(s) submitted before it were stopped: backend.parts[0] (eks, ranks 0-1)" in launch.stderr

    created = [e for e in kube.events(NAMESPACE) if e.get("reason") == "SuccessfulCreate"]
    jobs = {e["involvedObject"]["name"] for e in created if e["involvedObject"]["kind"] == "Job"}
    assert len(jobs) == 1, "the eks part's Job was created (and created its pods) before the refusal"
    run_id = jobs.pop().removesuffix("-r0-1")
    assert nothing_left(kube, sagemaker, run_id)
    assert kube.live_processes() == [] and sagemaker.jobs() == []
    assert [k for k in bucket_keys(s3_bucket) if k.startswith("mixed/")] == []
    assert run_cli("runs", "-o", "json", home=home).stdout.count(run_id) == 0
