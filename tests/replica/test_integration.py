"""End to end: real replica processes (``python -m diloco.replica.entrypoint``) train the built-in model with
DiLoCo, meeting only through a ``file://`` store.

What must hold: every rank exports bitwise-identical global weights; the held-out loss falls well below where it
started; the metrics follow the schema; old rounds are deleted; a missing peer makes the others fail naming the
round and the rank, instead of hanging. The training run is streaming DiLoCo (two fragments, overlapped), two
replicas; against a missing peer one replica starts. (The README's bring-your-own-trainer example, which records
nothing itself, is run through ``diloco launch`` in tests/trainers/test_readme_trainer.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco import envvars
from diloco.store.codec import decode_tensors
from diloco.store.objects import ObjectStore
from diloco.trainers.gpt_model import GPTConfig

pytestmark = pytest.mark.slow

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 8, "eval_batches": 4,
        "max_corpus_bytes": 150_000}
METRIC_KEYS = {"kind", "round", "step", "total_steps", "train_loss", "eval_loss", "tokens", "tokens_per_s",
               "sync_s", "bytes_written", "bytes_read", "time", "diverged", "extra"}
GUARD_S = 240  # only against a hang: the runs take seconds


def _launch(tmp_path: Path, ranks: list[int], world_size: int, kwargs: dict, timeout_s: float) -> list[tuple]:
    """Start one replica process per rank (rank via ``REPLICA_RANK``, as every backend sets it); wait for all."""
    uri = f"file://{tmp_path / 'rdv'}"
    env = {k: v for k, v in os.environ.items() if k not in (envvars.SM_MODEL_DIR, envvars.JOB_COMPLETION_INDEX)}
    procs = []
    for rank in ranks:
        out, err = open(tmp_path / f"r{rank}.out", "w"), open(tmp_path / f"r{rank}.err", "w")
        cmd = [sys.executable, "-m", "diloco.replica.entrypoint", "--rendezvous", uri,
               "--world-size", str(world_size), "--trainer", "diloco.trainers.gpt:diloco_train",
               "--trainer-kwargs-json", json.dumps(kwargs), "--timeout", str(timeout_s), "--poll-interval", "0.05"]
        procs.append((rank, subprocess.Popen(cmd, cwd=tmp_path, env={**env, envvars.REPLICA_RANK: str(rank)},
                                             stdout=out, stderr=err), out, err))
    results = []
    try:
        for rank, proc, out, err in procs:
            proc.wait(timeout=GUARD_S)
            out.close()
            err.close()
            results.append((rank, proc.returncode, (tmp_path / f"r{rank}.out").read_text(),
                            (tmp_path / f"r{rank}.err").read_text()))
    finally:
        for _, proc, out, err in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
            err.close()
    return results


def test_replicas_train_to_identical_weights_and_lower_loss_streaming_two_fragments_with_overlap(tmp_path) -> None:
    """Two replica processes of streaming DiLoCo (F=2, fragment_sync_delay=1): 6 all-reduce rounds (one per
    fragment every 10 steps), each launched a step before its wait; every round is waited for before the next one
    starts, so the k-1 deletion stays safe. (One fragment, plain DiLoCo, is the same loop with a round every 20
    steps: every launch of the built-in trainer elsewhere runs it.)"""
    kwargs = {**TINY, "total_steps": 60, "sync_every": 20, "fragments": 2, "fragment_sync_delay": 1}
    results = _launch(tmp_path, [0, 1], 2, kwargs, timeout_s=120)
    for rank, code, out, err in results:
        assert code == 0, f"rank {rank} exited {code}:\n{err}"
        assert f"[rank {rank}]" in out and "round 6 step 60/60" in out  # one numbering: each fragment's sync

    store = ObjectStore(f"file://{tmp_path / 'rdv'}")
    # 1. Every rank exported the same global weights, bit for bit, with the config needed to rebuild them.
    finals = [decode_tensors(store.get(f"final/rank_{r:04d}.safetensors"), expect={"rank": r, "step": 60})
              for r in range(2)]
    reference, meta0 = finals[0]
    assert GPTConfig.from_json(meta0["model_config"]) == GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    for tensors, meta in finals[1:]:
        assert tensors.keys() == reference.keys()
        assert all(torch.equal(tensors[k], reference[k]) for k in reference)
        assert meta["model_config"] == meta0["model_config"]

    # 2. Metrics: the schema, one row per round, and a loss that clearly fell.
    runs = []
    for r in range(2):
        rows = [json.loads(line) for line in store.get(f"metrics/rank_{r:04d}.jsonl").decode().splitlines()]
        assert [row["kind"] for row in rows] == ["init", *["round"] * 6, "final"]
        assert all(set(row) == METRIC_KEYS for row in rows)
        assert [row["step"] for row in rows] == [0, 10, 20, 30, 40, 50, 60, 60]
        assert all(row["total_steps"] == 60 for row in rows)
        assert [row["round"] for row in rows] == [0, 1, 2, 3, 4, 5, 6, 6]
        assert rows[-1]["bytes_read"] > 0 and rows[-1]["bytes_written"] > 0  # it really exchanged
        runs.append(rows)
    init = {rows[0]["eval_loss"] for rows in runs}
    final = {rows[-1]["eval_loss"] for rows in runs}
    assert len(init) == 1 and len(final) == 1  # same start, same global model (measured on it), same batches
    assert final.pop() < init.pop() - 1.0
    # Disjoint shards: the replicas trained on different data between syncs (their first measured train loss; a
    # train loss is measured at the end of each sync_every steps, so every other fragment's round has none).
    first_train = [next(row["train_loss"] for row in rows if row["train_loss"] is not None) for rows in runs]
    assert len(set(first_train)) == 2, first_train

    # 3. Old rounds were deleted by their writers: only the last round's objects (0-based 5) remain.
    rounds = [k for k in store.list() if k.startswith("round_")]
    assert rounds == [f"round_000005/rank_{r:04d}.safetensors" for r in range(2)]


def test_missing_peer_fails_the_others_naming_round_and_rank(tmp_path) -> None:
    kwargs = {**TINY, "total_steps": 10, "sync_every": 10}
    results = _launch(tmp_path, [0], 2, kwargs, timeout_s=3)  # rank 1 never starts
    for rank, code, _, err in results:
        assert code == 1, f"rank {rank} exited {code}:\n{err}"
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"diloco: error: rank {rank}: all-reduce round 1 timed out"), err  # from 1
        assert "waiting for rank(s) 1" in last
        assert "Traceback" not in err
    store = ObjectStore(f"file://{tmp_path / 'rdv'}")
    assert not [k for k in store.list() if k.startswith("final/")]  # nobody exported half-trained weights
