"""``ObjectStoreAllReduce`` over ``s3://`` (moto on loopback) with faults injected by a reverse proxy.

Ranks are threads, each with its own all-reduce and store (so its own S3 client), as separate jobs would have.
What these prove: transient faults (dropped connections, throttling, delays, a cut-off read) are absorbed and
every rank still gets the exact, identical mean; a persistent fault fails with an error that names the round, the
missing rank and the S3 error underneath (not a bare timeout); a truncated contribution is never averaged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.faultproxy import FaultProxy

from diloco.collectives.allreduce import AllReduceStats, ObjectStoreAllReduce, average
from diloco.errors import AllReduceTimeout, CorruptObjectError


def contribution(rank: int, round_: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * round_ + rank)
    return {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g, dtype=torch.float64)}


def run_ranks(uri: str, world: int, rounds: int, *, timeout_s: float = 60.0,
              ranks: list[int] | None = None) -> dict[int, Any]:
    """Run ``rounds`` all-reduces on each rank in its own thread; per rank, its tensors per round or its error."""
    results: dict[int, Any] = {}

    def body(rank: int) -> None:
        outs = []
        try:
            with ObjectStoreAllReduce(uri, rank, world, timeout_s=timeout_s, poll_interval_s=0.05) as ar:
                for r in range(rounds):
                    tensors = contribution(rank, r)
                    ar.allreduce(tensors)
                    outs.append(tensors)
                results[rank] = (outs, ar.stats)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(rank,)) for rank in (ranks if ranks is not None else range(world))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def deadline_from_a_clean_round(uri: str, world: int = 2) -> float:
    """A round deadline sized by the work: four times what one fault-free round of these contributions takes here
    (on a sibling prefix, before any fault is armed), and never under 2 s. A test that must wait a round out
    (a persistent fault) then waits about as long as the machine needs, on an idle laptop or a loaded CI runner."""
    import time

    start = time.monotonic()
    results = run_ranks(uri.rstrip("/") + "-calibration", world=world, rounds=1)
    assert all(not isinstance(r, BaseException) for r in results.values()), results
    return max(2.0, 4 * (time.monotonic() - start))


def expected_mean(world: int, round_: int) -> dict[str, torch.Tensor]:
    mean = average([contribution(rank, round_) for rank in range(world)])
    return {k: v.to(contribution(0, 0)[k].dtype) for k, v in mean.items()}


def assert_exact_and_identical(results: dict[int, Any], world: int, rounds: int) -> None:
    for rank in range(world):
        assert not isinstance(results[rank], BaseException), f"rank {rank} failed: {results[rank]!r}"
    for r in range(rounds):
        want = expected_mean(world, r)
        for rank in range(world):
            got = results[rank][0][r]
            for name in want:
                assert torch.equal(got[name], want[name]), f"rank {rank} round {r} {name} differs"


def test_allreduce_over_s3_is_exact(s3_uri: str, bucket_keys: Callable[[str], list[str]], s3_bucket: str) -> None:
    results = run_ranks(s3_uri, world=3, rounds=2)
    assert_exact_and_identical(results, 3, 2)
    stats: AllReduceStats = results[0][1]
    assert stats.rounds == 2 and stats.bytes_read > 0 and stats.bytes_written > 0
    prefix = s3_uri.split("/", 3)[3]
    # Layout pinned by the interface: round_NNNNNN/rank_RRRR.safetensors at the rendezvous root; round 0 deleted.
    assert sorted(bucket_keys(s3_bucket)) == [f"{prefix}/round_000001/rank_{r:04d}.safetensors" for r in range(3)]


def test_transient_faults_are_absorbed(s3_uri: str, fault_proxy: FaultProxy) -> None:
    drops = fault_proxy.add("drop", probability=0.15)
    throttles = fault_proxy.add("status", method="PUT", status=503, code="SlowDown", probability=0.3)
    slow = fault_proxy.add("delay", delay_s=0.05, probability=0.3)
    cut = fault_proxy.add("truncate", method="GET", path=r"rank_0002", times=1)
    results = run_ranks(s3_uri, world=3, rounds=3)
    assert_exact_and_identical(results, 3, 3)
    assert drops.fired > 0 and throttles.fired > 0 and slow.fired > 0 and cut.fired == 1


def test_persistent_denial_names_round_ranks_and_s3_error(s3_uri: str, fault_proxy: FaultProxy) -> None:
    deadline_s = deadline_from_a_clean_round(s3_uri)  # bounds our own upload too: a fixed one was missed under load
    fault_proxy.add("status", method="HEAD", path=r"/round_000000/rank_0001", status=403, code="AccessDenied")
    fault_proxy.add("status", method="GET", path=r"/round_000000/rank_0001", status=403, code="AccessDenied")
    results = run_ranks(s3_uri, world=2, rounds=1, timeout_s=deadline_s)
    err = results[0]
    assert isinstance(err, AllReduceTimeout)
    assert err.round == 1 and err.missing_ranks == [1]
    assert isinstance(err.last_error, PermissionError)
    text = str(err)
    assert "round 1" in text and "rank(s) 1" in text and "S3AccessDenied" in text and "denied by S3 (403)" in text
    assert not isinstance(results[1], BaseException)  # rank 1 could read rank 0: only the denied read failed


def test_persistent_throttling_is_reported_not_a_bare_timeout(
    s3_uri: str, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # keep the bounded retries short for the test
    deadline_s = deadline_from_a_clean_round(s3_uri)  # room for our own upload on a busy machine
    fault_proxy.add("status", method="HEAD", path=r"/rank_0001", status=503, code="SlowDown")
    results = run_ranks(s3_uri, world=2, rounds=1, timeout_s=deadline_s)
    err = results[0]
    assert isinstance(err, AllReduceTimeout) and err.missing_ranks == [1]
    assert "exists" in str(err.last_error) and "HTTP 503" in str(err.last_error)


def test_truncated_contribution_is_never_averaged(s3_uri: str, fault_proxy: FaultProxy) -> None:
    fault_proxy.add("truncate", method="GET", path=r"/round_000000/rank_0001")
    uri = s3_uri
    mine = contribution(0, 0)
    before = {k: v.clone() for k, v in mine.items()}
    outcome: dict[str, Any] = {}

    def rank1() -> None:
        with ObjectStoreAllReduce(uri, 1, 2, timeout_s=30, poll_interval_s=0.05) as ar:
            ar.allreduce(contribution(1, 0))
            outcome["rank1"] = "ok"

    t = threading.Thread(target=rank1)
    t.start()
    with ObjectStoreAllReduce(uri, 0, 2, timeout_s=30, poll_interval_s=0.05) as ar, \
            pytest.raises(CorruptObjectError, match=r"round 1: the contribution of rank 1 .* not averaged"):
        ar.allreduce(mine)
    t.join(timeout=60)
    assert all(torch.equal(mine[k], before[k]) for k in mine)  # untouched
    assert outcome.get("rank1") == "ok"


# ---------------------------------------------------------------- sharded over S3
@pytest.mark.parametrize("world", [2, 4, 8])
def test_sharded_over_s3_is_exact_and_reads_within_5_percent_of_the_bound(s3_uri: str, world: int) -> None:
    """Ranged GETs through s3fs/botocore against moto: bitwise-identical means, and the bytes each rank's store
    counted for one round within 5% of 2S(N-1)/N (S = 8 MiB of fp32)."""
    from support.ranks import run_ranks as run_rank_fns

    from diloco.collectives.allreduce import ShardedAllReduce

    elements = 2 * 2**20

    def rank_fn(rank: int) -> tuple[int, torch.Tensor]:
        g = torch.Generator().manual_seed(rank)
        t = torch.randn(elements, generator=g)
        with ShardedAllReduce(s3_uri, rank, world, timeout_s=60, poll_interval_s=0.05) as ar:
            before = ar.store.traffic
            ar.allreduce({"g": t})
            return (ar.store.traffic - before).bytes_read, t

    results = run_rank_fns(world, rank_fn, timeout=180)
    want = average([{"g": torch.randn(elements, generator=torch.Generator().manual_seed(r))} for r in range(world)])
    bound = 2 * elements * 4 * (world - 1) / world
    for read, t in results:
        assert torch.equal(t, want["g"])
        assert bound <= read <= 1.05 * bound, f"read {read} bytes, bound {bound:.0f}"


def test_sharded_absorbs_transient_faults_and_a_cut_off_ranged_read(s3_uri: str, fault_proxy: FaultProxy) -> None:
    from support.ranks import run_ranks as run_rank_fns

    from diloco.collectives.allreduce import ShardedAllReduce

    drops = fault_proxy.add("drop", probability=0.1)
    cut = fault_proxy.add("truncate", method="GET", path=r"rank_0001", times=1)
    world = 3

    def rank_fn(rank: int) -> dict[str, torch.Tensor]:
        tensors = contribution(rank, 0)
        tensors["b"] = tensors["b"].float()  # sharded averages in fp32
        with ShardedAllReduce(s3_uri, rank, world, timeout_s=60, poll_interval_s=0.05) as ar:
            ar.allreduce(tensors)
        return tensors

    results = run_rank_fns(world, rank_fn, timeout=120)
    inputs = []
    for r in range(world):
        c = contribution(r, 0)
        c["b"] = c["b"].float()
        inputs.append(c)
    want = average(inputs)
    for out in results:
        assert all(torch.equal(out[k], want[k]) for k in want)
    assert drops.fired > 0 and cut.fired == 1
