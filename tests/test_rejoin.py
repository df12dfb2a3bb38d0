"""A replica that dies comes back and rejoins at its peers' round (ranks as threads over real store rounds).

A "death" is an exception out of the training loop (the replica stops; its store objects stay as they were);
the "restart" is a fresh model, optimizer, all-reduce and manager for the same rank, as a relaunched process has.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ranks import run_ranks  # tests/ is on sys.path
from torch import nn

from diloco.allreduce import ObjectStoreAllReduce, contribution_key
from diloco.checkpoint import RoundCheckpoints
from diloco.manager import ObjectStoreManager
from diloco.outer import make_diloco_outer_loop

WORLD, SYNC_EVERY, ROUNDS = 3, 4, 5
TOTAL = SYNC_EVERY * ROUNDS
_SEED_LOCK = threading.Lock()


class Died(Exception):
    """The replica's process is gone (raised from its training loop)."""


def manager_for(uri: str, rank: int, run_id: str = "run-t") -> ObjectStoreManager:
    allreduce = ObjectStoreAllReduce(uri, rank, WORLD, timeout_s=20, poll_interval_s=0.01, run_id=run_id)
    rounds = RoundCheckpoints(allreduce.store, run_id=run_id, world_size=WORLD)
    return ObjectStoreManager(allreduce, rounds=rounds)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of inner step ``step``: a pure function of both, so a resumed trainer sees the same data."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def train(uri: str, rank: int, *, die_after_step: int | None = None, fragments: int = 1, delay: int = 0,
          hook: bool = True, events: list[str] | None = None) -> dict[str, torch.Tensor]:
    """One replica's whole life: the final global weights, or ``Died`` after inner step ``die_after_step``."""
    with _SEED_LOCK:  # torch's global RNG is shared by the rank threads: identical initial weights need a lock
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    parts = [model[0], model[2]] if fragments == 2 else [model]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = manager_for(uri, rank)
    start = [0]

    def on_rejoin(inner_step: int) -> None:
        start[0] = inner_step
        if events is not None:
            events.append(f"rank {rank} rejoined at step {inner_step}")

    loop = make_diloco_outer_loop(manager=manager, model_fragments=parts, inner_optimizer=opt, outer_lr=0.7,
                                  outer_momentum=0.9, sync_every=SYNC_EVERY, fragment_sync_delay=delay, model=model,
                                  on_rejoin=on_rejoin if hook else None)
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
                        pending._upload.result()  # it dies *after* its upload of the round in flight landed
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
    with caplog.at_level("WARNING", logger="diloco.outer"):
        finals = run_with_a_death(uri, 2, 6, lambda: train(uri, 2, hook=False))
    assert_identical(finals)
    assert any("fresh inner state" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- the kill harness: real processes, real launcher
DILOCO = str(Path(sys.executable).with_name("diloco"))
#: 20 is the issue's count; the default (2) keeps this file under a minute on two shared cores.
#: The whole harness: DILOCO_REJOIN_TRIALS=20 (about 20 s a trial on two cores: raise pytest's --timeout).
TRIALS = int(os.environ.get("DILOCO_REJOIN_TRIALS", "2"))
FIRST_TRIAL = int(os.environ.get("DILOCO_REJOIN_FIRST_TRIAL", "0"))  # the seed of trial k is 1000 + k
TINY = ("-k", "n_layer=1", "-k", "n_embd=32", "-k", "block_size=32", "-k", "batch_size=8", "-k", "eval_batches=2",
        "-k", "max_corpus_bytes=120000", "-k", "threads=1")


def child_pid(home: Path, rank: int) -> int | None:
    """The replica process (not its supervisor) of ``rank`` in the only run under ``home``, once it started."""
    for child in home.glob(f"runs/*/logs/rank_{rank}/child.json"):
        try:
            return int(json.loads(child.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None
    return None


def progress_file(home: Path, rank: int) -> Path | None:
    return next(iter(home.glob(f"runs/*/store/progress/rank_{rank:04d}.json")), None)


def kill_later(home: Path, rank: int, after: str, delay_s: float, log: dict[str, object]) -> None:
    """SIGKILL replica ``rank`` ``delay_s`` after it started (``after="start"``: while it imports, or before its
    first round) or after its training began (``"training"``: mid-round, during an upload or an outer step)."""
    deadline = time.monotonic() + 120
    while (pid := child_pid(home, rank)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    while after == "training" and progress_file(home, rank) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(delay_s)
    progress = progress_file(home, rank)
    try:
        log["progress_at_kill"] = json.loads(progress.read_text()).get("step") if progress else None
        os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
        log["killed"] = True
    except (OSError, ValueError, TypeError) as exc:
        log["killed"] = f"no ({type(exc).__name__}: it had already ended)"


def test_sigkill_of_a_random_replica_at_a_random_moment_is_survived_with_identical_weights(tmp_path: Path) -> None:
    trial_log = []
    for trial in range(FIRST_TRIAL, FIRST_TRIAL + TRIALS):
        rng = random.Random(1000 + trial)
        victim, after = rng.randrange(4), rng.choice(["start", "training", "training"])
        delay = rng.uniform(0.0, 4.0 if after == "start" else 1.2)  # its 10 rounds take about a second
        home = tmp_path / f"home{trial}"
        log: dict[str, object] = {"trial": trial, "victim": victim, "after": after, "kill_after_s": round(delay, 2)}
        killer = threading.Thread(target=kill_later, args=(home, victim, after, delay, log), daemon=True)
        killer.start()
        started = time.monotonic()
        launch = subprocess.run(
            [DILOCO, "launch", "--replicas", "4", "--backend", "local", "--steps", "40", "--sync-every", "4",
             "--max-restarts", "2", "--set", "store.poll_interval_s=0.05", "--set", "store.timeout_s=60", *TINY,
             "-o", "json"],
            capture_output=True, text=True, env={**os.environ, "DILOCO_HOME": str(home)}, cwd=tmp_path, timeout=240)
        killer.join(timeout=60)
        summary = json.loads(launch.stdout) if launch.stdout.strip().startswith("{") else {}
        ranks = summary.get("ranks") or []
        victim_log = "".join(p.read_text() for p in home.glob(f"runs/*/logs/rank_{victim}/combined.log"))
        rejoined = re.search(r"rejoins the run after committed round (\d+)", victim_log)
        log.update(rc=launch.returncode, state=summary.get("state"), identical=summary.get("weights_identical"),
                   restarts=[r.get("restarts") for r in ranks], rejoined_after_round=rejoined and int(rejoined[1]),
                   seconds=round(time.monotonic() - started, 1))
        trial_log.append(log)
        print("rejoin trial:", json.dumps(log))  # the trial log, kept in the test output
        assert launch.returncode == 0, (log, launch.stderr[-3000:])
        assert summary["state"] == "succeeded" and summary["weights_identical"] is True, log
        if log.get("killed") is True:
            assert ranks[victim]["restarts"] == 1, log
            assert "relaunching it" in launch.stderr
    assert len(trial_log) == TRIALS


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
    from diloco.orchestrate import relaunchable

    status = ReplicaStatus(rank=0, state=ReplicaState.FAILED, exit_code=exit_code, timed_out=timed_out)
    assert relaunchable(status) is expected
    assert relaunchable(status.model_copy(update={"state": ReplicaState.CANCELLED})) is False
