"""The no-image bootstrap (executors/bootstrap.py) in emulated SageMaker jobs: stopping it while pip runs, the
user's ``requirements.txt``, and what ``--dry-run`` says it will install; and the emulator's stop signal as
``docker stop`` sends it (to the container's PID 1 only, which gets nothing it has no handler for).

The jobs run this environment's interpreter (the image-like one matters only for what is installed, proved in
tests/test_sagemaker_image.py); pip runs for real, offline (a local package folder, a loopback server).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from emulators.sagemaker import SageMakerEmulator
from support.commands import run_cli as cli
from support.polling import wait_for
from support.sagemaker_jobs import describe, log_lines, role

pytestmark = pytest.mark.slow

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
#: The emulator's SIGTERM -> SIGKILL delay in these tests: the real service's. A job that reaches Stopped before
#: it ended did so because its main process acted on the SIGTERM, never because the emulator killed it.
REAL_GRACE_S = 120.0


# ---------------------------------------------------------------------------------------------------- helpers

def launch_args(emulator: SageMakerEmulator, bucket: str, source: Path, *extra: str) -> list[str]:
    return ["launch", "--backend", "sagemaker", "--role", role(emulator), "--region", "us-east-1",
            "--rendezvous", f"s3://{bucket}/boot/{{run_id}}", "--source-dir", str(source),
            "--set", "store.poll_interval_s=0.2", *extra]


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.fixture
def emulator(aws_env: str, s3_bucket: str, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[SageMakerEmulator]:
    """The suite's emulator without the session's bootstrap cache: these tests are about the install itself, so
    every job installs afresh into its own site, as on a cold instance."""
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=2.0,
                           log_flush_s=0.1, restart_delay_s=0.2) as emu:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emu.url)
        yield emu


@pytest.fixture
def patient_emulator(aws_env: str, s3_bucket: str, tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch) -> Iterator[SageMakerEmulator]:
    """The emulator with the real service's 120 s stop grace period."""
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=REAL_GRACE_S,
                           log_flush_s=0.1) as emu:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emu.url)
        yield emu


class SilentServer:
    """A loopback HTTP "package index" that never finishes an answer: it sends the headers of a huge page, then one
    byte every second, so pip's reads never time out and pip blocks on it for as long as the test needs."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = threading.Event()
        self._closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.set()
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 100000000\r\n\r\n")
                while not self._closed.wait(1.0):
                    conn.sendall(b" ")
            except OSError:
                return

    def close(self) -> None:
        self._closed.set()
        self.sock.close()


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


# ---------------------------------------------------------------------------------------------------- the emulator
PID1_PROBE = """
import os, signal, subprocess, sys, time
if os.environ.get("HANDLE_TERM"):
    signal.signal(signal.SIGTERM, lambda *a: (print("main got SIGTERM", flush=True), sys.exit(143)))
child = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (print('child got SIGTERM', flush=True), sys.exit(0))); time.sleep(300)"])
print("child", child.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("handles", [True, False], ids=["main-handles-sigterm", "main-has-no-handler"])
def test_stop_signals_the_main_process_only_and_only_through_its_handler(
    aws_env: str, s3_bucket: str, tmp_path: Path, handles: bool
) -> None:
    """docker stop: SIGTERM to PID 1 alone; PID 1 without a handler gets nothing and is killed after the grace."""
    import boto3

    s3 = boto3.client("s3")
    s3.put_object(Bucket=s3_bucket, Key="code/pid1/job.py", Body=PID1_PROBE.encode())
    grace = REAL_GRACE_S if handles else 1.0  # without a handler nothing but the SIGKILL can end it
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sm", stop_grace_s=grace,
                           log_flush_s=0.1) as emu:
        sm = boto3.client("sagemaker", endpoint_url=emu.url)
        sm.create_training_job(
            TrainingJobName="pid1", RoleArn=f"arn:aws:iam::{emu.account_id}:role/r",
            AlgorithmSpecification={"TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/own:1",
                                    "TrainingInputMode": "File", "ContainerEntrypoint": ["python"],
                                    "ContainerArguments": ["/opt/ml/input/data/code/job.py"]},
            InputDataConfig=[{"ChannelName": "code", "DataSource": {"S3DataSource": {
                "S3DataType": "S3Prefix", "S3Uri": f"s3://{s3_bucket}/code/pid1/",
                "S3DataDistributionType": "FullyReplicated"}}}],
            OutputDataConfig={"S3OutputPath": f"s3://{s3_bucket}/out"},
            ResourceConfig={"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 10},
            StoppingCondition={"MaxRuntimeInSeconds": 600},
            Environment={"HANDLE_TERM": "1"} if handles else {})
        lines = wait_for(lambda: [x for x in log_lines("pid1") if x.startswith("child ")], "the job to start", 60)
        child = int(lines[0].split()[1])
        sm.stop_training_job(TrainingJobName="pid1")
        job = emu.job("pid1")
        assert job.wait(timeout=60), "the job did not end"
        assert sm.describe_training_job(TrainingJobName="pid1")["TrainingJobStatus"] == "Stopped"
        seen = log_lines("pid1")
        assert "child got SIGTERM" not in seen  # the child is never signalled: only PID 1 is
        assert ("main got SIGTERM" in seen) is handles
        assert process_gone(child)  # the container's end kills the rest


# ---------------------------------------------------------------------------------------------------- stopping
def test_a_stop_while_the_bootstraps_pip_runs_is_forwarded_and_the_job_ends_at_once(
    patient_emulator: SageMakerEmulator, silent_server: SilentServer, s3_bucket: str, home: Path, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    # pip blocks reading the never-finished index page: the stop lands while it runs
    (source / "requirements.txt").write_text(
        f"--no-index\n--find-links http://127.0.0.1:{silent_server.port}/simple/\ndiloco-never-served==1.0\n")
    launch = cli(*launch_args(patient_emulator, s3_bucket, source, "--replicas", "1", "--detach", "-o", "json"),
                 home=home, cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    assert silent_server.accepted.wait(timeout=120), "the bootstrap's pip never asked the index"
    job = patient_emulator.job(f"{run_id}-r0")
    main = job.pid()
    assert main is not None

    import boto3

    boto3.client("sagemaker").stop_training_job(TrainingJobName=f"{run_id}-r0")
    assert job.wait(timeout=REAL_GRACE_S / 2), "the job waited for the emulator's SIGKILL"
    assert describe(f"{run_id}-r0")["TrainingJobStatus"] == "Stopped"
    lines = log_lines(f"{run_id}-r0")
    assert any(line.startswith("diloco bootstrap: SIGTERM: forwarding it to pip") for line in lines), lines
    assert any(line.startswith("diloco bootstrap: stopped by SIGTERM while pip") and line.endswith("exiting 143")
               for line in lines), lines
    assert process_gone(main)


# ---------------------------------------------------------------------------------------------------- requirements.txt
def make_wheel(directory: Path, name: str, version: str, module_text: str) -> Path:
    """A minimal pure-Python wheel (what ``pip wheel`` makes of a one-module project)."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = directory / f"{dist}-py3-none-any.whl"
    module = name.replace("-", "_")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{module}.py", module_text)
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                               "Tag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


#: The shipped trainer: imports what requirements.txt installs, then exports a model without torch (the bootstrap,
#: not training, is under test).
USES_REQUIREMENT = '''
def train(*, manager, rank, **_):
    import diloco_probe_pkg
    import numpy as np
    from safetensors.numpy import save

    from diloco.store.layout import FINAL_KEY

    print("requirement says", diloco_probe_pkg.HELLO, "from", diloco_probe_pkg.__file__, flush=True)
    manager.store.put(FINAL_KEY.format(rank=rank), save({"w": np.ones(4, dtype=np.float32)}, metadata={"round": "1"}))
'''


def test_the_sources_requirements_txt_is_installed_by_pip_before_the_trainer_runs(
    emulator: SageMakerEmulator, s3_bucket: str, home: Path, tmp_path: Path
) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "diloco-probe-pkg", "1.0", 'HELLO = "hello from requirements.txt"\n')
    source = tmp_path / "src"
    source.mkdir()
    (source / "usesreq.py").write_text(USES_REQUIREMENT)
    (source / "requirements.txt").write_text(f"--no-index\n--find-links {wheels}\ndiloco-probe-pkg==1.0\n")
    launch = cli(*launch_args(emulator, s3_bucket, source, "--replicas", "1", "--trainer", "usesreq:train",
                              "--steps", "2", "--sync-every", "2", "-o", "json"), home=home, cwd=tmp_path)
    run_id = json.loads(launch.stdout)["run_id"] if launch.stdout.strip() else None
    lines = log_lines(f"{run_id}-r0") if run_id else []
    assert launch.returncode == 0, "\n".join(lines[-30:]) or launch.stderr[-3000:]
    said = next(line for line in lines if line.startswith("requirement says"))
    assert "hello from requirements.txt" in said and "/opt/ml/diloco/site/diloco_probe_pkg.py" in said
    assert any("installing what this image lacks" in line and "diloco-probe-pkg==1.0" in line for line in lines)


# ---------------------------------------------------------------------------------------------------- dry run
@pytest.mark.parametrize(("extra", "expected"), [
    ([], ["s3fs[boto3]>=2025.7.0"]),
    (["--trainer", "diloco.trainers.hf:train", "-k", "model=m", "-k", "data=d"],
     ["s3fs[boto3]>=2025.7.0", "transformers>=5.0", "tokenizers>=0.22", "pyarrow>=15", "tensorboard>=2.14"]),
    (["--trainer", "diloco.trainers.hf:train", "-k", "model=m", "-k", "data=hf:wikitext:wikitext-2-raw-v1"],
     ["s3fs[boto3]>=2025.7.0", "transformers>=5.0", "tokenizers>=0.22", "pyarrow>=15", "tensorboard>=2.14",
      "datasets>=3.0"]),
    (["--tensorboard", "s3://diloco-test-bucket/tb/"], ["s3fs[boto3]>=2025.7.0", "tensorboard>=2.14"]),
], ids=["built-in-trainer", "hf-trainer", "hf-trainer-streaming-a-dataset", "tensorboard"])
def test_the_dry_run_lists_what_each_job_will_install(
    emulator: SageMakerEmulator, s3_bucket: str, home: Path, tmp_path: Path, extra: list[str], expected: list[str]
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    out = cli(*launch_args(emulator, s3_bucket, source, "--replicas", "2", *extra, "--dry-run", "-o", "json"),
              home=home, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for request in json.loads(out.stdout)["requests"]:
        assert json.loads(request["Environment"]["DILOCO_BOOTSTRAP_REQUIREMENTS"]) == expected
    (source / "requirements.txt").write_text("rich\n")
    with_file = cli(*launch_args(emulator, s3_bucket, source, "--replicas", "1", *extra, "--dry-run", "-o", "json"),
                    home=home, cwd=tmp_path)
    assert with_file.returncode == 0, with_file.stderr
    request = json.loads(with_file.stdout)["requests"][0]
    assert json.loads(request["Environment"]["DILOCO_BOOTSTRAP_REQUIREMENTS"]) == [*expected, "-r requirements.txt"]
    assert emulator.calls == []


USER_HF_TRAINER = '''
import transformers_is_not_installed_on_the_launcher  # noqa: F401  (proves the launcher never imports this)

DILOCO_EXTRAS = ("hf",)


def train(*, manager, rank, world_size, total_steps=1, sync_every=1):
    pass
'''


def test_a_user_trainer_declares_its_extras_in_its_source_and_the_launcher_never_imports_it(
    emulator: SageMakerEmulator, s3_bucket: str, home: Path, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "mytrain.py").write_text(USER_HF_TRAINER)
    out = cli(*launch_args(emulator, s3_bucket, source, "--replicas", "1", "--trainer", "mytrain:train",
                           "--dry-run", "-o", "json"), home=home, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    request = json.loads(out.stdout)["requests"][0]
    assert "transformers>=5.0" in json.loads(request["Environment"]["DILOCO_BOOTSTRAP_REQUIREMENTS"])

    (source / "mytrain.py").write_text(USER_HF_TRAINER.replace('("hf",)', '("hff",)'))
    bad = cli(*launch_args(emulator, s3_bucket, source, "--replicas", "1", "--trainer", "mytrain:train",
                           "--dry-run"), home=home, cwd=tmp_path)
    assert bad.returncode == 2
    line = bad.stderr.strip()
    assert "\n" not in line and "train.trainer: mytrain.DILOCO_EXTRAS names 'hff'" in line, bad.stderr
    assert emulator.calls == []


def test_the_built_in_trainers_extras_are_read_without_importing_it() -> None:
    probe = subprocess.run([sys.executable, "-c", """
import sys
from diloco.executors.replica_requirements import trainer_extras
print(trainer_extras("diloco.trainers.hf:train"), "diloco.trainers.hf" in sys.modules, "transformers" in sys.modules)
"""], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["('hf',)", "False", "False"]
