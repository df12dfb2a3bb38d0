"""End to end through the installed ``diloco`` console script, with the real replica entrypoint and trainer.

Steps are kept small so the whole file runs in well under a minute on two cores; the full demo is
``diloco launch --config configs/local.yaml``.
"""

from __future__ import annotations

import json
import signal
import time
from functools import partial
from pathlib import Path

import pytest
from support.commands import run_cli, start_cli
from support.run_processes import processes_of

from diloco.launcher.runs import RunRegistry
from diloco.store.codec import decode_tensors, encode_tensors

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = str(ROOT / "tests")


cli = partial(run_cli, script=True)
start = partial(start_cli, script=True)


def wait_until_running(home: Path, n: int, timeout: float = 60) -> str:
    """The run id of the only run in ``home`` once all ``n`` replicas report training progress."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = RunRegistry(home).ids()
        if ids:
            status = cli("status", ids[0], "-o", "json", home=home, cwd=TESTS_DIR)
            if status.returncode == 0:
                reps = json.loads(status.stdout)["ranks"]
                if len(reps) == n and all(r["state"] == "running" and r["step"] is not None for r in reps):
                    return ids[0]
        time.sleep(0.3)
    raise AssertionError("the run did not start in time")


def test_replicas_train_agree_and_report(tmp_path: Path) -> None:
    """The demo config's replicas (two of them) with the sparse format (``--compression topk``): they agree bit for
    bit, and every round each one wrote and read over 100x fewer bytes than the same round in fp32 would have."""
    home = tmp_path / "home"
    launch = cli("launch", "--config", str(ROOT / "configs" / "local.yaml"), "--replicas", "2", "--backend",
                 "local", "--steps", "40", "--sync-every", "20", "--set", "train.trainer_kwargs.eval_batches=4",
                 "--compression", "topk", "-o", "json", home=home, cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr
    summary = json.loads(launch.stdout)
    run_id = summary["run_id"]
    assert summary["state"] == "succeeded" and summary["weights_identical"] is True
    assert "launched " + run_id in launch.stderr  # narration on stderr, data on stdout
    fp32_object = len(encode_tensors(decode_tensors(
        (home / "runs" / run_id / "store" / "final" / "rank_0000.safetensors").read_bytes())[0], {}))
    for rank in summary["ranks"]:  # counted by each replica's store: 2 rounds, 1 peer read per round
        assert rank["round"] == 2
        assert rank["bytes_written"] * 100 < 2 * fp32_object, rank
        assert rank["bytes_read"] * 100 < 2 * 1 * fp32_object, rank

    collect = cli("collect", "-o", "json", "--output", str(tmp_path / "model.safetensors"), home=home, cwd=tmp_path)
    assert collect.returncode == 0, collect.stderr
    report = json.loads(collect.stdout)
    assert report["run_id"] == run_id and report["state"] == "succeeded"
    assert [r["state"] for r in report["ranks"]] == ["succeeded"] * 2
    assert report["weights_identical"] is True
    for rep in report["ranks"]:
        assert rep["step"] == 40 and rep["round"] == 2 and rep["finished_training"]
        assert rep["eval_loss"] < rep["initial_eval_loss"]
    assert report["final_eval_loss"] < report["initial_eval_loss"]

    # The written model is the agreed weights, bit for bit.
    assert report["model_path"] == str(tmp_path / "model.safetensors")
    model, meta = decode_tensors((tmp_path / "model.safetensors").read_bytes())
    final0, _ = decode_tensors((home / "runs" / run_id / "store" / "final" / "rank_0000.safetensors").read_bytes())
    assert meta["run_id"] == run_id and set(model) == set(final0)
    assert all(model[k].equal(final0[k]) for k in model)

    shown = cli("status", run_id, home=home, cwd=tmp_path).stdout  # a one-line eval-loss trend per replica
    trends = [line.split() for line in shown.splitlines() if line.rstrip().endswith("%)")]
    assert [t[0] for t in trends] == ["r0", "r1"], shown

    logs = cli("logs", run_id, home=home, cwd=tmp_path)
    assert logs.returncode == 0
    lines = logs.stdout.splitlines()
    prefixes = {line.split(" ", 1)[0] for line in lines}
    assert prefixes == {"[r0]", "[r1]"}
    for rank in range(2):
        assert any(line.startswith(f"[r{rank}] ") and "replica" in line and "finished" in line for line in lines)
    assert processes_of(run_id) == []


def test_crashing_replica_fails_launch_and_collect_naming_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    args = ("--replicas", "2", "--trainer", "support.cli_trainers:crash_at_rank", "--steps", "2", "--sync-every", "1")
    launch = cli("launch", *args, home=home, cwd=TESTS_DIR)
    assert launch.returncode == 1, launch.stderr
    assert "replica 1 failed with exit code 1" in launch.stderr
    assert "RuntimeError: injected failure at rank 1" in launch.stderr  # the last lines of its stderr
    assert "stopping replica(s) 0" in launch.stderr  # fail-fast: the other cannot finish without it
    run_id = RunRegistry(home).ids()[-1]
    assert processes_of(run_id) == []

    detached = cli("launch", *args, "--detach", home=home, cwd=TESTS_DIR)
    assert detached.returncode == 0, detached.stderr
    run_id = detached.stdout.strip()
    assert run_id.startswith("diloco-")
    collect = cli("collect", run_id, "-o", "json", home=home, cwd=TESTS_DIR)
    assert collect.returncode == 1
    report = json.loads(collect.stdout)
    assert report["state"] == "failed"
    assert [r["state"] for r in report["ranks"]] == ["cancelled", "failed"]
    assert report["ranks"][1]["exit_code"] == 1
    assert "replica 1 failed with exit code 1" in collect.stderr
    assert processes_of(run_id) == []


def test_a_run_whose_replicas_disagree_is_failed_not_succeeded_in_every_command(tmp_path: Path) -> None:
    """Every replica exits 0, but their final weights differ: the run has no one model. ``launch`` says failed
    (never "succeeded" beside the failed weights check) and exits 1, and so do ``status``, ``runs`` and
    ``collect`` afterwards, naming the difference."""
    home = tmp_path / "home"
    launch = cli("launch", "--replicas", "2", "--trainer", "support.cli_trainers:disagree", "--steps", "2",
                 "--sync-every", "1", home=home, cwd=TESTS_DIR)
    assert launch.returncode == 1, launch.stderr
    run_id = RunRegistry(home).ids()[-1]
    assert f"run {run_id}: failed" in launch.stdout and "succeeded  (" not in launch.stdout, launch.stdout
    difference = "replica 1's final weights differ from replica 0's in 'w' (max abs difference 1)"
    assert f"final weights: DIFFERENT: {difference}" in launch.stdout
    assert f"the replicas' final weights disagree: {difference}" in launch.stderr
    assert "write the model with" not in launch.stderr
    status = json.loads(cli("status", run_id, "-o", "json", home=home, cwd=TESTS_DIR).stdout)
    assert (status["state"], status["weights_identical"], status["weights_detail"]) == ("failed", False, difference)
    assert [r["state"] for r in status["ranks"]] == ["succeeded", "succeeded"]
    runs = cli("runs", "-o", "json", home=home, cwd=TESTS_DIR)
    assert [r["state"] for r in json.loads(runs.stdout)["runs"]] == ["failed"], runs.stdout
    collect = cli("collect", run_id, "-o", "json", home=home, cwd=tmp_path)
    assert collect.returncode == 1 and json.loads(collect.stdout)["state"] == "failed"
    assert not list(tmp_path.glob("*.safetensors"))  # no model written


def test_ctrl_c_stops_waiting_but_not_the_run_and_cancel_stops_everything_and_waiters_exit_4(tmp_path: Path) -> None:
    """One run, two moments: Ctrl-C in ``launch`` stops waiting (exit 130, naming ``diloco cancel``) while the
    replicas go on; then ``diloco cancel`` stops everything, and every command waiting on the run (``collect``, and
    ``watch``: the launcher reattached, which waits as ``launch`` does) exits 4."""
    home = tmp_path / "home"
    launch = start("launch", "--replicas", "2", "--trainer", "support.cli_trainers:slow", "--steps", "4000",
                   "--sync-every", "10", home=home, cwd=TESTS_DIR)
    waiters = []
    try:
        run_id = wait_until_running(home, 2)
        waiters.append(start("collect", run_id, home=home, cwd=TESTS_DIR))
        launch.send_signal(signal.SIGINT)
        _, err = launch.communicate(timeout=60)
        assert launch.returncode == 130
        assert f"diloco cancel {run_id}" in err
        status = json.loads(cli("status", run_id, "-o", "json", home=home, cwd=TESTS_DIR).stdout)
        assert [r["state"] for r in status["ranks"]] == ["running", "running"]

        waiters.append(start("watch", run_id, home=home, cwd=TESTS_DIR))
        cancel = cli("cancel", run_id, home=home, cwd=TESTS_DIR)
        assert cancel.returncode == 0, cancel.stderr
        ended = [waiter.communicate(timeout=60) for waiter in waiters]
        assert [waiter.returncode for waiter in waiters] == [4, 4], ended
        assert processes_of(run_id) == []
        status = json.loads(cli("status", run_id, "-o", "json", home=home, cwd=TESTS_DIR).stdout)
        assert status["state"] == "cancelled"
    finally:
        for proc in [launch, *waiters]:
            proc.kill()


def test_ctrl_c_with_cancel_on_interrupt_cancels(tmp_path: Path) -> None:
    home = tmp_path / "home"
    launch = start("launch", "--replicas", "2", "--trainer", "support.cli_trainers:slow", "--steps", "4000",
                   "--sync-every", "10", "--cancel-on-interrupt", home=home, cwd=TESTS_DIR)
    run_id = wait_until_running(home, 2)
    launch.send_signal(signal.SIGINT)
    _, err = launch.communicate(timeout=60)
    assert launch.returncode == 130
    assert f"run {run_id} cancelled" in err
    assert processes_of(run_id) == []
    status = json.loads(cli("status", run_id, "-o", "json", home=home, cwd=TESTS_DIR).stdout)
    assert status["state"] == "cancelled"
