"""Asynchronous DiLoCo survives its master: seeded SIGKILLs of the master of a 3-replica local run, through the
real launcher (relaunch) and the real built-in trainer (``tests/support/async_kill_trainer.py``).

Each trial kills the master once, at a moment drawn from its seed: before its first publication, mid-run after a
random step, or during the publication of a random version (before one of its four writes). Every run must exit
0 with identical final weights on every replica, and the relaunched master must resume at the step its position
record held when it died (not at step 1) and from the committed state that publication had reached. One trial
also kills a worker mid-run: it too resumes at its recorded step.
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


def trial_plan(trial: int) -> list[dict[str, object]]:
    """Trial ``trial``'s kills, from its seed: the master at moment ``MOMENTS[trial]`` (the fourth trial draws its
    moment too); trial 1 also kills a worker mid-run."""
    rng = random.Random(4000 + trial)
    moment = MOMENTS[trial] if trial < len(MOMENTS) else rng.choice(MOMENTS)
    master: dict[str, object] = {"trial": trial, "rank": 0, "moment": moment}
    if moment == "mid_run":
        master["step"] = rng.randrange(3 * SYNC_EVERY, STEPS - SYNC_EVERY)
    elif moment == "publish":
        master.update(version=rng.randrange(3, 12), point=rng.choice(POINTS))
    plan = [master]
    if trial == 1:
        plan.append({"trial": 100 + trial, "rank": rng.choice([1, 2]), "moment": "mid_run",
                     "step": rng.randrange(3 * SYNC_EVERY, STEPS - SYNC_EVERY)})
    return plan


def attempt_logs(home: Path, rank: int) -> list[str]:
    """Every attempt's log of ``rank``, oldest first (a relaunch moves the old one to ``rank_R.tryN``)."""
    run_logs = next(iter(home.glob("runs/*/logs")))
    tries = sorted(run_logs.glob(f"rank_{rank}.try*"), key=lambda p: int(p.suffix[len(".try"):]))
    return [(d / "combined.log").read_text(errors="replace") for d in [*tries, run_logs / f"rank_{rank}"]]


def one(pattern: str, text: str) -> re.Match[str]:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text[-3000:]}"
    return found


@pytest.mark.parametrize("trial", range(4))
def test_a_killed_master_is_relaunched_resumes_where_it_was_and_every_replica_exports_the_same_model(
        trial: int, tmp_path: Path) -> None:
    plan = trial_plan(trial)
    home, done = tmp_path / "home", tmp_path / "done"
    done.mkdir()
    knobs = [f"-k{k}={v}" for k, v in TINY.items()]
    launch = subprocess.run(
        [DILOCO, "launch", "--mode", "async", "--replicas", "3", "--backend", "local",
         "--trainer", "support.async_kill_trainer:train", "--steps", str(STEPS), "--sync-every", str(SYNC_EVERY),
         *knobs, "-k", f"kills={json.dumps(plan)}", "-k", f"done_dir={done}", "--max-restarts", "2",
         "--set", "store.poll_interval_s=0.1", "--set", f"store.timeout_s={round_deadline_s(60):.0f}",
         "-o", "json"],
        capture_output=True, text=True, cwd=TESTS_DIR, timeout=LAUNCH_GUARD_S,
        env={**os.environ, "DILOCO_HOME": str(home), "DILOCO_RESTART_BACKOFF_S": "0", "TMPDIR": str(tmp_path)})
    print("async kill trial:", json.dumps(plan))
    assert launch.returncode == 0, (plan, launch.stderr[-3000:])
    summary = json.loads(launch.stdout)
    assert summary["state"] == "succeeded" and summary["weights_identical"] is True, summary["weights_detail"]
    victims = {int(str(kill["rank"])) for kill in plan}
    assert [r["restarts"] for r in summary["ranks"]] == [int(r in victims) for r in range(3)], plan

    for kill in plan:
        rank = int(str(kill["rank"]))
        killed, relaunched = attempt_logs(home, rank)
        recorded = int(recorded_kill(str(done), int(str(kill["trial"])))["position"])
        if kill["moment"] == "start":  # nothing was published: the relaunch bootstraps, from step 1
            assert recorded == 0
            one(r"startup selection bootstrap \(committed None, remote None\)", relaunched)
            assert "rejoins the run" not in relaunched
            continue
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
