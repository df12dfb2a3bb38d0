"""ObjectStore semantics on memory:// and file:// (the S3 conformance runs against a loopback S3 elsewhere)."""

from __future__ import annotations

import os
import sys
import threading
import uuid
from typing import Any

import pytest

from diloco.errors import ObjectNotFound, StoreError
from diloco.store.objects import ObjectStore, split_uri


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> ObjectStore:
    if request.param == "memory":
        return ObjectStore(f"memory://bucket-{uuid.uuid4().hex[:8]}/run")
    return ObjectStore(f"file://{tmp_path}/run")


def test_put_get_overwrite(store: ObjectStore) -> None:
    store.put("a/b.bin", b"one")
    assert store.get("a/b.bin") == b"one"
    store.put("a/b.bin", b"two")
    assert store.get("/a/b.bin/") == b"two"  # surrounding slashes do not matter
    store.put("empty", b"")
    assert store.get("empty") == b""


def test_get_missing_raises_object_not_found_naming_the_key(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound, match="nope/x") as info:
        store.get("nope/x")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, StoreError)


def test_exists_sees_objects_not_prefixes(store: ObjectStore) -> None:
    assert not store.exists("d/x")
    store.put("d/x", b"1")
    assert store.exists("d/x")
    assert not store.exists("d")  # a prefix is not an object
    store.delete("d/x")
    assert not store.exists("d/x")


def test_list_is_recursive_relative_sorted_and_prefix_filtered(store: ObjectStore) -> None:
    for key in ["round_000001/rank_0001", "round_000001/rank_0000", "round_000000/rank_0000", "metrics/a.jsonl"]:
        store.put(key, b"x")
    assert store.list() == ["metrics/a.jsonl", "round_000000/rank_0000", "round_000001/rank_0000",
                            "round_000001/rank_0001"]
    assert store.list("round_000001") == ["round_000001/rank_0000", "round_000001/rank_0001"]
    assert store.list("missing") == []


def test_temporaries_are_never_listed(store: ObjectStore) -> None:
    store.put("r/rank_0000", b"x")
    store.put("r/.rank_0001.tmp-abc", b"partial")  # what an in-flight local write looks like
    assert store.list() == ["r/rank_0000"]


def test_local_put_leaves_no_temporary_behind(tmp_path: Any) -> None:
    store = ObjectStore(f"file://{tmp_path}/run")
    for i in range(5):
        store.put("r/obj", bytes([i]) * 1000)
    assert os.listdir(tmp_path / "run" / "r") == ["obj"]


def test_put_is_atomic_for_concurrent_readers(store: ObjectStore) -> None:
    a, b = b"A" * 400_000, b"B" * 400_000
    store.put("obj", a)
    stop = threading.Event()
    seen: set[bytes] = set()
    bad: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            data = store.get("obj")
            if data not in (a, b):
                bad.append(len(data))
            seen.add(data[:1])

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    for i in range(30):
        store.put("obj", b if i % 2 == 0 else a)
    stop.set()
    t.join(10)
    assert bad == [], "a reader saw a partial object"
    assert seen <= {b"A", b"B"}


