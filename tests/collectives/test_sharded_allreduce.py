"""The sharded all-reduce (reduce-scatter + all-gather through the store), the shared protocol and the request
layout, with real stores (memory:// and file://) and ranks as threads.

What these prove: the sharded mean is bitwise identical on every rank and to gather's, with every compression
format; the bytes a rank reads per round, counted by the store itself, are within 5% of 2S(N-1)/N; a corrupt or
missing object (a contribution's shard or a reduced shard) names the round and the rank and is never averaged;
the round runs in the background so ``wait()`` finds the mean already local; ``spread`` moves the keys under
several prefixes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch
from support.ranks import run_ranks  # tests/ is on sys.path

from diloco.collectives.allreduce import (
    ObjectStoreAllReduce,
    ShardedAllReduce,
    average,
    contribution_key,
    create_allreduce,
)
from diloco.errors import AllReduceTimeout, ConfigError, CorruptObjectError
from diloco.store import codec
from diloco.store.layout import reduced_shard_key
from diloco.store.objects import ObjectStore

POLL = 0.01
FORMATS = ("none", "bf16", "int8", "int4")


@pytest.fixture(params=["memory", "file"])
def uri(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "memory":
        return f"memory://rdv-{uuid.uuid4().hex[:8]}"
    return f"file://{tmp_path}/rdv"


def sharded(uri: str, rank: int, world: int, **kw: Any) -> ShardedAllReduce:
    return ShardedAllReduce(uri, rank, world, timeout_s=kw.pop("timeout_s", 20), poll_interval_s=POLL, **kw)


def order_sensitive(rank: int, shape: tuple[int, ...] = (33, 65)) -> dict[str, torch.Tensor]:
    """Magnitudes over 16 orders, so a sum in another order (or in another precision) gives other bits."""
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-8, 8, shape, generator=g)
    return {"w": w, "b": torch.randn(7, generator=g), "h": torch.randn(3, 5, generator=g).to(torch.bfloat16)}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ---------------------------------------------------------------- results
def test_sharded_mean_is_bitwise_identical_on_every_rank_and_to_gather(uri: str) -> None:
    world = 3
    inputs = [order_sensitive(r) for r in range(world)]
    reference = average(inputs)
    reversed_sum = (inputs[2]["w"] + inputs[1]["w"] + inputs[0]["w"]) / 3
    assert not torch.equal(reference["w"], reversed_sum), "test data must be sensitive to summation order"

    def rank_fn(rank: int) -> dict[str, torch.Tensor]:
        tensors = {k: v.clone() for k, v in inputs[rank].items()}
        with sharded(uri, rank, world) as ar:
            ar.allreduce(tensors)
        return tensors

    for out in run_ranks(world, rank_fn):
        for name, t in out.items():
            assert t.dtype == inputs[0][name].dtype
            assert torch.equal(bits(t), bits(reference[name].to(t.dtype))), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_compression_format_gives_identical_results_on_every_rank(fmt: str, tmp_path: Any) -> None:
    """Sharded and gather, three rounds each (error feedback carries residuals from round to round)."""
    world, rounds = 3, 3
    for strategy in ("gather", "sharded"):
        uri = f"file://{tmp_path}/{strategy}"

        def rank_fn(rank: int, strategy: str = strategy, uri: str = uri) -> list[dict[str, torch.Tensor]]:
            outs = []
            with create_allreduce(uri, rank, world, allreduce=strategy, compression=fmt, timeout_s=20,
                                  poll_interval_s=POLL) as ar:
                for k in range(rounds):
                    tensors = {name: t * (k + 1) for name, t in order_sensitive(rank).items() if name != "h"}
                    ar.allreduce(tensors)
                    outs.append(tensors)
            return outs

        results = run_ranks(world, rank_fn)
        for k in range(rounds):
            truth = average([{n: t * (k + 1) for n, t in order_sensitive(r).items() if n != "h"}
                             for r in range(world)])
            for rank in range(1, world):
                for name in truth:
                    assert torch.equal(bits(results[rank][k][name]), bits(results[0][k][name])), (strategy, k, name)
            got = results[0][k]["b"]
            if fmt == "none":
                assert torch.equal(got, truth["b"])
            else:  # lossy, but a mean of the right values (the bound is loose: int4 has 15 levels)
                assert torch.allclose(got, truth["b"], atol=0.6 * float(truth["b"].abs().max()) + 1e-6), strategy


def test_compressed_rounds_write_fewer_bytes(tmp_path: Any) -> None:
    world = 2
    written = {}
    for fmt in ("none", "int8"):
        def rank_fn(rank: int, fmt: str = fmt) -> int:
            with sharded(f"file://{tmp_path}/{fmt}", rank, world, compression=fmt) as ar:
                ar.allreduce({"w": torch.randn(64 * 1024)})
                return ar.stats.bytes_written

        written[fmt] = run_ranks(world, rank_fn)[0]
    assert written["none"] / written["int8"] > 3.5


# ---------------------------------------------------------------- traffic
@pytest.mark.parametrize("world", [2, 4, 8])
def test_bytes_read_per_rank_per_round_are_within_5_percent_of_the_bound(world: int, tmp_path: Any) -> None:
    """Counted by each rank's own store (``ObjectStore.traffic``), round 2 (round 1 warms up nothing here, but
    round 2 also deletes round 1's objects: the steady state)."""
    elements = 2 * 2**20  # 8 MiB of fp32
    payload = elements * 4
    uri = f"file://{tmp_path}/rdv"

    def rank_fn(rank: int) -> tuple[int, int]:
        with sharded(uri, rank, world) as ar:
            ar.allreduce({"g": torch.full((elements,), float(rank))})
            before = ar.store.traffic
            g = torch.full((elements,), float(rank))
            ar.allreduce({"g": g})
            used = ar.store.traffic - before
            assert torch.equal(g, torch.full((elements,), (world - 1) / 2))
            return used.bytes_read, used.bytes_written

    bound = 2 * payload * (world - 1) / world
    for read, written in run_ranks(world, rank_fn, timeout=120):
        assert bound <= read <= 1.05 * bound, f"read {read} bytes, bound {bound:.0f}"
        assert payload < written < 1.05 * (payload + payload / world)


