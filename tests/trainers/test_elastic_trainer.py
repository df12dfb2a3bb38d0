"""The built-in trainer in an elastic run: real replicas as threads over one ``file://`` store, real managers with
committed rounds. A run launched with 2 replicas whose target already names a third: round 1 averages ranks 0 and
1, its manifest names 0, 1, 2 for round 2, and rank 2 (past the world of 2 it was started with) adopts the committed
round, deals itself its data by the round's membership and ends holding the same final weights, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.ranks import run_ranks

from diloco.collectives.allreduce import create_allreduce
from diloco.collectives.membership import write_target
from diloco.launcher.weights import check_final_weights
from diloco.replica.checkpoint import RoundCheckpoints
from diloco.replica.manager import ObjectStoreManager
from diloco.store.layout import ROUND_MANIFEST_KEY
from diloco.trainers.gpt import diloco_train

TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=4, eval_batches=1, max_corpus_bytes=60_000)


def _manager(uri: str, rank: int) -> ObjectStoreManager:
    allreduce = create_allreduce(uri, rank, 2, run_id="run", max_replicas=3, timeout_s=60, poll_interval_s=0.02)
    return ObjectStoreManager(allreduce, rounds=RoundCheckpoints(allreduce.store, run_id="run", world_size=2))


def test_a_replica_added_to_a_run_of_the_builtin_trainer_joins_and_ends_with_identical_weights(tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'rdv'}"
    managers = [_manager(uri, r) for r in range(3)]
    write_target(managers[0].store, "run", [0, 1, 2])

    def train(rank: int) -> dict[str, Any]:
        return diloco_train(manager=managers[rank], rank=rank, world_size=2, total_steps=12, sync_every=3, **TINY)

    summaries = run_ranks(3, train, timeout=240)
    store = managers[0].store
    members = [json.loads(store.get(ROUND_MANIFEST_KEY.format(round=k)))["members"] for k in range(4)]
    assert members == [[0, 1], [0, 1, 2], [0, 1, 2], [0, 1, 2]]
    assert [s["rounds"] for s in summaries] == [4, 4, 4]
    check = check_final_weights(store, 3)
    assert check.identical is True, check.detail
    for manager in managers:
        manager._allreduce.close()  # type: ignore[attr-defined]
