"""Elastic runs on the local backend, through the real launcher and real replica processes: a run of 2 replicas
scaled to 4 at round 3 and back to 3 at round 6 (``Run.scale``) ends with every remaining replica holding identical
weights, every replica exiting 0; the committed rounds' member sets, read from the round manifests, are 2, 4 and 3.
Replica 1 is SIGKILLed during the change (the target names 4 members, the round whose manifest applies it has not
committed): it is relaunched by the waiting launcher while the new replicas start, and rejoins. The data dealt by each round's membership covers the epoch exactly: counting the blocks every
replica trained on, none twice, none skipped. Scaling the ended run is one line, exit 2, through the CLI.

The scenario runs once (a module fixture) and the tests assert on it. Gates in the trainer
(``support.elastic_trainer``) hold every replica at a known step while the test scales, so the scale lands at a
known round boundary whatever the machine's load."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.cli.views import membership_line
from diloco.errors import ConfigError
from diloco.store.layout import ROUND_MANIFEST_KEY
from diloco.store.objects import ObjectStore

#: One worker runs this module: its module-scoped scenario (a real run) is then started once, not once per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_elastic_scale")]

ROUNDS, SYNC_EVERY = 9, 2
GROW_GATE, SHRINK_GATE = 5, 11  # the first step of rounds 3 and 6: held there while the test scales
PER_STEP = 2  # blocks per replica per step
EPOCH = (2 * 3 + 4 * 3 + 3 * 3) * SYNC_EVERY * PER_STEP  # exactly the blocks the run trains on: one epoch


@dataclass
class Scenario:
    home: Path
    gate_dir: Path
    run_id: str
    report: Any
    store: ObjectStore
    grown: Any
    shrunk: Any
    relaunched: list[tuple[int, int, str]]
    refused: list[str]


def _wait_for(paths: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never reached: {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    import os

    from diloco.launcher import api

    root = tmp_path_factory.mktemp("elastic")
    home, gate_dir = root / "home", root / "gates"
    gate_dir.mkdir()
    saved = {k: os.environ.get(k) for k in ("DILOCO_HOME", "DILOCO_RESTART_BACKOFF_S")}
    os.environ.update(DILOCO_HOME=str(home), DILOCO_RESTART_BACKOFF_S="0")
    cwd = os.getcwd()
    os.chdir(Path(__file__).resolve().parents[1])  # tests/: the local replicas import support.elastic_trainer from here
    # Without min_replicas the round deadline only bounds a hang (no round commits without all its members), so
    # it is generous rather than measured.
    deadline_s = 120.0
    try:
        run = api.launch(backend={"kind": "local", "oversubscribe": True}, replicas=2, max_restarts=2,
                         train={"trainer": "support.elastic_trainer:train", "steps": ROUNDS * SYNC_EVERY,
                                "sync_every": SYNC_EVERY,
                                "trainer_kwargs": {"gate_dir": str(gate_dir), "gates": f"{GROW_GATE},{SHRINK_GATE}",
                                                   "kill_rank": 1, "kill_at_step": GROW_GATE,
                                                   "per_step": PER_STEP, "epoch_blocks": EPOCH}},
                         store={"max_replicas": 4, "poll_interval_s": 0.05, "timeout_s": deadline_s})
        relaunched: list[tuple[int, int, str]] = []
        outcome: dict[str, Any] = {}

        def wait() -> None:
            try:
                outcome["report"] = run.wait(max_restarts=2, on_relaunch=lambda *a: relaunched.append(a))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
                outcome["error"] = exc

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        patience = 2 * deadline_s
        _wait_for([gate_dir / f"step{GROW_GATE}.rank{r}.waiting" for r in (0, 1)], patience)
        # Scaled through another handle on the run, as `diloco scale` from another terminal is: the waiting one
        # follows the grown run through the registry (it must see, judge and be able to relaunch the new replicas).
        scaler = api.get_run(run.run_id)
        grown = scaler.scale(4)  # held before round 3: its manifest names 4 members for round 4
        (gate_dir / f"step{GROW_GATE}.open").touch()
        _wait_for([gate_dir / f"step{SHRINK_GATE}.rank{r}.waiting" for r in range(4)], patience)
        refused = []
        for request in (5, "-4", "+0"):  # above --max-replicas, below 1, no change: refused, nothing written
            with pytest.raises(ConfigError) as info:
                scaler.scale(request)
            refused.append(str(info.value))
        shrunk = scaler.scale("-1")  # held before round 6: rank 3's last round is 6
        (gate_dir / f"step{SHRINK_GATE}.open").touch()
        waiter.join(patience)
        assert not waiter.is_alive(), "the run did not end"
        if "error" in outcome:
            raise outcome["error"]
        report = outcome["report"]
        run.check_weights(report)
        yield Scenario(home=home, gate_dir=gate_dir, run_id=run.run_id, report=report,
                       store=ObjectStore(report.rendezvous_uri), grown=grown, shrunk=shrunk, relaunched=relaunched,
                       refused=refused)
    finally:
        os.chdir(cwd)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_scaled_2_to_4_to_3_every_replica_ends_0_with_identical_weights(scenario: Scenario) -> None:
    report = scenario.report
    assert report.state.value == "succeeded", report
    assert [(r.rank, r.state.value, r.exit_code) for r in report.ranks] == [(r, "succeeded", 0) for r in range(4)]
    assert report.weights_identical is True, report.weights_detail
    assert "0, 1, 2" in (report.weights_detail or "") or "3 replica" in (report.weights_detail or ""), \
        report.weights_detail
    assert scenario.grown.added == [2, 3] and scenario.grown.after == [0, 1, 2, 3]
    assert scenario.shrunk.leaving == [3] and scenario.shrunk.after == [0, 1, 2]
    # The drained rank holds no final weights: it left after round 6, exit 0, not relaunched for it.
    assert not scenario.store.exists("final/rank_0003.safetensors")
    assert all(scenario.store.exists(f"final/rank_{r:04d}.safetensors") for r in range(3))


def test_the_committed_rounds_member_sets_are_2_then_4_then_3(scenario: Scenario) -> None:
    members = [json.loads(scenario.store.get(ROUND_MANIFEST_KEY.format(round=k)))["members"] for k in range(ROUNDS)]
    assert members == [[0, 1]] * 3 + [[0, 1, 2, 3]] * 3 + [[0, 1, 2]] * 3, members
    # status shows the joins and leaves by round
    assert [(c.round, c.joined, c.left) for c in scenario.report.membership] == [
        (1, [], []), (4, [2, 3], []), (7, [], [3])], scenario.report.membership
    assert membership_line(scenario.report) == "members: round 1: 2; round 4: 4 (+2, 3); round 7: 3 (-3)"


def test_a_count_outside_the_bounds_is_refused_naming_them(scenario: Scenario) -> None:
    above, below, same = scenario.refused
    assert "--replicas: 5 would make 5 replica(s), outside this run's bounds 1..4" in above
    assert "--replicas: -4 would make 0 replica(s)" in below
    assert "--replicas: +0 changes nothing" in same


def test_a_replica_killed_during_the_scale_change_is_relaunched_and_rejoins(scenario: Scenario) -> None:
    assert [(rank, attempt) for rank, attempt, _ in scenario.relaunched] == [(1, 1)], scenario.relaunched
    assert scenario.report.ranks[1].restarts == 1
    assert (scenario.gate_dir / "killed.rank1").exists()
    # Killed after step 5, past the gate (the scale written, round 3 not yet contributed to): the relaunch trained
    # step 5 again from committed round 2, then went on to the end with the others.
    steps = [int(line.split()[0]) for line in (scenario.gate_dir / "steps.rank1").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, *range(5, 19)], steps
    # The new rank 3 trained rounds 4-6 only: its last round (6) counted, then it drained.
    steps = [int(line.split()[0]) for line in (scenario.gate_dir / "steps.rank3").read_text().splitlines()]
    assert steps == list(range(7, 13)), steps


def test_the_data_dealt_by_membership_covers_the_epoch_once(scenario: Scenario) -> None:
    trained: dict[tuple[int, int], list[int]] = {}  # (rank, step) -> its blocks; a step redone after a kill counts once
    for rank in range(4):
        for line in (scenario.gate_dir / f"steps.rank{rank}").read_text().splitlines():
            step, *blocks = map(int, line.split())
            assert trained.setdefault((rank, step), blocks) == blocks, (rank, step)  # a redone step reads the same
    counted = sorted(b for blocks in trained.values() for b in blocks)
    assert counted == list(range(EPOCH)), "some block was trained on twice or never"
    assert {step for rank, step in trained if rank == 3} == set(range(7, 13))  # rounds 4-6 only


def test_scaling_an_ended_run_is_one_line_exit_2(scenario: Scenario) -> None:
    result = CliRunner().invoke(app, ["scale", scenario.run_id, "--replicas", "+1"],
                                env={"DILOCO_HOME": str(scenario.home), "COLUMNS": "200"})
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "has ended (succeeded)" in lines[0] and "cannot be scaled" in lines[0], lines
    assert not scenario.store.exists("relaunch/rank_0004.json")
