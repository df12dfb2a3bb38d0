"""A launch that does not get under way leaves nothing behind and exits with the documented code, whatever stops it.

Through the real ``diloco launch``, on the SageMaker emulator (the service refusing the first job, an instance quota
reached at the second, a request the service rejects, Ctrl-C while a job is being created), the Kubernetes
emulator (a namespace that does not exist) and a bucket that does not exist. Each time: no object in the bucket
(listed straight from moto: ``run.json``, the spec object and the shipped code all went), no run record
(``diloco runs``), no job left running, and the exit code README documents: 3 when the service, the cluster or the
store refused (2 when diloco itself refuses the input before any call), 130 for Ctrl-C.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.sagemaker import SageMakerEmulator
from support.commands import DILOCO_MODULE as DILOCO
from support.commands import cli_env, killed_if_still_running
from support.commands import run_cli as cli

from diloco.cli import exit_codes

pytestmark = pytest.mark.slow

TINY = ["--steps", "4", "--sync-every", "2", "-k", "n_layer=1", "-k", "n_embd=16", "-k", "eval_batches=1",
        "-k", "threads=1"]
SLOW_TRAINER = '''
import time


def train(*, manager, rank, world_size, total_steps=1, sync_every=1):
    print(f"slow trainer started on rank {rank}", flush=True)
    time.sleep(120)
'''


def error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("diloco: error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def assert_nothing_recorded(home: Path, cwd: Path) -> None:
    runs = cli("runs", "-o", "json", home=home, cwd=cwd)
    assert runs.returncode == 0 and json.loads(runs.stdout)["runs"] == [], runs.stdout
    assert not (home / "runs").exists() or list((home / "runs").iterdir()) == []


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "slowtrain.py").write_text(SLOW_TRAINER)
    return src


def sagemaker_launch(emulator: SageMakerEmulator, bucket: str, source: Path, *extra: str,
                     role: str | None = None) -> list[str]:
    return ["launch", "--backend", "sagemaker", "--role", role or f"arn:aws:iam::{emulator.account_id}:role/e2e",
            "--region", "us-east-1", "--rendezvous", f"s3://{bucket}/runs/{{run_id}}", "--source-dir", str(source),
            "--trainer", "slowtrain:train", "--set", "store.poll_interval_s=0.2", *extra]


def assert_no_job_left(emulator: SageMakerEmulator) -> None:
    for job in emulator.jobs():
        status = job.describe()["TrainingJobStatus"]
        assert status == "Stopped", (job.name, status)
    assert emulator.running_pids() == []


# ---------------------------------------------------------------------------------------------- SageMaker
@pytest.mark.parametrize("case", ["service refuses the first job", "quota reached at the second job"])
def test_a_launch_the_service_refuses_leaves_nothing_and_exits_3(
        emulator: SageMakerEmulator, s3_bucket: str, source: Path, tmp_path: Path,
        bucket_keys: Callable[[str], list[str]], case: str) -> None:
    home = tmp_path / "home"
    if case.startswith("service"):
        emulator.refuse_create(nth=1)
    else:
        emulator.set_instance_limit("ml.m5.xlarge", 1)
    out = cli(*sagemaker_launch(emulator, s3_bucket, source, "--replicas", "2"), home=home, cwd=tmp_path)
    assert out.returncode == exit_codes.REFUSED, out.stderr
    line = error_line(out.stderr)
    assert "ResourceLimitExceeded" in line, line
    assert ("replica 0" in line and "nothing was created" in line) if case.startswith("service") else \
        ("replica 1" in line and "the 1 job(s) already created were stopped" in line), line
    assert len(emulator.jobs()) == (0 if case.startswith("service") else 1)
    assert_no_job_left(emulator)
    assert bucket_keys(s3_bucket) == [], "run.json, the spec object, the shipped code and any output must go"
    assert_nothing_recorded(home, tmp_path)


@pytest.mark.parametrize(("option", "field"), [
    (["--role", "arn:aws:iam::role/any"], "role"),
    (["--instance-type", "ml.m5.huge"], "nstance"),
])
def test_a_request_the_service_would_reject_leaves_nothing_and_exits_2_or_3(
        emulator: SageMakerEmulator, s3_bucket: str, source: Path, tmp_path: Path,
        bucket_keys: Callable[[str], list[str]], option: list[str], field: str) -> None:
    """Refused by diloco at plan time (exit 2, no call made) or by the service (exit 3): both documented, and
    either way nothing is left."""
    home = tmp_path / "home"
    role = option[1] if option[0] == "--role" else None
    extra = [] if role else option
    out = cli(*sagemaker_launch(emulator, s3_bucket, source, "--replicas", "2", *extra, role=role),
              home=home, cwd=tmp_path)
    asked = emulator.operation_calls("CreateTrainingJob")
    assert out.returncode == (exit_codes.REFUSED if asked else exit_codes.USAGE), out.stderr
    assert field in error_line(out.stderr)
    assert emulator.jobs() == [] and emulator.running_pids() == []
    assert bucket_keys(s3_bucket) == []
    assert_nothing_recorded(home, tmp_path)


def test_ctrl_c_while_a_job_is_being_created_rolls_everything_back_and_exits_130(
        emulator: SageMakerEmulator, s3_bucket: str, source: Path, tmp_path: Path,
        bucket_keys: Callable[[str], list[str]]) -> None:
    """The second CreateTrainingJob creates its job but answers late (``hold_create``): the launcher is waiting
    on it, with one job recorded, one it has not heard of, its code shipped and run.json and the spec written."""
    home = tmp_path / "home"
    emulator.hold_create(nth=2)
    with killed_if_still_running(subprocess.Popen(
            [*DILOCO, *sagemaker_launch(emulator, s3_bucket, source, "--replicas", "2")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(home), cwd=tmp_path)) as launch:
        try:
            assert emulator.wait_until_held(timeout=120), "the launch never reached its second CreateTrainingJob"
            assert len(emulator.jobs()) == 2
            written = bucket_keys(s3_bucket)
            assert any(key.endswith("/run.json") for key in written) and any("/sagemaker/code/" in k for k in written)
            launch.send_signal(signal.SIGINT)
            _, stderr = launch.communicate(timeout=240)
        finally:
            emulator.release_create()
    assert launch.returncode == exit_codes.INTERRUPTED, stderr
    assert "interrupted" in stderr
    assert_no_job_left(emulator)  # both, the one the launcher never heard of included
    assert bucket_keys(s3_bucket) == [], "the rollback waits for the stopped jobs' output, then removes it all"
    assert_nothing_recorded(home, tmp_path)


# ---------------------------------------------------------------------------------------------- the store
@pytest.mark.parametrize("backend", ["local", "sagemaker"])
def test_a_missing_bucket_is_a_refusal_with_exit_3_and_nothing_launched(
        emulator: SageMakerEmulator, source: Path, tmp_path: Path, backend: str) -> None:
    home = tmp_path / "home"
    args = ["launch", "--backend", backend, "--rendezvous", "s3://no-such-bucket-here/runs/{run_id}", *TINY]
    if backend == "sagemaker":
        args += ["--role", f"arn:aws:iam::{emulator.account_id}:role/e2e", "--region", "us-east-1",
                 "--source-dir", str(source)]
    out = cli(*args, home=home, cwd=source)
    assert out.returncode == exit_codes.REFUSED, out.stderr
    assert "no-such-bucket-here" in error_line(out.stderr)
    assert emulator.calls == []
    assert_nothing_recorded(home, source)


# ---------------------------------------------------------------------------------------------- Kubernetes
@pytest.fixture
def kube(aws_env: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from emulators.kubernetes import KubernetesEmulator

    with KubernetesEmulator(tmp_path / "kube", namespace="diloco") as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig))
        yield emulator


def test_a_launch_into_a_missing_namespace_leaves_nothing_and_exits_3(
        kube: Any, s3_bucket: str, tmp_path: Path, bucket_keys: Callable[[str], list[str]]) -> None:
    home = tmp_path / "home"
    out = cli("launch", "--backend", "eks", "--image", "registry.example/diloco:e2e", "--namespace", "absent",
              "--rendezvous", f"s3://{s3_bucket}/runs/{{run_id}}", *TINY, home=home, cwd=tmp_path)
    assert out.returncode == exit_codes.REFUSED, out.stderr
    assert 'namespaces "absent" not found' in error_line(out.stderr)
    with kube.cluster.store.lock:
        assert kube.cluster.store.items("jobs") == []
    assert bucket_keys(s3_bucket) == []
    assert_nothing_recorded(home, tmp_path)

