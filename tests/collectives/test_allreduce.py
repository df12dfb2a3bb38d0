"""ObjectStoreAllReduce with real stores (memory:// and file://) and ranks as threads."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.ranks import run_ranks  # tests/ is on sys.path

from diloco.collectives.allreduce import AllReduceStats, ObjectStoreAllReduce, average, contribution_key
from diloco.collectives.driver import RoundIO
from diloco.errors import AllReduceTimeout, ConfigError, CorruptObjectError, DilocoError, StoreError
from diloco.store.codec import decode_tensors, encode_stream, encode_tensors
from diloco.store.objects import ObjectStore

POLL = 0.01


@pytest.fixture(params=["memory", "file"])
def uri(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "memory":
        return f"memory://rdv-{uuid.uuid4().hex[:8]}"
    return f"file://{tmp_path}/rdv"


def streamed(tensors: dict[str, torch.Tensor], metadata: dict[str, str | int]) -> bytes:
    """An object exactly as a rank publishes it (``codec.encode_stream``, verifiable by ranges)."""
    return b"".join(bytes(chunk) for chunk in encode_stream(tensors, metadata)[1])


def make(uri: str, rank: int, world_size: int, **kw: Any) -> ObjectStoreAllReduce:
    return ObjectStoreAllReduce(uri, rank, world_size, timeout_s=kw.pop("timeout_s", 10), poll_interval_s=POLL, **kw)


# ---------------------------------------------------------------- results
def test_three_ranks_get_bitwise_identical_rank_order_mean(uri: str) -> None:
    gen = torch.Generator().manual_seed(0)
    # Magnitudes spread over 16 orders so the fp32 sum depends on the order of the additions.
    inputs = [torch.randn(4096, generator=gen) * 10.0 ** torch.randint(-8, 8, (4096,), generator=gen)
              for _ in range(3)]
    reference = average([{"x": t} for t in inputs])["x"]
    reversed_order = (inputs[2] + inputs[1] + inputs[0]) / 3
    assert not torch.equal(reference, reversed_order), "test data must be sensitive to summation order"
    assert torch.equal(reference, ((inputs[0] + inputs[1]) + inputs[2]) / 3)

    def rank_fn(rank: int) -> torch.Tensor:
        t = inputs[rank].clone()
        with make(uri, rank, 3) as ar:
            ar.allreduce({"x": t})
        return t

    outs = run_ranks(3, rank_fn)
    for out in outs:
        assert torch.equal(out.view(torch.int32), reference.view(torch.int32))


def test_mean_is_written_in_place_keeping_dtype_device_and_identity(uri: str) -> None:
    def rank_fn(rank: int) -> list[torch.Tensor]:
        tensors = [
            torch.full((3,), float(rank), dtype=torch.float32),
            torch.full((2, 2), float(rank * 2), dtype=torch.float16),
            torch.full((1,), float(rank * 4), dtype=torch.float64),
        ]
        ids = [id(t) for t in tensors]
        with make(uri, rank, 2) as ar:
            ar.allreduce(tensors)  # a list: names t0..t2 on the wire
        assert [id(t) for t in tensors] == ids
        return tensors

    for tensors in run_ranks(2, rank_fn):
        assert [t.dtype for t in tensors] == [torch.float32, torch.float16, torch.float64]
        assert all(t.device.type == "cpu" for t in tensors)
        assert torch.equal(tensors[0], torch.full((3,), 0.5))
        assert torch.equal(tensors[1], torch.full((2, 2), 1.0, dtype=torch.float16))
        assert torch.equal(tensors[2], torch.full((1,), 2.0, dtype=torch.float64))


def test_bf16_is_accumulated_in_fp32(uri: str) -> None:
    # In bf16, 256 + 1 rounds back to 256 (spacing 2 above 256), so a bf16 sum would give 256/3 -> 85.5.
    values = [256.0, 1.0, 1.0]
    assert torch.tensor(256.0, dtype=torch.bfloat16) + torch.tensor(1.0, dtype=torch.bfloat16) == 256.0

    def rank_fn(rank: int) -> torch.Tensor:
        t = torch.full((8,), values[rank], dtype=torch.bfloat16)
        with make(uri, rank, 3) as ar:
            ar.allreduce({"w": t})
        return t

    for out in run_ranks(3, rank_fn):
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, torch.full((8,), 86.0, dtype=torch.bfloat16))  # (256 + 1 + 1) / 3 exactly


def test_single_rank_is_identity_and_layout_is_pinned(uri: str) -> None:
    t = torch.arange(5, dtype=torch.float32)
    with make(uri, 0, 1) as ar:
        ar.allreduce({"t": t})
        assert torch.equal(t, torch.arange(5, dtype=torch.float32))
        keys = ar.store.list()
    assert keys == ["round_000000/rank_0000.safetensors"] == [contribution_key(0, 0)]
    tensors, meta = decode_tensors(ObjectStore(uri).get(keys[0]), expect={"round": 0, "rank": 0, "world_size": 1})
    assert torch.equal(tensors["t"], t)


def test_old_rounds_are_deleted_so_the_store_stays_bounded(uri: str) -> None:
    world, rounds = 3, 12
    peak: list[int] = [0] * world

    def rank_fn(rank: int) -> AllReduceStats:
        with make(uri, rank, world) as ar:
            for k in range(rounds):
                t = torch.full((4,), float(rank + k))
                ar.allreduce({"t": t})
                assert torch.equal(t, torch.full((4,), 1.0 + k))
                peak[rank] = max(peak[rank], len(ar.store.list()))
            return ar.stats

    stats = run_ranks(world, rank_fn)
    # Each rank holds at most its previous and its current round.
    assert max(peak) <= 2 * world
    assert ObjectStore(uri).list() == [contribution_key(rounds - 1, r) for r in range(world)]
    for s in stats:
        assert s.rounds == rounds
        assert s.bytes_written > 0 and s.bytes_read > 0
        # every rank reads each peer's object exactly once per round, all objects being the same size
        assert s.bytes_read == s.bytes_written * (world - 1)
        assert s.seconds_blocked > 0


# ---------------------------------------------------------------- async
def test_allreduce_async_returns_before_peers_write_and_wait_gives_the_mean(uri: str) -> None:
    ar0 = make(uri, 0, 2)
    t0 = torch.full((16,), 2.0)
    work = ar0.allreduce_async({"g": t0})
    # The caller keeps going: the peer has not even started, and changing t0 now does not change what was sent.
    t0.add_(100.0)
    deadline = time.monotonic() + 10
    while not ar0.store.exists(contribution_key(0, 0)):  # the upload runs in the background
        assert time.monotonic() < deadline, "rank 0's upload never appeared"
        time.sleep(POLL)
    assert not ar0.store.exists(contribution_key(0, 1))
    assert not work.is_completed()

    peer_out = torch.full((16,), 4.0)
    peer = threading.Thread(target=lambda: make(uri, 1, 2).allreduce({"g": peer_out}), daemon=True)
    peer.start()
    assert work.wait() is True
    peer.join(10)
    assert torch.equal(t0, torch.full((16,), 3.0))
    assert torch.equal(peer_out, torch.full((16,), 3.0))
    assert work.wait() is True  # idempotent
    ar0.close()


def test_wait_reraises_upload_errors_and_the_instance_refuses_later_rounds(tmp_path: Any) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the rendezvous directory should be")
    ar = make(f"file://{blocker}/rdv", 0, 1)
    work = ar.allreduce_async({"g": torch.ones(2)})
    with pytest.raises(OSError):
        work.wait()
    with pytest.raises(OSError):  # the same error again, not a silent success
        work.wait()
    with pytest.raises(DilocoError, match="already failed"):
        ar.allreduce_async({"g": torch.ones(2)})
    ar.close()


def test_a_stuck_upload_fails_the_round_instead_of_hanging(uri: str) -> None:
    ar = make(uri, 0, 1, timeout_s=0.3)
    release = threading.Event()
    real_put = ar.store.put_stream
    ar.store.put_stream = lambda key, chunks, size=None: (release.wait(30),  # type: ignore[method-assign]
                                                          real_put(key, chunks, size))[1]
    try:
        work = ar.allreduce_async({"g": torch.ones(2)})
        started = time.monotonic()
        with pytest.raises(StoreError, match=r"round 1: rank 0's own upload .* did not finish in 0.3s"):
            work.wait()
        assert time.monotonic() - started < 10
    finally:
        release.set()
        ar.close()


def test_starting_a_round_before_waiting_the_previous_one_is_refused(uri: str) -> None:
    with make(uri, 0, 1) as ar:
        work = ar.allreduce_async({"g": torch.ones(2)})
        with pytest.raises(RuntimeError, match="never waited"):
            ar.allreduce_async({"g": torch.ones(2)})
        work.wait()
        ar.allreduce({"g": torch.ones(2)})
        assert ar.next_round == 2


# ---------------------------------------------------------------- failures
def test_timeout_names_the_round_and_exactly_the_missing_ranks(uri: str) -> None:
    world = 4
    ars = [make(uri, r, world, timeout_s=1.0) for r in range(world)]
    run_ranks(world, lambda r: ars[r].allreduce({"g": torch.ones(2)}))  # round 1 (index 0) completes

    # Round 2 (index 1): rank 2 publishes (and does not wait), ranks 1 and 3 never show up. Messages and the
    # error's `round` number rounds from 1, like the metrics and the CLI.
    ars[2].allreduce_async({"g": torch.ones(2)})
    started = time.monotonic()
    with pytest.raises(AllReduceTimeout) as info:
        ars[0].allreduce({"g": torch.ones(2)})
    elapsed = time.monotonic() - started
    err = info.value
    assert err.round == 2
    assert err.missing_ranks == [1, 3]
    assert "round 2" in str(err) and "1, 3" in str(err)
    assert err.timeout_s == 1.0
    assert elapsed >= 1.0  # it did wait for the configured time...
    assert elapsed < 20.0  # ...and gave up (generous bound: a hang would be caught here)
    for ar in ars:
        ar.close()


def test_a_wait_polls_quickly_first_then_backs_off_to_the_poll_interval(tmp_path: Any) -> None:
    """Peers finish a phase close together: the first polls of a wait come after 1/16, 1/8, ... of the interval,
    so an object that was almost there is noticed soon; a late one costs one poll per interval."""
    store = ObjectStore(f"file://{tmp_path}/store")

    class RecordedWaits(threading.Event):
        """The round's stop event, recording how long each poll waited; the peer's object lands at the 7th."""

        def __init__(self) -> None:
            super().__init__()
            self.timeouts: list[float] = []

        def wait(self, timeout: float | None = None) -> bool:
            self.timeouts.append(float(timeout or 0))
            if len(self.timeouts) == 7:
                store.put("peer-object", b"x")
            return False

    stop = RecordedWaits()
    io = RoundIO(store, 0, 2, timeout_s=600, poll_interval_s=1.6, run_id=None, spread=1, stats=AllReduceStats(),
                 stats_lock=threading.Lock(), stop=stop)
    io.await_object(0, 1, lambda rank: "peer-object", io.deadline())
    assert stop.timeouts == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 1.6, 1.6])


def test_timeout_reports_the_last_store_error_seen_while_polling(tmp_path: Any) -> None:
    # A store that fails (not "not found") for rank 1's key: a symlink loop makes every stat raise ELOOP, the
    # local stand-in for a 403. The timeout must say so instead of blaming a slow peer.
    uri = f"file://{tmp_path}/rdv"
    round_dir = tmp_path / "rdv" / "round_000000"
    round_dir.mkdir(parents=True)
    (round_dir / "rank_0001.safetensors").symlink_to("rank_0001.safetensors")
    ar = make(uri, 0, 2, timeout_s=0.5)
    ar.store = ObjectStore(uri, retries=0)  # a real store that gives up at once, to keep the test short
    with pytest.raises(AllReduceTimeout) as info:
        ar.allreduce({"g": torch.ones(2)})
    assert info.value.missing_ranks == [1]
    assert info.value.last_error is not None
    assert "last store error" in str(info.value) and "symbolic links" in str(info.value)
    ar.close()


def test_a_peer_being_relaunched_extends_the_wait_past_the_timeout(uri: str) -> None:
    """The launcher records ``relaunch/rank_0001.json`` with an ``until`` time: rank 0 waits for the new rank 1
    past its own timeout instead of failing, and gets the mean once rank 1's contribution lands."""
    import json

    from diloco.store.layout import RELAUNCH_KEY

    r0 = make(uri, 0, 2, timeout_s=0.2)
    r0.store.put(RELAUNCH_KEY.format(rank=1), json.dumps({"until": time.time() + 20}).encode())
    x = [torch.tensor([1.0])]
    work = r0.allreduce_async(x)
    late = threading.Timer(0.6, lambda: make(uri, 1, 2).allreduce([torch.tensor([3.0])]))
    late.start()
    work.wait()
    late.join()
    assert torch.equal(x[0], torch.tensor([2.0]))


