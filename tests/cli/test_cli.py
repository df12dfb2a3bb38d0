"""The CLI, fast: start-up imports, dry run, one-line errors, and status/logs/cancel/collect on runs of the tiny
``fake_replica`` module (real processes, no torch). The real trainer end to end is in test_cli_e2e.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.commands import DILOCO_SCRIPT as DILOCO
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.executors.base import EntrypointArgs, LaunchSpec, RunState
from diloco.executors.local import LocalBackend, LocalBackendConfig, LocalProcess, LocalRunHandle
from diloco.executors.local_supervisor import group_members
from diloco.launcher.runs import RunRecord, RunRegistry

TESTS_DIR = str(Path(__file__).resolve().parents[1])
runner = CliRunner()


def run_cli(*args: str, home: Path, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it."""
    env = {**os.environ, "DILOCO_HOME": str(home)}
    env.pop("DILOCO_DEBUG", None)
    return subprocess.run([DILOCO, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def processes_with_env(needle: str) -> list[int]:
    """Pids whose environment contains ``needle`` (to prove that nothing was started)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle.encode() in f.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def fake_run(home: Path, tmp_path: Path, n: int = 2, **behaviour: object) -> RunRecord:
    """Launch ``fake_replica`` processes through the local executor and record them like `diloco launch` does."""
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    # The time part is random: tests run in parallel (pytest-xdist), and the processes of one run are found by its
    # id in their environment, so two tests must never share one.
    count = len(list(home.glob("runs/*.json"))) if home.exists() else 0
    run_id = f"diloco-20240101-{random.randrange(10**6):06d}-{count:04x}"
    backend = LocalBackend(LocalBackendConfig(grace_period_s=2.0))
    args = EntrypointArgs(rendezvous_uri=f"file://{store}", world_size=n, trainer="fake:train",
                          trainer_kwargs=dict(behaviour))
    spec = LaunchSpec(run_id=run_id, replicas=n, entrypoint="support.fake_replica", entrypoint_args=args,
                      env={"PYTHONPATH": TESTS_DIR})
    handle = backend.submit(backend.plan(spec))
    record = RunRecord(run_id=run_id, backend="local", created_at=time.time(), rendezvous_uri=f"file://{store}",
                       replicas=n, config={"store": {"poll_interval_s": 0.1},
                                           "backend": backend.config.model_dump(mode="json")},
                       handle=handle.model_dump(mode="json"))
    RunRegistry().save(record)
    return record


def processes(record: RunRecord) -> list[LocalProcess]:
    """The supervisors of a local run, in rank order."""
    assert record.handle is not None
    return LocalRunHandle.model_validate(record.handle).processes


# ---------------------------------------------------------------------------------------------- start-up
def test_importing_the_cli_does_not_import_heavy_modules() -> None:
    code = ("import sys, diloco.cli.main\n"
            "print(sorted(m for m in ('torch', 'boto3', 'botocore', 'kubernetes', 'safetensors') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_help_lists_commands_and_exit_codes(home: Path) -> None:
    result = run_cli("--help", home=home)
    assert result.returncode == 0
    for name in ("launch", "status", "logs", "collect", "cancel", "runs"):
        assert name in result.stdout
    text = " ".join(result.stdout.split())
    assert "4 cancelled, 5 succeeded with replicas left behind (--min-replicas), 124 timeout, 130 interrupted" in text
    assert run_cli(home=home).returncode == 0  # bare `diloco` prints the help too


@pytest.mark.parametrize("command", ["launch", "status", "logs", "collect", "cancel", "runs", "smoke", "doctor", "watch", "plot"])
def test_every_command_help_has_examples_and_exit_codes(command: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert f"Examples: diloco {command}" in text
    assert "Exit codes: 0 " in text and "130 interrupted" in text  # its own codes: see test_cli_help.py
    assert "list[str]" not in text  # metavars say what to type (KEY=VALUE), not Python types


@pytest.mark.parametrize("args", [["runs"], ["runs", "-o", "json"], ["launch", "--dry-run"], ["logs"]])
def test_a_reader_that_closes_the_pipe_early_is_not_an_error(home: Path, tmp_path: Path, args: list[str]) -> None:
    if args == ["logs"]:
        fake_run(home, tmp_path, n=1, lines=3)
    env = {**os.environ, "DILOCO_HOME": str(home)}
    result = subprocess.run(f"{DILOCO} {' '.join(args)} | true", shell=True, capture_output=True, text=True,
                            env=env, timeout=60)  # `| true`: the reader is gone before diloco writes
    assert "Traceback" not in result.stderr and "error" not in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------- launch
def test_dry_run_prints_requests_and_launches_nothing(home: Path) -> None:
    result = runner.invoke(app, ["launch", "--replicas", "4", "--backend", "local", "--steps", "20",
                                 "--sync-every", "10", "--dry-run", "-o", "json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["schema_version"] == 1 and plan["backend"] == "local"
    run_id = plan["spec"]["run_id"]
    assert [r["rank"] for r in plan["requests"]] == [0, 1, 2, 3]
    for r in plan["requests"]:
        req = r
        assert req["argv"][1:3] == ["-m", "diloco.replica.entrypoint"]
        assert req["env"]["REPLICA_RANK"] == str(r["rank"]) and req["env"]["WORLD_SIZE"] == "4"
        assert req["env"]["DILOCO_RUN_ID"] == run_id
        # every replica names the run's spec object (published by the launch) and its checksum, nothing else
        assert req["argv"][3:5] == ["--spec", f"{plan['spec']['entrypoint_args']['rendezvous_uri']}/spec.json"]
        assert req["argv"][5] == "--spec-sha256" and len(req["argv"]) == 7
    assert plan["spec"]["entrypoint_args"]["trainer_kwargs"] == {"total_steps": 20, "sync_every": 10}
    assert plan["spec"]["entrypoint_args"]["rendezvous_uri"] == f"file://{home.resolve()}/runs/{run_id}/store"
    assert not home.exists()  # no registry entry, no store, no log directory
    assert processes_with_env(run_id) == []  # and no process


@pytest.mark.parametrize(("args", "message"), [
    (["--replicas", "0"], "replicas: must be >= 1 (got 0)"),
    (["--backend", "ec2"], "backend: must be one of local, sagemaker, eks, mixed (got 'ec2')"),
    (["--backend", "nomad"], "backend: must be one of local, sagemaker, eks, mixed (got 'nomad')"),
    (["--backend", "sagemaker"], "store.rendezvous: required for the sagemaker backend"),
    (["--no-such-flag"], "No such option: --no-such-flag"),
    (["--replicas", "many"], "Invalid value for '--replicas'"),
    (["--set", "train.nope=1"], "train.nope: unknown key"),
    (["--steps", "30", "--sync-every", "20"], "train.steps: must be a multiple of train.sync_every"),
    (["--trainer-kwargs", "rank=3"], "train.trainer_kwargs.rank: not allowed here"),
    (["--config", "{tmp}/bad.yaml"], "bad.yaml: line 2, column 1: invalid YAML"),
    (["--config", "{tmp}/unknown.yaml"], "replicaz: unknown key"),
    (["--config", "{tmp}/missing.yaml"], "--config: no such file"),
    (["--trainer", "no_such_module:train"], "train.trainer: module 'no_such_module' is not importable here"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_launched(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "bad.yaml").write_text("replicas: 2\n: [\n")
    (tmp_path / "unknown.yaml").write_text("replicaz: 2\n")
    home = tmp_path / "home"
    result = run_cli("launch", *[a.replace("{tmp}", str(tmp_path)) for a in args], home=home)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("diloco: error: ") and message in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not home.exists()


@pytest.mark.parametrize("command", ["status", "logs", "collect", "cancel"])
def test_unknown_run_is_a_usage_error_pointing_to_diloco_runs(home: Path, command: str) -> None:
    result = runner.invoke(app, [command, "no-such-run"])
    assert result.exit_code == 2
    assert result.stderr.startswith("diloco: error: no run 'no-such-run'")
    assert "diloco runs" in result.stderr and result.stdout == ""


def test_runs_lists_nothing_then_json(home: Path) -> None:
    result = runner.invoke(app, ["runs", "-o", "json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"schema_version": 1, "runs": []}


# ---------------------------------------------------------------------------------------------- run commands
def test_logs_merge_replicas_in_time_order_with_prefixes(home: Path, tmp_path: Path) -> None:
    record = fake_run(home, tmp_path, n=3, lines=4, line_gap=0.05)
    result = runner.invoke(app, ["status", "--watch", "-o", "json"])  # waits for the run to end
    assert result.exit_code == 0, result.output
    # fake replicas write no model: collect cannot check one, so it is not "every check passed"
    collected = runner.invoke(app, ["collect"])
    assert collected.exit_code == 1 and "the final weights could not be checked" in collected.stderr

    out = runner.invoke(app, ["logs"])
    assert out.exit_code == 0
    lines = out.stdout.splitlines()
    assert len(lines) == 3 * 5
    assert {line.split(" ", 1)[0] for line in lines} == {"[r0]", "[r1]", "[r2]"}
    assert "[r1] rank 1 line 3" in lines and "[r2] rank 2 says hello on stderr" in lines
    # time order: the merge follows the supervisors' timestamps
    stamps = {}
    for h in processes(record):
        for raw in Path(h.log_dir, "combined.log").read_text().splitlines():
            ts, _, text = raw.split(" ", 2)
            stamps[f"[r{h.rank}] {text}"] = float(ts)
    assert [stamps[line] for line in lines] == sorted(stamps[line] for line in lines)

    only = runner.invoke(app, ["logs", record.run_id, "-r", "0,2", "--tail", "1"])
    last = {h.rank: Path(h.log_dir, "combined.log").read_text().splitlines()[-1].split(" ", 2)[2]
            for h in processes(record)}
    assert sorted(only.stdout.splitlines()) == [f"[r0] {last[0]}", f"[r2] {last[2]}"]
    bad = runner.invoke(app, ["logs", "-r", "7"])
    assert bad.exit_code == 2 and "replica 7 does not exist" in bad.stderr


def test_status_and_collect_report_a_failed_replica_and_why(home: Path, tmp_path: Path) -> None:
    fake_run(home, tmp_path, n=2, fail_rank=1, fail_exit=3)
    result = runner.invoke(app, ["collect", "-o", "json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["state"] == "failed"
    failed = report["ranks"][1]
    assert failed["state"] == "failed" and failed["exit_code"] == 3
    assert failed["stderr_tail"][-1] == "rank 1: injected failure"
    assert "replica 1 failed with exit code 3: rank 1: injected failure" in result.stderr
    assert "rank 1: injected failure" in result.stderr
    status = runner.invoke(app, ["status", "-o", "json"])
    assert status.exit_code == 0 and json.loads(status.stdout)["state"] == "failed"


def test_cancel_stops_every_process_and_collect_then_exits_4(home: Path, tmp_path: Path) -> None:
    record = fake_run(home, tmp_path, n=2, sleep=120, spawn_child=True)
    deadline = time.monotonic() + 20
    while not all(Path(h.log_dir, "child.json").exists() for h in processes(record)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status = runner.invoke(app, ["status", "-o", "json"])
    assert [r["state"] for r in json.loads(status.stdout)["ranks"]] == ["running", "running"]

    result = runner.invoke(app, ["cancel", "-o", "json"])
    assert result.exit_code == 0, result.output
    assert [r["state"] for r in json.loads(result.stdout)["ranks"]] == ["cancelled", "cancelled"]
    assert all(group_members(h.pid) == [] for h in processes(record))
    assert processes_with_env(record.run_id) == []

    shown = runner.invoke(app, ["status"])
    assert "r0, r1: cancelled" in shown.stdout  # one line for the shared reason, not one per replica
    collected = runner.invoke(app, ["collect"])
    assert collected.exit_code == 4
    again = runner.invoke(app, ["cancel"])
    assert again.exit_code == 0 and "already finished" in again.stderr
    listed = json.loads(runner.invoke(app, ["runs", "-o", "json"]).stdout)["runs"]
    assert [(r["run_id"], r["state"]) for r in listed] == [(record.run_id, RunState.CANCELLED.value)]


def test_collect_timeout_exits_124_and_leaves_the_run_running(home: Path, tmp_path: Path) -> None:
    record = fake_run(home, tmp_path, n=1, sleep=120)
    try:
        result = runner.invoke(app, ["collect", "--timeout", "0.5"])
        assert result.exit_code == 124
        assert "timed out after 0.5s" in result.stderr
        assert json.loads(runner.invoke(app, ["status", "-o", "json"]).stdout)["state"] == "running"
    finally:
        assert runner.invoke(app, ["cancel"]).exit_code == 0
    assert processes_with_env(record.run_id) == []


def test_follow_and_watch_end_with_the_run(home: Path, tmp_path: Path) -> None:
    fake_run(home, tmp_path, n=2, lines=6, line_gap=0.05, fail_rank=0, fail_exit=2)
    followed = runner.invoke(app, ["logs", "-f", "-r", "1"])
    assert followed.exit_code == 0
    assert followed.stdout.splitlines()[:6] == [f"[r1] rank 1 line {i}" for i in range(6)]
    watched = runner.invoke(app, ["status", "--watch", "-o", "json"])
    assert watched.exit_code == 1  # the run failed: --watch exits like collect
    assert json.loads(watched.stdout)["ranks"][0]["exit_code"] == 2


def test_unwritable_diloco_home_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    result = run_cli("launch", "--steps", "2", "--sync-every", "1", home=tmp_path / "file" / "home")
    assert result.returncode == 2
    assert result.stderr.startswith("diloco: error: DILOCO_HOME: cannot record runs in ")
    assert "internal error" not in result.stderr and len(result.stderr.splitlines()) == 1


def test_failure_why_prefers_the_informative_cause() -> None:
    from diloco.cli.views import failure_why
    from diloco.launcher.reports import ReplicaReport

    def rep(reason: str | None, tail: list[str]) -> ReplicaReport:
        return ReplicaReport(rank=0, state=RunState.FAILED, reason=reason, stderr_tail=tail)

    err = ["Traceback ...", "diloco: error: rank 0: RuntimeError: boom", "done"]
    assert failure_why(rep("exited with code 1", err)) == "rank 0: RuntimeError: boom"
    assert failure_why(rep("exceeded its time limit of 5s (timeout_s) and was stopped", err)).startswith("exceeded")
    assert failure_why(rep("exited with code 3", ["last words"])) == "last words"
    assert failure_why(rep(None, [])) == "no reason recorded"
