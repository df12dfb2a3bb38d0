"""The object store over ``s3://``, against moto's real S3 API on loopback (optionally through a fault proxy).

What these prove: the store's S3 semantics (atomic single PUT, multipart above the threshold, conditional create),
that polling never trusts a stale listing, and that faults are classified right: transient ones are retried a
bounded number of times, a 403 or a missing bucket fails at once and is never mistaken for "not written yet".
"""

from __future__ import annotations

import time

import pytest
from support.faultproxy import FaultProxy

from diloco.errors import ConfigError, CorruptObjectError, ObjectNotFound, StoreError
from diloco.store.codec import decode_tensors, encode_tensors
from diloco.store.objects import ObjectStore
from diloco.store.s3 import S3AccessDenied, S3BucketNotFound, parse_s3_uri, s3_storage_options

MiB = 2**20


def test_basic_operations_round_trip(s3_uri: str, bucket_keys, s3_bucket: str) -> None:
    store = ObjectStore(s3_uri)
    assert store.list() == []
    assert not store.exists("round_000000/rank_0000.safetensors")
    store.put("round_000000/rank_0000.safetensors", b"zero")
    store.put("round_000000/rank_0001.safetensors", b"one")
    store.put("metrics/rank_0000.jsonl", b"{}\n")
    assert store.get("round_000000/rank_0001.safetensors") == b"one"
    assert store.exists("round_000000/rank_0000.safetensors")
    assert not store.exists("round_000000")  # a "directory" is not an object
    assert store.list("round_000000") == ["round_000000/rank_0000.safetensors", "round_000000/rank_0001.safetensors"]
    assert store.list() == ["metrics/rank_0000.jsonl", *store.list("round_000000")]
    assert store.child("round_000000").get("rank_0000.safetensors") == b"zero"
    store.put("round_000000/rank_0000.safetensors", b"overwritten")
    assert store.get("round_000000/rank_0000.safetensors") == b"overwritten"
    with pytest.raises(ObjectNotFound, match="rank_0009"):
        store.get("round_000000/rank_0009.safetensors")
    store.delete("round_000000/rank_0001.safetensors")
    store.delete("round_000000/rank_0001.safetensors")  # idempotent
    assert store.list("round_000000") == ["round_000000/rank_0000.safetensors"]
    store.delete_prefix("")
    assert bucket_keys(s3_bucket) == []


def test_put_if_absent_is_one_conditional_put(s3_uri: str, fault_proxy: FaultProxy) -> None:
    store = ObjectStore(s3_uri)
    assert store.put_if_absent("lease", b"first") is True
    assert store.put_if_absent("lease", b"second") is False
    assert ObjectStore(s3_uri).get("lease") == b"first"
    puts = fault_proxy.requests("PUT", r"/lease")
    assert len(puts) == 2  # one request per call: no read-then-write race window
    assert all(p.headers.get("if-none-match") == "*" for p in puts)


def test_put_if_absent_whose_response_was_lost_still_wins(s3_uri: str, fault_proxy: FaultProxy) -> None:
    """The PUT lands, its response is lost, botocore retries and meets its own object (412): still ours."""
    lost = fault_proxy.add("drop_response", method="PUT", path=r"/lease", times=1)
    store = ObjectStore(s3_uri)
    assert store.put_if_absent("lease", b"writer-a") is True
    assert lost.fired == 1 and fault_proxy.count("forward", "PUT") == 1  # the retry was answered 412
    assert ObjectStore(s3_uri).put_if_absent("lease", b"writer-b") is False
    assert store.get("lease") == b"writer-a"


