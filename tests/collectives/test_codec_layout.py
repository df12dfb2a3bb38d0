"""The fast codecs write exactly the documented wire layout: bit for bit what a slow, element-by-element
implementation of the module docstring writes (tests/support/codec_reference.py), and they decode that
implementation's payloads to the very values it decodes them to. So payloads of the earlier block-at-a-time
implementation (the same layout) and of this one decode alike, on every machine.

Inputs: random ones, and the adversarial cases a vectorised kernel gets wrong first: exact ties at .5 (round half
to even), subnormal blocks (where x / scale can round past qmax), values near the fp32 maximum, signed zeros,
NaN and infinities, odd lengths and short last blocks or chunks, empty and 0-d tensors, equal magnitudes (top-k
ties, broken by position).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.codec_reference import decode_blocks, decode_topk, encode_blocks, encode_topk

from diloco.collectives import compression
from diloco.collectives.compression import TopkSpec, decode, encode

FLT_MAX = float(np.finfo(np.float32).max)


def adversarial(n: int, seed: int) -> dict[str, np.ndarray]:
    """Named fp32 arrays of ``n`` elements (about) that stress rounding, ranges and ties."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n, dtype=np.float32)
    ties = (steps % 255 - 127).astype(np.float32) + np.float32(0.5)  # x / scale lands on k + 0.5
    ties[::97] = 127.0  # a max of 127 (or 7 * k) makes scale exactly 1 in many blocks
    return {
        "random": rng.standard_normal(n).astype(np.float32) * np.float32(1e-3),
        "ties": ties,
        "ties4": (steps % 15 - 7).astype(np.float32) + np.float32(0.5),
        "subnormal": (rng.standard_normal(n) * 1e-39).astype(np.float32),
        "tiny": (rng.integers(-3, 4, n) * np.float32(1.4e-45)).astype(np.float32),
        "huge": (rng.uniform(-1, 1, n) * FLT_MAX).astype(np.float32),
        "zeros": np.where(rng.random(n) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32),
        "equal": np.where(rng.random(n) < 0.5, np.float32(0.25), np.float32(-0.25)).astype(np.float32),
        "sparse": np.where(rng.random(n) < 0.02, rng.standard_normal(n), 0).astype(np.float32),
        "nonfinite": np.where(steps % 301 == 5, np.float32("nan"),
                              np.where(steps % 433 == 9, np.float32("-inf"), rng.standard_normal(n)))
        .astype(np.float32),
    }


