"""What the Hugging Face trainer's inner loop reads from: one interface over its two kinds of data.

* ``MemoryFeed``: text tokenized whole at start (``diloco.trainers.hf.load_blocks``), this process's shard of it and a
  seeded ``BlockSampler`` over the shard;
* ``StreamFeed``: a stream read as training goes (``diloco.trainers.hf_data``: ``hf:`` datasets, pre-tokenized
  shards).

Both give the held-out blocks, ``take(n)`` (the next ``n`` blocks, ``[n, block_size]``), an exact JSON position
(``state_dict``/``load_state_dict``) and ``advance(n)`` (skip ``n`` blocks exactly as taking them would).
``restore_position`` puts a rejoining process's feed where its committed round left it
(``diloco.trainers.data_positions``). ``DataLog`` appends, per inner step, a digest of the token ids it trained
on: how a test (or a user in doubt) checks that a relaunch trains on exactly the data a run without the kill did.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from diloco.trainers.data_positions import DataPositions

log = logging.getLogger("diloco.trainers.hf")


class Feed(Protocol):
    """Blocks to train on, the held-out ones, and an exact JSON position."""

    eval: torch.Tensor
    describe: str

    def take(self, count: int) -> torch.Tensor: ...

    def advance(self, count: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class MemoryFeed:
    """Rows of an in-memory shard, in the order ``sampler`` (a ``BlockSampler``) gives."""

    def __init__(self, shard: torch.Tensor, sampler: Any, eval_blocks: torch.Tensor, describe: str) -> None:
        self.shard, self.sampler, self.eval, self.describe = shard, sampler, eval_blocks, describe

    def take(self, count: int) -> torch.Tensor:
        return self.shard[self.sampler.take(count)]

    def advance(self, count: int) -> None:
        self.sampler.advance(count)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.sampler.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class StreamFeed:
    """A ``diloco.trainers.hf_data`` stream as a feed."""

    def __init__(self, stream: Any, describe: str) -> None:
        self.stream, self.eval, self.describe = stream, stream.eval_blocks, describe

    def take(self, count: int) -> torch.Tensor:
        return self.stream.take(count)

    def advance(self, count: int) -> None:
        self.stream.advance(count)

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stream.load_state_dict(state)


def restore_position(feed: Feed, positions: DataPositions | None, *, round_number: int,
                     blocks_per_round: int) -> str:
    """Put ``feed`` where committed round ``round_number`` left it: the position saved with that round, else the
    newest earlier one moved on by the rounds between, else the start moved on by all of them. Returns (and
    logs) which."""
    saved = positions.load(round_number) if positions is not None else None
    start = 0
    if saved is not None:
        try:
            feed.load_state_dict(saved.position)
            start = saved.round
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("the data position saved with round %d does not fit this data (%s): advancing from the "
                        "start instead", saved.round, exc)
    if start < round_number:
        feed.advance((round_number - start) * blocks_per_round)
    how = (f"data position of round {round_number} restored" if start == round_number else
           f"data position of round {start} restored and moved on by {round_number - start} round(s)" if start else
           f"data position moved on from the start by {round_number} round(s)")
    log.info("%s: %s", how, json.dumps(feed.state_dict(), sort_keys=True)[:200])
    return how


class DataLog:
    """``directory/rank_RRRR_proc_LL.jsonl``: one line per inner step, ``{"step", "sha256", "tokens"}``, the
    SHA-256 over the int64 token ids of the step's micro-batches in order. Appended, so a relaunched process adds
    its steps after its predecessor's (a step done twice appears twice)."""

    def __init__(self, directory: str, *, rank: int, local_rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"rank_{rank:04d}_proc_{local_rank:02d}.jsonl")

    def step(self, step: int) -> Callable[[list[torch.Tensor]], None]:
        def record(batches: list[torch.Tensor]) -> None:
            self.write(step, batches)

        return record

    def write(self, step: int, batches: list[torch.Tensor]) -> None:
        digest = hashlib.sha256()
        tokens = 0
        for x in batches:
            digest.update(x.to("cpu", copy=True).long().contiguous().numpy().tobytes())
            tokens += x.numel()
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "sha256": digest.hexdigest(), "tokens": tokens}) + "\n")


def read_data_log(path: str) -> list[dict[str, Any]]:
    """The rows of a ``DataLog`` file, in the order written."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