def test_gather_reads_n_minus_one_payloads_for_comparison(tmp_path: Any) -> None:
    world, elements = 4, 64 * 1024
    uri = f"file://{tmp_path}/rdv"

    def rank_fn(rank: int) -> int:
        with ObjectStoreAllReduce(uri, rank, world, timeout_s=20, poll_interval_s=POLL) as ar:
            before = ar.store.traffic
            ar.allreduce({"g": torch.ones(elements)})
            return (ar.store.traffic - before).bytes_read

    for read in run_ranks(world, rank_fn):  # each peer: a header probe, then its data in verified ranges
        assert (world - 1) * elements * 4 <= read <= (world - 1) * (elements * 4 + codec.HEADER_PROBE_BYTES)


# ---------------------------------------------------------------- overlap
def test_the_round_completes_in_the_background_before_wait(uri: str) -> None:
    """With every peer present, the mean becomes local while the caller is still 'training'; wait() only copies."""
    world = 2
    works = {}

    def rank_fn(rank: int) -> torch.Tensor:
        ar = sharded(uri, rank, world)
        t = torch.full((1000,), float(rank))
        works[rank] = work = ar.allreduce_async({"t": t})
        deadline = time.monotonic() + 20
        while not work.is_ready():  # the inner steps of Streaming DiLoCo's delay would run here
            assert time.monotonic() < deadline, "the round never completed in the background"
            time.sleep(POLL)
        assert not work.is_completed()
        assert torch.equal(t, torch.full((1000,), float(rank)))  # nothing written back before wait()
        work.wait()
        ar.close()
        return t

    for t in run_ranks(world, rank_fn):
        assert torch.equal(t, torch.full((1000,), 0.5))


# ---------------------------------------------------------------- store layout and cleanup
def test_old_rounds_are_deleted_and_the_last_round_remains(uri: str) -> None:
    world, rounds = 3, 5

    def rank_fn(rank: int) -> int:
        peak = 0
        with sharded(uri, rank, world) as ar:
            for k in range(rounds):
                t = torch.full((10,), float(rank + k))
                ar.allreduce({"t": t})
                assert torch.equal(t, torch.full((10,), 1.0 + k))
                peak = max(peak, len(ar.store.list()))
            return peak

    peaks = run_ranks(world, rank_fn)
    assert max(peaks) <= 4 * world  # two rounds of (contribution + reduced shard) per rank at most
    last = rounds - 1
    assert ObjectStore(uri).list() == sorted([contribution_key(last, r) for r in range(world)]
                                             + [reduced_shard_key(last, r) for r in range(world)])


@pytest.mark.parametrize("strategy", ["gather", "sharded"])
def test_spread_puts_the_round_keys_under_several_prefixes(strategy: str, tmp_path: Any) -> None:
    world, spread = 4, 2
    uri = f"file://{tmp_path}/rdv"

    def rank_fn(rank: int) -> torch.Tensor:
        with create_allreduce(uri, rank, world, allreduce=strategy, spread=spread, timeout_s=20,
                              poll_interval_s=POLL) as ar:
            t = torch.full((300,), float(rank))
            ar.allreduce([t])
            assert ar.has_own_contribution(0)
            return t

    for t in run_ranks(world, rank_fn):
        assert torch.equal(t, torch.full((300,), 1.5))
    keys = ObjectStore(uri).list()
    assert {k.split("/")[0] for k in keys} == {"p0", "p1"}
    assert "p1/round_000000/rank_0003.safetensors" in keys and "p0/round_000000/rank_0002.safetensors" in keys
    if strategy == "sharded":
        assert "p1/round_000000/shard_0001.safetensors" in keys