def test_small_object_is_a_single_put_large_one_is_multipart(s3_uri: str, fault_proxy: FaultProxy) -> None:
    store = ObjectStore(s3_uri, storage_options={"multipart_chunksize": 5 * MiB})
    small = bytes(range(256)) * (4 * MiB // 256)  # below 2 x chunksize: one PutObject
    store.put("small.bin", small)
    assert [(s.method, "uploads" in s.path) for s in fault_proxy.requests(path=r"/small\.bin")] == [("PUT", False)]

    big = bytes(reversed(range(256))) * (11 * MiB // 256)  # above: create, 3 parts, complete
    store.put("big.bin", big)
    reqs = fault_proxy.requests(path=r"/big\.bin")
    assert [r.method for r in reqs] == ["POST", "PUT", "PUT", "PUT", "POST"]
    assert "uploads" in reqs[0].path and "uploadId=" in reqs[-1].path
    assert ObjectStore(s3_uri).get("big.bin") == big
    assert ObjectStore(s3_uri).list() == ["big.bin", "small.bin"]

    # Conditional create above the threshold: the condition is on CompleteMultipartUpload, so a loser's upload
    # never becomes visible and the winner's bytes stay.
    assert store.put_if_absent("big.bin", small + small + small) is False
    assert ObjectStore(s3_uri).get("big.bin") == big


def test_stale_listing_regression_peer_object_seen_by_next_poll(s3_uri: str) -> None:
    """A peer's object written after we listed must be visible to our very next exists/list."""
    import s3fs

    reader = ObjectStore(s3_uri)
    writer = ObjectStore(s3_uri)
    writer.put("round_000000/rank_0000.safetensors", b"r0")
    assert reader.list("round_000000") == ["round_000000/rank_0000.safetensors"]
    assert not reader.exists("round_000000/rank_0001.safetensors")

    # The hazard is real: a default s3fs instance (listings cache on) answers from its cached listing.
    cached = s3fs.S3FileSystem(skip_instance_cache=True)
    bucket_prefix = s3_uri[len("s3://"):] + "/round_000000"
    assert cached.ls(bucket_prefix) == [bucket_prefix + "/rank_0000.safetensors"]

    writer.put("round_000000/rank_0001.safetensors", b"r1")
    assert cached.exists(bucket_prefix + "/rank_0001.safetensors") is False  # stale
    assert reader.exists("round_000000/rank_0001.safetensors")  # ours is not
    assert reader.list("round_000000") == ["round_000000/rank_0000.safetensors", "round_000000/rank_0001.safetensors"]


def test_stores_of_one_process_share_a_client_until_the_aws_environment_changes(
        s3_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a botocore client costs ten times a request: stores with one set of settings share one filesystem
    (a child store too); a change to the AWS environment (another endpoint, other credentials) gets its own."""
    first, second = ObjectStore(s3_uri), ObjectStore(f"{s3_uri}/other")
    first.put("k", b"v")
    assert second.fs is first.fs and first.child("sub").fs is first.fs
    assert ObjectStore(s3_uri, storage_options={"default_block_size": 2**20}).fs is not first.fs
    with monkeypatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "someone-else")
        assert ObjectStore(s3_uri).fs is not first.fs
    assert ObjectStore(s3_uri).get("k") == b"v" and ObjectStore(s3_uri).fs is first.fs


def test_transient_slowdown_and_dropped_connections_are_retried(s3_uri: str, fault_proxy: FaultProxy) -> None:
    store = ObjectStore(s3_uri, backoff_s=0.01)
    throttle = fault_proxy.add("status", method="PUT", status=503, code="SlowDown", times=2)
    store.put("k", b"payload")
    assert throttle.fired == 2
    drop = fault_proxy.add("drop", method="GET", times=2)
    assert store.get("k") == b"payload"
    assert drop.fired == 2
    reset = fault_proxy.add("drop", method="HEAD", times=3)
    assert store.exists("k")
    assert reset.fired == 3
    assert fault_proxy.count("forward", "PUT") == 1 and fault_proxy.count("forward", "GET") == 1


def test_persistent_throttling_fails_after_a_bounded_number_of_attempts(
    s3_uri: str, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two layers only: botocore's attempts x (1 + the store's retries). s3fs's own loop must not multiply them."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # honoured: we never override the standard AWS retry settings
    store = ObjectStore(s3_uri, retries=2, backoff_s=0.01)
    fault_proxy.add("status", method="PUT", status=503, code="SlowDown")
    with pytest.raises(StoreError, match=r"put s3://.+/k failed after 3 attempt\(s\)") as info:
        store.put("k", b"x")
    assert "(S3 SlowDown, HTTP 503)" in str(info.value)  # the underlying S3 error is named
    assert fault_proxy.count("status:503", "PUT") == 2 * 3


def test_access_denied_fails_fast_and_is_not_missing(s3_uri: str, fault_proxy: FaultProxy) -> None:
    store = ObjectStore(s3_uri)
    store.put("k", b"v")
    fault_proxy.add("status", status=403, code="AccessDenied")
    for op in (lambda: store.exists("k"), lambda: store.exists("absent"), lambda: store.get("k"),
               lambda: store.list(), lambda: store.put("k", b"w")):
        with pytest.raises(S3AccessDenied) as info:
            op()
        assert isinstance(info.value, PermissionError) and isinstance(info.value, StoreError)
        assert "denied" in str(info.value) and s3_uri in str(info.value)
        assert "s3:GetObject" in (info.value.hint or "")
    # Never retried: exactly one request per operation.
    assert fault_proxy.count("status:403") == 5


def test_missing_bucket_is_an_error_not_an_empty_store(aws_env: str) -> None:
    store = ObjectStore("s3://no-such-bucket-here/prefix")
    for op in (lambda: store.exists("k"), lambda: store.list(), lambda: store.put("k", b"v"),
               lambda: store.get("k")):
        with pytest.raises(S3BucketNotFound, match="'no-such-bucket-here' does not exist"):
            op()


def test_truncated_body_is_caught_by_the_codec(s3_uri: str, fault_proxy: FaultProxy) -> None:
    import torch

    store = ObjectStore(s3_uri)
    store.put("t.safetensors", encode_tensors({"w": torch.arange(4096, dtype=torch.float32)}, {"rank": 1}))
    cut = fault_proxy.add("truncate", method="GET", times=1)
    data = store.get("t.safetensors")  # the client cannot tell: honest length, no checksum header
    assert cut.fired == 1
    with pytest.raises(CorruptObjectError):
        decode_tensors(data, source="t.safetensors")
    tensors, _ = decode_tensors(store.get("t.safetensors"), expect={"rank": 1})  # the next read is whole
    assert torch.equal(tensors["w"], torch.arange(4096, dtype=torch.float32))


def test_endpoint_comes_from_the_standard_aws_environment(
    s3_uri: str, aws_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ObjectStore(s3_uri).put("k", b"v")
    # botocore resolves the endpoint (we pass none), so the service-specific variable wins, as in the AWS CLI.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", aws_env)
    assert ObjectStore(s3_uri).get("k") == b"v"
    # A dead endpoint is a transient connection error: retried (bounded), then a StoreError naming the URL.
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(StoreError, match=r"get s3://.+/k failed after 2 attempt\(s\): EndpointConnectionError"):
        ObjectStore(s3_uri, retries=1, backoff_s=0.01).get("k")


def test_storage_options_and_uri_parsing() -> None:
    opts = s3_storage_options()
    assert ObjectStore("s3://my-bucket/x").fs.retries == 1  # s3fs's own retry loop off (see diloco/store/s3.py)
    assert opts["config_kwargs"]["retries"] == {"mode": "standard", "max_attempts": 3}
    assert "endpoint_url" not in opts and "endpoint_url" not in opts.get("client_kwargs", {})
    assert parse_s3_uri("s3://my-bucket/a/b/") == ("my-bucket", "a/b")
    assert parse_s3_uri("s3://my-bucket") == ("my-bucket", "")
    for bad in ("my-bucket/x", "s3://", "s3://Upper/x", "s3://ab/x", "s3://a..b/x", "s3://b-1/x//y", "s3://1.2.3.4/x"):
        with pytest.raises(ConfigError):
            parse_s3_uri(bad)
    with pytest.raises(ConfigError, match="multipart_chunksize"):
        ObjectStore("s3://my-bucket/x", storage_options={"multipart_chunksize": 1024})


# ---------------------------------------------------------------------------------------------- streaming, traffic
def test_put_stream_small_is_one_put_large_is_multipart_sent_as_parts_fill(
    s3_uri: str, fault_proxy: FaultProxy
) -> None:
    store = ObjectStore(s3_uri, storage_options={"multipart_chunksize": 5 * MiB})
    assert store.put_stream("small.bin", [b"a" * MiB, memoryview(b"b" * MiB)], size=2 * MiB) == 2 * MiB
    assert [r.method for r in fault_proxy.requests(path=r"/small\.bin")] == ["PUT"]

    piece = bytes(range(256)) * (MiB // 256)
    observer = ObjectStore(s3_uri)

    def parts_sent() -> int:
        return len(fault_proxy.requests("PUT", r"/big\.bin\?.*partNumber"))

    def chunks() -> object:
        for i in range(12):  # 12 MiB in 1 MiB pieces: parts of 5, 5 and 2 MiB
            if i == 5:
                assert parts_sent() == 0  # part 1 is full but only sent once more data arrives
            if i == 7:  # part 1 was handed off with piece 5: it goes up while the stream goes on
                deadline = time.monotonic() + 30
                while parts_sent() == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert parts_sent() == 1
            assert not observer.exists("big.bin"), "the object became visible before the upload completed"
            yield piece

    assert store.put_stream("big.bin", chunks()) == 12 * MiB
    reqs = fault_proxy.requests(path=r"/big\.bin")
    assert [r.method for r in reqs if r.method != "HEAD"] == ["POST", "PUT", "PUT", "PUT", "POST"]
    assert ObjectStore(s3_uri).get("big.bin") == piece * 12
    traffic = store.traffic
    assert traffic.bytes_written == 14 * MiB
    assert traffic.requests == {"complete_multipart": 1, "create_multipart": 1, "put": 1, "put_part": 3}


def test_failed_stream_is_aborted_and_never_visible(s3_uri: str, fault_proxy: FaultProxy, s3_bucket: str) -> None:
    import boto3

    store = ObjectStore(s3_uri, storage_options={"multipart_chunksize": 5 * MiB})

    def chunks() -> object:
        yield b"x" * (6 * MiB)
        raise RuntimeError("encoder died")

    with pytest.raises(RuntimeError, match="encoder died"):
        store.put_stream("obj", chunks())
    assert not store.exists("obj")
    assert fault_proxy.count(method="DELETE") == 1  # AbortMultipartUpload
    uploads = boto3.client("s3").list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert uploads == []
    assert store.traffic.requests["abort_multipart"] == 1


def test_a_throttled_part_is_retried_alone(s3_uri: str, fault_proxy: FaultProxy) -> None:
    store = ObjectStore(s3_uri, backoff_s=0.01, storage_options={"multipart_chunksize": 5 * MiB})
    throttle = fault_proxy.add("status", method="PUT", path=r"partNumber=2", status=503, code="SlowDown", times=1)
    data = bytes(reversed(range(256))) * (11 * MiB // 256)
    store.put("big.bin", data)  # >= 2 parts: the streaming multipart path, fed one view per part
    assert throttle.fired == 1
    assert ObjectStore(s3_uri).get("big.bin") == data
    assert fault_proxy.count("forward", "PUT") == 3 and fault_proxy.count("forward", "POST") == 2


def test_get_range_is_one_ranged_get_and_size_one_head(s3_uri: str, fault_proxy: FaultProxy) -> None:
    store = ObjectStore(s3_uri)
    data = bytes(range(256)) * 4096
    store.put("obj", data)
    assert store.get_range("obj", 1000, 300_000) == data[1000:300_000]
    gets = fault_proxy.requests("GET", r"/obj")
    assert len(gets) == 1 and gets[0].headers.get("range") == "bytes=1000-299999"
    assert store.get_range("obj", len(data) - 5, len(data) + 100) == data[-5:]
    assert store.get_range("obj", len(data), len(data) + 100) == b""  # 416 is "nothing there", not retried
    assert store.size("obj") == len(data)
    with pytest.raises(ObjectNotFound, match="absent"):
        store.get_range("absent", 0, 10)
    with pytest.raises(ObjectNotFound, match="absent"):
        store.size("absent")
    assert store.traffic.requests["get_range"] == 4 and store.traffic.bytes_read == 299_000 + 5


def test_get_range_into_is_one_ranged_get_into_the_callers_buffer(s3_uri: str, fault_proxy: FaultProxy) -> None:
    store = ObjectStore(s3_uri)
    data = bytes(range(256)) * 4096
    store.put("obj", data)
    buffer = bytearray(300_000)
    assert store.get_range_into("obj", 1000, memoryview(buffer)[:299_000]) == 299_000
    assert buffer[:299_000] == data[1000:300_000]
    gets = fault_proxy.requests("GET", r"/obj")
    assert len(gets) == 1 and gets[0].headers.get("range") == "bytes=1000-299999"
    assert store.get_range_into("obj", len(data) - 5, buffer) == 5 and buffer[:5] == data[-5:]
    assert store.get_range_into("obj", len(data), buffer) == 0  # 416 is "nothing there", not retried
    with pytest.raises(ObjectNotFound, match="absent"):
        store.get_range_into("absent", 0, buffer)
    assert store.traffic.requests["get_range"] == 4 and store.traffic.bytes_read == 299_000 + 5


def test_streamed_object_ranges_verify_over_s3(s3_uri: str, fault_proxy: FaultProxy) -> None:
    import torch

    from diloco.store.codec import encode_stream, read_data, read_header, tensors_from_data

    store = ObjectStore(s3_uri, storage_options={"multipart_chunksize": 5 * MiB})
    w = torch.arange(3 * MiB, dtype=torch.float32)  # 12 MiB: a multipart upload of streamed views
    size, chunks = encode_stream({"w": w}, {"rank": 0}, chunk_bytes=MiB)
    assert store.put_stream("c.safetensors", chunks, size=size) == size
    header = read_header(store, "c.safetensors")
    begin, end = 4 * MiB, 8 * MiB
    data = read_data(store, "c.safetensors", header, begin, end)
    offset, view = tensors_from_data(header, data, begin, end)["w"]
    assert offset == MiB and torch.equal(view, w[MiB : 2 * MiB])
    cut = fault_proxy.add("truncate", method="GET", times=1)  # an honest, short body
    with pytest.raises(CorruptObjectError, match="c.safetensors is truncated"):
        read_data(store, "c.safetensors", header, begin, end)
    assert cut.fired == 1
    assert len(read_data(store, "c.safetensors", header, begin, end)) == end - begin  # the reread is whole


def test_a_completed_upload_whose_response_was_lost_counts_as_done(s3_uri: str, fault_proxy: FaultProxy) -> None:
    """The retry of CompleteMultipartUpload meets NoSuchUpload: the object's multipart ETag proves it is ours."""
    store = ObjectStore(s3_uri, backoff_s=0.01, storage_options={"multipart_chunksize": 5 * MiB})
    lost = fault_proxy.add("drop_response", method="POST", path=r"/big\.bin\?uploadId=", times=1)
    data = bytes(range(256)) * (11 * MiB // 256)
    store.put("big.bin", data)
    assert lost.fired == 1
    assert ObjectStore(s3_uri).get("big.bin") == data
    # A different object at the key is not mistaken for ours: its ETag differs, so the error stands.
    other = ObjectStore(s3_uri, retries=0, storage_options={"multipart_chunksize": 5 * MiB})
    fault_proxy.add("status", method="POST", path=r"/big\.bin\?uploadId=", status=404, code="NoSuchUpload")
    with pytest.raises((StoreError, OSError)):
        other.put("big.bin", bytes(reversed(data)))
    assert ObjectStore(s3_uri).get("big.bin") == data


def test_a_denied_part_fails_the_upload_and_aborts_it(s3_uri: str, fault_proxy: FaultProxy, s3_bucket: str) -> None:
    import boto3

    store = ObjectStore(s3_uri, storage_options={"multipart_chunksize": 5 * MiB})
    fault_proxy.add("status", method="PUT", path=r"partNumber=2", status=403, code="AccessDenied")
    with pytest.raises(S3AccessDenied, match="denied by S3"):
        store.put_stream("obj", (bytes([i]) * MiB for i in range(16)))
    assert not ObjectStore(s3_uri).exists("obj")
    assert boto3.client("s3").list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert store.traffic.requests["abort_multipart"] == 1 and store.traffic.bytes_written == 0
