"""``diloco`` on the SageMaker backend, end to end: the real CLI, real boto3, the SageMaker emulator, moto's S3/Logs.

Nothing is patched: the CLI finds the emulator through ``AWS_ENDPOINT_URL_SAGEMAKER`` and S3/CloudWatch through
``AWS_ENDPOINT_URL``, exactly as a user points diloco at any endpoint. The emulator runs each job as a local
process from the request's ContainerEntrypoint/ContainerArguments (the test interpreter stands for the image's
``python``), so the no-image path is real: the launcher uploads a wheel of diloco, the bootstrap and the user's
source directory, and each job's bootstrap pip-installs that wheel before the replica entrypoint runs.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
from backends.sagemaker.test_sagemaker_iam import (  # noqa: F401 - a fixture, used by name
    holds_only_documented_actions,
    iam_emulator,
    role_arn,
)
from emulators.sagemaker import SageMakerEmulator
from support.async_kill_trainer import recorded_kill
from support.commands import run_cli as cli
from support.commands import start_cli
from support.polling import wait_for
from support.run_processes import processes_of
from support.sagemaker_jobs import describe, log_lines, role

pytestmark = pytest.mark.slow

TESTS_DIR = str(Path(__file__).resolve().parents[2])
SHIPPED_TRAINER = '''
import json
import sys

from pacedtrain import train as paced


def train(**kwargs):
    """The paced trainer, from the user's own (shipped) source directory; then the file of every loaded
    diloco module (the shipped wheel's, installed by the bootstrap)."""
    print("shipped trainer from", __file__, flush=True)
    result = paced(**kwargs)
    files = sorted(m.__file__ for n, m in list(sys.modules.items())
                   if n.split(".")[0] == "diloco" and getattr(m, "__file__", None))
    print("diloco imported from", json.dumps(files), flush=True)
    return result
'''

#: A paced trainer on the real outer loop (tests/support/paced_trainer.py), shipped in the user's source directory.
PACED_TRAINER = (Path(__file__).resolve().parents[2] / "support" / "paced_trainer.py").read_text()

SLOW_TRAINER = '''
import time


def train(*, manager, rank, world_size, total_steps=1, sync_every=1, seconds=120.0):
    """Holds the job in Training long enough to cancel or interrupt it."""
    print(f"slow trainer started on rank {rank}", flush=True)
    time.sleep(seconds)
'''


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture
def source(tmp_path: Path) -> Path:
    """The user's source directory: two trainers, and something the ignore file keeps out."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "shipped.py").write_text(SHIPPED_TRAINER)
    (src / "slowtrain.py").write_text(SLOW_TRAINER)
    (src / "pacedtrain.py").write_text(PACED_TRAINER)
    (src / "data").mkdir()
    (src / "data" / "huge.bin").write_bytes(b"x" * 1024)
    (src / ".dilocoignore").write_text("data/\n")
    return src


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def launch_args(emulator: SageMakerEmulator, bucket: str, source: Path, *extra: str,
                under_iam: bool = False) -> list[str]:
    """``diloco launch`` on the emulator; ``under_iam``: with the execution role that ``iam_emulator`` creates
    (it checks that SageMaker can assume the role, and that the caller may do each action)."""
    return ["launch", "--backend", "sagemaker", "--role", role_arn(emulator) if under_iam else role(emulator),
            "--region", "us-east-1",
            "--rendezvous", f"s3://{bucket}/e2e/{{run_id}}", "--source-dir", str(source),
            "--set", "store.poll_interval_s=0.2", *extra]


def jobs_of(emulator: SageMakerEmulator) -> dict[str, Any]:
    return {job.name: job for job in emulator.jobs()}



# ---------------------------------------------------------------------------------------------------- tests
def test_a_refused_third_job_rolls_the_launch_back(
    emulator: SageMakerEmulator, s3_bucket: str, source: Path, home: Path, tmp_path: Path
) -> None:
    emulator.refuse_create(nth=3)
    launch = cli(*launch_args(emulator, s3_bucket, source, "--replicas", "4", "--trainer", "slowtrain:train"),
                 home=home, cwd=tmp_path)
    assert launch.returncode == 3  # the service refused: nothing launched, nothing left
    error = [line for line in launch.stderr.splitlines() if line.startswith("diloco: error:")]
    assert len(error) == 1 and "replica 2" in error[0] and "ResourceLimitExceeded" in error[0], launch.stderr
    assert "the 2 job(s) already created were stopped" in error[0]
    created = sorted(jobs_of(emulator))
    assert len(created) == 2 and created[0].endswith("-r0") and created[1].endswith("-r1")
    for name in created:
        desc = wait_for(lambda n=name: (d := describe(n))["TrainingJobStatus"] == "Stopped" and d,
                        f"{name} to stop")
        assert desc["SecondaryStatus"] == "Stopped"
    runs = cli("runs", "-o", "json", home=home, cwd=tmp_path)
    assert runs.returncode == 0 and json.loads(runs.stdout)["runs"] == []
    assert emulator.running_pids() == []


def test_dry_run_prints_four_valid_requests_and_calls_nothing(
    emulator: SageMakerEmulator, s3_bucket: str, source: Path, home: Path, tmp_path: Path
) -> None:
    import botocore.session
    from botocore.validate import ParamValidator

    out = cli(*launch_args(emulator, s3_bucket, source, "--replicas", "4", "--spot", "--keep-alive", "0",
                           "--set", "timeout_s=3600", "--dry-run", "-o", "json"), home=home, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    shape = botocore.session.get_session().get_service_model("sagemaker").operation_model(
        "CreateTrainingJob").input_shape
    assert len(plan["requests"]) == 4
    for rank, request in enumerate(plan["requests"]):
        assert not ParamValidator().validate(request, shape).has_errors()
        assert request["TrainingJobName"].endswith(f"-r{rank}")
        assert request["Environment"]["REPLICA_RANK"] == str(rank)
        assert request["Environment"]["SM_MODEL_DIR"] == "/opt/ml/model"
        assert request["EnableManagedSpotTraining"] is True
        assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}
        assert request["CheckpointConfig"]["S3Uri"].endswith(f"/sagemaker/checkpoints/rank_{rank}/")
        assert {"Key": "diloco:rank", "Value": str(rank)} in request["Tags"]
    assert emulator.calls == [] and emulator.jobs() == []


def test_invalid_settings_are_refused_before_any_call(
    emulator: SageMakerEmulator, s3_bucket: str, source: Path, home: Path, tmp_path: Path
) -> None:
    cases: list[tuple[list[str], str]] = [
        (["--keep-alive", "30000"], "backend.keep_alive_period_s: must be <= 21600"),
        (["--spot", "--set", "backend.max_wait_s=60", "--set", "timeout_s=120"],
         "StoppingCondition.MaxWaitTimeInSeconds: 60 is less than MaxRuntimeInSeconds (120)"),
        (["--spot", "--keep-alive", "60"], "warm pools do not work with managed spot training"),
        (["--set", "store.rendezvous=s3://bucket/" + "p" * 520], "Environment['RENDEZVOUS_URI']: 532 characters"),
        (["--gpu", "Z80"], "--gpu: unknown GPU 'Z80'"),
    ]
    started = [(extra, expected, start_cli(*launch_args(emulator, s3_bucket, source, "--replicas", "2", *extra),
                                           home=home, cwd=tmp_path))
               for extra, expected in cases]  # independent: run them side by side
    for extra, expected, process in started:
        _, stderr = process.communicate(timeout=240)
        assert process.returncode == 2, (extra, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("diloco: error:") and expected in lines[0], (extra, stderr)
    assert emulator.calls == []


def test_a_missing_role_names_the_roles_sagemaker_may_assume(
    emulator: SageMakerEmulator, s3_bucket: str, home: Path, tmp_path: Path
) -> None:
    import boto3

    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                     "Principal": {"Service": "sagemaker.amazonaws.com"}}]}
    arn = boto3.client("iam").create_role(RoleName="diloco-execution",
                                          AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    out = cli("launch", "--backend", "sagemaker", "--region", "us-east-1", "--rendezvous",
              f"s3://{s3_bucket}/x/{{run_id}}", home=home, cwd=tmp_path)
    assert out.returncode == 2
    line = out.stderr.strip()
    assert "\n" not in line and "backend.role_arn" in line and arn in line, out.stderr
    assert emulator.calls == []


def test_an_interrupted_spot_job_shows_preempted_comes_back_and_cancel_stops_every_job(
    iam_emulator: SageMakerEmulator, s3_bucket: str, source: Path, home: Path, tmp_path: Path  # noqa: F811
) -> None:
    """One slow spot run, with only the documented IAM policy: replica 1's instance is reclaimed (status says
    preempted, SageMaker brings the job back), then `diloco cancel` stops every job, the one that came back
    included, and leaves no process; every action called is in the policy."""
    emulator = iam_emulator
    launch = cli(*launch_args(emulator, s3_bucket, source, "--replicas", "2", "--trainer", "slowtrain:train",
                              "--spot", "--detach", "-o", "json", under_iam=True), home=home, cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    name = f"{run_id}-r1"
    for rank in range(2):
        wait_for(lambda r=rank: any("slow trainer started" in line for line in log_lines(f"{run_id}-r{r}")),
                 f"replica {rank} to start training")
    assert processes_of(run_id)

    emulator.interrupt(name, hold=True)  # it stays Interrupted until resumed: no race with the CLI below
    status = cli("status", run_id, "-o", "json", home=home, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    r1 = json.loads(status.stdout)["ranks"][1]
    assert r1["state"] == "preempted" and r1["restarts"] == 1, r1
    assert "spot" in r1["reason"]
    emulator.resume(name)

    wait_for(lambda: sum("slow trainer started" in line for line in log_lines(name)) == 2, "replica 1 to come back")
    back = describe(name)
    assert (back["TrainingJobStatus"], back["SecondaryStatus"]) == ("InProgress", "Training")
    assert [t["Status"] for t in back["SecondaryStatusTransitions"]][-3:] == ["Restarting", "Downloading",
                                                                             "Training"]

    cancel = cli("cancel", run_id, "-o", "json", home=home, cwd=tmp_path)
    assert cancel.returncode == 0, cancel.stderr
    assert [r["state"] for r in json.loads(cancel.stdout)["ranks"]] == ["cancelled", "cancelled"]
    for rank in range(2):
        desc = describe(f"{run_id}-r{rank}")
        assert (desc["TrainingJobStatus"], desc["SecondaryStatus"]) == ("Stopped", "Stopped")
    assert processes_of(run_id) == []
    holds_only_documented_actions(emulator, {"sagemaker:CreateTrainingJob", "sagemaker:StopTrainingJob",
                                             "iam:PassRole", "servicequotas:ListServiceQuotas"})


@pytest.mark.long
def test_after_round_1_a_spot_interruption_rejoins_in_place_a_failed_job_is_relaunched_and_weights_agree(
    iam_emulator: SageMakerEmulator, s3_bucket: str, source: Path, home: Path, tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica lost after a committed round, through SageMaker, both ways at once on a managed spot run whose rank 0
    is left alone: rank 1's spot instance is reclaimed (SageMaker restarts the same job itself), rank 2's job dies
    for good (SIGKILL, exit 137: an OOM kill, a lost instance) and `diloco watch` creates a new training job for it.
    Both rejoin from the latest committed round in the store and the run ends with bitwise-identical weights. With
    only the documented IAM policy: launch, status, logs, the relaunch, watch and collect call nothing outside it.

    The same run is the no-image path's: the jobs' requests, the wheel the launch uploaded and the bootstrap
    pip-installed (diloco is imported from it, not from the checkout), the user's source unpacked into the job
    (its trainer is ``shipped.py``, the paced trainer called from the source's own module), what the ignore file
    kept out, every replica's logs (``logs`` and, the run ended, ``logs -f`` alike) and what ``collect`` gets from
    each job's ``model.tar.gz`` and billing."""
    import boto3

    emulator = iam_emulator
    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0")
    launch = cli(*launch_args(emulator, s3_bucket, source, "--replicas", "3", "--trainer", "shipped:train",
                              "--steps", "40", "--sync-every", "5", "--spot", "--detach", "-o", "json",
                              under_iam=True),
                 home=home, cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    committed = f"e2e/{run_id}/committed/"  # any committed round: the store keeps only the last 3
    s3 = boto3.client("s3")
    wait_for(lambda: any(obj["Key"].endswith("/COMMITTED")
                         for obj in s3.list_objects_v2(Bucket=s3_bucket, Prefix=committed).get("Contents", [])),
             "a round to commit")
    emulator.interrupt(f"{run_id}-r1")  # SIGKILL mid-run; SageMaker brings the job back on its own
    emulator.crash(f"{run_id}-r2")  # SIGKILL mid-run; the job ends Failed and only diloco brings the rank back
    status = cli("status", run_id, "-o", "json", home=home, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    logs = cli("logs", run_id, "--replica", "0", home=home, cwd=tmp_path)
    assert logs.returncode == 0 and logs.stdout.strip(), logs.stderr

    watch = cli("watch", run_id, "-o", "json", home=home, cwd=tmp_path, timeout=240)
    assert watch.returncode == 0, watch.stderr[-3000:]
    report = json.loads(watch.stdout)
    assert report["weights_identical"] is True, report["weights_detail"]
    assert [r["restarts"] for r in report["ranks"]] == [0, 1, 1]
    assert [r["job_id"] for r in report["ranks"]] == [f"{run_id}-r0", f"{run_id}-r1", f"{run_id}-r2-1"]
    assert "relaunching it (restart 1 of 3)" in watch.stderr, watch.stderr[-3000:]
    assert describe(f"{run_id}-r2")["FailureReason"].endswith("exit code: 137")
    assert any("rank 1 rejoined at step" in line for line in log_lines(f"{run_id}-r1"))
    assert any("rank 2 rejoined at step" in line for line in log_lines(f"{run_id}-r2-1"))

    first = describe(f"{run_id}-r0")
    assert first["AlgorithmSpecification"]["ContainerEntrypoint"] == ["python",
                                                                      "/opt/ml/input/data/code/diloco_bootstrap.py"]
    assert first["ResourceConfig"] == {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 30}
    assert first["EnableNetworkIsolation"] is False
    from diloco.executors.sagemaker import default_image_versions

    version, py = default_image_versions("us-east-1")
    assert f"pytorch-training:{version}-cpu-{py}" in first["AlgorithmSpecification"]["TrainingImage"]
    r0_lines = log_lines(f"{run_id}-r0")
    bootstrap = next(line for line in r0_lines if line.startswith("diloco bootstrap: installed"))
    assert "diloco-0.1.0-py3-none-any.whl" in bootstrap  # the uploaded wheel, pip-installed in the job
    # the user's source, unpacked into the job's /opt/ml/code (the emulator's stand-in directory for it)
    assert any(line.startswith("shipped trainer from") and line.endswith("/opt/ml/code/shipped.py")
               for line in r0_lines)
    # the wheel the launch uploaded is the one builder's, and the replica ran diloco from it, not from the checkout
    from diloco.executors.wheel_builder import build_wheel

    wheel_name, wheel = build_wheel()
    uploaded = s3.get_object(Bucket=s3_bucket, Key=f"e2e/{run_id}/sagemaker/code/{wheel_name}")
    assert uploaded["Body"].read() == wheel
    imported = json.loads(next(line for line in r0_lines if line.startswith("diloco imported from"))
                          [len("diloco imported from"):])
    assert any(f.endswith("/diloco/collectives/__init__.py") for f in imported), imported
    # the site the bootstrap installed into: the job's own, or the warm-instance cache's site for this wheel
    site = bootstrap.split(" into ", 1)[1].split(";", 1)[0]
    assert site.endswith("/opt/ml/diloco/site") or "/diloco-site-" in site, bootstrap
    assert not site.startswith(str(Path(TESTS_DIR).parent)), site  # not the checkout
    assert [f for f in imported if not f.startswith(f"{site}/diloco/")] == []
    code = s3.get_object(Bucket=s3_bucket, Key=f"e2e/{run_id}/sagemaker/code/source.tar.gz")
    with tarfile.open(fileobj=io.BytesIO(code["Body"].read())) as tar:
        assert sorted(tar.getnames()) == [".dilocoignore", "pacedtrain.py", "shipped.py", "slowtrain.py"]  # data/ ignored

    every = cli("logs", run_id, home=home, cwd=tmp_path)
    assert every.returncode == 0, every.stderr
    lines = every.stdout.splitlines()
    for rank in range(3):
        assert any(line.startswith(f"[r{rank}] shipped trainer from") for line in lines), rank
    assert all(line[:4] in {"[r0]", "[r1]", "[r2]"} for line in lines)
    followed = cli("logs", run_id, "-f", home=home, cwd=tmp_path, timeout=60)  # ends: every job is terminal
    assert followed.returncode == 0 and followed.stdout.splitlines() == lines

    collect = cli("collect", run_id, "--output", str(tmp_path / "model.safetensors"), "-o", "json",
                  home=home, cwd=tmp_path, timeout=240)
    assert collect.returncode == 0, collect.stderr[-3000:]
    collected = json.loads(collect.stdout)
    assert collected["weights_identical"] is True, collected["weights_detail"]
    assert Path(collected["model_path"]).is_file()
    assert [r["restarts"] for r in collected["ranks"]] == [0, 1, 1]
    assert collected["cost_usd"] > 0 and collected["billable_s"] >= 4
    for row in collected["ranks"]:  # each job's $SM_MODEL_DIR, uploaded by SageMaker
        uri = row["artifacts"]["model"]
        assert uri == f"s3://{s3_bucket}/e2e/{run_id}/sagemaker/output/{row['job_id']}/output/model.tar.gz"
        blob = s3.get_object(Bucket=s3_bucket, Key=uri.split("/", 3)[3])["Body"].read()
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            assert "model.safetensors" in tar.getnames()
        assert row["billable_s"] >= 1
        assert row["cost_usd"] > 0 and "an estimate" in row["cost_source"]
        assert row["state"] == "succeeded" and row["exit_code"] == 0
    assert processes_of(run_id) == []
    holds_only_documented_actions(emulator, {"sagemaker:CreateTrainingJob", "sagemaker:ListTags", "iam:PassRole",
                                             "logs:GetLogEvents", "servicequotas:ListServiceQuotas"})


#: The asynchronous kill trainer (tests/support/async_kill_trainer.py), shipped in the user's source directory.
ASYNC_KILL_TRAINER = (Path(__file__).resolve().parents[2] / "support" / "async_kill_trainer.py").read_text()


@pytest.mark.long
def test_an_async_master_killed_mid_run_comes_back_as_a_new_job_and_resumes_where_it_was(
    emulator: SageMakerEmulator, s3_bucket: str, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asynchronous DiLoCo through SageMaker: the master's job dies (SIGKILL, exit 137) mid-run; the waiting
    launch creates a new job for rank 0, which resumes from its committed state in S3 at the step it had
    recorded, and every replica exports the same final version."""
    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0")
    source, done = tmp_path / "src", tmp_path / "done"
    source.mkdir()
    done.mkdir()
    (source / "asynckill.py").write_text(ASYNC_KILL_TRAINER)
    plan = [{"trial": 0, "rank": 0, "moment": "mid_run", "step": 35}]
    launch = cli(*launch_args(emulator, s3_bucket, source, "--mode", "async", "--replicas", "2", "--trainer",
                              "asynckill:train", "--steps", "60", "--sync-every", "10", "-k", "n_layer=1", "-k",
                              "n_embd=16", "-k", "block_size=16", "-k", "batch_size=8", "-k", "eval_batches=1", "-k",
                              "max_corpus_bytes=50000", "-k", "threads=1", "-k", f"kills={json.dumps(plan)}", "-k",
                              f"done_dir={done}", "-o", "json"), home=home, cwd=tmp_path, timeout=400)
    assert launch.returncode == 0, launch.stderr[-3000:]
    report = json.loads(launch.stdout)
    run_id = report["run_id"]
    assert report["state"] == "succeeded" and report["weights_identical"] is True, report["weights_detail"]
    assert [r["restarts"] for r in report["ranks"]] == [1, 0]
    assert [r["job_id"] for r in report["ranks"]] == [f"{run_id}-r0-1", f"{run_id}-r1"]
    assert describe(f"{run_id}-r0")["FailureReason"].endswith("exit code: 137")
    recorded = int(recorded_kill(str(done), 0)["position"])  # a line printed just before a SIGKILL may be lost
    assert recorded > 0
    assert any(f"rejoins the run at step {recorded} of 60" in line for line in log_lines(f"{run_id}-r0-1"))
    assert processes_of(run_id) == []


def test_logs_read_every_page_of_a_long_stream(emulator: SageMakerEmulator, s3_bucket: str) -> None:
    from diloco.executors.base import EntrypointArgs, LaunchSpec
    from diloco.executors.sagemaker import SageMakerBackend, SageMakerBackendConfig

    lines = 10_050  # one GetLogEvents page holds at most 10,000 events
    backend = SageMakerBackend(SageMakerBackendConfig(role_arn=role(emulator), region="us-east-1",
                                                      image_uri="diloco-ready-image:test"))
    args = EntrypointArgs(rendezvous_uri=f"s3://{s3_bucket}/long", world_size=1, trainer="fake:train",
                          trainer_kwargs={"lines": lines})
    spec = LaunchSpec(run_id=f"long-{int(time.time())}", replicas=1, entrypoint="support.fake_replica",
                      entrypoint_args=args, env={"PYTHONPATH": TESTS_DIR})
    handle = backend.submit(backend.plan(spec))
    assert backend.wait(handle, timeout_s=90, poll_interval_s=0.2).state.value == "succeeded"
    texts = [r.text for r in backend.logs(handle)]
    assert [t for t in texts if " line " in t] == [f"rank 0 line {i}" for i in range(lines)]
