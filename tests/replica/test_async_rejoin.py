"""Asynchronous DiLoCo survives its master: one 2-replica local run, through the real launcher (relaunch) and the
real built-in trainer (``tests/support/async_kill_trainer.py``), whose master is SIGKILLed at each named moment in
turn (seeded): before its first publication, during the publication of a random version (before one of its four
writes), and mid-run after a random step; its worker is SIGKILLed once mid-run too.

The run must exit 0 with identical final weights on every replica, and after each kill the relaunched replica must
resume at the step its position record held when it died (not at step 1) and from the committed state that
publication had reached. The kills share one run's start-up: two replica processes plus one per kill.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
from pathlib import Path

import pytest
from support.async_kill_trainer import recorded_kill
from support.commands import DILOCO_SCRIPT as DILOCO
from support.pacing import round_deadline_s

pytestmark = pytest.mark.slow

TESTS_DIR = Path(__file__).resolve().parents[1]
SYNC_EVERY, STEPS = 10, 100
TINY = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "batch_size": 8, "eval_batches": 1,
        "max_corpus_bytes": 50_000, "threads": 1}
MOMENTS = ("start", "mid_run", "publish")
POINTS = ("state", "marker", "data", "latest")
#: Only against a hang: every wait inside the run is bounded by store.timeout_s, and the launcher gives up on a
#: replica after --max-restarts.
LAUNCH_GUARD_S = 900


def run_plan(seed: int = 4000) -> list[dict[str, object]]:
    """The run's kills, from its seed: the master (rank 0) before its first publication, then while publishing an
    early version (3-5: long before the mid-run kill, so that version is still to come when the second attempt
    runs), then mid-run late in the run; the worker (rank 1) mid-run at a random step."""
    rng = random.Random(seed)
    return [{"trial": 0, "rank": 0, "moment": "start"},
            {"trial": 1, "rank": 0, "moment": "publish", "version": rng.randrange(3, 6), "point": rng.choice(POINTS)},
            {"trial": 2, "rank": 0, "moment": "mid_run", "step": rng.randrange(6 * SYNC_EVERY, STEPS - SYNC_EVERY)},
            {"trial": 100, "rank": 1, "moment": "mid_run",
             "step": rng.randrange(3 * SYNC_EVERY, STEPS - SYNC_EVERY)}]


def in_the_order_they_happened(done: Path, kills: list[dict[str, object]]) -> list[dict[str, object]]:
    """One rank's kills, oldest first: each kill creates its trial's file in ``done`` just before the SIGKILL, and
    each happens in an attempt of its own."""
    return sorted(kills, key=lambda kill: (done / f"trial_{kill['trial']}").stat().st_mtime_ns)


def attempt_logs(home: Path, rank: int) -> list[str]:
    """Every attempt's log of ``rank``, oldest first (a relaunch moves the old one to ``rank_R.tryN``)."""
    run_logs = next(iter(home.glob("runs/*/logs")))
    tries = sorted(run_logs.glob(f"rank_{rank}.try*"), key=lambda p: int(p.suffix[len(".try"):]))
    return [(d / "combined.log").read_text(errors="replace") for d in [*tries, run_logs / f"rank_{rank}"]]


def one(pattern: str, text: str) -> re.Match[str]:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text[-3000:]}"
    return found


def test_a_master_killed_at_every_moment_resumes_where_it_was_and_every_replica_exports_the_same_model(
        tmp_path: Path) -> None:
    plan = run_plan()
    home, done = tmp_path / "home", tmp_path / "done"
    done.mkdir()
    knobs = [f"-k{k}={v}" for k, v in TINY.items()]
    launch = subprocess.run(
        [DILOCO, "launch", "--mode", "async", "--replicas", "2", "--backend", "local",
         "--trainer", "support.async_kill_trainer:train", "--steps", str(STEPS), "--sync-every", str(SYNC_EVERY),
         *knobs, "-k", f"kills={json.dumps(plan)}", "-k", f"done_dir={done}", "--max-restarts", "3",
         "--set", "store.poll_interval_s=0.1", "--set", f"store.timeout_s={round_deadline_s(60):.0f}",
         "-o", "json"],
        capture_output=True, text=True, cwd=TESTS_DIR, timeout=LAUNCH_GUARD_S,
        env={**os.environ, "DILOCO_HOME": str(home), "DILOCO_RESTART_BACKOFF_S": "0", "TMPDIR": str(tmp_path)})
    print("async kill run:", json.dumps(plan))
    assert launch.returncode == 0, (plan, launch.stderr[-3000:])
    summary = json.loads(launch.stdout)
    assert summary["state"] == "succeeded" and summary["weights_identical"] is True, summary["weights_detail"]
    assert [r["restarts"] for r in summary["ranks"]] == [3, 1], plan
    assert {str(kill["moment"]) for kill in plan if kill["rank"] == 0} == set(MOMENTS)

    for rank in (0, 1):
        logs = attempt_logs(home, rank)
        kills = in_the_order_they_happened(done, [kill for kill in plan if kill["rank"] == rank])
        assert len(logs) == len(kills) + 1, (rank, len(logs), kills)
        for attempt, kill in enumerate(kills):
            relaunched = logs[attempt + 1]
            recorded = int(recorded_kill(str(done), int(str(kill["trial"])))["position"])
            if kill["moment"] == "start":  # nothing was published: the relaunch bootstraps, from step 1
                assert attempt == 0 and recorded == 0, (kill, attempt, recorded)
                one(r"startup selection bootstrap \(committed None, remote None\)", relaunched)
                assert "rejoins the run" not in relaunched
                continue
            if recorded == 0:
                # A publication can come before the master's own first round ends (on a loaded machine the worker's
                # deltas arrive first): its position record still says step 0, so the relaunch starts at step 1.
                assert kill["moment"] == "publish", (kill, recorded)
                assert "rejoins the run" not in relaunched
                resumed = 0
            else:
                resumed = int(one(r"rejoins the run at step (\d+) of", relaunched)[1])
            assert resumed == recorded and resumed % SYNC_EVERY == 0, (kill, recorded, resumed)
            if kill["moment"] == "mid_run":
                assert 0 < resumed <= int(str(kill["step"])), (kill, resumed)  # not step 1
            if kill["moment"] == "publish":
                # Killed before the version's commit completed: the relaunch resumes at the version before it, whose
                # deltas it applies again; killed after: at that version, which it publishes (again) if need be.
                version = int(str(kill["version"]))
                committed = version - 1 if kill["point"] in ("state", "marker") else version
                one(rf"startup selection committed \(committed {committed}, remote \d+\)", relaunched)
