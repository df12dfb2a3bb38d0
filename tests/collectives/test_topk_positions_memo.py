"""The positions a large tensor's check (or encode) decoded, reused by the decode of the same stream that follows
(``diloco.formats.kernels.topk._memo``, a ``content_memo.ContentMemo``): the very bits a decode without it gives, never the positions
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
    topk._memo.clear()
    return decoded(wire, **kwargs)  # type: ignore[arg-type]


def test_a_checked_stream_decodes_to_the_same_bits_and_is_handed_out_once() -> None:
    wire = encoded(1)
    base = torch.randn(N, generator=torch.Generator().manual_seed(9))
    want = without_memo(wire, mode="add", base=base)
    topk.check_positions(wire[0], SPEC, N)
    assert len(topk._memo) == 1
    assert torch.equal(decoded(wire, mode="add", base=base), want)
    assert not len(topk._memo)  # taken: not held past the decode that used it


def test_an_encode_keeps_its_positions_for_the_subtraction_of_error_feedback() -> None:
    flat = torch.randn(N, generator=torch.Generator().manual_seed(2))
    topk._memo.clear()
    wire = topk.encode(flat, SPEC)
    assert len(topk._memo) == 1
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
    topk._memo.clear()
    bad = wire[0].clone()
    bad[-1] ^= 0xFF  # the last chunk's bitmap no longer marks exactly k elements
    with pytest.raises(CorruptObjectError):
        topk.check_positions(bad, SPEC, N)
    assert not len(topk._memo)
    with pytest.raises(CorruptObjectError):
        decoded((bad, wire[1], wire[2]))


def test_every_tensor_of_a_payload_checked_first_is_decoded_from_its_kept_positions() -> None:
    """A round checks all of a peer's tensors, then adds them all: each finds its own positions."""
    wires = [encoded(seed) for seed in (6, 7, 8)]
    want = [without_memo(w, mode="add") for w in wires]
    for w in wires:
        topk.check_positions(w[0], SPEC, N)
    assert len(topk._memo) == 3
    assert all(torch.equal(decoded(w, mode="add"), expected) for w, expected in zip(wires, want, strict=True))
    assert not len(topk._memo) and topk._memo.held_bytes == 0


def test_what_is_held_is_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    wires = [encoded(seed) for seed in (10, 11, 12)]
    topk._memo.clear()
    one = wires[0][0].numel() + sum(p.numel() * p.element_size() for p in topk.decode_index(wires[0][0], SPEC, N))
    monkeypatch.setattr(topk._memo, "max_bytes", 2 * one)
    for w in wires:
        topk.check_positions(w[0], SPEC, N)
    assert len(topk._memo) == 2 and topk._memo.held_bytes <= 2 * one
    assert topk._taken_positions(wires[0][0], SPEC, N) is None  # the oldest went first
    assert topk._taken_positions(wires[2][0], SPEC, N) is not None
