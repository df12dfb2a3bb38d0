"""Rounds reuse the buffers of the round before (``diloco.collectives.spares``): every mean stays exact, the
caller's tensors never share memory with them, and only the latest round's buffers are kept."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.ranks import run_ranks  # tests/ is on sys.path

from diloco.collectives.allreduce import average, create_allreduce
from diloco.collectives.sharded import SHARD_TENSOR, PayloadLayout
from diloco.collectives.spares import Spares
from diloco.collectives.wire import PayloadCodec

POLL = 0.01
WORLD = 3
#: Payloads of successive rounds: two fragments with the same shapes under other names (Streaming DiLoCo's
#: fragments), then one of another shape, then the first again: each round may take the one before's buffers.
PAYLOADS = [{"a.w": (64, 33), "a.b": (33,)}, {"b.w": (64, 33), "b.b": (33,)}, {"c": (5000,)},
            {"a.w": (64, 33), "a.b": (33,)}, {"b.w": (64, 33), "b.b": (33,)}]


def contribution(round_: int, rank: int) -> dict[str, torch.Tensor]:
    """What ``rank`` sends in ``round_``: different in every round and on every rank."""
    gen = torch.Generator().manual_seed(1000 * round_ + rank)
    return {name: torch.randn(shape, generator=gen) * (rank + 1) for name, shape in PAYLOADS[round_].items()}


def expected_means(fmt: str) -> list[dict[str, torch.Tensor]]:
    """Every round's mean, computed apart: each rank's contribution as its peers decode it (with its own error
    feedback, as the collective keeps it), averaged in rank order."""
    codecs = [PayloadCodec(fmt) for _ in range(WORLD)]
    means = []
    for k in range(len(PAYLOADS)):
        decoded = []
        for rank, codec in enumerate(codecs):
            tensors = contribution(k, rank)
            layout = tuple((name, (tuple(t.shape), t.dtype)) for name, t in tensors.items())
            decoded.append(codec.encode_contribution(layout, tensors)[2])
        means.append(average(decoded))
    return means


def run_rounds(uri: str, strategy: str, fmt: str) -> list[list[dict[str, torch.Tensor]]]:
    """Every round of ``PAYLOADS`` on every rank; per rank, the caller's tensors of every round (each kept, so a
    later round writing into memory they share would show)."""
    def rank_fn(rank: int) -> list[dict[str, torch.Tensor]]:
        kept = []
        with create_allreduce(uri, rank, WORLD, allreduce=strategy, compression=fmt, timeout_s=30,
                              poll_interval_s=POLL) as ar:
            for k in range(len(PAYLOADS)):
                tensors = contribution(k, rank)
                ar.allreduce(tensors)
                kept.append(tensors)
        return kept

    return run_ranks(WORLD, rank_fn, timeout=120)


@pytest.mark.parametrize(("strategy", "fmt"), [("gather", "none"), ("gather", "bf16"), ("gather", "int8"),
                                               ("gather", "int4"), ("sharded", "none")])
def test_rounds_that_reuse_buffers_give_every_rank_the_exact_mean(strategy: str, fmt: str, tmp_path: Any) -> None:
    expected = expected_means(fmt)
    for kept in run_rounds(f"file://{tmp_path}/rdv", strategy, fmt):
        for k, (got, want) in enumerate(zip(kept, expected, strict=True)):
            for name in want:
                assert torch.equal(got[name].view(torch.int32), want[name].view(torch.int32)), (k, name)


def sharded_expected_means(fmt: str) -> list[dict[str, torch.Tensor]]:
    """Every round's sharded mean, computed apart with fresh buffers: each rank's shards encoded with its own error
    feedback, each shard's contributions added by its owner (its own first, then the others in rank order) and
    divided, the reduced shard re-encoded once."""
    codecs = [PayloadCodec(fmt) for _ in range(WORLD)]
    means = []
    for k in range(len(PAYLOADS)):
        shards_of = []
        for rank in range(WORLD):
            layout = PayloadLayout.of(contribution(k, rank), WORLD, codecs[rank].block)
            shards_of.append(layout.split(contribution(k, rank)))
        flat = torch.empty(WORLD * layout.shard_elements)
        shard_layout = {SHARD_TENSOR: ((layout.shard_elements,), torch.float32)}
        for j in range(WORLD):
            acc: dict[str, torch.Tensor] = {}
            for rank in [j, *(r for r in range(WORLD) if r != j)]:
                codec = codecs[rank]
                wire, meta = codec.encode_wire((layout.key, j), {SHARD_TENSOR: shards_of[rank][j]})
                codec.add_into(acc, wire, meta, shard_layout)
            reduced = codecs[j].encode_plain({SHARD_TENSOR: acc[SHARD_TENSOR].div_(WORLD)})[2][SHARD_TENSOR]
            layout.shard(flat, j).copy_(reduced)
        means.append({name: t.clone() for name, t in layout.unflatten(flat).items()})
    return means


@pytest.mark.parametrize("fmt", ["int8", "bf16", "int4"])  # several wire tensors, one, and packed codes
def test_sharded_compressed_rounds_that_reuse_buffers_give_every_rank_the_exact_mean(fmt: str, tmp_path: Any) -> None:
    """Rounds whose wire tensors live in memory the round reuses (a shard's in its snapshot, our own and the
    reduced shard's in the read buffer) send what fresh memory would: the exact means of the reference."""
    expected = sharded_expected_means(fmt)
    for kept in run_rounds(f"file://{tmp_path}/rdv", "sharded", fmt):
        for k, (got, want) in enumerate(zip(kept, expected, strict=True)):
            for name in want:
                assert torch.equal(got[name].view(torch.int32), want[name].view(torch.int32)), (k, name)


def test_spares_are_taken_by_shape_and_dtype_and_only_the_latest_round_is_kept() -> None:
    spares = Spares()
    a, b = torch.empty(4, 5), torch.empty(4, 5)
    spares.give(0, [a, b])
    assert spares.empty((4, 5), torch.float32).data_ptr() in {a.data_ptr(), b.data_ptr()}
    assert spares.empty((4, 5), torch.bfloat16).dtype == torch.bfloat16  # no spare of that dtype: a new tensor
    assert spares.empty((5, 4), torch.float32).data_ptr() not in {a.data_ptr(), b.data_ptr()}
    c = torch.empty(7)
    spares.give(1, [c])  # round 1 gives back: round 0's untaken spare is dropped
    assert spares.empty((7,), torch.float32).data_ptr() == c.data_ptr()
    assert spares.empty((4, 5), torch.float32).data_ptr() not in {a.data_ptr(), b.data_ptr()}
    spares.give(0, [torch.empty(3)])  # an older round's buffer, handed back late, is not kept
    whole = torch.empty(6)
    spares.give(1, [whole[:3], whole.view(2, 3).t()])  # views of a larger buffer, or not contiguous: not kept
    assert all(spares.empty((3,), torch.float32).data_ptr() != whole.data_ptr() for _ in range(2))
    d = torch.empty(2)
    spares.give(2, [d])
    spares.clear()
    assert spares.empty((2,), torch.float32).data_ptr() != d.data_ptr()
