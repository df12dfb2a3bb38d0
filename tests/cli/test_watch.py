"""``diloco watch RUN`` through the real CLI on the local backend: a detached run whose replica is SIGKILLed is
relaunched by ``watch`` (nothing else would: ``launch --detach`` has returned), rejoins, and the run ends with
bitwise-identical weights; ``watch`` prints launch's summary and exits with launch's code, and its webhook hears
of the replica it found failed and relaunched. A ``logs -f`` started
before the kill waits through it and follows the relaunched replica to the run's end."""

from __future__ import annotations

import json
import os
import signal
from functools import partial
from pathlib import Path

import pytest
from support.commands import run_cli, start_cli
from support.polling import wait_for_file as wait_for
from support.webhook import WebhookReceiver

from diloco.executors.local_supervisor import parse_combined_line

TESTS_DIR = Path(__file__).resolve().parents[1]


#: The CLI from tests/ (so ``support.paced_trainer:train`` imports), relaunching without a backoff.
cli = partial(run_cli, restart_backoff_s=0, timeout=180)


def test_watch_relaunches_a_killed_replica_of_a_detached_run_and_ends_with_identical_weights(tmp_path: Path) -> None:
    home = tmp_path / "home"
    launch = cli("launch", "--replicas", "2", "--backend", "local", "--trainer", "support.paced_trainer:train",
                 "--steps", "30", "--sync-every", "5", "-k", "step_s=0.05", "--set", "store.poll_interval_s=0.05",
                 "--set", "store.timeout_s=60", "--detach", "-o", "json", home=home)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    logs = start_cli("logs", run_id, "-f", "-r", "1", home=home)
    wait_for("runs/*/store/committed/round_000001/COMMITTED", home)
    child = json.loads(wait_for("runs/*/logs/rank_1/child.json", home).read_text())
    os.kill(int(child["pid"]), signal.SIGKILL)  # nobody relaunches it until `watch` runs

    with WebhookReceiver() as hook:  # the replica this watch found failed and relaunched is news to its webhook
        watch = cli("watch", run_id, "-o", "json", "--notify", hook.url, home=home)
    assert watch.returncode == 0, watch.stderr[-3000:]
    events = [(b["diloco"]["event"], b["diloco"].get("rank")) for b in hook.bodies]
    assert events == [("replica_failed", 1), ("replica_relaunched", 1), ("run_ended", None)], hook.bodies
    report = json.loads(watch.stdout)
    assert report["state"] == "succeeded" and report["weights_identical"] is True, report
    assert [r["restarts"] for r in report["ranks"]] == [0, 1]
    assert "replica 1 failed" in watch.stderr and "relaunching it (restart 1 of 3)" in watch.stderr, watch.stderr
    victim_log = "".join(p.read_text() for p in home.glob("runs/*/logs/rank_1/combined.log"))
    assert "rank 1 rejoined at step" in victim_log, victim_log[-2000:]

    followed, _ = logs.communicate(timeout=60)  # it ends with the run: the relaunched replica's end is the run's
    assert logs.returncode == 0
    lines = followed.splitlines()
    assert lines and all(line.startswith("[r1] ") for line in lines), lines[:5]
    attempts = [home.glob("runs/*/logs/rank_1.try1/combined.log"), home.glob("runs/*/logs/rank_1/combined.log")]
    written = [f"[r1] {parsed[2]}" for found in attempts for path in found
               for parsed in map(parse_combined_line, path.read_text().splitlines()) if parsed is not None]
    assert any("rank 1 rejoined at step" in line for line in written), written[-10:]
    assert lines == written, "every line of both attempts, in order, each once"

    again = cli("watch", run_id, home=home)  # a run that has ended: its summary, the same exit code
    assert again.returncode == 0, again.stderr[-2000:]
    assert "has already ended (succeeded)" in again.stderr


def test_watch_of_an_unknown_run_is_a_one_line_usage_error(tmp_path: Path) -> None:
    out = cli("watch", "no-such-run", home=tmp_path / "home")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "no run 'no-such-run'" in out.stderr, out.stderr


def test_watch_help_has_examples_and_exit_codes() -> None:
    from typer.testing import CliRunner

    from diloco.cli.main import app

    result = CliRunner().invoke(app, ["watch", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "Examples: diloco watch" in text and "diloco watch 7c98 --max-restarts 5" in text
    assert "Default: the run's own launch --max-restarts" in text
    codes = text.split("Exit codes:", 1)[1]
    for code in ("0", "1", "2", "4", "5", "124", "130"):
        assert f" {code} " in f" {codes}", f"watch --help does not list exit code {code}"
    assert " 3 " not in codes.split("130")[0], "watch never returns launch's refusal code 3"


def test_ctrl_c_stops_watching_and_never_the_run(tmp_path: Path) -> None:
    home = tmp_path / "home"
    launch = cli("launch", "--replicas", "1", "--backend", "local", "--trainer", "support.cli_trainers:slow", "--steps", "4000",
                 "--sync-every", "100", "--detach", "-o", "json", home=home)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    watch = start_cli("watch", run_id, home=home)
    try:
        assert watch.stderr is not None
        first = watch.stderr.readline()  # printed once it has found the run and starts waiting
        assert first.startswith(f"watching {run_id}"), first
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=60)
        assert watch.returncode == 130, err
        assert f"run {run_id} keeps running" in err
        status = cli("status", run_id, "-o", "json", home=home)
        assert json.loads(status.stdout)["ranks"][0]["state"] in ("pending", "running"), status.stdout
    finally:
        watch.kill()
        cli("cancel", run_id, home=home)


def test_the_relaunch_backoff_comes_from_the_environment_and_bad_values_name_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco.errors import ConfigError
    from diloco.launcher.waiter import restart_backoff

    monkeypatch.delenv("DILOCO_RESTART_BACKOFF_S", raising=False)
    assert restart_backoff() == 2.0
    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0.5")
    assert restart_backoff() == 0.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", bad)
        with pytest.raises(ConfigError, match="DILOCO_RESTART_BACKOFF_S"):
            restart_backoff()
