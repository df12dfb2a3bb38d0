"""What a waiting replica's poll really costs on S3: counted on the wire, by the store, and by the cost model.

A look at a peer's object (``ObjectStore.exists``) is one HeadObject, found or not (``diloco.store.s3.object_
exists``). s3fs's own ``exists``/``info`` follow a 404 with a ListObjectsV2 (``MaxKeys=1``) to tell a missing key
from a directory (fsspec/s3fs ``s3fs/core.py``, ``S3FileSystem._info``), billed at the PUT rate ($0.005 per 1,000,
against $0.0004 for a HEAD): a miss cost 13.5 times a HEAD, and twice its latency. A missing bucket answers a HEAD
of a key with the same 404, so the first miss of a store instance also asks for the bucket, once. The requests are
counted as moto's server receives them, through a forwarding proxy on loopback, and compared with the store's own
counter and with ``bench/scale_model.py``.
"""

from __future__ import annotations

from types import ModuleType

import pytest
from support.bench_scripts import load_bench_script
from support.faultproxy import FaultProxy

from diloco.store.objects import ObjectStore

#: S3 Standard request prices (https://aws.amazon.com/s3/pricing/): GET and HEAD; PUT, COPY, POST and LIST.
HEAD_USD, LIST_USD = 0.0004 / 1000, 0.005 / 1000


def load_scale_model() -> ModuleType:
    return load_bench_script("scale_model")


def wire(proxy: FaultProxy) -> list[str]:
    """The S3 operations the server received, in order: HEAD (HeadObject), HEAD bucket (HeadBucket) or LIST
    (ListObjectsV2)."""
    ops = []
    for seen in proxy.requests():
        if seen.method == "HEAD":
            ops.append("HEAD" if "/" in seen.path.strip("/") else "HEAD bucket")
        elif seen.method == "GET" and "list-type=2" in seen.path:
            assert "max-keys=1" in seen.path, seen.path
            ops.append("LIST")
        else:
            ops.append(f"{seen.method} {seen.path}")
    return ops


def test_a_look_at_a_missing_object_is_one_head_and_the_first_also_asks_for_the_bucket(
        s3_uri: str, fault_proxy: FaultProxy) -> None:
    store = ObjectStore(s3_uri)
    before = store.traffic
    assert store.exists("round-1/rank-3.bin") is False
    assert wire(fault_proxy) == ["HEAD", "HEAD bucket"]
    assert (store.traffic - before).requests == {"exists": 1, "head_bucket": 1}
    fault_proxy.clear()
    before = store.traffic
    assert store.exists("round-1/rank-3.bin") is False
    assert wire(fault_proxy) == ["HEAD"], "a look that misses is one HEAD, no LIST"
    assert (store.traffic - before).requests == {"exists": 1}

    store.put("round-1/rank-3.bin", b"peer's update")
    fault_proxy.clear()
    before = store.traffic
    assert store.exists("round-1/rank-3.bin") is True
    assert wire(fault_proxy) == ["HEAD"], "a look that finds the object is one HEAD"
    assert (store.traffic - before).requests == {"exists": 1}


@pytest.mark.parametrize("misses", [0, 1, 4])
def test_the_cost_model_prices_a_wait_as_the_server_counts_it(s3_uri: str, fault_proxy: FaultProxy,
                                                             misses: int) -> None:
    """A replica that looks ``misses`` times before its peer's object lands, then once more: the model's HEADs,
    LISTs and dollars for ``misses + 1`` looks per object are what the server received."""
    sm = load_scale_model()
    ObjectStore(s3_uri).put("peer.bin", b"x")
    fault_proxy.clear()  # the peer's own upload is not the waiting replica's cost
    store = ObjectStore(s3_uri)
    store.exists("absent.bin")  # the first miss also asked for the bucket: the store instance knows it now
    fault_proxy.clear()
    before = store.traffic
    for _ in range(misses):
        assert store.exists("absent.bin") is False
    assert store.exists("peer.bin") is True
    ops = wire(fault_proxy)
    heads = ops.count("HEAD")
    assert heads == misses + 1 and len(ops) == heads, ops

    modelled = sm._polls(1, sm.Assumptions(polls_per_object=misses + 1))
    assert modelled == {"polls": heads}
    assert sm.poll_usd(heads, found=1) == pytest.approx(heads * HEAD_USD)
    assert (store.traffic - before).requests == {"exists": heads}


def test_an_hour_of_waiting_costs_what_the_docs_say() -> None:
    """docs/trainers.md, docs/s3.md and diloco/defaults.py: a replica waiting on S3 at the default 0.2 s costs
    about $0.007 an hour, at 2 s (configs/sagemaker.yaml, configs/eks.yaml) about $0.0007; with a LIST after every
    HEAD that missed, as s3fs's exists sends, it was 13.5 times that."""
    sm = load_scale_model()
    for interval, quoted in ((0.2, 0.0072), (2.0, 0.00072)):
        looks = round(3600 / interval)
        hourly = sm.poll_usd(looks, found=0)
        assert hourly == pytest.approx(quoted, rel=0.05), (interval, hourly)
        assert sm.usd_for(0, looks, lists=looks) == pytest.approx(13.5 * hourly)
