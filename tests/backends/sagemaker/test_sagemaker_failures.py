"""Only a failure a relaunch can cure is relaunched on SageMaker, and ``status`` says which kind each one was.

A relaunch is a new training job: a paid cold start. SageMaker's FailureReason comes in several forms (the
emulator's ``FAILURE_FORMS`` cite where each is on record); the backend classifies them (``failures.py``) and
the orchestrator relaunches by that verdict, so a bootstrap that cannot install, a denied S3 read or a script's
own error fails the run at once, naming the reason, while a lost instance, a kill or missing capacity is retried.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from emulators.sagemaker import FailureForm, SageMakerEmulator

from diloco.executors.base import EntrypointArgs, LaunchSpec, ReplicaState
from diloco.executors.failures import FailureClass
from diloco.executors.sagemaker import SageMakerBackend, SageMakerBackendConfig

TESTS_DIR = str(Path(__file__).resolve().parents[2])
USER, INFRA, KILLED, CAPACITY, UNKNOWN = (FailureClass.USER_ERROR, FailureClass.INFRASTRUCTURE, FailureClass.KILLED,
                                          FailureClass.CAPACITY, FailureClass.UNKNOWN)
BOOTSTRAP = "AlgorithmError: diloco bootstrap: pip could not install diloco-0.1.0-py3-none-any.whl"

#: (form armed on the rank's job, or None for the replica's own exit 1) -> (class, relaunched, status words)
FORMS: list[tuple[str | FailureForm | None, FailureClass, bool, str]] = [
    ("capacity", CAPACITY, True, "no capacity for the instance type"),
    ("internal", INFRA, True, "an error on SageMaker's side"),
    ("instance-lost", INFRA, True, "an error on SageMaker's side"),
    ("download-denied", USER, False, "denied"),
    ("oom-kill", KILLED, True, "killed by signal 9 (SIGKILL)"),
    ("toolkit-exit-1", USER, False, "exited with code 1"),
    ("toolkit-exit-137", KILLED, True, "killed by signal 9 (SIGKILL)"),
    ("legacy-exit-1", USER, False, "exited with code 1"),
    (FailureForm("Training", BOOTSTRAP, "the bootstrap's failure file"), USER, False,
     "pip could not install what the job needs"),
    (FailureForm("Training", "AlgorithmError: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                 "a trainer's failure file"), USER, False, "ran out of memory"),
    (FailureForm("Training", "QuotaError: a form nobody has documented", "none: a wording not on record"), UNKNOWN,
     False, "a form diloco does not know"),
    (None, USER, False, "exited with code 1"),
]


def backend_for(emulator: SageMakerEmulator) -> SageMakerBackend:
    return SageMakerBackend(SageMakerBackendConfig(
        role_arn=f"arn:aws:iam::{emulator.account_id}:role/diloco-failures", region="us-east-1",
        image_uri="diloco-ready-image:test", log_poll_interval_s=0.2))


@pytest.mark.parametrize(("reason", "expected", "relaunch"), [
    ("CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML "
     "instance type.", CAPACITY, True),
    ("InternalServerError: We encountered an internal error. Please try again.", INFRA, True),
    ("ClientError: Data download failed:Unable to download object s3://b/k (AccessDenied: Access Denied)", USER,
     False),
    ('ClientError: No S3 objects found under S3 URL "s3://b/code/" given in input data source.', USER, False),
    ("ClientError: Artifact upload failed:Insufficient disk space", USER, False),
    ("AlgorithmError: , exit code: 137", KILLED, True),
    ("AlgorithmError: , exit code: 143", KILLED, True),
    ("AlgorithmError: , exit code: 1", USER, False),
    ("AlgorithmError: Exit Code: 139", KILLED, True),
    ('AlgorithmError: ExecuteUserScriptError:\nExitCode 2\nErrorMessage "usage"\nCommand "python x.py"', USER, False),
    ('AlgorithmError: ExecuteUserScriptError:\nExitCode -9\nErrorMessage ""\nCommand "python x.py"', KILLED, True),
    ("AlgorithmError: framework error: \nTraceback (most recent call last): ...", USER, False),
    ("AlgorithmError: worker died: Signal 9 (SIGKILL) received by PID 81", KILLED, True),
    ("AlgorithmError: MemoryError", USER, False),
    (BOOTSTRAP, USER, False),
    ("AlgorithmError: diloco bootstrap: no wheel in the code channel /opt/ml/input/data/code", USER, False),
    ("", UNKNOWN, False),
    (None, UNKNOWN, False),
    ("Something new: with a colon", UNKNOWN, False),
])
def test_every_failure_reason_form_gets_a_class_and_a_decision(reason: str | None, expected: FailureClass,
                                                               relaunch: bool) -> None:
    from diloco.executors.sagemaker.failures import classify_failure

    verdict = classify_failure(reason)
    assert (verdict.failure_class, verdict.relaunch) == (expected, relaunch), verdict
    assert verdict.why and "\n" not in verdict.why


def _render(report: Any) -> str:
    from rich.console import Console

    from diloco.cli.views import render_run

    out = io.StringIO()
    render_run(Console(file=out, width=300, no_color=True, highlight=False, soft_wrap=True), report)
    return out.getvalue()


def test_each_form_through_the_backend_gets_the_right_decision_and_status_line(
    emulator: SageMakerEmulator, s3_bucket: str
) -> None:
    """One job per form, as the service would end it; the backend describes them, the orchestrator decides, and
    ``diloco status``'s rendering says which kind of failure each was and whether it is relaunched."""
    from diloco.launcher.lifecycle import relaunchable
    from diloco.launcher.run import Run
    from diloco.launcher.runs import RunRecord

    backend = backend_for(emulator)
    run_id = f"forms-{int(time.time() * 1000) % 10**8}"
    natural = next(rank for rank, (form, *_) in enumerate(FORMS) if form is None)
    uri = f"s3://{s3_bucket}/forms/{run_id}"
    args = EntrypointArgs(rendezvous_uri=uri, world_size=len(FORMS), trainer="fake:train",
                          trainer_kwargs={"fail_rank": natural, "fail_exit": 1, "lines": 1})
    spec = LaunchSpec(run_id=run_id, replicas=len(FORMS), entrypoint="support.fake_replica", entrypoint_args=args,
                      env={"PYTHONPATH": TESTS_DIR})
    plan = backend.plan(spec)
    for rank, (form, *_) in enumerate(FORMS):
        if form is not None:
            emulator.fail(plan.requests[rank]["TrainingJobName"], form)
    handle = backend.submit(plan)
    status = backend.wait(handle, timeout_s=90, poll_interval_s=0.2)
    assert all(r.state == ReplicaState.FAILED for r in status.replicas), [(r.rank, r.state, r.reason)
                                                                           for r in status.replicas]
    record = RunRecord(run_id=run_id, backend="sagemaker", created_at=time.time(), rendezvous_uri=uri,
                       replicas=len(FORMS), config={"backend": backend.config.model_dump(mode="json")},
                       handle=handle.model_dump(mode="json"))
    report = Run(record, backend).report(status, with_stderr=False)
    lines = {}  # rank -> its "r1, r2: why" line (replicas that failed alike share one)
    for line in _render(report).splitlines():
        found = re.match(r"^(r\d+(?:, r\d+)*): (.+)$", line)
        for rank in found.group(1).split(", ") if found else []:
            lines[int(rank[1:])] = found.group(2)
    for rank, (form, expected, relaunch, words) in enumerate(FORMS):
        replica = status.replica(rank)
        assert replica.failure is not None, replica
        assert (replica.failure.failure_class, replica.failure.relaunch) == (expected, relaunch), (form, replica)
        assert relaunchable(replica) is relaunch, (form, replica)
        line = lines[rank]
        assert words in line, (form, line)
        assert ("not relaunched" in line) is not relaunch, (form, line)
    assert status.replica(0).billable_s is None  # no capacity: no instance was ever started, nothing billed


