"""A run split over backends when this shell cannot reach one part's backend (no kubeconfig here, the cluster's
credentials expired): a run that has ended is ended, whatever the backend answers now, so ``collect`` and
``watch`` give its summary and exit code at once; a run that is still live is said to be out of reach once, with
the fix, and the wait on it is bounded (``diloco.launcher.waiter.unreachable_patience``).

The run is real and cheap: a mixed run of two local parts through the CLI. Its record is then what a run whose
second part ran on a cluster looks like from a shell without that cluster's kubeconfig: the part is an ``eks`` part,
its handle a Kubernetes Job's, and ``KUBECONFIG`` names no file (``HOME`` has no ``~/.kube`` either).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.commands import run_cli

#: One worker runs this module: its module-scoped run (or server) is then started once, not once per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_mixed_unreachable")]

#: Only bounds a hang: each command below answers from the record and the store.
PATIENCE_S = 120.0


def _as_if_on_a_cluster(home: Path, run_id: str) -> dict[str, str]:
    """Make part 1 of the recorded run an EKS part this shell cannot reach; the environment to run the CLI in."""
    path = home / "runs" / f"{run_id}.json"
    record = json.loads(path.read_text())
    record["config"]["backend"]["parts"][1] = {"kind": "eks", "image": "python:3.11-slim", "namespace": "diloco"}
    part: dict[str, Any] = record["handle"]["parts"][1]
    part["backend"] = "eks"
    part["handle"] = {"backend": "eks", "run_id": run_id, "replicas": 2, "ranks": [1], "namespace": "diloco",
                      "job_name": f"{run_id}-r1"}
    path.write_text(json.dumps(record))
    return {"KUBECONFIG": str(home / "no-kubeconfig"), "HOME": str(home)}


@pytest.fixture(scope="module")
def ended_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, str]]:
    home = tmp_path_factory.mktemp("home")
    launch = run_cli("launch", "--backend", "mixed", "--part", "local:1", "--part", "local", "--replicas", "2",
                     "--trainer", "support.cli_trainers:agreed", "--steps", "4", "--sync-every", "2",
                     "-o", "json", home=home)  # torch-free: what an ended run's commands read is under test
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    return home, run_id, _as_if_on_a_cluster(home, run_id)


def test_status_of_the_ended_run_says_succeeded_and_names_the_part_out_of_reach(
        ended_run: tuple[Path, str, dict[str, str]]) -> None:
    home, run_id, env = ended_run
    status = run_cli("status", run_id, "-o", "json", home=home, env=env, timeout=PATIENCE_S)
    assert status.returncode == 0, status.stderr[-3000:]
    assert json.loads(status.stdout)["state"] == "succeeded"


def test_collect_of_an_ended_run_returns_its_model_though_a_part_is_out_of_reach(
        ended_run: tuple[Path, str, dict[str, str]], tmp_path: Path) -> None:
    home, run_id, env = ended_run
    result = run_cli("collect", run_id, "--output", str(tmp_path / "model.safetensors"), home=home, env=env,
                     timeout=PATIENCE_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "model.safetensors").is_file()


def test_watch_of_an_ended_run_gives_its_summary_at_once_though_a_part_is_out_of_reach(
        ended_run: tuple[Path, str, dict[str, str]]) -> None:
    home, run_id, env = ended_run
    result = run_cli("watch", run_id, home=home, env=env, timeout=PATIENCE_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"run {run_id} has already ended (succeeded)" in result.stderr
    assert "keeps running" not in result.stderr


def test_a_live_run_with_a_part_out_of_reach_is_said_once_with_the_fix_and_the_wait_is_bounded(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    launch = run_cli("launch", "--backend", "mixed", "--part", "local:1", "--part", "local", "--replicas", "2",
                     "--trainer", "support.cli_trainers:slow", "--steps", "4000", "--sync-every", "100",
                     "--detach", "-o", "json", home=home)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    record = (home / "runs" / f"{run_id}.json").read_text()
    try:
        env = {**_as_if_on_a_cluster(home, run_id), "DILOCO_UNREACHABLE_PATIENCE_S": "1"}
        for command in ("collect", "watch"):
            result = run_cli(command, run_id, home=home, env=env, timeout=PATIENCE_S)
            assert result.returncode == 1, result.stderr[-3000:]
            said = [line for line in result.stderr.splitlines() if "cannot be seen from here" in line]
            assert len(said) == 2, result.stderr  # the warning once, then the error
            assert said[0].startswith("warning: replica(s) 1 (eks) cannot be seen from here: ")
            assert "KUBECONFIG" in said[0] and "waiting up to 1s" in said[0]
            assert said[1].startswith(f"diloco: error: run {run_id}: replica(s) 1 (eks)")
            assert f"once that backend answers: diloco watch {run_id}" in said[1]
    finally:
        (home / "runs" / f"{run_id}.json").write_text(record)
        assert run_cli("cancel", run_id, home=home).returncode == 0
