"""Gather fetches small contributions of every peer at once (``gather._PeerFetches``) and still adds
them in rank order: the same bits as one peer after another, the same errors naming the same rank, and no fetch
left polling or reading once a round has failed or the all-reduce is closed."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from support.ranks import run_ranks  # tests/ is on sys.path

from diloco.collectives import gather
from diloco.collectives.allreduce import ObjectStoreAllReduce, contribution_key
from diloco.collectives.driver import RoundClosed
from diloco.errors import AllReduceTimeout, CorruptObjectError
from diloco.store.objects import ObjectStore

POLL = 0.01
WORLD = 4


def make(uri: str, rank: int, world_size: int = WORLD, **kw: Any) -> ObjectStoreAllReduce:
    return ObjectStoreAllReduce(uri, rank, world_size, timeout_s=kw.pop("timeout_s", 10), poll_interval_s=POLL,
                                compression=kw.pop("compression", "topk"), **kw)


def inputs(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(64, 96, generator=g), "b": torch.randn(96, generator=g) * 1e-3} for _ in range(WORLD)]


def fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("diloco-fetch")]


def no_fetch_threads_soon() -> bool:
    until = time.monotonic() + 10
    while fetch_threads() and time.monotonic() < until:
        time.sleep(0.01)
    return not fetch_threads()


@pytest.mark.parametrize("fmt", ["topk", "int8", "none"])
def test_fetching_every_peer_at_once_sums_the_bits_one_at_a_time_does(tmp_path: Any, fmt: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def rounds(uri: str) -> list[dict[str, torch.Tensor]]:
        def rank_fn(rank: int) -> dict[str, torch.Tensor]:
            with make(uri, rank, compression=fmt) as ar:
                for seed in range(3):  # error feedback carries from round to round
                    tensors = {name: t.clone() for name, t in inputs(seed)[rank].items()}
                    ar.allreduce(tensors)
            return tensors
        return run_ranks(WORLD, rank_fn)

    at_once = rounds(f"file://{tmp_path}/at-once")
    monkeypatch.setattr(gather, "CONCURRENT_READ_MAX_BYTES", 0)  # one peer after another, into one buffer
    in_turn = rounds(f"file://{tmp_path}/in-turn")
    for a, b in zip(at_once, in_turn, strict=True):
        for name in a:
            assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), name
    assert all(torch.equal(at_once[0][n].view(torch.int32), at_once[r][n].view(torch.int32))
               for r in range(WORLD) for n in at_once[0])
    assert no_fetch_threads_soon()


def test_a_missing_peer_times_out_naming_it_and_leaves_no_fetch_waiting(tmp_path: Any) -> None:
    uri = f"file://{tmp_path}/rdv"
    ars = [make(uri, r, timeout_s=1.0) for r in range(WORLD)]
    try:
        ars[1].allreduce_async(dict(inputs(0)[1]))
        ars[2].allreduce_async(dict(inputs(0)[2]))  # rank 3 never shows up
        with pytest.raises(AllReduceTimeout) as info:
            ars[0].allreduce(dict(inputs(0)[0]))
        assert info.value.missing_ranks == [3] and info.value.round == 1
        assert no_fetch_threads_soon()
    finally:
        for ar in ars:
            ar.close()


def test_a_corrupt_peer_is_named_and_nothing_of_the_round_is_averaged(tmp_path: Any) -> None:
    uri = f"file://{tmp_path}/rdv"
    store = ObjectStore(uri)
    ars = [make(uri, r) for r in range(WORLD)]
    try:
        for r in (1, 2, 3):
            ars[r].allreduce_async(dict(inputs(0)[r]))
        key = contribution_key(0, 2)
        while not store.exists(key):
            time.sleep(0.01)
        data = bytearray(store.get(key))
        data[-3] ^= 0xFF  # in the data: only its checksum tells
        store.put(key, bytes(data))
        mine = dict(inputs(0)[0])
        before = {name: t.clone() for name, t in mine.items()}
        with pytest.raises(CorruptObjectError, match="rank 2"):
            ars[0].allreduce(mine)
        assert all(torch.equal(mine[n], before[n]) for n in mine)
        assert no_fetch_threads_soon()
    finally:
        for ar in ars:
            ar.close()


def test_closing_the_all_reduce_stops_its_fetches_waiting_for_late_peers(tmp_path: Any) -> None:
    uri = f"file://{tmp_path}/rdv"
    ar = make(uri, 0, timeout_s=600)
    work = ar.allreduce_async(dict(inputs(0)[0]))  # no peer will come
    until = time.monotonic() + 10
    while len(fetch_threads()) < WORLD - 1 and time.monotonic() < until:
        time.sleep(0.01)
    assert len(fetch_threads()) == WORLD - 1  # every peer's fetch is waiting
    ar.close()
    with pytest.raises(RoundClosed):  # closed long before its 600 s were up
        work.wait()
    assert no_fetch_threads_soon()


def test_a_small_uncompressed_peer_object_is_checked_as_a_streamed_read_checks_it(tmp_path: Any) -> None:
    """Read whole and at once, an fp32 contribution of the wrong shape, dtype, round or format is refused naming
    its rank, and nothing is averaged, as when it is read window by window."""
    from diloco.store.codec import encode_stream

    uri = f"file://{tmp_path}/rdv"
    store = ObjectStore(uri)
    good = {"round": 0, "rank": 2, "world_size": 3}
    cases = {
        "wrong shape": ({"g": torch.full((3,), 7.0)}, good),
        "wrong dtype": ({"g": torch.full((64,), 7.0, dtype=torch.float64)}, good),
        "wrong round": ({"g": torch.full((64,), 7.0)}, {**good, "round": 5}),
        "compressed": ({"g": torch.full((64,), 7.0, dtype=torch.bfloat16)}, {**good, "compression": "bf16",
                                                                             "block": 256}),
    }
    for what, (tensors, meta) in cases.items():
        store.delete_prefix("")
        store.put(contribution_key(0, 1), b"".join(bytes(c) for c in encode_stream(
            {"g": torch.full((64,), 5.0)}, {"round": 0, "rank": 1, "world_size": 3})[1]))
        store.put(contribution_key(0, 2), b"".join(bytes(c) for c in encode_stream(tensors, meta)[1]))
        mine = torch.full((64,), 1.0)
        ar = make(uri, 0, 3, compression="none")
        with pytest.raises(CorruptObjectError, match="rank 2"):
            ar.allreduce({"g": mine})
        assert torch.equal(mine, torch.full((64,), 1.0)), what
        ar.close()
    assert no_fetch_threads_soon()


def test_a_large_payload_is_read_peer_by_peer_however_small_its_wire(tmp_path: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking a sparse contribution decodes its positions, work and memory that scale with the payload, not with
    its bytes on the wire: fetched and checked at once, every peer's would be held together (at 1 GiB and N = 4 a
    rank's peak went from 2.24x the payload to 2.62x). So the payload's size, not the wire's, decides."""
    payload = sum(t.numel() * t.element_size() for t in inputs(0)[0].values())
    started: list[int] = []
    original = gather._PeerFetches.__init__

    def counted(self: Any, *args: Any, **kw: Any) -> None:
        started.append(1)
        original(self, *args, **kw)

    monkeypatch.setattr(gather._PeerFetches, "__init__", counted)

    def one_round(uri: str) -> None:
        def rank_fn(rank: int) -> None:
            with make(uri, rank) as ar:
                ar.allreduce({name: t.clone() for name, t in inputs(0)[rank].items()})
        run_ranks(WORLD, rank_fn)

    monkeypatch.setattr(gather, "CONCURRENT_READ_MAX_BYTES", (WORLD - 1) * payload)
    one_round(f"file://{tmp_path}/fits")
    assert len(started) == WORLD  # every rank fetched its peers at once
    started.clear()
    monkeypatch.setattr(gather, "CONCURRENT_READ_MAX_BYTES", (WORLD - 1) * payload - 1)  # the wire fits many times
    one_round(f"file://{tmp_path}/too-large")
    assert started == []
    assert no_fetch_threads_soon()