def test_a_launch_whose_bootstrap_pip_fails_is_not_relaunched_and_fails_naming_it(
    emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real bootstrap, the real pip, a failure file and the service's FailureReason: the launch (which would
    relaunch curable failures up to 3 times) creates no second job for either rank and exits 1 naming pip."""
    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0")
    emulator.break_pip()
    source = tmp_path / "src"
    source.mkdir()
    env = {**os.environ, "DILOCO_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    out = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", "--backend", "sagemaker",
                          "--role", f"arn:aws:iam::{emulator.account_id}:role/diloco-e2e", "--region", "us-east-1",
                          "--rendezvous", f"s3://{s3_bucket}/pip/{{run_id}}", "--source-dir", str(source),
                          "--replicas", "2", "--steps", "2", "--sync-every", "1", "--max-restarts", "3",
                          "--set", "store.poll_interval_s=0.2"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert out.returncode == 1, out.stderr[-3000:]
    names = sorted(job.name for job in emulator.jobs())
    assert len(names) == 2 and all(name.endswith(("-r0", "-r1")) for name in names), names  # nothing relaunched
    reasons = {job.describe().get("FailureReason") for job in emulator.jobs()} - {None}
    assert any(r.startswith("AlgorithmError: diloco bootstrap: pip could not install") for r in reasons), reasons
    assert "relaunching" not in out.stderr, out.stderr[-3000:]
    # The first line that reports a failure names its cause, whether the launcher stopped the peer (it saw rank 0
    # fail first) or saw both fail on their own.
    failed = [line for line in out.stderr.splitlines() if line.startswith("replica ") and " failed" in line]
    assert failed and "pip could not install" in failed[0] and "not relaunched" in failed[0], out.stderr[-3000:]
    assert emulator.running_pids() == []


@pytest.mark.parametrize(("failure", "exit_code", "expected"), [
    (FailureClass.USER_ERROR, 137, False),  # the backend read the report: its verdict decides
    (FailureClass.KILLED, 1, True),
    (FailureClass.UNKNOWN, None, False),
    (None, None, True),  # a backend that cannot tell (local, Kubernetes): the exit code decides, as before
    (None, 1, False),
])
def test_a_backends_verdict_decides_over_the_exit_code(failure: FailureClass | None, exit_code: int | None,
                                                       expected: bool) -> None:
    from diloco.executors.base import ReplicaStatus
    from diloco.executors.failures import FailureVerdict
    from diloco.launcher.lifecycle import relaunchable

    verdict = FailureVerdict.of(failure, "because") if failure is not None else None
    status = ReplicaStatus(rank=0, state=ReplicaState.FAILED, exit_code=exit_code, failure=verdict)
    assert relaunchable(status) is expected
    assert relaunchable(status.model_copy(update={"timed_out": True})) is False


def test_the_emulators_command_line_arms_a_failure_form(aws_env: str, tmp_path: Path) -> None:
    """``python -m tests.emulators.sagemaker --fail JOB=FORM``: a job created later under that name fails so."""
    import signal

    import boto3

    repo = Path(TESTS_DIR).parent
    proc = subprocess.Popen([sys.executable, "-m", "tests.emulators.sagemaker", "--port", "0", "--aws-endpoint", aws_env, "--root",
                             str(tmp_path / "emu"), "--fail", "armed-job=capacity"], cwd=repo, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        exports: dict[str, str] = {}
        for line in proc.stdout:
            if line.startswith("export "):
                key, _, value = line[len("export "):].strip().partition("=")
                exports[key] = value
            if line.startswith("# Ctrl-C"):
                break
        sm = boto3.client("sagemaker", endpoint_url=exports["AWS_ENDPOINT_URL_SAGEMAKER"])
        sm.create_training_job(
            TrainingJobName="armed-job", RoleArn="arn:aws:iam::000000000000:role/any",
            AlgorithmSpecification={"TrainingImage": "ready:1", "TrainingInputMode": "File",
                                    "ContainerEntrypoint": ["python", "-c", "pass"]},
            ResourceConfig={"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 1},
            OutputDataConfig={"S3OutputPath": "s3://any-bucket/out"}, StoppingCondition={"MaxRuntimeInSeconds": 60})
        deadline = time.monotonic() + 30
        while (desc := sm.describe_training_job(TrainingJobName="armed-job"))["TrainingJobStatus"] == "InProgress":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert desc["TrainingJobStatus"] == "Failed" and desc["FailureReason"].startswith("CapacityError: ")
        assert "TrainingStartTime" not in desc  # it failed before any instance was up: nothing billed
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_training_job_failed_by_the_knob_is_killed_and_reports_the_form(
    emulator: SageMakerEmulator, s3_bucket: str
) -> None:
    from diloco.launcher.lifecycle import relaunchable

    backend = backend_for(emulator)
    run_id = f"knob-{int(time.time() * 1000) % 10**8}"
    args = EntrypointArgs(rendezvous_uri=f"s3://{s3_bucket}/knob/{run_id}", world_size=1, trainer="fake:train",
                          trainer_kwargs={"sleep": 120, "lines": 1})
    handle = backend.submit(backend.plan(LaunchSpec(run_id=run_id, replicas=1, entrypoint="support.fake_replica",
                                                    entrypoint_args=args, env={"PYTHONPATH": TESTS_DIR})))
    name = handle.job_names[0]
    deadline = time.monotonic() + 45
    while not any("rank 0 line 0" in r.text for r in backend.logs(handle)):
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.2)
    with pytest.raises(ValueError, match="already training"):
        emulator.fail(name, "capacity")  # the service runs out of capacity before a job starts, never after
    emulator.fail(name, "internal")
    status = backend.wait(handle, timeout_s=45, poll_interval_s=0.2).replica(0)
    assert status.state == ReplicaState.FAILED and status.reason is not None
    assert status.reason.startswith("InternalServerError: ") and relaunchable(status)
    assert emulator.running_pids() == []
