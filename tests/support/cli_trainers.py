"""Trainer functions for CLI tests, run by the real replica entrypoint (``--trainer support.cli_trainers:<fn>``).

The CLI tests run ``diloco`` with this directory as the working directory, and a local replica's ``python -m``
puts its working directory on ``sys.path``, so ``cli_trainers`` is importable there.
"""

from __future__ import annotations

import json
import time
from typing import Any


def _metric(manager: Any, rank: int, rows: list[str], **row: Any) -> None:
    rows.append(json.dumps({"time": time.time(), "train_loss": None, "tokens_per_s": 0.0, "sync_s": 0.0,
                            "bytes_written": 0, "bytes_read": 0, **row}) + "\n")
    manager.store.put(f"metrics/rank_{rank:04d}.jsonl", "".join(rows).encode())


def agreed(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int, **_: Any) -> None:
    """A finished run with one model, without torch: every replica reports its rounds and exports the same weights
    (plain safetensors, as a trainer of its own may write them). For tests of what the launcher does with a
    finished run (collect, its output paths), where training is not what is under test."""
    import numpy as np
    from safetensors.numpy import save

    from diloco.store.layout import FINAL_KEY

    rows: list[str] = []
    _metric(manager, rank, rows, kind="init", round=0, step=0, total_steps=total_steps, eval_loss=5.0)
    rounds = max(1, total_steps // sync_every)
    for number in range(1, rounds + 1):
        loss = 4.0 + 1.0 / number
        _metric(manager, rank, rows, kind="round", round=number, step=min(number * sync_every, total_steps),
                total_steps=total_steps, train_loss=loss, eval_loss=loss)
    _metric(manager, rank, rows, kind="final", round=rounds, step=total_steps, total_steps=total_steps,
            train_loss=4.0, eval_loss=4.0)
    weights = {"w": np.linspace(-1.0, 1.0, 8, dtype=np.float32), "b": np.zeros(2, dtype=np.float32)}
    manager.store.put(FINAL_KEY.format(rank=rank), save(weights, metadata={"round": str(rounds)}))


def crash_at_rank(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int,
                  fail_rank: int = 1, wait_s: float = 120.0, **_: Any) -> None:
    """Rank ``fail_rank`` raises; the others wait ``wait_s`` (as they would for its missing contribution)."""
    if rank == fail_rank:
        raise RuntimeError(f"injected failure at rank {rank}")
    time.sleep(wait_s)


def slow(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int,
         step_s: float = 0.05, **_: Any) -> None:
    """Reports progress in the metrics schema, slowly: something to cancel or interrupt mid-run."""
    rows: list[str] = []
    _metric(manager, rank, rows, kind="init", round=0, step=0, total_steps=total_steps, eval_loss=5.0)
    for step in range(1, total_steps + 1):
        time.sleep(step_s)
        if step % sync_every == 0:
            _metric(manager, rank, rows, kind="round", round=step // sync_every, step=step,
                    total_steps=total_steps, train_loss=4.0, eval_loss=4.0)
    _metric(manager, rank, rows, kind="final", round=total_steps // sync_every, step=total_steps,
            total_steps=total_steps, train_loss=4.0, eval_loss=4.0)


def diverge(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int, **_: Any) -> None:
    """A run whose losses blew up: NaN and infinity in the metrics, as a diverged trainer writes them."""
    rows: list[str] = []
    _metric(manager, rank, rows, kind="init", round=0, step=0, total_steps=total_steps, eval_loss=5.0)
    _metric(manager, rank, rows, kind="final", round=1, step=total_steps, total_steps=total_steps,
            train_loss=float("nan"), eval_loss=float("inf"), tokens_per_s=float("-inf"))


def crash_with_text(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int,
                    text: str = "", **_: Any) -> None:
    """Every rank raises with ``text`` in the message (markup- or emoji-like text must print literally)."""
    raise RuntimeError(text)


def bad_metrics(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int,
                **_: Any) -> None:
    """Metric rows a sloppy trainer might write: a string loss and a non-numeric step, next to good rows."""
    rows: list[str] = []
    _metric(manager, rank, rows, kind="init", round=0, step=0, total_steps=total_steps, eval_loss=5.0)
    _metric(manager, rank, rows, kind="round", round=1, step=total_steps, total_steps=total_steps,
            train_loss="abc", eval_loss=4.0)


def disagree(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int, **_: Any) -> None:
    """Every replica ends normally (exit 0) but exports its own weights: a run without one model."""
    import torch

    from diloco.replica.final_weights import write_final_weights

    rows: list[str] = []
    _metric(manager, rank, rows, kind="init", round=0, step=0, total_steps=total_steps, eval_loss=5.0)
    _metric(manager, rank, rows, kind="final", round=1, step=total_steps, total_steps=total_steps, eval_loss=4.0)
    write_final_weights(manager.store, rank, {"w": torch.full((2,), float(rank))}, {"rank": rank})
