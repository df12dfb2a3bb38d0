"""A reader that assembles a payload from pieces decodes each straight into its place (the sharded strategy's
reduced shards): the same bits as decoding into a new tensor, and a payload in another format refused before
anything is written."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from diloco.collectives.wire import PayloadCodec  # noqa: E402
from diloco.errors import CorruptObjectError  # noqa: E402

FORMATS = ["none", "bf16", "int8", "int4"]
LAYOUT = {"x": ((1000,), torch.float32)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_into_writes_what_decode_returns(fmt: str) -> None:
    codec = PayloadCodec(fmt)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    wire, meta, decoded = codec.encode_plain({"x": x})
    out = torch.full((1000,), 7.0)
    codec.decode_into(wire, meta, LAYOUT, {"x": out}, "test object")
    assert torch.equal(out.view(torch.int32), decoded["x"].view(torch.int32))
    if fmt != "none":
        assert not torch.equal(out, x)  # a lossy format really went through its decode


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_plain_into_leaves_the_decoded_values_in_place(fmt: str) -> None:
    codec = PayloadCodec(fmt)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    want_wire, want_meta, want = codec.encode_plain({"x": x})
    out = torch.zeros(1000)
    wire, meta = codec.encode_plain_into({"x": x}, {"x": out})
    assert meta == want_meta and set(wire) == set(want_wire)
    assert all(torch.equal(wire[name], want_wire[name]) for name in wire)
    assert torch.equal(out.view(torch.int32), want["x"].view(torch.int32))
    # the mean may be decoded over itself: every value is read before it is written
    same = x.clone()
    codec.encode_plain_into({"x": same}, {"x": same})
    assert torch.equal(same.view(torch.int32), want["x"].view(torch.int32))


def test_decode_into_refuses_another_format_before_writing() -> None:
    wire, meta, _ = PayloadCodec("int8").encode_plain({"x": torch.randn(1000)})
    out = torch.full((1000,), 7.0)
    with pytest.raises(CorruptObjectError, match="reduced shard 1 is compressed as 'int8'.*'int4'"):
        PayloadCodec("int4").decode_into(wire, meta, LAYOUT, {"x": out}, "reduced shard 1")
    with pytest.raises(CorruptObjectError, match="reduced shard 1"):
        PayloadCodec("int8").decode_into(wire, meta, {"x": ((999,), torch.float32)}, {"x": out[:999]},
                                         "reduced shard 1")
    assert torch.equal(out, torch.full((1000,), 7.0))
