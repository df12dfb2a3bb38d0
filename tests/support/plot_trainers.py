"""Trainers for the ``diloco plot`` tests, run by the real replica entrypoint (``--trainer support.plot_trainers:<fn>``):
they write metric rows in the store's schema (``diloco.replica.metrics``) exactly as the outer loop would, without torch,
so a test can say which points the plot must show."""

from __future__ import annotations

import json
import time
from typing import Any


def _row(**row: Any) -> dict[str, Any]:
    return {"time": time.time(), "train_loss": None, "eval_loss": None, "tokens_per_s": 0.0, "sync_s": 0.0,
            "bytes_written": 0, "bytes_read": 0, **row}


def _history(manager: Any, rank: int, rows: list[dict[str, Any]]) -> None:
    manager.store.put(f"metrics/rank_{rank:04d}.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())


def _progress(manager: Any, rank: int, row: dict[str, Any]) -> None:
    manager.store.put(f"progress/rank_{rank:04d}.json", json.dumps(row).encode())


def fail_before_eval(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int,
                     fail_rank: int = 1, **_: Any) -> None:
    """Every rank trains one round with no evaluation at all; ``fail_rank`` then raises, the others wait (and are
    stopped by fail-fast)."""
    rows = [_row(kind="init", step=0, round=0, total_steps=total_steps)]
    rows.append(_row(kind="round", step=sync_every, round=1, total_steps=total_steps, train_loss=4.0 - rank / 10))
    _history(manager, rank, rows)
    if rank == fail_rank:
        # Fail only once every other rank has written its round: fail-fast stops them at once, and a rank that
        # was still starting (a loaded machine) would otherwise leave no curve to plot.
        others = [f"metrics/rank_{r:04d}.jsonl" for r in range(world_size) if r != rank]
        while not all(manager.store.exists(key) for key in others):
            time.sleep(0.05)
        raise RuntimeError(f"injected failure at rank {rank}")
    time.sleep(120)


def stale_progress(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int,
                   **_: Any) -> None:
    """Two rounds, then a progress row mid-way to the next: rank 0's carries round 2's train loss over (no loss
    measured since, as a trainer that reports once per round leaves it); rank 1's carries a loss it just measured.
    Then it waits to be cancelled."""
    rows = [_row(kind="init", step=0, round=0, total_steps=total_steps, eval_loss=5.0),
            _row(kind="round", step=sync_every, round=1, total_steps=total_steps, train_loss=4.0, eval_loss=4.5),
            _row(kind="round", step=2 * sync_every, round=2, total_steps=total_steps, train_loss=3.8, eval_loss=4.2)]
    _history(manager, rank, rows)
    fresh = 3.5 if rank == 1 else 3.8
    _progress(manager, rank, _row(kind="progress", step=2 * sync_every + sync_every // 2, round=2,
                                  total_steps=total_steps, train_loss=fresh, eval_loss=4.2))
    time.sleep(300)
