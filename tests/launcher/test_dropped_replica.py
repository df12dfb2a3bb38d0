"""A replica dropped from a ``--min-replicas`` round, through the real CLI on the local backend: it exits with the
dropped code (75), ``diloco launch`` relaunches it, it rejoins at its peers' next round (and, dropped from the last
round, adopts the final committed model), and the run ends with every replica holding identical weights; the
run's ``final_eval_loss`` is the collected model's own eval loss, never the mean with a stale one.

Two replicas, either of which may commit a round alone (``--min-replicas 1``): the straggler's drop, relaunch and
rejoin need no third.

A replica dropped more often than ``--max-restarts`` allows is left behind: that is the run-state rules' (as
functions over hand-built statuses: ``lifecycle.left_behind`` in ``test_lifecycle_rules.py``, and the run's eval
loss without the stale one, ``reports.model_eval_loss`` in ``test_reports.py``), not a second real run's.

The straggler is ``late_trainer`` (the built-in trainer; one rank holds back its contribution to chosen rounds
until they committed without it), so the drop is certain whatever the machine's load.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.commands import run_cli
from support.pacing import round_deadline_s
from support.run_processes import processes_of

from diloco.store.layout import METRICS_KEY
from diloco.store.objects import ObjectStore

TESTS_DIR = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

#: The built-in trainer, tiny: 6 rounds of 5 steps on 2 replicas, either of which may commit a round alone.
MODEL = {"n_layer": 1, "n_head": 1, "n_embd": 16, "block_size": 16, "batch_size": 4, "eval_batches": 2,
         "max_corpus_bytes": 200_000, "outer_momentum_warmup": 0}
SYNC_EVERY, ROUNDS = 5, 6
REPLICAS, LATE = 2, 1


def launch_args(*, late_rounds: str, hold_rounds: str) -> list[str]:
    """``diloco launch`` of the tiny model on 2 replicas, rank 1 late for ``late_rounds``, rank 0 holding
    ``hold_rounds`` until it has rejoined (``late_trainer``).

    The round deadline (``store.timeout_s``) must be one the on-time rank never misses, or a round would commit
    with a member short: a fixed few seconds is missed on a loaded machine, so it is scaled by the replica start-up
    measured when the test runs (support/pacing.py), with 4 s as its floor on an idle machine. No start-up falls
    inside a round both ranks must make: the first round is a late one, and the round after a drop is held until
    the relaunched rank has rejoined, so what the deadline covers is a few tiny steps and a load of the committed
    state: one start-up and a half is ample. It is short because every late round waits it out (a drop costs a
    deadline); the late rank's drop does not ride on it (``late_trainer`` holds back until the round has
    committed)."""
    deadline_s = round_deadline_s(4.0, starts=1.5)
    knobs = {**MODEL, "late_rank": LATE, "late_rounds": late_rounds, "hold_rounds": hold_rounds}
    return ["launch", "-n", str(REPLICAS), "--trainer", "support.late_trainer:train",
            "--steps", str(ROUNDS * SYNC_EVERY), "--sync-every", str(SYNC_EVERY), "--min-replicas", "1",
            *[a for k, v in knobs.items() for a in ("-k", f"{k}={v}")],
            "--set", f"store.timeout_s={deadline_s:.1f}", "--set", "store.poll_interval_s=0.05", "-o", "json"]


def cli(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """The CLI, bounded against a hang: every round may wait out its deadline (measured when the test runs, not
    while every worker collects)."""
    return run_cli(*args, restart_backoff_s=0, timeout=300 + ROUNDS * round_deadline_s(4.0), script=True, **kwargs)


def round_losses(store: ObjectStore, rank: int) -> dict[int, float]:
    """Round number -> the eval loss ``rank`` recorded after it, from its metrics history: a rank has a ``round``
    row exactly for the rounds it took part in (a dropped one raises instead), and every member of one round
    holds the same model afterwards, so equal losses mean it was averaged with its peers. (The rounds' manifests
    are gone once a succeeded run's store is compacted.)"""
    rows = [json.loads(line) for line in store.get(METRICS_KEY.format(rank=rank)).decode().splitlines() if line]
    return {row["round"]: row["eval_loss"] for row in rows if row.get("kind") == "round"}


def eval_loss_of(model_path: str) -> float:
    """The collected model's eval loss, computed the way the built-in trainer computes it: its fixed held-out
    batches (the corpus' common tail, the default seed), the mean loss over them, on one CPU thread."""
    import torch
    from safetensors import safe_open

    from diloco.trainers.data import eval_batches, load_corpus, split_corpus
    from diloco.trainers.gpt import _evaluate
    from diloco.trainers.gpt_model import GPT, GPTConfig

    with safe_open(model_path, framework="pt") as f:
        config = GPTConfig.from_json(f.metadata()["model_config"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    model = GPT(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and not [m for m in missing if m in dict(model.named_parameters())], (missing, unexpected)
    split = split_corpus(load_corpus(None, MODEL["max_corpus_bytes"]), rank=0, world_size=REPLICAS,
                         block_size=config.block_size)
    batches = eval_batches(split.eval, n_batches=MODEL["eval_batches"], batch_size=MODEL["batch_size"],
                           block_size=config.block_size, seed=1337)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the replicas ran (the trainer's `threads` default)
    try:
        return _evaluate(model, batches, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)


def test_a_dropped_replica_is_relaunched_rejoins_and_the_run_ends_with_one_model(tmp_path: Path) -> None:
    """Rank 1 is late for round 1 (dropped, relaunched, it rejoins at round 2 and is averaged there again) and for
    the last round (dropped again: relaunched, it adopts the final committed model and succeeds)."""
    home = tmp_path / "home"
    launched = cli(*launch_args(late_rounds=f"1,{ROUNDS}", hold_rounds="2"), home=home)
    assert launched.returncode == 0, launched.stderr[-4000:]
    report: dict[str, Any] = json.loads(launched.stdout)
    run_id = report["run_id"]
    assert report["state"] == "succeeded" and report["left_behind"] == [], report
    assert [r["state"] for r in report["ranks"]] == ["succeeded"] * REPLICAS, report["ranks"]
    assert report["weights_identical"] is True, report["weights_detail"]
    late_rank = report["ranks"][LATE]
    assert late_rank["restarts"] == 2 and late_rank["round"] == ROUNDS and late_rank["finished_training"], late_rank
    assert launched.stderr.count("dropped from a round it was late for (exit code 75)") == 2, launched.stderr[-3000:]

    store = ObjectStore(report["rendezvous_uri"])
    peers, late = round_losses(store, 0), round_losses(store, LATE)
    assert sorted(peers) == list(range(1, ROUNDS + 1)) and sorted(late) == list(range(2, ROUNDS)), (peers, late)
    assert all(late[k] == peers[k] for k in late), (peers, late)  # averaged with them in rounds 2..5

    # The attempts that were dropped (the local backend keeps an earlier attempt's logs in logs/rank_R.tryN/),
    # each ending on its one line, then the last attempt (`diloco logs` shows the latest) adopting round 6.
    dropped = [(home / "runs" / run_id / "logs" / f"rank_{LATE}.try{n}" / "stderr.log").read_text().splitlines()[-1]
               for n in (1, 2)]
    assert dropped == [f"diloco: error: rank 1: dropped from round {k}: its contribution arrived after the round "
                       f"committed with ranks 0 (min_replicas 1); it rejoins at the next round when relaunched "
                       f"(exit code 75)" for k in (1, ROUNDS)], dropped
    logs = cli("logs", run_id, "-r", str(LATE), home=home)
    assert f"rank 1 rejoins the run after committed round {ROUNDS}" in logs.stdout, logs.stdout[-3000:]

    model = tmp_path / "model.safetensors"
    collected = cli("collect", run_id, "--output", str(model), "-o", "json", home=home)
    assert collected.returncode == 0, collected.stderr[-3000:]
    own = eval_loss_of(str(model))
    assert report["final_eval_loss"] == pytest.approx(own, abs=1e-6), (report["final_eval_loss"], own)
    assert all(r["eval_loss"] == pytest.approx(own, abs=1e-6) for r in report["ranks"]), report["ranks"]
    assert json.loads(collected.stdout)["final_eval_loss"] == pytest.approx(own, abs=1e-6)
    assert not processes_of(run_id)
