"""The sparse format's small tensors done together give the very bits of one tensor at a time.

A payload's small CPU tensors are encoded, checked and decoded as groups of chunks (``topk_many``) where the general
path does one tensor at a time with torch (the reference here: ``SMALL_ELEMENTS`` set below every size); peers may
take either path (a GPU replica never groups), so the wire and the sums must not depend on which ran, and a corrupt
stream must be refused before anything is written."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from diloco.errors import CorruptObjectError  # noqa: E402
from diloco.formats.base import INDEX_SUFFIX, WireFormat  # noqa: E402
from diloco.formats.kernels import topk as kernels  # noqa: E402
from diloco.formats.topk import Topk  # noqa: E402

SPECS = [(0.025, 4096, 2), (0.0156, 4096, 3), (0.05, 1024, 4), (0.5, 64, 2), (1.0, 16, 1)]
#: A tail that shares its group with an earlier tensor's whole chunk (64 then 4096 + 64), lengths of one, zero, and
#: tensors of several whole chunks: the orders in which a tensor's runs meet their groups.
SIZES = [64, 4096 + 64, 0, 1, 5, 192, 4095, 4096, 4097, 8209, 192, 12288]


def payload(seed: int) -> dict[str, torch.Tensor]:
    """Gaussian tensors, one of small integers (ties), one of zeros, one with a NaN, an infinity and a -0.0."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, n in enumerate(SIZES):
        x = torch.randn(n, generator=g) * 10.0 ** (i % 3 - 1)
        if i == 3 or i == 8:
            x = torch.randint(-3, 3, (n,), generator=g).float()
        if i == 6:
            x = torch.zeros(n)
        if i == 9:
            x[1], x[2], x[4] = float("nan"), float("inf"), -0.0
        out[f"t{i}"] = x.view(-1, 1) if n and i % 2 else x
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("density,chunk,value_bits", SPECS)
def test_a_payload_encodes_and_decodes_to_the_bits_of_one_tensor_at_a_time(monkeypatch: pytest.MonkeyPatch,
                                                                            density: float, chunk: int,
                                                                            value_bits: int) -> None:
    fmt = Topk(density=density, chunk=chunk, value_bits=value_bits)
    tensors = payload(seed=int(density * 1000) + chunk)
    together = fmt.encode_payload(tensors)
    with monkeypatch.context() as torch_path:
        torch_path.setattr(kernels, "SMALL_ELEMENTS", -1)
        alone = WireFormat.encode_payload(fmt, tensors)
    assert list(together) == list(alone)  # the order the object lays them out in
    for name, t in alone.items():
        assert together[name].dtype == t.dtype and together[name].shape == t.shape, name
        assert torch.equal(bits(together[name]), bits(t)), name
    base = {name: torch.randn(t.numel(), generator=torch.Generator().manual_seed(7)) for name, t in tensors.items()}
    for mode in ("write", "add", "subtract"):
        outs = [{name: b.clone() for name, b in base.items()} for _ in range(2)]
        fmt.decode_payload(alone, outs[0], mode)
        with monkeypatch.context() as torch_path:
            torch_path.setattr(kernels, "SMALL_ELEMENTS", -1)
            WireFormat.decode_payload(fmt, alone, outs[1], mode)
        for name in base:
            assert torch.equal(bits(outs[0][name]), bits(outs[1][name])), (name, mode)
    fmt.check_payload(alone, {name: t.numel() for name, t in tensors.items()})


def test_a_corrupt_stream_is_refused_before_any_tensor_is_written() -> None:
    fmt = Topk()
    tensors = payload(seed=3)
    numels = {name: t.numel() for name, t in tensors.items()}
    wire = fmt.encode_payload(tensors)
    index = wire["t5" + INDEX_SUFFIX].clone()
    index[-1] ^= 0x01  # a mark added to or taken from the last chunk's bitmap
    corrupt = {**wire, "t5" + INDEX_SUFFIX: index}
    outs = {name: torch.zeros(n) for name, n in numels.items()}
    with pytest.raises(CorruptObjectError, match="bitmap|strictly increasing"):
        fmt.check_payload(corrupt, numels)
    with pytest.raises(CorruptObjectError, match="bitmap|strictly increasing"):
        fmt.decode_payload(corrupt, outs, "add")
    assert all(not out.any() for out in outs.values())
    short = {**wire, "t1" + INDEX_SUFFIX: wire["t1" + INDEX_SUFFIX][:-1]}
    with pytest.raises(CorruptObjectError, match="bytes of positions"):
        fmt.check_payload(short, numels)


def test_payloads_read_into_one_buffer_in_turn_decode_as_their_own_bytes() -> None:
    """A round reads every peer into the same buffer, checks it, then adds it: positions decoded once per content
    are reused only for the very same bytes, never for whatever else later sits in that buffer."""
    fmt = Topk()
    first, second = fmt.encode_payload(payload(seed=11)), fmt.encode_payload(payload(seed=12))
    numels = {name: t.numel() for name, t in payload(seed=11).items()}
    buffer = {name: t.clone() for name, t in first.items()}  # one buffer, refilled with each payload in turn
    for wire in (first, second, first, second):
        for name, t in wire.items():
            buffer[name].copy_(t)
        fmt.check_payload(buffer, numels)
        got = {name: torch.zeros(n) for name, n in numels.items()}
        fmt.decode_payload(buffer, got, "add")
        want = {name: torch.zeros(n) for name, n in numels.items()}
        WireFormat.decode_payload(fmt, wire, want, "add")
        for name in numels:
            assert torch.equal(bits(got[name]), bits(want[name])), name
