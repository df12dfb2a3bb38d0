"""The replicas' settings travel as the run's spec object, so their size is bounded by nothing but the store.

``diloco launch`` publishes the run's ``EntrypointArgs`` as ``spec.json`` under the rendezvous and gives every
replica only ``--spec URI --spec-sha256 HEX``: a few short tokens on every backend, where SageMaker allows 256
characters per ContainerArguments element. Proven end to end with 4 KB of trainer kwargs through the real CLI on
the local backend and on the SageMaker emulator (the request is accepted, each replica's trainer receives the
kwargs byte for byte), plus the replica's own checks of the object it reads (missing, replaced, another run's).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.commands import run_cli as cli

from diloco.executors.base import EntrypointArgs, LaunchSpec

TINY = ["--steps", "4", "--sync-every", "2"]
#: 4 KB of one trainer setting: far beyond one 256-character ContainerArguments element.
BLOB = "".join(f"{i:04d}-abcdefghij;" for i in range(4096 // 16))[:4096]

#: Says exactly what it received as ``blob`` and writes the same final weights on every rank: what is under test is
#: how the settings travel, not training (so no torch, whose import would cost each replica process seconds).
ECHO_TRAINER = '''
import hashlib

import numpy as np
from safetensors.numpy import save


def train(*, manager, rank, world_size, total_steps, sync_every, blob: str):
    print(f"blob received: {len(blob)} chars, sha256 {hashlib.sha256(blob.encode()).hexdigest()}", flush=True)
    manager.store.put(f"final/rank_{rank:04d}.safetensors", save({"w": np.arange(4, dtype=np.float32)}))
'''


def received_line() -> str:
    return f"blob received: {len(BLOB)} chars, sha256 {hashlib.sha256(BLOB.encode()).hexdigest()}"


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "echo_trainer.py").write_text(ECHO_TRAINER)
    return src


def test_4kb_of_trainer_kwargs_reach_every_local_replica_through_the_spec_object(tmp_path: Path,
                                                                                 source: Path) -> None:
    home = tmp_path / "home"
    plan = cli("launch", "-n", "2", "--trainer", "echo_trainer:train", "-k", f"blob={BLOB}", *TINY, "--dry-run",
               "-o", "json", home=home, cwd=source)
    assert plan.returncode == 0, plan.stderr
    shown = json.loads(plan.stdout)
    assert shown["spec"]["entrypoint_args"]["trainer_kwargs"]["blob"] == BLOB  # the dry run shows every setting
    assert all(len(token) < 256 for r in shown["requests"] for token in r["argv"])

    out = cli("launch", "-n", "2", "--trainer", "echo_trainer:train", "-k", f"blob={BLOB}", *TINY, "-o", "json",
              home=home, cwd=source)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["state"] == "succeeded" and report["weights_identical"] is True
    for rank in range(2):
        logs = cli("logs", report["run_id"], "-r", str(rank), home=home, cwd=source)
        assert f"[r{rank}] {received_line()}" in logs.stdout.splitlines(), logs.stdout[-2000:]
    spec = json.loads((home / "runs" / report["run_id"] / "store" / "spec.json").read_text())
    assert spec["run_id"] == report["run_id"] and spec["settings"]["trainer_kwargs"]["blob"] == BLOB


@pytest.mark.slow
def test_4kb_of_trainer_kwargs_reach_every_sagemaker_job(emulator: object, s3_bucket: str, source: Path,
                                                         tmp_path: Path) -> None:
    import boto3

    home = tmp_path / "home"
    role = f"arn:aws:iam::{emulator.account_id}:role/diloco-e2e"  # type: ignore[attr-defined]
    out = cli("launch", "--backend", "sagemaker", "--role", role, "--region", "us-east-1", "--rendezvous",
              f"s3://{s3_bucket}/spec/{{run_id}}", "--source-dir", str(source), "--set", "store.poll_interval_s=0.2",
              "-n", "2", "--trainer", "echo_trainer:train", "-k", f"blob={BLOB}", *TINY, "-o", "json",
              home=home, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run_id = json.loads(out.stdout)["run_id"]
    sm, logs = boto3.client("sagemaker"), boto3.client("logs")
    for rank in range(2):
        name = f"{run_id}-r{rank}"
        arguments = sm.describe_training_job(TrainingJobName=name)["AlgorithmSpecification"]["ContainerArguments"]
        assert arguments[2:4] == ["--spec", f"s3://{s3_bucket}/spec/{run_id}/spec.json"], arguments
        assert all(len(a) <= 256 for a in arguments)
        streams = logs.describe_log_streams(logGroupName="/aws/sagemaker/TrainingJobs",
                                            logStreamNamePrefix=f"{name}/")["logStreams"]
        lines = [e["message"] for s in streams for e in logs.get_log_events(
            logGroupName="/aws/sagemaker/TrainingJobs", logStreamName=s["logStreamName"], startFromHead=True)["events"]]
        assert received_line() in lines, lines[-20:]


# ---------------------------------------------------------------------------------------------- the replica's checks
def _publish(tmp_path: Path, run_id: str = "run-a") -> LaunchSpec:
    root = f"file://{tmp_path}/store"
    args = EntrypointArgs(rendezvous_uri=root, world_size=1, trainer="echo_trainer:train",
                          trainer_kwargs={"blob": BLOB})
    spec = LaunchSpec(run_id=run_id, replicas=1, entrypoint_args=args, spec_uri=f"{root}/spec.json")
    (tmp_path / "store").mkdir(exist_ok=True)
    (tmp_path / "store" / "spec.json").write_bytes(spec.spec_object())
    return spec


def test_the_spec_gives_every_setting_and_explicit_flags_win(tmp_path: Path) -> None:
    from diloco.replica.entrypoint import resolve_args

    spec = _publish(tmp_path)
    args = resolve_args([*spec.entrypoint_argv(), "--rank", "0", "--timeout", "7"], {"DILOCO_RUN_ID": "run-a"})
    assert args.settings == spec.entrypoint_args.model_copy(update={"timeout_s": 7.0})
    assert (args.rank, args.run_id) == (0, "run-a")


@pytest.mark.parametrize(("tamper", "message"), [
    ("missing", "do not exist"),
    ("replaced", "not the ones this replica was started with"),
    ("other run", "holds the settings of run run-b, not of this replica's run run-a"),
    ("not a spec", "are unreadable"),
])
def test_a_spec_object_that_is_not_this_runs_is_refused_with_exit_2(tmp_path: Path, tamper: str,
                                                                     message: str) -> None:
    spec = _publish(tmp_path)
    argv = spec.entrypoint_argv()
    path = tmp_path / "store" / "spec.json"
    if tamper == "missing":
        path.unlink()
    elif tamper == "replaced":
        path.write_bytes(path.read_bytes().replace(b"abcdefghij", b"ABCDEFGHIJ"))
    elif tamper == "other run":
        _publish(tmp_path, run_id="run-b")
        argv = argv[:2]  # without the checksum, the run id still tells them apart
    else:
        path.write_text(json.dumps({"format": "diloco.replica-spec/1", "run_id": "run-a", "settings": {}}))
        argv = argv[:2]
    env = {**os.environ, "DILOCO_RUN_ID": "run-a", "REPLICA_RANK": "0"}
    out = subprocess.run([sys.executable, "-m", "diloco.replica.entrypoint", *argv], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("diloco: error:") and message in last, out.stderr