def test_put_if_absent_creates_exactly_once_under_a_race(store: ObjectStore) -> None:
    n, races = 8, 20
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: a check-then-write race shows up
    try:
        for race in range(races):
            barrier = threading.Barrier(n)
            wins: list[int] = []

            def contender(i: int, key: str, barrier: threading.Barrier, wins: list[int]) -> None:
                barrier.wait()
                if store.put_if_absent(key, f"writer-{i}".encode()):
                    wins.append(i)

            threads = [threading.Thread(target=contender, args=(i, f"manifest-{race}", barrier, wins))
                       for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert len(wins) == 1, f"race {race}: winners {wins}"
            assert store.get(f"manifest-{race}") == f"writer-{wins[0]}".encode()
    finally:
        sys.setswitchinterval(old_interval)
    assert store.put_if_absent("manifest-0", b"late") is False
    assert store.get("manifest-0") != b"late"


def test_delete_is_idempotent_and_delete_prefix_is_scoped(store: ObjectStore) -> None:
    for key in ["round_000000/a", "round_000000/b", "round_0000001/a", "other"]:
        store.put(key, b"x")
    store.delete("other")
    store.delete("other")  # already gone: fine
    store.delete_prefix("round_000000")
    assert store.list() == ["round_0000001/a"]  # a sibling sharing the name's start survives
    store.delete_prefix("nothing/here")


def test_child_store_and_urls(store: ObjectStore) -> None:
    child = store.child("runs/abc")
    child.put("config.json", b"{}")
    assert store.get("runs/abc/config.json") == b"{}"
    assert child.list() == ["config.json"]
    assert child.url("config.json") == store.url("runs/abc/config.json")
    assert store.url().startswith(store.protocol + "://")


def test_split_uri() -> None:
    assert split_uri("s3://bucket/prefix") == ("s3", "bucket/prefix")
    assert split_uri("memory://x/y") == ("memory", "x/y")
    proto, path = split_uri("relative/dir")
    assert proto == "file" and os.path.isabs(path)


# ---------------------------------------------------------------------------------------------- streaming, traffic
def test_traffic_counts_bytes_and_requests_per_operation(store: ObjectStore) -> None:
    from diloco.store.objects import StoreTraffic

    assert store.traffic == StoreTraffic(0, 0, {})
    store.put("a", b"12345")
    before = store.traffic
    assert store.get("a") == b"12345"
    assert store.get_range("a", 1, 3) == b"23"
    store.exists("a")
    store.exists("nope")
    store.list()
    store.delete("a")
    assert store.put_if_absent("b", b"xy") and not store.put_if_absent("b", b"zz")
    round_ = store.traffic - before
    assert round_.bytes_read == 5 + 2 and round_.bytes_written == 2  # only the create that won wrote
    assert round_.requests == {"delete": 1, "exists": 2, "get": 1, "get_range": 1, "list": 1, "put_if_absent": 2}
    assert round_.total_requests == 8
    assert store.traffic.bytes_written == 7 and store.traffic.requests["put"] == 1


def test_traffic_counter_is_exact_under_concurrent_threads(store: ObjectStore) -> None:
    store.put("k", b"v" * 100)

    def worker() -> None:
        for _ in range(50):
            store.get("k")

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert store.traffic.requests["get"] == 200 and store.traffic.bytes_read == 200 * 100


def test_put_stream_writes_the_concatenation_and_returns_its_size(store: ObjectStore) -> None:
    pieces = [b"head", memoryview(b"-middle-"), bytearray(b"tail"), b""]
    assert store.put_stream("s/obj", iter(pieces), size=16) == 16
    assert store.get("s/obj") == b"head-middle-tail"
    assert store.size("s/obj") == 16
    assert store.traffic.bytes_written == 16 and store.traffic.requests["put"] == 1
    assert store.put_stream("s/empty", []) == 0 and store.get("s/empty") == b""


def test_put_stream_publishes_nothing_when_the_stream_fails_or_lies(store: ObjectStore) -> None:
    def failing() -> Any:
        yield b"partial"
        raise RuntimeError("encoder died")

    with pytest.raises(RuntimeError, match="encoder died"):
        store.put_stream("s/obj", failing())
    with pytest.raises(ValueError, match="size=99"):
        store.put_stream("s/obj", [b"abc"], size=99)
    assert store.list() == [] and not store.exists("s/obj")


def test_local_put_stream_is_invisible_until_renamed(tmp_path: Any) -> None:
    store = ObjectStore(f"file://{tmp_path}/run")
    seen: list[bool] = []

    def chunks(key: str) -> Any:
        yield b"A" * 1000
        seen.append(store.exists(key))  # mid-stream: the object must not be visible yet
        yield b"B" * 1000

    store.put("r/obj", b"old")
    store.put_stream("r/obj", chunks("r/obj"))
    assert seen == [True] and store.get("r/obj") == b"A" * 1000 + b"B" * 1000  # the old one stayed until done
    store.put_stream("r/new", chunks("r/new"))
    assert seen == [True, False]
    assert sorted(os.listdir(tmp_path / "run" / "r")) == ["new", "obj"]  # no temporary left behind


def test_get_range_into_fills_a_given_buffer_and_says_how_much(store: ObjectStore) -> None:
    data = bytes(range(256)) * 40
    store.put("obj", data)
    buffer = bytearray(b"\xee" * 6000)
    before = store.traffic
    assert store.get_range_into("obj", 5000, memoryview(buffer)[:4000]) == 4000
    assert buffer[:4000] == data[5000:9000] and buffer[4000:] == b"\xee" * 2000  # nothing past the view
    assert store.get_range_into("obj", 9000, buffer) == len(data) - 9000  # the object ends first
    assert buffer[: len(data) - 9000] == data[9000:]
    assert store.get_range_into("obj", len(data), buffer) == 0
    assert store.get_range_into("obj", 0, bytearray()) == 0
    after = store.traffic - before
    assert after.requests == {"get_range": 4} and after.bytes_read == 4000 + len(data) - 9000
    with pytest.raises(ObjectNotFound, match="missing"):
        store.get_range_into("missing", 0, buffer)


def test_get_range_and_size(store: ObjectStore) -> None:
    data = bytes(range(256)) * 40
    store.put("obj", data)
    assert store.size("obj") == len(data)
    assert store.get_range("obj", 0, 10) == data[:10]
    assert store.get_range("obj", 5000, 10_240) == data[5000:]
    assert store.get_range("obj", 10_000, 20_000) == data[10_000:]  # shorter when the object ends first
    assert store.get_range("obj", 20_000, 20_010) == b""
    assert store.get_range("obj", 7, 7) == b""
    assert isinstance(store.get_range("obj", 0, 4), bytearray)
    with pytest.raises(ObjectNotFound, match="missing"):
        store.get_range("missing", 0, 4)
    with pytest.raises(ObjectNotFound, match="missing"):
        store.size("missing")
    with pytest.raises(ValueError, match="invalid range"):
        store.get_range("obj", 5, 4)
