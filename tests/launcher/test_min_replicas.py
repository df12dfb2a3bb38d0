"""``--min-replicas K`` through the real CLI on the local backend (issue 11, item 4): one of 4 replicas dies for
good after round 1; with K = 3 the run completes on the other 3, every rank agreeing on each round's members (read
from the round manifests), with identical final weights; without the flag the run fails naming the replica, and no
replica process is left behind."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
from support.commands import run_cli
from support.pacing import round_deadline_s
from support.run_processes import processes_of

from diloco.store.layout import ROUND_MANIFEST_KEY
from diloco.store.objects import ObjectStore

TESTS_DIR = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

def run_args() -> list[str]:
    """4 replicas, 4 rounds of 5 steps; rank 3 exits with its own error (code 1: not relaunched) after step 7
    (round 2).

    The round deadline (``store.timeout_s``): past it a round commits without the dead rank 3, so no live rank may
    miss it. On a loaded machine four replicas start seconds apart and a fixed few seconds is missed by a slow
    rank, so it is scaled by the replica start-up measured when the test runs (support/pacing.py), under the load
    the test meets; 4 s is its floor on an idle machine."""
    deadline_s = round_deadline_s(4.0)
    return ["launch", "--replicas", "4", "--backend", "local", "--trainer", "support.paced_trainer:train",
            "--steps", "20", "--sync-every", "5", "-k", "step_s=0.02", "-k", "exit_rank=3", "-k", "exit_at_step=7",
            "--set", "store.poll_interval_s=0.05", "--set", f"store.timeout_s={deadline_s:.1f}", "-o", "json"]


#: A hang's bound: every round may wait out its deadline.
cli = partial(run_cli, restart_backoff_s=0, timeout=240 + 4 * round_deadline_s(4.0))


def test_with_min_replicas_3_of_4_the_run_finishes_on_3_that_agree_on_every_round(tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = cli(*run_args(), "--min-replicas", "3", home=home)
    assert result.returncode == 5, result.stderr[-3000:]  # succeeded, but not every replica: exit 5, not 0
    report = json.loads(result.stdout)
    assert report["state"] == "succeeded" and report["weights_identical"] is True, report
    assert report["left_behind"] == [3]
    assert [r["state"] for r in report["ranks"]] == ["succeeded"] * 3 + ["failed"]
    assert "finished on 3 of 4 replicas (min_replicas)" in result.stderr, result.stderr[-2000:]
    assert "the 3 replicas that finished (0, 1, 2 of 4) hold identical final weights" in report["weights_detail"]

    store = ObjectStore(report["rendezvous_uri"])
    manifests = {k: json.loads(store.get(ROUND_MANIFEST_KEY.format(round=k))) for k in range(4)
                 if store.exists(ROUND_MANIFEST_KEY.format(round=k))}
    # Round 1 had all 4 contributions before any deadline; every round after rank 3 died was committed by 0, 1, 2,
    # and each manifest is the one every rank adopted (created once).
    assert all(m["members"] == [0, 1, 2] for k, m in manifests.items() if k >= 2), manifests
    assert {2, 3} <= set(manifests), sorted(manifests)
    assert not processes_of(report["run_id"])

    # Every command that judges the run says the same: succeeded, replica 3 left behind, exit 5.
    watch = cli("watch", report["run_id"], "-o", "json", home=home)
    assert watch.returncode == 5 and "relaunching" not in watch.stderr, watch.stderr[-2000:]
    assert json.loads(watch.stdout)["left_behind"] == [3]
    followed = cli("status", report["run_id"], "--watch", "-o", "json", home=home)
    assert followed.returncode == 5 and json.loads(followed.stdout)["left_behind"] == [3]
    runs = json.loads(cli("runs", "-o", "json", home=home).stdout)["runs"]
    assert [(r["state"], r["left_behind"]) for r in runs] == [("succeeded", [3])]


def test_without_min_replicas_the_run_fails_naming_the_replica_and_leaves_no_process(tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = cli(*run_args(), home=home)
    assert result.returncode == 1, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["state"] == "failed" and report["left_behind"] == []
    assert "replica 3 failed with exit code 1" in result.stderr, result.stderr[-2000:]
    assert "rank 3: dies for good after step 7" in result.stderr
    assert report["ranks"][3]["round"] == 1  # it died in round 2, after committing round 1
    assert not processes_of(report["run_id"])
