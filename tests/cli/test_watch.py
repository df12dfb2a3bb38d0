"""``diloco watch RUN`` through the real CLI: an unknown run is a one-line usage error, the help shows examples
and exit codes, Ctrl-C stops the watching and never the run, and the relaunch backoff comes from the environment.
What ``watch`` does with a real run (relaunching a killed replica of a run nobody else
watches, its webhook, a ``logs -f`` beside it, a run that has ended, a run that allows no restart) is asserted on
the runs of tests/launcher/test_run_lifecycle.py."""

from __future__ import annotations

import json
import signal
from functools import partial
from pathlib import Path

import pytest
from support.commands import run_cli, start_cli

#: The CLI from tests/ (so ``support.cli_trainers`` imports), relaunching without a backoff.
cli = partial(run_cli, restart_backoff_s=0, timeout=180)


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
