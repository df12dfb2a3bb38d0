"""A replica SIGKILLed mid-run resumes at its committed data position, with ``hf:`` streamed data and with
pre-tokenized shards on S3: 2 replicas of the Hugging Face trainer through the real ``diloco launch`` (local
backend), a tiny Llama, data built here.

Replica 1 kills itself after inner step 6 (round 1 committed at step 4, round 2 not yet), the launcher relaunches
it, it rejoins at round 1. Every process logs a digest of the token ids of each inner step (``data_log``). The
relaunch must train steps 5..12 on exactly the token ids a run without the kill trains on (a fresh stream of the
same slot, and the killed process's own steps 5 and 6), restoring the position saved with round 1 rather than the
one the killed process had reached at step 6.

The same run has ``--eval-every 2``: only replica 0 evaluates the committed global model, every 2 rounds and after the
last, and its metrics rows carry that loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainers.hf_data_fixtures import check_resumed_exactly, launch_with_a_kill, save_dataset
from trainers.test_hf_trainer import tokenizer_dir  # noqa: F401 (tests/ is on sys.path)

from diloco.store.layout import METRICS_KEY
from diloco.store.objects import ObjectStore


@pytest.mark.slow
def test_a_killed_replica_on_hf_streamed_data_resumes_at_its_committed_position(
        home: Path, tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0")
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # tests/: the replicas import support.*
    data = save_dataset(tmp_path / "dataset")
    run_id, logs = launch_with_a_kill(home, tmp_path, data, tokenizer_dir, eval_every=2)
    check_resumed_exactly(home, tmp_path, run_id, logs, data, tokenizer_dir)

    # eval_every=2: rank 0 alone evaluates the global model, at the start, after round 2 and after the last (3); a
    # row carries the latest loss, so round 1's is the start's and the final row's is round 3's
    store = ObjectStore(f"file://{home.resolve()}/runs/{run_id}/store")
    rows = {rank: [json.loads(line) for line in store.get(METRICS_KEY.format(rank=rank)).decode().splitlines()]
            for rank in (0, 1)}
    assert all(r.get("eval_loss") is None for r in rows[1])
    losses = {r["round"] if r["kind"] == "round" else r["kind"]: r.get("eval_loss") for r in rows[0]
              if r["kind"] in ("init", "round", "final")}
    assert list(losses) == ["init", 1, 2, 3, "final"] and None not in losses.values(), rows[0]
    assert losses[1] == losses["init"] and losses[2] != losses[1] and losses[3] != losses[2]
    assert losses["final"] == losses[3]