# ---------------------------------------------------------------- failures
def publish_only(uri: str, rank: int, world: int, **kw: Any) -> ShardedAllReduce:
    """A rank that uploads its contribution and then dies (closed before it could publish a reduced shard)."""
    ar = sharded(uri, rank, world, **kw)
    ar.allreduce_async({"g": torch.full((1024,), 7.0)})
    deadline = time.monotonic() + 20
    while not ar.store.exists(contribution_key(0, rank)):
        assert time.monotonic() < deadline
        time.sleep(POLL)
    ar.close(wait=False)
    return ar


def test_a_corrupted_shard_of_a_peer_names_the_round_and_rank_and_is_never_averaged(tmp_path: Any) -> None:
    uri = f"file://{tmp_path}/rdv"
    publish_only(uri, 1, 2)
    store = ObjectStore(uri)
    key = contribution_key(0, 1)
    header = codec.read_header(store, key)
    path = tmp_path / "rdv" / key
    raw = bytearray(path.read_bytes())
    raw[header.data_offset + header.tensors["shard_0000"].begin + 5] ^= 0xFF  # inside rank 0's shard
    path.write_bytes(bytes(raw))
    mine = torch.full((1024,), 1.0)
    with sharded(uri, 0, 2) as ar, pytest.raises(CorruptObjectError) as info:
        ar.allreduce({"g": mine})
    assert "round 1" in str(info.value) and "rank 1" in str(info.value) and "chunk" in str(info.value)
    assert torch.equal(mine, torch.full((1024,), 1.0))


def test_a_missing_reduced_shard_times_out_naming_its_owner(uri: str) -> None:
    publish_only(uri, 1, 2)
    with sharded(uri, 0, 2, timeout_s=0.5) as ar, pytest.raises(AllReduceTimeout) as info:
        ar.allreduce({"g": torch.full((1024,), 1.0)})
    assert info.value.round == 1 and info.value.missing_ranks == [1]


def test_a_reduced_shard_of_another_round_is_corrupt_naming_its_owner(uri: str) -> None:
    publish_only(uri, 1, 2)
    _, chunks = codec.encode_stream({"x": torch.zeros(512)}, {"round": 7, "rank": 1, "world_size": 2})
    ObjectStore(uri).put(reduced_shard_key(0, 1), b"".join(bytes(c) for c in chunks))
    mine = torch.full((1024,), 1.0)
    with sharded(uri, 0, 2) as ar, pytest.raises(CorruptObjectError) as info:
        ar.allreduce({"g": mine})
    message = str(info.value)
    assert "round 1" in message and "reduced shard of rank 1" in message and "round='7'" in message
    assert torch.equal(mine, torch.full((1024,), 1.0))


def test_a_peer_with_another_compression_format_is_corrupt(tmp_path: Any) -> None:
    uri = f"file://{tmp_path}/rdv"
    publish_only(uri, 1, 2, compression="int8")
    with sharded(uri, 0, 2) as ar, pytest.raises(CorruptObjectError, match="rank 1"):
        ar.allreduce({"g": torch.full((1024,), 1.0)})


def test_a_leftover_of_another_run_is_rejected(uri: str) -> None:
    publish_only(uri, 1, 2, run_id="old")
    with sharded(uri, 0, 2, run_id="new") as ar, pytest.raises(CorruptObjectError, match="run_id='old'"):
        ar.allreduce({"g": torch.full((1024,), 1.0)})


# ---------------------------------------------------------------- construction
def test_create_allreduce_builds_the_strategy_asked_for_and_names_bad_settings() -> None:
    assert isinstance(create_allreduce("memory://x", 0, 2, allreduce="sharded"), ShardedAllReduce)
    assert isinstance(create_allreduce("memory://x", 0, 2), ObjectStoreAllReduce)
    with pytest.raises(ConfigError, match="store.allreduce"):
        create_allreduce("memory://x", 0, 2, allreduce="ring")
    with pytest.raises(ConfigError, match="store.compression"):
        create_allreduce("memory://x", 0, 2, compression="fp8")
    with pytest.raises(ConfigError, match="store.spread"):
        create_allreduce("memory://x", 0, 2, spread=0)


def test_sharded_refuses_fp64_naming_the_tensor_and_the_fix() -> None:
    with sharded("memory://x", 0, 1) as ar, pytest.raises(TypeError, match="'d' is float64.*gather"):
        ar.allreduce_async({"d": torch.ones(3, dtype=torch.float64)})
