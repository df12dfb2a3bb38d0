"""The positions a large tensor's check (or encode) decoded, reused by the decode of the same stream that follows
(``diloco.formats.kernels.topk._PositionsMemo``): the very bits a decode without it gives, never the positions
of another stream of the same size (a read buffer is reused for the next peer's payload), and never kept for a
stream that failed its check."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from diloco.errors import CorruptObjectError  # noqa: E402
from diloco.formats.kernels import topk  # noqa: E402
from diloco.formats.kernels.topk import SMALL_ELEMENTS, TopkSpec  # noqa: E402

SPEC = TopkSpec()
N = 4 * SMALL_ELEMENTS + 1000  # the large path (not the small tensors' NumPy one), with a short last chunk


def encoded(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = torch.randn(N, generator=torch.Generator().manual_seed(seed))
    return topk.encode(flat, SPEC)


def decoded(wire: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, mode: str = "write",
            base: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros(N) if base is None else base.clone()
    return topk.decode(*wire, SPEC, out, mode=mode)


def without_memo(wire: tuple[torch.Tensor, torch.Tensor, torch.Tensor], **kwargs: object) -> torch.Tensor:
    topk._memo._entry = None
    return decoded(wire, **kwargs)  # type: ignore[arg-type]


def test_a_checked_stream_decodes_to_the_same_bits_and_is_handed_out_once() -> None:
    wire = encoded(1)
    base = torch.randn(N, generator=torch.Generator().manual_seed(9))
    want = without_memo(wire, mode="add", base=base)
    topk.check_positions(wire[0], SPEC, N)
    assert topk._memo._entry is not None
    assert torch.equal(decoded(wire, mode="add", base=base), want)
    assert topk._memo._entry is None  # taken: not held past the decode that used it


def test_an_encode_keeps_its_positions_for_the_subtraction_of_error_feedback() -> None:
    flat = torch.randn(N, generator=torch.Generator().manual_seed(2))
    wire = topk.encode(flat, SPEC)
    assert topk._memo._entry is not None
    residual = decoded(wire, mode="subtract", base=flat)
    assert torch.equal(residual, without_memo(wire, mode="subtract", base=flat))


def test_another_stream_of_the_same_size_never_gets_the_kept_positions() -> None:
    first, second = encoded(3), encoded(4)
    assert first[0].numel() == second[0].numel() and not torch.equal(first[0], second[0])
    want = without_memo(second)
    topk.check_positions(first[0], SPEC, N)
    reused = first[0].clone()
    reused.copy_(second[0])  # the same memory holding the next peer's bytes, as a reused read buffer does
    assert torch.equal(decoded((reused, second[1], second[2])), want)
    topk.check_positions(first[0], SPEC, N)
    assert torch.equal(decoded(second), want)  # the peer after it, in memory of its own


def test_a_stream_that_fails_its_check_leaves_nothing_to_reuse() -> None:
    wire = encoded(5)
    topk._memo._entry = None
    bad = wire[0].clone()
    bad[-1] ^= 0xFF  # the last chunk's bitmap no longer marks exactly k elements
    with pytest.raises(CorruptObjectError):
        topk.check_positions(bad, SPEC, N)
    assert topk._memo._entry is None
    with pytest.raises(CorruptObjectError):
        decoded((bad, wire[1], wire[2]))
