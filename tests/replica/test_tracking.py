"""``--mlflow`` and ``--wandb`` with real parts: a real ``mlflow server`` (SQLite backend store, artifacts in a temporary
directory, a loopback port) and W&B in offline mode, both fed by ONE 2-replica local run through the real CLI, with
replica 1 SIGKILLed mid-run and relaunched (``support.tracking_trainer``): the two sinks are independent, so one run
with the kill shows both. What the trackers hold is read back through ``MlflowClient`` and from the offline run's
``.wandb`` files: one tracker run each, one series per replica whose steps are each present once with no committed
round missing, the round metrics and the run's settings."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.polling import wait_for

#: One worker runs this module: its module-scoped run (or server) is then started once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_tracking")

TESTS_DIR = Path(__file__).resolve().parents[1]
DILOCO = str(Path(sys.executable).with_name("diloco"))
MLFLOW = str(Path(sys.executable).with_name("mlflow"))
STEPS, SYNC_EVERY, REPLICAS = 12, 3, 2
#: Every step a replica's series must hold: the ``init`` row's and each committed round's.
EXPECTED_STEPS = [0] + [SYNC_EVERY * k for k in range(1, STEPS // SYNC_EVERY + 1)]
#: Rank 1 dies after the first inner step of round 3, past two committed rounds: its successor rejoins at step 6.
KILL = {"trial": 0, "rank": 1, "moment": "mid_round", "round": 3, "step": 1}
LAUNCH_LIMIT_S = 600  # a hang bound: 2 replicas plus a relaunch on shared cores


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server on a loopback port, its store in SQLite; stopped at the end."""
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = (root / "server.log").open("w")
    proc = subprocess.Popen([MLFLOW, "server", "--backend-store-uri", f"sqlite:///{root / 'store.db'}",
                             "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True,  # its own process group: the server's workers go with it
                            # No server-side job runner: it starts seven more Python processes that each import
                            # mlflow (minutes of CPU on shared cores), and tracking never submits a job to it.
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=5) as reply:
                return reply.status == 200
        except OSError:
            return False

    try:
        # a hang bound only: the server's start (migrations of a fresh SQLite store) takes a minute on shared cores
        wait_for(healthy, "the MLflow server's /health", limit_s=300, interval_s=0.5, alive=lambda: proc.poll() is None)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def launch(tmp_path: Path, *flags: str, env: dict[str, str] | None = None, replicas: int = REPLICAS,
           kills: list[dict[str, object]] | None = None, trainer: str = "support.tracking_trainer:train",
           ) -> tuple[subprocess.CompletedProcess[str], dict]:
    """``diloco launch`` of a local run of the tracking trainer (or ``trainer``), waited for; its JSON summary."""
    done = tmp_path / "done"
    done.mkdir(exist_ok=True)
    result = subprocess.run(
        [DILOCO, "launch", "--replicas", str(replicas), "--backend", "local",
         "--trainer", trainer, "--steps", str(STEPS), "--sync-every", str(SYNC_EVERY),
         "--max-restarts", "1", "--set", "store.poll_interval_s=0.1", "--set", "store.timeout_s=120",
         "-k", f"kills={json.dumps(kills or [])}", "-k", f"done_dir={done}", "-o", "json", *flags],
        capture_output=True, text=True, cwd=TESTS_DIR, timeout=LAUNCH_LIMIT_S,
        env={**os.environ, "DILOCO_HOME": str(tmp_path / "home"), "DILOCO_RESTART_BACKOFF_S": "0",
             **(env or {})})
    summary = json.loads(result.stdout) if result.stdout.strip().startswith("{") else {}
    return result, summary


def record_of(tmp_path: Path, run_id: str) -> dict:
    return json.loads((tmp_path / "home" / "runs" / f"{run_id}.json").read_text())


def assert_killed_and_back(result: subprocess.CompletedProcess[str], summary: dict) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary["state"] == "succeeded", summary
    assert [r["restarts"] for r in summary["ranks"]] == [0, 1], summary["ranks"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_run_with_a_kill_holds_each_replicas_steps_once_in_mlflow_and_in_wandb(tmp_path: Path,
                                                                                   mlflow_server: str) -> None:
    wandb_dir = tmp_path / "wandb-files"
    wandb_dir.mkdir()
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    result, summary = launch(tmp_path, "--mlflow", mlflow_server, "--wandb", "diloco-tests", env=env, kills=[KILL])
    assert_killed_and_back(result, summary)
    check_mlflow(tmp_path, summary, mlflow_server)
    check_wandb(tmp_path, summary, wandb_dir)


def check_mlflow(tmp_path: Path, summary: dict, mlflow_server: str) -> None:
    """One MLflow run holds the run's settings, each replica's series once per step, and the collected model."""
    from mlflow.tracking import MlflowClient

    run_id = summary["run_id"]
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("diloco")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`diloco.run_id` = '{run_id}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    mlflow_run = runs[0]
    # the id the replicas logged into is the one the run record keeps
    assert record_of(tmp_path, run_id)["config"]["metrics"]["mlflow_run_id"] == mlflow_run.info.run_id
    params = mlflow_run.data.params
    assert params["replicas"] == str(REPLICAS) and params["train.steps"] == str(STEPS), params
    assert params["train.trainer"] == "support.tracking_trainer:train"
    assert not any(key.startswith("env") for key in params), params
    for rank in range(REPLICAS):
        for metric in ("round", "train_loss", "tokens_per_s", "sync_s", "bytes_written", "bytes_read",
                       "extra/compression_error"):
            steps = [m.step for m in client.get_metric_history(mlflow_run.info.run_id, f"r{rank}/{metric}")]
            if metric in ("round", "sync_s", "bytes_written", "bytes_read"):
                assert sorted(steps) == EXPECTED_STEPS, (rank, metric, steps)
            elif metric == "tokens_per_s":  # a row has a rate once MIN_RATE_WINDOW_S passed since the last one
                assert len(set(steps)) == len(steps) and set(steps) <= set(EXPECTED_STEPS[1:]), steps
            else:  # measured from the first inner step on: not in the init row
                assert sorted(steps) == EXPECTED_STEPS[1:], (rank, metric, steps)
        rounds = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, f"r{rank}/round")}
        assert rounds == {step: step // SYNC_EVERY for step in EXPECTED_STEPS}, (rank, rounds)
        written = client.get_metric_history(mlflow_run.info.run_id, f"r{rank}/bytes_written")
        assert max(m.value for m in written) > 0
        participants = client.get_metric_history(mlflow_run.info.run_id, f"r{rank}/participants")
        assert {m.step: m.value for m in participants} == {s: REPLICAS for s in EXPECTED_STEPS[1:]}, participants
        latency = client.get_metric_history(mlflow_run.info.run_id, f"r{rank}/round_sync_s")
        assert latency and all(m.value >= 0 for m in latency), (rank, latency)
    # `diloco collect` logs the collected model into the same MLflow run
    collected = subprocess.run([DILOCO, "collect", run_id, "--output", str(tmp_path / "model.safetensors")],
                               capture_output=True, text=True, cwd=TESTS_DIR, timeout=LAUNCH_LIMIT_S,
                               env={**os.environ, "DILOCO_HOME": str(tmp_path / "home")})
    assert collected.returncode == 0, collected.stderr[-3000:]
    artifacts = [a.path for a in client.list_artifacts(mlflow_run.info.run_id, "model")]
    assert artifacts == ["model/model.safetensors"], artifacts
    assert client.get_run(mlflow_run.info.run_id).info.status == "FINISHED"


def check_wandb(tmp_path: Path, summary: dict, wandb_dir: Path) -> None:
    """One W&B run (offline files) holds the run's settings and each replica's rows, no step twice."""
    from support.wandb_files import read_run

    wandb_id = record_of(tmp_path, summary["run_id"])["config"]["metrics"]["wandb_run_id"]
    assert wandb_id
    files = sorted(wandb_dir.glob("**/offline-run-*/*.wandb"))
    # the launcher's (settings) and one per replica attempt: the replicas + 1 relaunch, all of one W&B run. The
    # killed attempt's file may hold no record at all, or not exist: its sink connects beside training, and the
    # kill can come before wandb-core has written anything or even made the attempt's folder
    assert 1 + REPLICAS <= len(files) <= 1 + REPLICAS + 1, files
    runs = [run for run in map(read_run, files) if run["run_id"] is not None]
    assert len(runs) >= 1 + REPLICAS and {run["run_id"] for run in runs} == {wandb_id}, runs
    config = {key: value for run in runs for key, value in run["config"].items()}
    assert config["replicas"] == str(REPLICAS) and config["train.steps"] == str(STEPS), config
    for rank in range(REPLICAS):
        rows = [row for run in runs for row in run["history"] if f"r{rank}/step" in row]
        steps = [row[f"r{rank}/step"] for row in rows]
        if rank != KILL["rank"]:
            assert sorted(steps) == EXPECTED_STEPS, (rank, steps)
        else:  # never a step twice; every step its relaunched attempt trained (after its rejoin at step 6). Up
            # to there, wandb-core may have kept the killed attempt's rows in a write buffer that died with it
            assert len(set(steps)) == len(steps) and set(steps) <= set(EXPECTED_STEPS), steps
            assert {s for s in EXPECTED_STEPS if s > 2 * SYNC_EVERY} <= set(steps), steps
        assert all(f"r{rank}/round" in row and f"r{rank}/bytes_read" in row for row in rows), rows
        assert all(f"r{rank}/train_loss" in row for row in rows if row[f"r{rank}/step"] > 0), rows


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_unreachable_tracker_is_one_warning_and_the_run_succeeds(tmp_path: Path) -> None:
    """The launcher creates the run's MLflow run: where it cannot, it says so once and launches without it (a
    torch-free replica: the launcher, not training, is under test)."""
    closed = free_port()  # nothing listens there once the probe socket is closed
    result, summary = launch(tmp_path, "--mlflow", f"http://127.0.0.1:{closed}", replicas=1,
                             trainer="support.cli_trainers:agreed")
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary["state"] == "succeeded", summary
    lines = [line for line in result.stderr.splitlines() if "MLflow" in line]
    assert len(lines) == 1, result.stderr
    assert f"127.0.0.1:{closed}" in lines[0] and "goes on without it" in lines[0]
    assert record_of(tmp_path, summary["run_id"])["config"]["metrics"]["mlflow_run_id"] is None
