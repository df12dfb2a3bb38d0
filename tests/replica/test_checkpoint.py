"""Committed rounds in the store (diloco.replica.checkpoint): written once, verified on read, old ones deleted."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from diloco.errors import CorruptObjectError
from diloco.replica.checkpoint import RoundCheckpoints, data_key, marker_key
from diloco.store.objects import ObjectStore


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "memory":
        return ObjectStore(f"memory://ckpt-{uuid.uuid4().hex[:8]}")
    return ObjectStore(f"file://{tmp_path}/rdv")


def state(value: float) -> dict[str, torch.Tensor]:
    return {"fragment0.global.w": torch.full((3, 2), value), "fragment0.momentum.w": torch.full((3, 2), -value)}


def test_a_committed_round_reads_back_bit_for_bit(store: ObjectStore) -> None:
    rounds = RoundCheckpoints(store, run_id="run-a", world_size=4)
    tensors = {"fragment0.global.w": torch.randn(5, 7), "fragment0.momentum.w": torch.randn(5, 7)}
    assert rounds.commit(1, tensors) is True
    got = rounds.latest()
    assert got is not None and got.round == 1
    assert set(got.tensors) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(got.tensors[name], t)
    assert json.loads(store.get(marker_key(1)))["world_size"] == 4


def test_the_marker_is_created_once_whichever_rank_commits(store: ObjectStore) -> None:
    ranks = [RoundCheckpoints(store, run_id="run-a", world_size=3) for _ in range(3)]
    won = [r.commit(1, state(1.0)) for r in ranks]
    assert won == [True, False, False]
    assert ranks[2].committed_rounds() == [1]


def test_data_without_its_marker_is_not_committed_and_a_survivor_completes_it(store: ObjectStore) -> None:
    """A writer killed between the data and the marker: readers ignore the round until a peer writes the marker."""
    from diloco.store.codec import encode_tensors

    rounds = RoundCheckpoints(store, run_id="run-a", world_size=2)
    store.put(data_key(1), encode_tensors(state(1.0), rounds._identity(1)))  # the killed writer's data, no marker
    assert rounds.latest() is None
    assert rounds.commit(1, state(1.0)) is True  # the survivor: same bits, so it covers them with the marker
    latest = rounds.latest()
    assert latest is not None and torch.equal(latest.tensors["fragment0.global.w"], state(1.0)["fragment0.global.w"])


def test_a_rank_holding_other_bits_than_the_committed_data_is_told_the_replicas_diverged(store: ObjectStore) -> None:
    RoundCheckpoints(store, run_id="run-a", world_size=2).commit(1, state(1.0))
    store.delete(marker_key(1))  # as if the first writer died before its marker
    with pytest.raises(CorruptObjectError, match="diverged"):
        RoundCheckpoints(store, run_id="run-a", world_size=2).commit(1, state(2.0))


def test_a_writers_metadata_comes_back_with_the_round(store: ObjectStore) -> None:
    rounds = RoundCheckpoints(store, run_id="run-a", world_size=1)
    rounds.commit(1, state(1.0), metadata={"processed": ["deltas/a", "deltas/b"], "workers": {"w": {"applied": 2}}})
    rounds.commit(2, state(2.0))
    got = rounds.read(1)
    assert got.metadata == {"processed": ["deltas/a", "deltas/b"], "workers": {"w": {"applied": 2}}}
    assert rounds.read(2).metadata == {}


def test_a_single_writer_replaces_its_own_uncommitted_data_instead_of_calling_it_divergence(
        store: ObjectStore) -> None:
    """The asynchronous master, killed between data and marker, comes back and computes other tensors for that
    number (its deltas arrived in another order): those replace the old life's data, then are committed."""
    from diloco.store.codec import encode_tensors

    rounds = RoundCheckpoints(store, run_id="run-a", world_size=1)
    store.put(data_key(3), encode_tensors(state(1.0), rounds._identity(3)))  # the killed life's, no marker
    with pytest.raises(CorruptObjectError, match="replicas diverged"):
        RoundCheckpoints(store, run_id="run-a", world_size=1).commit(3, state(2.0))  # several writers: refused
    assert rounds.commit(3, state(2.0), single_writer=True) is True
    latest = rounds.latest()
    assert latest is not None and torch.equal(latest.tensors["fragment0.global.w"], state(2.0)["fragment0.global.w"])


def test_a_round_whose_data_another_rank_re_encoded_still_reads(store: ObjectStore) -> None:
    """Where the store ignores conditional create, the second of two ranks finishing a round together overwrites
    the first one's data with its own encoding of the same state (safetensors orders its header differently every
    time), so the marker that landed names other bytes. The round is still the committed state."""
    from diloco.store.codec import encode_tensors

    first = RoundCheckpoints(store, run_id="run-a", world_size=2)
    assert first.commit(1, state(1.0))
    landed = store.get(data_key(1))
    again = next(d for d in (encode_tensors(state(1.0), first._identity(1)) for _ in range(50)) if d != landed)
    store.put(data_key(1), again)  # the other rank's PUT, which a store ignoring If-None-Match lets through
    got = RoundCheckpoints(store, run_id="run-a", world_size=2).latest()
    assert got is not None and got.round == 1
    assert all(torch.equal(got.tensors[name], t) for name, t in state(1.0).items())


def test_a_tampered_round_is_refused(store: ObjectStore) -> None:
    rounds = RoundCheckpoints(store, run_id="run-a", world_size=2)
    rounds.commit(1, state(1.0))
    data = bytearray(store.get(data_key(1)))
    data[-1] ^= 0xFF
    store.put(data_key(1), bytes(data))
    with pytest.raises(CorruptObjectError, match="failed its checksum"):  # the data's own, whatever the marker says
        rounds.latest()


@pytest.mark.parametrize(("run_id", "world_size", "match"), [("run-b", 2, "belongs to run"),
                                                               ("run-a", 3, "world_size")])
def test_another_runs_or_another_worlds_round_is_refused(store: ObjectStore, run_id: str, world_size: int,
                                                        match: str) -> None:
    RoundCheckpoints(store, run_id="run-a", world_size=2).commit(1, state(1.0))
    with pytest.raises(CorruptObjectError, match=match):
        RoundCheckpoints(store, run_id=run_id, world_size=world_size).latest()


def test_only_the_last_few_rounds_are_kept(store: ObjectStore) -> None:
    rounds = RoundCheckpoints(store, run_id="run-a", world_size=1, keep=3)
    for n in range(1, 7):
        rounds.commit(n, state(float(n)))
    assert rounds.committed_rounds() == [4, 5, 6]
    assert not store.exists(data_key(3))
    latest = rounds.latest()
    assert latest is not None and latest.round == 6
    assert torch.equal(latest.tensors["fragment0.global.w"], state(6.0)["fragment0.global.w"])


def test_round_numbers_and_keep_are_checked() -> None:
    store = ObjectStore(f"memory://ckpt-{uuid.uuid4().hex[:8]}")
    with pytest.raises(ValueError, match="keep"):
        RoundCheckpoints(store, run_id=None, world_size=1, keep=0)
    with pytest.raises(ValueError, match="start at 1"):
        RoundCheckpoints(store, run_id=None, world_size=1).commit(0, state(1.0))
