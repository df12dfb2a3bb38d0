"""End to end, asynchronous DiLoCo: ``diloco launch --mode async`` starts a master and 3 workers as real replica
processes (the local backend, the built-in trainer in ``mode="async"``) that train the built-in model through the
loopback S3 server to an eval loss clearly below its start. (The ``file://`` store's async runs are the kill
tests' in tests/replica/test_async_rejoin.py.)

Also: every rank exports the same final global weights, and the published metadata (what ``diloco status``
shows) names the global version and each worker's last upload and staleness.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.launcher.async_status import read_async_status
from diloco.store.codec import decode_tensors
from diloco.store.objects import ObjectStore

pytestmark = pytest.mark.slow

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 8, "eval_batches": 4,
        "max_corpus_bytes": 150_000, "mode": "async"}
GUARD_S = 240  # only against a hang: the runs take seconds


def check_run(store: ObjectStore, results: list[tuple[int, int, str]], world_size: int) -> None:
    for rank, code, err in results:
        assert code == 0, f"rank {rank} exited {code}:\n{err[-3000:]}"
    # Every rank ends on the master's final global version: identical exported weights.
    # (A launch that found them identical keeps one copy: final/compacted.json says which.)
    kept = [r for r in range(world_size) if store.exists(f"final/rank_{r:04d}.safetensors")]
    assert kept == list(range(world_size)) or store.exists("final/compacted.json")
    finals = [decode_tensors(store.get(f"final/rank_{r:04d}.safetensors")) for r in kept]
    reference = finals[0][0]
    for tensors, meta in finals[1:]:
        assert all(torch.equal(tensors[k], reference[k]) for k in reference)
        assert meta["round"] == finals[0][1]["round"]
    # The loss clearly fell, on every rank (same initial model, same held-out batches, same final model).
    assert len({json.loads(store.get(f"metrics/rank_{r:04d}.jsonl").decode().splitlines()[0])["eval_loss"]
                for r in range(world_size)}) == 1
    for r in range(world_size):
        rows = [json.loads(line) for line in store.get(f"metrics/rank_{r:04d}.jsonl").decode().splitlines()]
        assert rows[0]["kind"] == "init" and rows[-1]["kind"] == "final"
        assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] - 1.0, (rows[0]["eval_loss"], rows[-1]["eval_loss"])
        assert rows[-1]["extra"]["global_version"] == int(finals[0][1]["round"])
    # What `diloco status` reads: the global version and each worker's last upload and staleness.
    status = read_async_status(store)
    assert status is not None and status.version == int(finals[0][1]["round"]) >= 3 * world_size
    assert set(status.workers) == {f"replica-{r}" for r in range(world_size)}
    for worker in status.workers.values():
        assert worker.applied >= 1 and worker.last_upload_time and worker.staleness is not None


def test_cli_launch_mode_async_over_s3_and_status(tmp_path: Path, s3_uri: str, aws_env: str) -> None:
    """``diloco launch --mode async`` on the local backend with an S3 rendezvous, then ``diloco status``."""
    diloco = str(Path(sys.executable).with_name("diloco"))
    env = {**os.environ, "DILOCO_HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path)}
    env.pop("DILOCO_DEBUG", None)
    knobs = [f"-k{k}={v}" for k, v in TINY.items() if k != "mode"]
    launched = subprocess.run([diloco, "launch", "--mode", "async", "-n", "2", "--steps", "60", "--sync-every",
                               "10", "--rendezvous", f"{s3_uri}/{{run_id}}", "--set", "store.poll_interval_s=0.05",
                               *knobs], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=GUARD_S)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "final weights: identical: 2 replica(s)" in launched.stdout, launched.stdout
    table = subprocess.run([diloco, "status"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert "async: global version" in table.stdout and "staleness" in table.stdout, table.stdout
    shown = json.loads(subprocess.run([diloco, "status", "-o", "json"], capture_output=True, text=True, env=env,
                                      cwd=tmp_path, timeout=60).stdout)
    assert shown["rendezvous_uri"].startswith(s3_uri), shown["rendezvous_uri"]
    store = ObjectStore(shown["rendezvous_uri"])
    check_run(store, [(r, 0, "") for r in range(2)], 2)
    published = read_async_status(store)
    assert published is not None and shown["async_global_version"] == published.version
    assert all(r["async_last_upload_at"] and r["async_staleness"] is not None for r in shown["ranks"])
