"""Committed rounds written by rows (``diloco.replica.checkpoint_parts``), in a real ``file://`` store: a sharded
replica's K processes each commit their rows, local process 0 marks the round, and any partition reads it back.

What these prove: a round committed by 2 processes reads back, bitwise, as whole tensors (K = 1) and as 3 other
processes' rows (a relaunch on another instance type); a round is only committed once its marker is there; a
second replica of the same K that holds other bits fails loudly (the replicas diverged); retention deletes old
rounds whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco.collectives.part_layout import ShardSpec, spec_of_part
from diloco.errors import CorruptObjectError
from diloco.replica.checkpoint import RoundCheckpoints
from diloco.replica.checkpoint_parts import PartCheckpoints
from diloco.store.objects import ObjectStore

SHAPES = {"fragment0.global.emb": (11, 6), "fragment0.global.b": (5,), "fragment0.momentum.emb": (11, 6),
          "fragment0.momentum.b": (5,)}


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def rows(whole: dict[str, torch.Tensor], parts: int, part: int) -> tuple[dict[str, torch.Tensor],
                                                                         dict[str, ShardSpec]]:
    specs = {name: spec_of_part(t.shape, parts, part) for name, t in whole.items()}
    return {name: whole[name][s.row_start:s.row_end].clone() for name, s in specs.items()}, specs


def commit(checkpoints: PartCheckpoints, round_number: int, whole: dict[str, torch.Tensor], parts: int) -> bool:
    digests = []
    for part in range(parts):
        tensors, specs = rows(whole, parts, part)
        digest = checkpoints.write_part(round_number, parts, part, tensors, specs)
        assert digest is not None
        digests.append(digest)
    return checkpoints.mark(round_number, parts, digests)


def test_rows_committed_by_two_processes_read_back_bitwise_by_one_and_by_three(tmp_path: Path) -> None:
    checkpoints = PartCheckpoints(ObjectStore(f"file://{tmp_path}/store"), run_id="run", world_size=2)
    whole = state(1)
    assert checkpoints.latest_round() == 0
    assert commit(checkpoints, 1, whole, parts=2)
    assert checkpoints.latest_round() == 1
    one = checkpoints.read(1, {name: ShardSpec.whole(t.shape) for name, t in whole.items()})
    assert all(torch.equal(one.tensors[name], whole[name]) for name in whole)
    for part in range(3):
        expected, specs = rows(whole, 3, part)
        got = checkpoints.read(1, specs).tensors
        assert all(torch.equal(got[name], expected[name]) for name in whole), part


def test_a_round_is_committed_only_by_its_marker_and_a_diverged_replica_is_refused(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}/store")
    checkpoints = PartCheckpoints(store, run_id="run", world_size=2)
    whole = state(1)
    tensors, specs = rows(whole, 2, 0)
    assert checkpoints.write_part(1, 2, 0, tensors, specs) is not None
    assert RoundCheckpoints(store, run_id="run", world_size=2).latest_round() == 0  # no marker: not committed
    other, _ = rows(state(2), 2, 0)
    with pytest.raises(CorruptObjectError, match="replicas diverged"):
        checkpoints.write_part(1, 2, 0, other, specs)  # another replica of K=2 with other bits
    assert commit(checkpoints, 1, whole, parts=2)
    assert checkpoints.write_part(1, 2, 1, *rows(whole, 2, 1)) is None  # committed already: nothing written


def test_retention_deletes_old_rounds_whole(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}/store")
    checkpoints = PartCheckpoints(store, run_id="run", world_size=1, keep=2)
    for round_number in (1, 2, 3):
        commit(checkpoints, round_number, state(round_number), parts=2)
    assert sorted({key.split("/")[1] for key in store.list("committed/")}) == ["round_000002", "round_000003"]
