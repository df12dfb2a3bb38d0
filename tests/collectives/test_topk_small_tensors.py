"""The sparse format's NumPy path for small CPU tensors gives the very bits of its general path.

Small tensors (a model's biases and norms) are encoded and decoded in NumPy, where a torch operation's fixed cost
would be most of the work; the wire format must not depend on which path ran, since peers may take different ones
(a CUDA replica takes the general path for every tensor)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from diloco.errors import CorruptObjectError  # noqa: E402
from diloco.formats.kernels import topk as kernels  # noqa: E402
from diloco.formats.topk import Topk  # noqa: E402

SPECS = [(0.025, 4096, 2), (0.0156, 4096, 3), (0.05, 1024, 4), (0.5, 64, 2), (1.0, 16, 1)]
SIZES = [0, 1, 5, 64, 192, 4095, 4096, 4097, 8209]


def tensors(n: int) -> list[torch.Tensor]:
    """Gaussian data, zeros, repeated values with a NaN, small integers (ties), an infinity and a -0.0."""
    g = torch.Generator().manual_seed(n)
    out = [torch.randn(n, generator=g), torch.zeros(n), torch.randint(-3, 3, (n,), generator=g).float()]
    x = torch.randn(n, generator=g)
    if n > 5:
        x[::3] = 1.0
        x[1] = float("nan")
        x[2] = float("inf")
        x[4] = -0.0
    out.append(x)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("density,chunk,value_bits", SPECS)
def test_small_path_encodes_and_decodes_the_same_bits(monkeypatch: pytest.MonkeyPatch, density: float, chunk: int,
                                                       value_bits: int) -> None:
    spec = Topk(density=density, chunk=chunk, value_bits=value_bits).spec
    for n in SIZES:
        for x in tensors(n):
            monkeypatch.setattr(kernels, "SMALL_ELEMENTS", 1 << 16)
            small = kernels.encode(x, spec)
            monkeypatch.setattr(kernels, "SMALL_ELEMENTS", -1)
            general = kernels.encode(x, spec)
            for a, b in zip(small, general, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(bits(a), bits(b)), (n, density)
            base = torch.randn(n, generator=torch.Generator().manual_seed(7))
            for mode in ("write", "add", "subtract"):
                decoded = []
                for threshold in (1 << 16, -1):
                    monkeypatch.setattr(kernels, "SMALL_ELEMENTS", threshold)
                    out = base.clone()
                    kernels.decode(*general, spec, out, mode=mode)
                    decoded.append(out)
                assert torch.equal(bits(decoded[0]), bits(decoded[1])), (n, mode)


def test_small_path_refuses_a_corrupt_position_stream_as_the_general_one_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = Topk().spec
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    index, codes, levels = kernels.encode(x, spec)
    broken = index.clone()
    broken[-1] ^= 0xFF
    errors = []
    for threshold in (1 << 16, -1):
        monkeypatch.setattr(kernels, "SMALL_ELEMENTS", threshold)
        target = torch.zeros(5000)
        with pytest.raises(CorruptObjectError) as caught:
            kernels.decode(broken, codes, levels, spec, target, mode="add")
        assert torch.equal(target, torch.zeros(5000))  # nothing added before the check failed
        errors.append(str(caught.value))
        with pytest.raises(CorruptObjectError):
            kernels.decode(index[:-1], codes, levels, spec, torch.zeros(5000), mode="add")
    assert errors[0] == errors[1]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_bitpack_numpy_path_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch, bits: int) -> None:
    from diloco.formats.kernels import bitpack

    for count in (0, 1, 7, 100, 4097):
        values = torch.randint(0, 1 << bits, (count,), generator=torch.Generator().manual_seed(count))
        streams, fields = [], []
        for threshold in (1 << 14, -1):
            monkeypatch.setattr(bitpack, "NUMPY_FIELDS", threshold)
            streams.append(bitpack.pack(values, bits))
            fields.append(bitpack.unpack(streams[-1], bits, count))
        assert streams[0].dtype == streams[1].dtype == torch.uint8
        assert torch.equal(streams[0], streams[1])
        assert torch.equal(fields[0], values) and torch.equal(fields[1], values)
        assert fields[0].dtype == fields[1].dtype == torch.int64
