"""``--min-replicas K`` through the real CLI on the local backend: one of 3 replicas dies for good after round 1;
with K = 2 the run completes on the other 2 without waiting out a round deadline for the dead one (the launcher
records it as left behind in the store), every rank agreeing on each round's members (read from the round
manifests), with identical final weights, the dead replica named with its own last line and the last round it
committed, and no replica process left behind.

Without the flag the same death fails the run: that is the run-state rule (``lifecycle.verdict`` over a lost replica
without ``min_replicas``), tested on hand-built statuses in test_lifecycle_rules.py; a real run failed by its
crashing replica, named in launch and collect, is test_cli_e2e.py's."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
from support.commands import run_cli
from support.run_processes import processes_of

from diloco.store.layout import ROUND_MANIFEST_KEY
from diloco.store.objects import ObjectStore

TESTS_DIR = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

#: The round deadline (``store.timeout_s``), far beyond the test's own bound: the survivors must not wait it out for
#: the dead replica, which the waiting launch records as left behind (``left/rank_0002.json``) once it has failed
#: for good, and must not drop a live replica that starts late on a loaded machine.
ROUND_DEADLINE_S = 900
#: A hang's bound, far below the round deadline: a round that waited for the dead replica would exceed it.
LAUNCH_LIMIT_S = 300


def run_args() -> list[str]:
    """3 replicas, 3 rounds of 5 steps; rank 2 exits with its own error (code 1: not relaunched) after step 7
    (round 2)."""
    return ["launch", "--replicas", "3", "--backend", "local", "--trainer", "support.paced_trainer:train",
            "--steps", "15", "--sync-every", "5", "-k", "step_s=0.02", "-k", "exit_rank=2", "-k", "exit_at_step=7",
            "--set", "store.poll_interval_s=0.05", "--set", f"store.timeout_s={ROUND_DEADLINE_S}", "-o", "json"]


cli = partial(run_cli, restart_backoff_s=0, timeout=LAUNCH_LIMIT_S)


def test_with_min_replicas_2_of_3_the_run_finishes_on_2_that_agree_on_every_round(tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = cli(*run_args(), "--min-replicas", "2", home=home)
    assert result.returncode == 5, result.stderr[-3000:]  # succeeded, but not every replica: exit 5, not 0
    report = json.loads(result.stdout)
    assert report["state"] == "succeeded" and report["weights_identical"] is True, report
    assert report["left_behind"] == [2]
    assert [r["state"] for r in report["ranks"]] == ["succeeded"] * 2 + ["failed"]
    assert "finished on 2 of 3 replicas (min_replicas)" in result.stderr, result.stderr[-2000:]
    assert "the 2 replicas that finished (0, 1 of 3) hold identical final weights" in report["weights_detail"]
    # The replica left behind is named with its own last line and the last round it committed: it died in round
    # 2, after committing round 1.
    assert "rank 2: dies for good after step 7" in result.stderr, result.stderr[-2000:]
    assert report["ranks"][2]["exit_code"] == 1 and report["ranks"][2]["round"] == 1, report["ranks"][2]

    store = ObjectStore(report["rendezvous_uri"])
    manifests = {k: json.loads(store.get(ROUND_MANIFEST_KEY.format(round=k))) for k in range(3)
                 if store.exists(ROUND_MANIFEST_KEY.format(round=k))}
    # Round 1 (index 0) had all 3 contributions before any deadline; every round rank 2 did not live to contribute
    # to (rounds 2 and 3: indices 1, 2) was committed by 0, 1, and each manifest is the one every rank adopted
    # (created once).
    assert all(m["members"] == [0, 1] for k, m in manifests.items() if k >= 1), manifests
    assert {1, 2} <= set(manifests), sorted(manifests)
    assert json.loads(store.get("left/rank_0002.json"))["rank"] == 2  # what let rounds 2 and 3 commit at once
    assert not processes_of(report["run_id"])

    # Every command that judges the run says the same: succeeded, replica 2 left behind, exit 5.
    watch = cli("watch", report["run_id"], "-o", "json", home=home)
    assert watch.returncode == 5 and "relaunching" not in watch.stderr, watch.stderr[-2000:]
    assert json.loads(watch.stdout)["left_behind"] == [2]
    followed = cli("status", report["run_id"], "--watch", "-o", "json", home=home)
    assert followed.returncode == 5 and json.loads(followed.stdout)["left_behind"] == [2]
    runs = json.loads(cli("runs", "-o", "json", home=home).stdout)["runs"]
    assert [(r["state"], r["left_behind"]) for r in runs] == [("succeeded", [2])]
