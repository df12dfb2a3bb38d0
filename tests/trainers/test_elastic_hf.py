"""The Hugging Face trainer in an elastic run: a tiny Llama from a config and a tokenizer trained here (nothing from
a hub), replicas as threads over one ``file://`` store with real managers. Launched with 2 replicas whose target
already names a third: rank 2 (past the world of 2) joins at round 2 from the committed round, its in-memory blocks
dealt by each round's membership; the data every replica trained on, counted from their data logs, has no block
twice, and every replica ends with the same weights, bit for bit."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from support.ranks import run_ranks
from test_hf_trainer import BLOCK, MODEL_CONFIG, SEED, tokenizer_dir, write_jsonl  # noqa: F401 - a fixture

from diloco.collectives.allreduce import create_allreduce
from diloco.collectives.membership import write_target
from diloco.launcher.weights import check_final_weights
from diloco.replica.checkpoint import RoundCheckpoints
from diloco.replica.manager import ObjectStoreManager
from diloco.store.layout import ROUND_MANIFEST_KEY
from diloco.trainers import hf
from diloco.trainers.hf_feed import read_data_log


def test_a_replica_added_to_a_hugging_face_run_joins_with_its_share_of_the_data(
        tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    uri = f"file://{tmp_path / 'rdv'}"
    # The replicas are threads of one process here, and a model is built from a seed through torch's process-wide
    # generator: one build at a time, so each replica's initial weights are what its own process would build.
    build, lock = hf.build_model, threading.Lock()

    def one_at_a_time(**kwargs: Any) -> Any:
        with lock:
            return build(**kwargs)

    monkeypatch.setattr(hf, "build_model", one_at_a_time)

    def manager(rank: int) -> ObjectStoreManager:
        allreduce = create_allreduce(uri, rank, 2, run_id="r", max_replicas=3, timeout_s=120, poll_interval_s=0.02)
        return ObjectStoreManager(allreduce, rounds=RoundCheckpoints(allreduce.store, run_id="r", world_size=2))

    managers = [manager(r) for r in range(3)]
    write_target(managers[0].store, "r", [0, 1, 2])
    logs = tmp_path / "data_log"
    kwargs = {"model_config": MODEL_CONFIG, "tokenizer": str(tokenizer_dir), "block_size": BLOCK, "batch_size": 4,
              "sync_every": 2, "eval_batches": 1, "seed": SEED, "data": str(write_jsonl(tmp_path / "corpus")),
              "data_log": str(logs)}
    summaries = run_ranks(3, lambda r: hf.train(manager=managers[r], rank=r, world_size=2, total_steps=6,
                                                **kwargs), timeout=300)
    store = managers[0].store
    assert [json.loads(store.get(ROUND_MANIFEST_KEY.format(round=k)))["members"] for k in range(3)] == \
        [[0, 1], [0, 1, 2], [0, 1, 2]]
    assert [s["rounds"] for s in summaries] == [3, 3, 3]
    # a position is the count of blocks taken: rank 2 starts where round 1 left the run (2 steps of 4 blocks)
    assert [s["data_position"]["taken"] for s in summaries] == [24, 24, 24]
    steps = {r: [row["step"] for row in read_data_log(str(logs / f"rank_{r:04d}_proc_00.jsonl"))] for r in range(3)}
    assert steps == {0: [1, 2, 3, 4, 5, 6], 1: [1, 2, 3, 4, 5, 6], 2: [3, 4, 5, 6]}
    digests = [row["sha256"] for r in range(3) for row in read_data_log(str(logs / f"rank_{r:04d}_proc_00.jsonl"))]
    assert len(set(digests)) == len(digests), "two steps trained on the same blocks"
    check = check_final_weights(store, 3)
    assert check.identical is True, check.detail
    for m in managers:
        m._allreduce.close()  # type: ignore[attr-defined]
