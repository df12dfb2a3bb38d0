"""Partial participation (issue 11 item 4, ``min_replicas``): a round commits with at least K contributions once
its deadline passes, every rank agreeing on the members through the round's manifest; a late contribution is
dropped, never averaged. Real ``file://`` stores, ranks as threads."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch
from ranks import run_ranks

from diloco.allreduce import average, create_allreduce
from diloco.collectives.gather import DroppedFromRound
from diloco.errors import AllReduceTimeout, ConfigError
from diloco.layout import ROUND_MANIFEST_KEY
from diloco.store import ObjectStore

POLL = 0.01


def contribution(rank: int, round_: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * round_ + rank)
    return {"w": torch.randn(64, generator=g) * 10.0 ** torch.randint(-6, 6, (64,), generator=g)}


def test_four_replicas_with_one_dead_for_good_finish_on_three_and_agree_on_every_round(tmp_path: Any) -> None:
    uri, world, rounds = f"file://{tmp_path}/rdv", 4, 3

    def rank_fn(rank: int) -> list[dict[str, torch.Tensor]]:
        outs = []
        with create_allreduce(uri, rank, world, min_replicas=3, timeout_s=0.3, poll_interval_s=POLL) as ar:
            for k in range(rounds):
                tensors = contribution(rank, k)
                ar.allreduce(tensors)
                outs.append(tensors)
        return outs

    live = run_ranks(3, rank_fn, timeout=60)  # ranks 0..2; rank 3 never starts
    store = ObjectStore(uri)
    for k in range(rounds):
        manifest = json.loads(store.get(ROUND_MANIFEST_KEY.format(round=k)))
        assert manifest["members"] == [0, 1, 2], manifest
        want = average([contribution(r, k) for r in range(3)])["w"]
        for rank in range(3):
            assert torch.equal(live[rank][k]["w"], want), (rank, k)  # divided by the 3 members, bitwise


def test_a_late_contribution_is_dropped_and_its_rank_told_to_rejoin(tmp_path: Any) -> None:
    uri, world = f"file://{tmp_path}/rdv", 3
    committed = threading.Event()

    def rank_fn(rank: int) -> Any:
        ar = create_allreduce(uri, rank, world, min_replicas=2, timeout_s=0.3, poll_interval_s=POLL)
        tensors = contribution(rank, 0)
        try:
            if rank == 2:
                committed.wait(30)  # arrives after ranks 0 and 1 committed round 1 without it
                with pytest.raises(DroppedFromRound, match=r"round 1: rank 2's contribution arrived after"):
                    ar.allreduce(tensors)
                return tensors
            ar.allreduce(tensors)
            committed.set()
            return tensors
        finally:
            ar.close(wait=False)

    outs = run_ranks(world, rank_fn, timeout=60)
    want = average([contribution(0, 0), contribution(1, 0)])["w"]
    assert torch.equal(outs[0]["w"], want) and torch.equal(outs[1]["w"], want)
    assert torch.equal(outs[2]["w"], contribution(2, 0)["w"])  # the dropped rank's tensors are untouched


def test_fewer_than_min_replicas_is_a_timeout_naming_the_missing_ranks(tmp_path: Any) -> None:
    with create_allreduce(f"file://{tmp_path}/rdv", 0, 4, min_replicas=3, timeout_s=0.3,
                          poll_interval_s=POLL) as ar, pytest.raises(AllReduceTimeout) as info:
        ar.allreduce(contribution(0, 0))
    assert info.value.missing_ranks == [1, 2, 3] and info.value.round == 1


def test_min_replicas_is_checked_and_refused_for_sharded() -> None:
    with pytest.raises(ConfigError, match=r"min_replicas must be an integer in \[1, 4\]"):
        create_allreduce("memory://x", 0, 4, min_replicas=5)
    with pytest.raises(ConfigError, match="gather only"):
        create_allreduce("memory://x", 0, 4, strategy="sharded", min_replicas=3)
