"""Data the streamed-data tests build here, offline: a ``save_to_disk`` dataset of grammar documents (``hf:``) and
the same documents pre-tokenized into ``.npy``/``.bin``/Parquet shards; nothing comes from a hub. And the run both
resume tests make: 2 replicas of the Hugging Face trainer, replica 1 SIGKILLed mid-run and relaunched, checked to
train on exactly the token ids a run without the kill does."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from trainers.test_hf_trainer import MODEL_CONFIG, SEED, sentences
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.store.objects import ObjectStore
from diloco.trainers import hf, hf_data
from diloco.trainers.hf_feed import DataLog, read_data_log

DOCS = 240
runner = CliRunner()


def save_dataset(directory: Path) -> str:
    """The grammar documents as a ``datasets`` dataset written by ``save_to_disk``; returns its ``hf:`` value."""
    import datasets

    datasets.Dataset.from_dict({"text": sentences(DOCS, seed=1)}).save_to_disk(str(directory))
    return f"hf:{directory}"


def token_ids(tokenizer: Any) -> list[int]:
    """The documents tokenized and joined with EOS, as a pre-tokenizing job would write them."""
    ids: list[int] = []
    for doc in sentences(DOCS, seed=1):
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids


def write_shards(directory: Path, tokenizer: Any) -> dict[str, bytes]:
    """Three shards of the token ids: ``.npy`` (uint16), raw ``.bin`` (uint16) and Parquet of id lists; also
    written to ``directory``. Returns ``{name: bytes}`` (to upload them elsewhere)."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = token_ids(tokenizer)
    third = len(ids) // 3
    directory.mkdir(parents=True, exist_ok=True)
    np.save(directory / "shard_000.npy", np.asarray(ids[:third], dtype=np.uint16))
    np.asarray(ids[third:2 * third], dtype=np.uint16).tofile(directory / "shard_001.bin")
    rest = ids[2 * third:]
    table = pa.table({"input_ids": [rest[i:i + 50] for i in range(0, len(rest), 50)]})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    (directory / "shard_002.parquet").write_bytes(buffer.getvalue())
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ------------------------------------------------------------------------------------------------ a kill mid-run
STEPS, SYNC, KILL_STEP, BLOCK, BATCH, EVAL_BATCHES = 12, 4, 6, 32, 4, 1


def launch_with_a_kill(home: Path, tmp_path: Path, data: str, tokenizer: Path, *, eval_every: int | None = None,
                       **extra: Any) -> tuple[str, Path]:
    """The run with replica 1 killed after step 6, waited for; returns its id and the data log directory.
    ``eval_every``: ``--eval-every``; ``extra``: more trainer kwargs."""
    from diloco.launcher import api

    done, logs = tmp_path / "done", tmp_path / "data_log"
    done.mkdir()
    kwargs = {"model_config": MODEL_CONFIG, "tokenizer": str(tokenizer), "data": data, "block_size": BLOCK,
              "batch_size": BATCH, "eval_batches": EVAL_BATCHES, "lr": 3e-3, "seed": SEED, "data_log": str(logs),
              "kill_step": KILL_STEP, "done_dir": str(done), **extra}
    args = ["launch", "--replicas", "2", "--backend", "local", "--trainer", "support.hf_data_kill_trainer:train",
            "--steps", str(STEPS), "--sync-every", str(SYNC), "--max-restarts", "1", "--set", "store.timeout_s=120",
            "--detach", "-o", "json", *(["--eval-every", str(eval_every)] if eval_every else [])]
    for key, value in kwargs.items():
        args += ["-k", f"{key}={json.dumps(value)}"]
    launched = runner.invoke(app, args)
    assert launched.exit_code == 0, launched.output
    run = api.get_run(str(json.loads(launched.stdout)["run_id"]))
    run.wait()  # relaunches the killed replica
    report = run.collect(None)
    assert report.state.value == "succeeded" and report.weights_identical is True, report
    assert [r.restarts for r in report.ranks] == [0, 1]
    return run.run_id, logs


def without_a_kill(data: str, tokenizer: Path, rank: int, directory: Path) -> list[dict[str, Any]]:
    """The digests of steps 1..12 of ``rank`` in a run without a kill: a fresh stream of its slot, read in order."""
    stream = hf_data.open_stream(data, hf.load_tokenizer(str(tokenizer)), block_size=BLOCK, slot=rank, slots=2,
                                 n_eval=EVAL_BATCHES * BATCH)
    log = DataLog(str(directory), rank=rank, local_rank=0)
    for step in range(1, STEPS + 1):
        log.write(step, [stream.take(BATCH)])
    return read_data_log(log.path)


def check_resumed_exactly(home: Path, tmp_path: Path, run_id: str, logs: Path, data: str, tokenizer: Path) -> None:
    """Each replica's per-step token-id digests equal a run without the kill's; the relaunch started at step 5 (the
    committed round 1), from the position saved with round 1; every committed round saved every position."""
    rows = {rank: read_data_log(str(logs / f"rank_{rank:04d}_proc_00.jsonl")) for rank in (0, 1)}
    expected = {rank: without_a_kill(data, tokenizer, rank, tmp_path / "reference") for rank in (0, 1)}
    assert rows[0] == expected[0]  # the replica that was not killed
    # the killed replica: steps 1..6, then its relaunch from the committed round 1: steps 5..12, no step skipped
    assert [r["step"] for r in rows[1]] == [*range(1, KILL_STEP + 1), *range(SYNC + 1, STEPS + 1)]
    assert rows[1][:KILL_STEP] == expected[1][:KILL_STEP]
    assert rows[1][KILL_STEP:] == expected[1][SYNC:]  # after the kill: exactly the token ids without one
    by_step = defaultdict(set)
    for row in rows[1]:
        by_step[row["step"]].add(row["sha256"])
    assert all(len(digests) == 1 for digests in by_step.values())  # the replayed steps 5, 6 read the same data
    assert len({r["sha256"] for r in expected[0]} | {r["sha256"] for r in expected[1]}) == 2 * STEPS  # disjoint

    relaunched = (home / "runs" / run_id / "logs" / "rank_1" / "combined.log").read_text(errors="replace")
    assert "data position of round 1 restored:" in relaunched, relaunched[-3000:]
    store = ObjectStore(f"file://{home.resolve()}/runs/{run_id}/store")
    saved = sorted(k for k in store.list("data_positions/"))
    assert saved == [f"data_positions/rank_{r:04d}/proc_00/round_{n:06d}.json" for r in (0, 1) for n in (1, 2, 3)]