def same_bits(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> bool:
    """Byte equality (NaN-safe, signed zeros told apart) of two arrays of the same dtype and shape."""
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    b = b.numpy() if isinstance(b, torch.Tensor) else b
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def fast_wire(x: np.ndarray, fmt: str, **kwargs: object) -> dict[str, torch.Tensor]:
    wire, _ = encode({"t": torch.from_numpy(x.copy())}, fmt, **kwargs)  # type: ignore[arg-type]
    return {name[1:]: t for name, t in wire.items()}


def fast_decode(wire: dict[str, np.ndarray], meta: dict[str, str], shape: tuple[int, ...]) -> torch.Tensor:
    tensors = {"t" + suffix: torch.from_numpy(a.copy()) for suffix, a in wire.items()}
    return decode(tensors, meta, {"t": (shape, torch.float32)})["t"]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("block,n", [(256, 1000), (64, 4097), (7, 333), (1, 9)])
def test_integer_formats_match_the_reference_bit_for_bit(fmt: str, block: int, n: int) -> None:
    for name, x in adversarial(n, seed=block).items():
        ours = fast_wire(x, fmt, block=block)
        theirs = encode_blocks(x, fmt, block)
        assert same_bits(ours[":q"], theirs[":q"]), (name, "codes")
        assert same_bits(ours[":scale"], theirs[":scale"]), (name, "scales")
        meta = {"compression": fmt, "block": str(block)}
        decoded = fast_decode(theirs, meta, (n,))
        assert same_bits(decoded, decode_blocks(theirs, fmt, n, block)), (name, "decode")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_payload_larger_than_a_chunk_of_work_matches_the_reference(fmt: str) -> None:
    """More elements than one cache-sized chunk, with a short last block: chunk boundaries change no bit."""
    from diloco.formats.kernels import blockquant

    n = 2 * blockquant.CPU_CHUNK_BYTES // 4 + 3 * 256 + 5
    x = adversarial(n, seed=5)["random"]
    x[n // 2 : n // 2 + 256] = np.float32("nan")  # a non-finite block in the middle of a chunk
    ours = fast_wire(x, fmt)
    theirs = encode_blocks(x, fmt, 256)
    assert same_bits(ours[":q"], theirs[":q"]) and same_bits(ours[":scale"], theirs[":scale"])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_empty_and_0d_match_the_reference(fmt: str) -> None:
    for x in (np.zeros(0, dtype=np.float32), np.array(-2.5, dtype=np.float32)):
        ours = fast_wire(x, fmt)
        theirs = encode_blocks(x, fmt, 256)
        assert same_bits(ours[":q"], theirs[":q"]) and same_bits(ours[":scale"], theirs[":scale"])


@pytest.mark.parametrize("chunk,density,value_bits,n", [
    (64, 1 / 8, 2, 64 * 5 + 37),     # pre-filter on, a short last chunk
    (4096, 0.025, 2, 4096 * 2 + 100),  # the defaults
    (4096, 1 / 64, 2, 4096 + 4000),  # SparseLoCo's density
    (100, 0.05, 1, 250),             # sign-only values, a chunk size that is no power of two
    (256, 0.1, 3, 256 * 3),          # 4 magnitude groups
    (16, 1.0, 2, 40),                # everything kept
])
def test_topk_matches_the_reference_bit_for_bit(chunk: int, density: float, value_bits: int, n: int) -> None:
    spec = TopkSpec(density=density, chunk=chunk, value_bits=value_bits)
    for name, x in adversarial(n, seed=chunk).items():
        ours = fast_wire(x, "topk", sparse=spec)
        theirs = encode_topk(x, chunk, spec.k, value_bits)
        for suffix in (":idx", ":q", ":scale"):
            assert same_bits(ours[suffix], theirs[suffix]), (name, suffix)
        meta = {"compression": "topk", "chunk": str(chunk), "k": str(spec.k), "value_bits": str(value_bits),
                "positions": "elias-fano"}
        assert same_bits(fast_decode(theirs, meta, (n,)), decode_topk(theirs, n, chunk, spec.k, value_bits)), name


def test_topk_ties_that_defeat_the_pre_filter_match_the_reference() -> None:
    """Chunks where several groups share the threshold maximum (repeated values, an all-zero chunk, a chunk of
    one repeated magnitude with a few larger ones) are searched whole, with the same result."""
    rng = np.random.default_rng(3)
    spec = TopkSpec(density=1 / 16, chunk=512)
    x = np.concatenate([
        np.zeros(512), np.full(512, 0.5), np.where(rng.random(512) < 0.1, 2.0, 0.5),
        rng.integers(-2, 3, 512).astype(np.float64), rng.standard_normal(512),
    ]).astype(np.float32)
    ours = fast_wire(x, "topk", sparse=spec)
    theirs = encode_topk(x, 512, spec.k, 2)
    assert all(same_bits(ours[s], theirs[s]) for s in (":idx", ":q", ":scale"))


def test_topk_equal_magnitudes_among_the_kept_match_the_reference() -> None:
    """Equal magnitudes rank by position: among the kept (which the pre-filter's magnitude order cannot rank), at
    the boundary of the kept set, across an infinity; each chunk otherwise ordinary random data."""
    rng = np.random.default_rng(11)
    spec = TopkSpec()
    x = rng.standard_normal(4 * 4096).astype(np.float32)
    x[[10, 3000, 777]] = [5.0, -5.0, 5.0]  # chunk 0: a three-way tie among its largest
    boundary = 4096 + np.argsort(-np.abs(x[4096:8192]))[spec.k - 1]  # chunk 1: its k-th largest, copied
    x[4096 + 5] = -x[boundary]
    x[[8192 + 1, 8192 + 4000]] = [np.inf, -np.inf]  # chunk 2: two infinities (no NaN)
    ours = fast_wire(x, "topk", sparse=spec)
    theirs = encode_topk(x, spec.chunk, spec.k, spec.value_bits)
    assert all(same_bits(ours[s], theirs[s]) for s in (":idx", ":q", ":scale"))


def test_topk_magnitudes_equal_in_their_high_bits_match_the_reference() -> None:
    """The CPU search compares magnitudes with their lowest bits replaced by an index: chunks whose largest
    magnitudes differ only in those bits (at the boundary of the kept set, and among the kept) are compared in
    full, with the same result."""
    rng = np.random.default_rng(5)
    spec = TopkSpec()
    x = rng.standard_normal(3 * 4096).astype(np.float32)
    bits = x.view(np.int32)
    for chunk in range(3):
        order = chunk * 4096 + np.argsort(-np.abs(x[chunk * 4096 : (chunk + 1) * 4096]))
        near = order[spec.k - 6 : spec.k + 6] if chunk < 2 else order[:40]  # across the boundary, or the top
        base = bits[near[0]] & ~0x3FF  # same sign, exponent and high mantissa bits; low 10 bits differ
        bits[near] = base | rng.integers(0, 1 << 10, near.size).astype(np.int32)
    ours = fast_wire(x, "topk", sparse=spec)
    theirs = encode_topk(x, spec.chunk, spec.k, spec.value_bits)
    assert all(same_bits(ours[s], theirs[s]) for s in (":idx", ":q", ":scale"))


def test_topk_over_several_passes_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor is described a pass of chunks at a time: with the smallest passes, pass boundaries change no
    bit (three passes and a short last chunk; ties and a NaN in the middle)."""
    from diloco.formats.kernels import topk

    monkeypatch.setattr(topk, "CPU_PASS_ELEMENTS", 1)  # a pass is then one call's worth of chunks
    spec = TopkSpec()
    rows = topk._Selector(spec.chunk, spec.k, spec.index_bits, torch.device("cpu")).rows_per_call
    x = adversarial(spec.chunk * (3 * rows) - 999, seed=13)["random"]
    x[spec.chunk * rows + 7] = np.float32("nan")
    x[spec.chunk * (rows + 1) : spec.chunk * (rows + 2)] = 0.5
    ours = fast_wire(x, "topk", sparse=spec)
    theirs = encode_topk(x, spec.chunk, spec.k, spec.value_bits)
    assert all(same_bits(ours[s], theirs[s]) for s in (":idx", ":q", ":scale"))


def test_topk_empty_and_0d_match_the_reference() -> None:
    spec = TopkSpec()
    for x in (np.zeros(0, dtype=np.float32), np.array(-2.5, dtype=np.float32)):
        ours = fast_wire(x, "topk", sparse=spec)
        theirs = encode_topk(x, spec.chunk, spec.k, spec.value_bits)
        assert all(same_bits(ours[s], theirs[s]) for s in (":idx", ":q", ":scale"))


def test_the_reference_is_not_trivially_equal() -> None:
    """Guards the comparisons above: the reference does disagree with a payload that differs by one bit."""
    x = adversarial(300, seed=1)["random"]
    theirs = encode_blocks(x, "int8", 64)
    wrong = fast_wire(x, "int8", block=32)
    assert not same_bits(wrong[":scale"], theirs[":scale"])
    assert compression.wire_nbytes({"t": ((300,), torch.float32)}, "int8", 64) == \
        sum(a.nbytes for a in theirs.values())
