"""Elastic membership in the gather all-reduce (``diloco.collectives.membership``): each round of a run launched
with ``max_replicas`` commits a manifest naming the ranks it averaged and the next round's members, copied from the
target the launcher wrote. Real threads, one ``file://`` store: a run of 2 grows to 3 and shrinks back to 2, every
member of each round holding the bitwise-identical mean over that round's members, and the leaving rank told so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.ranks import run_ranks

from diloco.collectives.allreduce import create_allreduce
from diloco.collectives.membership import member_history, read_target, round_members, write_target
from diloco.errors import ConfigError
from diloco.store.layout import ROUND_MANIFEST_KEY


def _value(rank: int, round_: int) -> torch.Tensor:
    return torch.full((5,), float((rank + 1) * 10 + round_) / 7.0)


def test_a_run_grows_and_shrinks_and_every_round_averages_its_own_members(tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'rdv'}"
    drivers = {r: create_allreduce(uri, r, 2, run_id="run", max_replicas=4, timeout_s=20, poll_interval_s=0.02)
               for r in (0, 1, 2)}  # rank 2 is past the world of 2 the run was launched with
    store = drivers[0].store
    write_target(store, "run", [0, 1, 2])  # read when round 1's manifest is created: round 2 has 3 members
    drivers[2].resume_at(1)  # what its manager does once a manifest names it

    def round_of(ranks: list[int], round_: int) -> list[torch.Tensor]:
        def one(i: int) -> torch.Tensor:
            t = _value(ranks[i], round_)
            drivers[ranks[i]].allreduce([t])
            return t
        return run_ranks(len(ranks), one)

    first = round_of([0, 1], 0)
    write_target(store, "run", [0, 1])  # between round 1's manifest and round 2's: rank 2 leaves after round 2
    second = round_of([0, 1, 2], 1)
    third = round_of([0, 1], 2)

    for got, members, round_ in ((first, [0, 1], 0), (second, [0, 1, 2], 1), (third, [0, 1], 2)):
        want = sum((_value(r, round_) for r in members), torch.zeros(5)) / len(members)
        assert all(torch.equal(t, got[0]) for t in got), f"round {round_ + 1}: the members disagree"
        assert torch.allclose(got[0], want), (round_, got[0], want)
    manifests = [json.loads(store.get(ROUND_MANIFEST_KEY.format(round=k))) for k in range(3)]
    assert [(m["members"], m["next"]) for m in manifests] == [([0, 1], [0, 1, 2]), ([0, 1, 2], [0, 1]),
                                                             ([0, 1], [0, 1])]
    assert drivers[2].members_after(1) == [0, 1]  # rank 2's manager reads: not in the next round, it leaves
    assert drivers[0].members_after(2) == [0, 1]
    assert round_members(store, 0, 2) == [0, 1] and round_members(store, 1, 2) == [0, 1, 2]
    assert round_members(store, 3, 2) == [0, 1] and round_members(store, 4, 2) is None  # not committed yet
    assert member_history(store, 3, 2) == [[0, 1], [0, 1, 2], [0, 1]]
    target = read_target(store)
    assert target is not None and target.members == (0, 1) and target.epoch == 2
    for driver in drivers.values():
        driver.close()


def test_a_run_never_scaled_keeps_its_members_and_a_fixed_run_writes_no_manifest(tmp_path: Path) -> None:
    elastic = [create_allreduce(f"file://{tmp_path / 'a'}", r, 2, max_replicas=3, timeout_s=20,
                                poll_interval_s=0.02) for r in (0, 1)]
    fixed = [create_allreduce(f"file://{tmp_path / 'b'}", r, 2, timeout_s=20, poll_interval_s=0.02) for r in (0, 1)]
    for group in (elastic, fixed):
        for round_ in range(2):
            run_ranks(2, lambda r, g=group, k=round_: g[r].allreduce([_value(r, k)]))
    assert [json.loads(elastic[0].store.get(ROUND_MANIFEST_KEY.format(round=k)))["next"] for k in range(2)] == \
        [[0, 1], [0, 1]]
    assert not fixed[0].store.exists(ROUND_MANIFEST_KEY.format(round=0))
    assert fixed[0].members_after(0) is None
    for driver in elastic + fixed:
        driver.close()


def test_an_elastic_run_needs_gather_and_a_max_at_least_its_min() -> None:
    with pytest.raises(ConfigError, match="max_replicas: an elastic run needs allreduce gather"):
        create_allreduce("memory://x", 0, 2, max_replicas=4, allreduce="sharded")
    with pytest.raises(ConfigError, match="min_replicas: must be at most max_replicas"):
        create_allreduce("memory://x", 0, 2, max_replicas=2, min_replicas=3)
