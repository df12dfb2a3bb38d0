"""A replica that dies comes back and rejoins at its peers' round (ranks as threads over real store rounds).

A "death" is an exception out of the training loop (the replica stops; its store objects stay as they were);
the "restart" is a fresh model, optimizer, all-reduce and manager for the same rank, as a relaunched process has.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support.commands import DILOCO_SCRIPT as DILOCO
from support.ranks import run_ranks  # tests/ is on sys.path
from torch import nn

from diloco.collectives.allreduce import ObjectStoreAllReduce, contribution_key
from diloco.replica.checkpoint import RoundCheckpoints
from diloco.replica.manager import ObjectStoreManager
from diloco.replica.outer import make_diloco_outer_loop

WORLD, SYNC_EVERY, ROUNDS = 3, 4, 5
TOTAL = SYNC_EVERY * ROUNDS
_SEED_LOCK = threading.Lock()


class Died(Exception):
    """The replica's process is gone (raised from its training loop)."""


def manager_for(uri: str, rank: int, run_id: str = "run-t", compression: str = "none") -> ObjectStoreManager:
    allreduce = ObjectStoreAllReduce(uri, rank, WORLD, timeout_s=20, poll_interval_s=0.01, run_id=run_id,
                                     compression=compression)
    rounds = RoundCheckpoints(allreduce.store, run_id=run_id, world_size=WORLD)
    return ObjectStoreManager(allreduce, rounds=rounds)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of inner step ``step``: a pure function of both, so a resumed trainer sees the same data."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def train(uri: str, rank: int, *, die_after_step: int | None = None, fragments: int = 1, delay: int = 0,
          hook: bool = True, events: list[str] | None = None, adamw: bool = False,
          checkpoint_dir: str | None = None, loops: list[object] | None = None,
          at_rejoin: dict[str, torch.Tensor] | None = None, compression: str = "none") -> dict[str, torch.Tensor]:
    """One replica's whole life: the final global weights, or ``Died`` after inner step ``die_after_step``.
    ``adamw``: an inner optimizer with state (SGD has none); ``loops`` collects the outer loop objects;
    ``at_rejoin`` gets the inner optimizer's ``exp_avg`` tensors as they are when the rejoin hook runs."""
    with _SEED_LOCK:  # torch's global RNG is shared by the rank threads: identical initial weights need a lock
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    parts = [model[0], model[2]] if fragments == 2 else [model]
    opt = torch.optim.AdamW(model.parameters(), lr=0.01) if adamw else torch.optim.SGD(model.parameters(), lr=0.1)
    manager = manager_for(uri, rank, compression=compression)
    start = [0]

    def on_rejoin(inner_step: int) -> None:
        start[0] = inner_step
        if at_rejoin is not None:
            at_rejoin.update({f"{p}.exp_avg": s["exp_avg"].clone() for p, s in opt.state_dict()["state"].items()})
        if events is not None:
            events.append(f"rank {rank} rejoined at step {inner_step}")

    loop = make_diloco_outer_loop(manager=manager, model_fragments=parts, inner_optimizer=opt, outer_lr=0.7,
                                  outer_momentum=0.9, sync_every=SYNC_EVERY, fragment_sync_delay=delay, model=model,
                                  on_rejoin=on_rejoin if hook else None, checkpoint_dir=checkpoint_dir)
    if loops is not None:
        loops.append(loop)
    try:
        with loop:
            # With the hook the trainer learns its position from it; without, it reads the loop's inner_step.
            first = start[0] if hook else loop.inner_step
            for step in range(first + 1, TOTAL + 1):
                x, y = batch(rank, step)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if step == die_after_step:
                    pending = manager._allreduce._pending
                    if pending is not None and not pending.is_completed():
                        pending.wait_for_upload()  # it dies *after* its upload of the round in flight landed
                    raise Died(f"rank {rank} after step {step}")
            if fragments > 1:
                loop.restore_global_parameters()
        return {k: v.clone() for k, v in loop.global_state_dict().items()}
    finally:
        manager._allreduce.close(wait=False)