def test_an_expired_relaunch_record_does_not_extend_the_wait(uri: str) -> None:
    import json

    from diloco.store.layout import RELAUNCH_KEY

    r0 = make(uri, 0, 2, timeout_s=0.2)
    r0.store.put(RELAUNCH_KEY.format(rank=1), json.dumps({"until": time.time() - 1}).encode())
    with pytest.raises(AllReduceTimeout, match="rank\\(s\\) 1"):
        r0.allreduce([torch.tensor([1.0])])


def test_resume_at_sets_the_next_round_only_before_any_round(uri: str) -> None:
    r = make(uri, 0, 1)
    r.resume_at(5)
    assert r.next_round == 5
    r.allreduce([torch.tensor([1.0])])
    assert r.store.exists(contribution_key(5, 0)) and r.has_own_contribution(5)
    with pytest.raises(RuntimeError, match="already started"):
        r.resume_at(2)


def test_corrupted_and_truncated_peer_objects_are_reported_and_never_averaged(uri: str) -> None:
    store = ObjectStore(uri)
    good = streamed({"g": torch.full((64,), 7.0)}, {"round": 0, "rank": 1, "world_size": 2})
    flipped = bytearray(good)
    flipped[-10] ^= 0xFF  # inside the tensor data: only the checksum can tell
    header_flipped = bytearray(good)
    header_flipped[20] ^= 0x01  # inside the header's JSON: its own digest must catch it
    cases = {
        "flipped byte": bytes(flipped),
        "flipped header": bytes(header_flipped),
        "truncated": good[: len(good) // 2],
        "not streamed": encode_tensors({"g": torch.full((64,), 7.0)}, {"round": 0, "rank": 1, "world_size": 2}),
        "wrong round": streamed({"g": torch.full((64,), 7.0)}, {"round": 5, "rank": 1, "world_size": 2}),
        "wrong shape": streamed({"g": torch.full((3,), 7.0)}, {"round": 0, "rank": 1, "world_size": 2}),
        "wrong dtype": streamed({"g": torch.full((64,), 7.0, dtype=torch.float64)},
                                {"round": 0, "rank": 1, "world_size": 2}),
        "compressed": streamed({"g": torch.full((64,), 7.0, dtype=torch.bfloat16)},
                               {"round": 0, "rank": 1, "world_size": 2, "compression": "bf16", "block": 256}),
    }
    for what, data in cases.items():
        store.delete_prefix("")
        store.put(contribution_key(0, 1), data)
        mine = torch.full((64,), 1.0)
        ar = make(uri, 0, 2)
        with pytest.raises(CorruptObjectError) as info:
            ar.allreduce({"g": mine})
        message = str(info.value)
        assert "round 1" in message and "rank 1" in message, what  # index 0 is round 1 for people
        assert torch.equal(mine, torch.full((64,), 1.0)), f"{what}: a bad contribution was averaged"
        assert ar.stats.rounds == 0
        ar.close()


def test_a_leftover_of_another_run_in_a_reused_prefix_is_rejected_not_averaged(uri: str) -> None:
    store = ObjectStore(uri)
    identity = {"round": 0, "rank": 1, "world_size": 2}
    store.put(contribution_key(0, 1), streamed({"g": torch.full((4,), 7.0)}, {**identity, "run_id": "old"}))
    mine = torch.full((4,), 1.0)
    with make(uri, 0, 2, run_id="new") as ar, pytest.raises(CorruptObjectError, match="run_id='old'"):
        ar.allreduce({"g": mine})
    assert torch.equal(mine, torch.full((4,), 1.0))
    # The same run's contribution is accepted: the tag is what tells them apart.
    store.put(contribution_key(0, 1), streamed({"g": torch.full((4,), 7.0)}, {**identity, "run_id": "new"}))
    with make(uri, 0, 2, run_id="new") as ar:
        ar.allreduce({"g": mine})
    assert torch.equal(mine, torch.full((4,), 4.0))


def test_invalid_arguments_name_the_field() -> None:
    with pytest.raises(ConfigError, match="rank"):
        ObjectStoreAllReduce("memory://x", 2, 2)
    with pytest.raises(ConfigError, match="world_size"):
        ObjectStoreAllReduce("memory://x", 0, 0)
    with pytest.raises(ConfigError, match="timeout_s"):
        ObjectStoreAllReduce("memory://x", 0, 1, timeout_s=0)
    with pytest.raises(ConfigError, match="poll_interval_s"):
        ObjectStoreAllReduce("memory://x", 0, 1, poll_interval_s=-1)
    with ObjectStoreAllReduce("memory://x", 0, 1) as ar:
        with pytest.raises(TypeError, match="floating-point"):
            ar.allreduce({"i": torch.ones(2, dtype=torch.int64)})
        with pytest.raises(ValueError, match="at least one tensor"):
            ar.allreduce({})


def test_rounds_over_a_real_s3_api(s3_uri: str, bucket_keys: Callable[[str], list[str]]) -> None:
    """The same rounds through s3fs/botocore against moto on loopback: exists/get/put/delete on the S3 wire."""
    world, rounds = 2, 3

    def rank_fn(rank: int) -> list[torch.Tensor]:
        outs = []
        with make(s3_uri, rank, world) as ar:
            for k in range(rounds):
                t = torch.full((32,), float(rank * 10 + k), dtype=torch.bfloat16)
                ar.allreduce({"t": t})
                outs.append(t)
        return outs

    results = run_ranks(world, rank_fn, timeout=60)
    for k in range(rounds):
        assert torch.equal(results[0][k], torch.full((32,), 5.0 + k, dtype=torch.bfloat16))
        assert torch.equal(results[1][k], results[0][k])
    bucket, prefix = s3_uri[len("s3://"):].split("/", 1)
    assert sorted(bucket_keys(bucket)) == [f"{prefix}/{contribution_key(rounds - 1, r)}" for r in range(world)]


def test_a_peer_object_larger_than_one_read_window_is_accumulated_window_by_window(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors straddling the ranged-read windows (one 4 MiB chunk each here) are added at the right offsets."""
    from diloco.collectives import gather
    from diloco.store import codec

    monkeypatch.setattr(gather, "WINDOW_BYTES", codec.CHUNK_BYTES)
    uri = f"file://{tmp_path}/rdv"

    def inputs(rank: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(rank)
        return {"a": torch.randn(1_500_000, generator=g), "b": torch.randn(1000, 1001, generator=g),
                "c": torch.randn(7, generator=g).to(torch.bfloat16)}

    def rank_fn(rank: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        tensors = inputs(rank)
        with make(uri, rank, 2) as ar:
            before = ar.store.traffic
            ar.allreduce(tensors)
            return tensors, dict((ar.store.traffic - before).requests)

    want = average([inputs(0), inputs(1)])
    for tensors, requests in run_ranks(2, rank_fn, timeout=60):
        for name, t in tensors.items():
            assert torch.equal(t, want[name].to(t.dtype)), name
        assert requests.get("get_range", 0) >= 1 + 3  # the header probe, then one GET per 4 MiB window