def run_with_a_death(uri: str, victim: int, die_after_step: int,
                     restart: Callable[[], dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """All ranks train; ``victim`` dies after ``die_after_step`` and ``restart()`` replaces it."""

    def life(rank: int) -> dict[str, torch.Tensor]:
        if rank != victim:
            return train(uri, rank)
        with pytest.raises(Died):
            train(uri, rank, die_after_step=die_after_step)
        return restart()

    return run_ranks(WORLD, life, timeout=60)


def assert_identical(finals: list[dict[str, torch.Tensor]]) -> None:
    for other in finals[1:]:
        assert set(other) == set(finals[0])
        for name, t in finals[0].items():
            assert torch.equal(other[name], t), name


def new_uri() -> str:
    return f"memory://rejoin-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("die_after_step", [2, 5, 9, 12])  # before round 1; mid-rounds 2 and 3; right at round 3
def test_a_restarted_rank_rejoins_and_every_rank_ends_with_the_same_weights(die_after_step: int) -> None:
    uri = new_uri()
    events: list[str] = []
    finals = run_with_a_death(uri, 1, die_after_step, lambda: train(uri, 1, events=events))
    assert_identical(finals)
    committed_before = (die_after_step // SYNC_EVERY)
    assert events == ([f"rank 1 rejoined at step {committed_before * SYNC_EVERY}"] if committed_before else [])
    assert RoundCheckpoints(ObjectStoreAllReduce(uri, 0, WORLD).store, run_id="run-t",
                            world_size=WORLD).latest_round() == ROUNDS


def test_a_rank_that_died_after_uploading_waits_for_that_round_instead_of_contributing_twice() -> None:
    """With fragment_sync_delay 1 the upload of round 2 starts after step 7; dying after it, the restart must not
    recompute round 2's contribution (its peers may have read the first one): it rejoins after round 2."""
    uri = new_uri()
    events: list[str] = []
    uploaded = threading.Event()

    def restart() -> dict[str, torch.Tensor]:
        store = ObjectStoreAllReduce(uri, 1, WORLD).store
        assert store.exists(contribution_key(3, 1))  # round 4's contribution of the dead rank is there
        uploaded.set()
        return train(uri, 1, fragments=2, delay=1, events=events)

    def life(rank: int) -> dict[str, torch.Tensor]:
        if rank != 1:
            return train(uri, rank, fragments=2, delay=1)
        with pytest.raises(Died):
            train(uri, rank, die_after_step=7, fragments=2, delay=1)
        return restart()

    # sync_every 4 with 2 fragments: a round every 2 steps; round 4 (index 3) uploads after step 7
    finals = run_ranks(WORLD, life, timeout=60)
    assert uploaded.is_set()
    assert_identical(finals)
    assert events == ["rank 1 rejoined at step 8"]  # after round 4 committed, not at round 3's weights


def test_a_trainer_without_the_hook_rejoins_with_fresh_inner_state_and_the_log_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    uri = new_uri()
    with caplog.at_level("WARNING", logger="diloco.replica.outer"):
        finals = run_with_a_death(uri, 2, 6, lambda: train(uri, 2, hook=False))
    assert_identical(finals)
    assert any("fresh inner state" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- the inner optimizer's state in a checkpoint directory
def test_a_rejoined_rank_restores_its_inner_optimizer_state_and_the_run_ends_as_if_it_had_not_died(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 (AdamW) dies after step 6, past round 1 (step 4): its restart finds round 1's inner state in the
    checkpoint directory (``exp_avg`` as saved), and since it continues the exact same inner trajectory, every rank
    ends with the weights of a run in which nobody died. Without the directory, the fresh AdamW moments give other
    weights: the restored state is what makes the difference."""
    from diloco.replica.checkpoint import InnerOptimizerState

    clean_uri = new_uri()
    clean = run_ranks(WORLD, lambda rank: train(clean_uri, rank, adamw=True), timeout=60)

    uri, ckpt = new_uri(), str(tmp_path / "ckpt")
    saved: dict[str, torch.Tensor] = {}
    restored: dict[str, torch.Tensor] = {}
    loops: list[object] = []

    def restart() -> dict[str, torch.Tensor]:
        found = InnerOptimizerState(ckpt, run_id="run-t", rank=1).load(1)
        assert found.state is not None, found.reason
        saved.update({f"{p}.exp_avg": s["exp_avg"] for p, s in found.state["state"].items()})  # type: ignore[union-attr]
        return train(uri, 1, adamw=True, checkpoint_dir=ckpt, loops=loops, at_rejoin=restored)

    def life(rank: int) -> dict[str, torch.Tensor]:
        if rank != 1:
            return train(uri, rank, adamw=True, checkpoint_dir=ckpt)
        with pytest.raises(Died):
            train(uri, rank, die_after_step=6, adamw=True, checkpoint_dir=ckpt)
        return restart()

    with caplog.at_level("INFO", logger="diloco.replica.outer"):
        finals = run_ranks(WORLD, life, timeout=60)
    assert_identical(finals)
    assert_identical([finals[0], clean[0]])  # as if rank 1 had never died
    assert loops[0].rejoined_round == 1 and loops[0].inner_state_restored  # type: ignore[attr-defined]
    assert any("restored the inner optimizer state of round 1" in r.getMessage() for r in caplog.records)
    assert len(saved) == 4 and all(t.abs().sum() > 0 for t in saved.values())
    assert set(restored) == set(saved) and all(torch.equal(restored[k], saved[k]) for k in saved)

    lost_uri = new_uri()
    fresh = run_with_a_death(lost_uri, 1, 6, lambda: train(lost_uri, 1, adamw=True))
    assert_identical(fresh)
    assert not all(torch.equal(fresh[0][k], clean[0][k]) for k in clean[0])  # fresh moments: another trajectory


@pytest.mark.parametrize("compression", ["int8", "topk"])
def test_a_rejoined_rank_restores_its_error_feedback_and_the_run_ends_as_if_it_had_not_died(
        compression: str, tmp_path: Path) -> None:
    """With a lossy format each rank owes its peers what earlier rounds did not send (its error-feedback
    residual). Rank 1 dies after step 6 (past round 1); restarted with its checkpoint directory it restores round
    1's residuals with its inner state, and every rank ends with the weights of a run in which nobody died. The
    inner optimizer is plain SGD (no state of its own), so the residuals alone make the difference: a restart
    without them ends elsewhere."""
    clean_uri = new_uri()
    clean = run_ranks(WORLD, lambda rank: train(clean_uri, rank, compression=compression), timeout=60)

    def with_death(checkpoint_dir: str | None) -> list[dict[str, torch.Tensor]]:
        uri = new_uri()

        def life(rank: int) -> dict[str, torch.Tensor]:
            if rank != 1:
                return train(uri, rank, compression=compression, checkpoint_dir=checkpoint_dir)
            with pytest.raises(Died):
                train(uri, rank, die_after_step=6, compression=compression, checkpoint_dir=checkpoint_dir)
            return train(uri, rank, compression=compression, checkpoint_dir=checkpoint_dir)

        return run_ranks(WORLD, life, timeout=60)

    restored = with_death(str(tmp_path / "ckpt"))
    assert_identical(restored)
    assert_identical([restored[0], clean[0]])  # as if rank 1 had never died
    forgotten = with_death(None)
    assert_identical(forgotten)
    assert not all(torch.equal(forgotten[0][k], clean[0][k]) for k in clean[0])  # its residual was lost


def test_inner_optimizer_state_saved_for_an_older_round_is_ignored_with_a_log_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 2 saved its state after round 1, then (as if the save of round 2 was lost: a crash before SageMaker
    synced it) the directory still holds round 1 while the run committed round 2: the restart starts fresh."""
    import shutil

    uri, ckpt, old = new_uri(), str(tmp_path / "ckpt"), tmp_path / "round1"
    loops: list[object] = []

    def life(rank: int) -> dict[str, torch.Tensor]:
        if rank != 2:
            return train(uri, rank, adamw=True, checkpoint_dir=ckpt)
        with pytest.raises(Died):
            train(uri, rank, die_after_step=5, adamw=True, checkpoint_dir=ckpt)
        shutil.copytree(Path(ckpt) / "rank_0002", old)  # round 1's state
        with pytest.raises(Died):
            train(uri, rank, die_after_step=9, adamw=True, checkpoint_dir=ckpt)  # saves round 2's, dies
        shutil.rmtree(Path(ckpt) / "rank_0002")
        shutil.copytree(old, Path(ckpt) / "rank_0002")  # the directory went back to round 1
        return train(uri, rank, adamw=True, checkpoint_dir=ckpt, loops=loops)

    with caplog.at_level("INFO", logger="diloco.replica.outer"):
        finals = run_ranks(WORLD, life, timeout=60)
    assert_identical(finals)
    assert loops[0].rejoined_round == 2 and not loops[0].inner_state_restored  # type: ignore[attr-defined]
    assert any("fresh inner optimizer state: the saved inner optimizer state is from round 1, not the committed "
               "round 2" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


# ---------------------------------------------------------------- the kill harness: real processes, real launcher
TESTS_DIR = Path(__file__).resolve().parents[1]
#: Seeded trials in runs of 2 replicas with 5 kills each (a run's kills share its start-up: two torch imports per
#: run plus one per kill, instead of a run per trial). One run (5 trials) hits every named moment: its first kill
#: before the first round, the other four mid-round, during an upload, during the outer step and mid-round again.
#: DILOCO_KILL_TRIALS=20 runs the 20 trials of the acceptance run (four runs side by side, the moments in turn).
KILLS_PER_RUN = 5
TRIALS = max(1, int(os.environ.get("DILOCO_KILL_TRIALS", "5")) // KILLS_PER_RUN) * KILLS_PER_RUN
HARNESS_REPLICAS, HARNESS_SYNC_EVERY, HARNESS_ROUNDS = 2, 4, 2 * KILLS_PER_RUN
#: The moments the issue names. "start" (before the first round) only fits a run's first kill, so slot s of a run
#: kills in round 2s+1: slot 0 before the first round (in the first run always at the very start; in later runs
#: before the first inner step or after a few steps of round 1), slots 1-4 mid-round, during an upload or during
#: the outer step, in turn.
MOMENTS = ("start", "mid_round", "upload", "outer_step")
#: A safety net for one launch, not a speed bound: each of a run's rounds is bounded by store.timeout_s (60 s,
#: extended while a relaunch is pending), and its launcher gives up on a replica after --max-restarts.
HARNESS_LAUNCH_LIMIT_S = 600


def trial_plan(trial: int) -> dict[str, int | str]:
    """Trial ``trial``'s kill, from its seed (1000 + trial): a random victim, at a random point of its moment."""
    rng = random.Random(1000 + trial)
    slot = trial % KILLS_PER_RUN
    moment = "start" if slot == 0 else MOMENTS[1 + (trial // KILLS_PER_RUN + slot - 1) % 3]
    round_number = 2 * slot + 1
    if moment == "start":  # before the first inner step, or (after the first run) after a few steps of round 1
        moment, step = ("start", 0) if trial == 0 else rng.choice(
            [("start", 0), ("mid_round", rng.randrange(1, HARNESS_SYNC_EVERY))])
    elif moment == "mid_round":
        step = rng.randrange(1, HARNESS_SYNC_EVERY)
    elif moment == "outer_step":
        step = rng.randrange(2)  # 0: before the outer step is applied; 1: after, before the round is committed
    else:
        step = 0
    return {"trial": trial, "rank": rng.randrange(HARNESS_REPLICAS), "moment": moment, "round": round_number,
            "step": step}


def attempt_logs(home: Path, rank: int) -> list[str]:
    """Every attempt's log of ``rank``, oldest first (a relaunch moves the old one to ``rank_R.tryN``)."""
    run_logs = next(iter(home.glob("runs/*/logs")))
    tries = sorted(run_logs.glob(f"rank_{rank}.try*"), key=lambda p: int(p.suffix[len(".try"):]))
    return [(d / "combined.log").read_text(errors="replace") for d in [*tries, run_logs / f"rank_{rank}"]]


def trial_outcome(plan: dict[str, int | str], logs: list[str], earlier_kills_of_rank: int) -> dict[str, object]:
    """What the victim's logs say about one trial: did it die where planned, where did its next attempt rejoin,
    and did it get its inner optimizer state back."""
    killed = logs[earlier_kills_of_rank] if earlier_kills_of_rank < len(logs) else ""
    after = logs[earlier_kills_of_rank + 1] if earlier_kills_of_rank + 1 < len(logs) else ""
    rejoined = re.search(r"rejoins the run after committed round (\d+)", after)
    fresh = re.search(r"fresh inner optimizer state: (.*)", after)
    return {"killed": f"kill trial {plan['trial']}:" in killed,
            "rejoined_after_round": int(rejoined[1]) if rejoined else None,
            "inner_state": "restored" if "restored the inner optimizer state" in after else
                           (f"fresh: {fresh[1][:80]}" if fresh else "fresh: no round committed yet")}


@dataclass
class HarnessRun:
    """One of the harness's launches: its kill plans, where it keeps its files, and (once done) how it ended."""

    plans: list[dict[str, int | str]]
    home: Path
    done: Path
    checkpoints: Path
    launch: subprocess.CompletedProcess[str] | None = None
    run_s: float = 0.0

    def go(self) -> None:
        """``diloco launch`` of the run, waited for (in a thread of its own)."""
        self.done.mkdir()
        started = time.monotonic()
        self.launch = subprocess.run(
            [DILOCO, "launch", "--replicas", str(HARNESS_REPLICAS), "--backend", "local",
             "--trainer", "support.kill_trainer:train",
             "--steps", str(HARNESS_SYNC_EVERY * HARNESS_ROUNDS), "--sync-every", str(HARNESS_SYNC_EVERY),
             "--max-restarts", str(KILLS_PER_RUN), "--set", "store.poll_interval_s=0.1",
             "--set", "store.timeout_s=60", "-k", f"kills={json.dumps(self.plans)}", "-k", f"done_dir={self.done}",
             "-o", "json"],
            capture_output=True, text=True, cwd=TESTS_DIR, timeout=HARNESS_LAUNCH_LIMIT_S,
            env={**os.environ, "DILOCO_HOME": str(self.home), "DILOCO_RESTART_BACKOFF_S": "0",
                 "DILOCO_CHECKPOINT_DIR": str(self.checkpoints)})
        self.run_s = time.monotonic() - started


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(900)  # 7 replica starts (20 trials: 28, four runs side by side)
def test_sigkill_of_a_random_replica_at_every_named_moment_is_survived_with_identical_weights(
        tmp_path: Path) -> None:
    """Seeded trials (``TRIALS``), each a SIGKILL of a random replica of a 2-replica local run at one of the named
    moments; every run completes through the real launcher (relaunch, rejoin) with identical weights."""
    from concurrent.futures import ThreadPoolExecutor

    runs = [HarnessRun(plans=[trial_plan(t) for t in range(first, first + KILLS_PER_RUN)],
                       home=tmp_path / f"home{first}", done=tmp_path / f"done{first}",
                       checkpoints=tmp_path / f"ckpt{first}") for first in range(0, TRIALS, KILLS_PER_RUN)]
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        for finished in [pool.submit(run.go) for run in runs]:
            finished.result()
    trial_log: list[dict[str, object]] = []
    for run in runs:
        assert run.launch is not None
        plans, launch = run.plans, run.launch
        summary = json.loads(launch.stdout) if launch.stdout.strip().startswith("{") else {}
        ranks = summary.get("ranks") or []
        for i, plan in enumerate(plans):
            earlier = sum(1 for p in plans[:i] if p["rank"] == plan["rank"])
            log = {**plan, "before_first_round": plan["round"] == 1,
                   **trial_outcome(plan, attempt_logs(run.home, int(plan["rank"])), earlier),
                   "run_state": summary.get("state"), "identical": summary.get("weights_identical"),
                   "run_s": round(run.run_s, 1)}
            trial_log.append(log)
            print("rejoin trial:", json.dumps(log))  # the trial log, kept in the test output
        assert launch.returncode == 0, (plans, launch.stderr[-3000:])
        assert summary["state"] == "succeeded" and summary["weights_identical"] is True, summary
        assert [r["restarts"] for r in ranks] == [sum(p["rank"] == r for p in plans)
                                                  for r in range(HARNESS_REPLICAS)], plans
        for log in trial_log[-KILLS_PER_RUN:]:
            assert log["killed"] is True, log
            # it rejoins at the round it was killed in, or after it (killed after its upload: that round commits
            # without a second contribution), never before: a kill in round 1 before committing restarts fresh
            joined = log["rejoined_after_round"] or 0
            assert int(log["round"]) - 1 <= joined <= int(log["round"]), log
    assert len(trial_log) == TRIALS
    assert {str(log["moment"]) for log in trial_log} == set(MOMENTS)
    # $DILOCO_CHECKPOINT_DIR: a victim that rejoins at the round its last saved inner state belongs to gets it back
    # (a kill during an outer step comes back at the round that step committed, whose state it had not saved yet)
    assert any(log["inner_state"] == "restored" for log in trial_log), trial_log


@pytest.mark.parametrize(("exit_code", "timed_out", "expected"), [
    (137, False, True),    # SIGKILL: the OOM killer, a kill -9
    (143, False, True),    # SIGTERM from outside: a spot reclaim, a node drain
    (None, False, True),   # lost: its supervisor vanished with it
    (1, False, False),     # the trainer raised: it would raise again
    (2, False, False),     # bad arguments
    (143, True, False),    # the run's own wall-clock limit
])
def test_only_failures_a_relaunch_can_cure_are_relaunched(exit_code: int | None, timed_out: bool,
                                                        expected: bool) -> None:
    from diloco.executors.base import ReplicaState, ReplicaStatus
    from diloco.launcher.lifecycle import relaunchable

    status = ReplicaStatus(rank=0, state=ReplicaState.FAILED, exit_code=exit_code, timed_out=timed_out)
    assert relaunchable(status) is expected
    assert relaunchable(status.model_copy(update={"state": ReplicaState.CANCELLED})) is False


def test_keep_rounds_bounds_the_committed_rounds_a_run_leaves_in_the_store(tmp_path: Path) -> None:
    """``store.keep_rounds`` (``--keep-rounds`` on the entrypoint): only the newest K committed rounds stay."""
    from diloco.replica.entrypoint import main

    store = tmp_path / "store"
    kwargs = {"total_steps": 8, "sync_every": 2, "n_embd": 16, "eval_batches": 1, "max_corpus_bytes": 100_000}
    argv = ["--rendezvous", store.as_uri(), "--world-size", "1", "--rank", "0", "--keep-rounds", "2",
            "--trainer-kwargs-json", json.dumps(kwargs)]
    assert main(argv, {}) == 0
    kept = sorted(p.parent.name for p in (store / "committed").glob("*/*"))  # a file store keeps empty folders
    assert kept == ["round_000003", "round_000003", "round_000004", "round_000004"]
