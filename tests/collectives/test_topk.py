"""The sparse ``topk`` format: what it keeps, the bytes it costs, determinism, corrupt payloads refused, error
feedback sending over later rounds what one round dropped, and a gather all-reduce carrying it between ranks."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch
from safetensors.torch import load, save
from support.ranks import run_ranks  # tests/ is on sys.path

from diloco.collectives import compression
from diloco.collectives.allreduce import create_allreduce
from diloco.collectives.compression import (
    ErrorFeedback,
    TopkSpec,
    decode,
    decode_into,
    encode,
    layout_of,
    wire_nbytes,
)
from diloco.collectives.wire import PayloadCodec
from diloco.errors import ConfigError, CorruptObjectError
from diloco.formats.kernels import bitpack, topk

SPEC = TopkSpec()  # 102 of every 4096, 2-bit values


def payload(seed: int, n: int = 4096 * 3 + 1000) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=gen), "b": torch.randn(5, 7, generator=gen), "s": torch.tensor(0.5)}


def round_trip(tensors: dict[str, torch.Tensor], spec: TopkSpec = SPEC) -> dict[str, torch.Tensor]:
    wire, meta = encode(tensors, "topk", sparse=spec)
    return decode(load(save(wire, metadata=meta)), meta, layout_of(tensors), fmt="topk", sparse=spec)


# ---------------------------------------------------------------- what is kept
def test_each_chunk_keeps_its_k_largest_magnitudes_as_two_levels_with_their_signs() -> None:
    x = payload(1)
    out = round_trip(x)["w"]
    w = x["w"]
    for start in range(0, w.numel(), SPEC.chunk):
        part, got = w[start : start + SPEC.chunk], out[start : start + SPEC.chunk]
        kept = SPEC.kept_in(part.numel())
        expected = set(part.abs().topk(kept).indices.tolist())
        assert set(got.nonzero().flatten().tolist()) == expected
        assert torch.equal(got[list(expected)].sign(), part[list(expected)].sign())
        magnitudes = got[got != 0].abs().unique()
        assert magnitudes.numel() <= SPEC.levels  # 2-bit values: a sign and one of two levels
        # each level is the magnitude of a kept element, between the smallest and the largest kept
        kept_magnitudes = part[list(expected)].abs()
        assert all(bool((kept_magnitudes == m).any()) for m in magnitudes)


@pytest.mark.parametrize("kind", ["normal", "heavy", "repeated", "zeros", "nan"])
def test_the_cpu_and_the_accelerator_searches_keep_the_same_elements(kind: str) -> None:
    """Chunks on a CPU are searched with NumPy, chunks on an accelerator with torch alone (which this CPU runs
    here): on every row neither calls inexact, both keep the same elements in the same order, and ``select``
    (with its fallbacks) keeps what the keys of the whole chunk say."""
    from diloco.formats.kernels.topk import _keys, _Selector

    gen = torch.Generator().manual_seed(7)
    rows = {"normal": torch.randn(64, 4096, generator=gen),
            "heavy": torch.randn(64, 4096, generator=gen) ** 5,
            "repeated": torch.randint(-3, 4, (64, 4096), generator=gen).float() / 4,
            "zeros": torch.zeros(64, 4096).index_fill_(1, torch.tensor([5, 700]), 1.0),
            "nan": torch.randn(64, 4096, generator=gen).index_fill_(1, torch.tensor([9]), float("nan"))}[kind]
    selector = _Selector(4096, SPEC.k, SPEC.index_bits, rows.device)
    fast, fast_inexact = selector._prefiltered_on_cpu(rows)
    plain, plain_inexact = selector._prefiltered(rows)
    both = ~(fast_inexact | plain_inexact)
    for name in ("position", "magnitude", "negative"):
        assert torch.equal(getattr(fast, name)[both], getattr(plain, name)[both]), name
    keys = _keys(rows.view(torch.int32) & 0x7FFFFFFF, torch.arange(4096), SPEC.index_bits, 4096)
    want = torch.topk(keys, SPEC.k, dim=1).values
    kept = selector.select(rows)
    assert torch.equal(kept.position, 4095 - (want & 4095)) and torch.equal(kept.magnitude, (want >> 12).int())
    assert torch.equal(kept.negative, torch.gather(rows.view(torch.int32), 1, kept.position) < 0)


def test_the_last_short_chunk_keeps_proportionally_fewer() -> None:
    assert SPEC.kept_in(1000) == 25 and SPEC.kept_in(1) == 1 and SPEC.kept_in(SPEC.chunk) == 102
    out = round_trip({"v": torch.randn(SPEC.chunk + 1000)})["v"]
    assert int((out[: SPEC.chunk] != 0).sum()) == 102 and int((out[SPEC.chunk :] != 0).sum()) == 25


def test_empty_and_0d_tensors_keep_their_shapes() -> None:
    x = {"empty": torch.zeros(0, 3), "scalar": torch.tensor(-1.5), "one": torch.ones(1)}
    out = round_trip(x)
    assert {n: t.shape for n, t in out.items()} == {n: t.shape for n, t in x.items()}
    assert out["scalar"].item() == -1.5 and out["one"].item() == 1.0  # a lone element is its own level


def test_an_all_zero_chunk_decodes_to_zeros_and_a_non_finite_one_to_nan() -> None:
    x = torch.randn(3 * SPEC.chunk)
    x[: SPEC.chunk] = 0.0
    x[SPEC.chunk + 7] = float("inf")
    out = round_trip({"v": x})["v"]
    assert torch.equal(out[: SPEC.chunk], torch.zeros(SPEC.chunk))
    assert torch.isnan(out[SPEC.chunk : 2 * SPEC.chunk]).all()
    assert torch.isfinite(out[2 * SPEC.chunk :]).all()


# ---------------------------------------------------------------- bytes
@pytest.mark.parametrize("density", [0.01, 1 / 64, 0.02, 0.025])
def test_at_one_to_two_and_a_half_percent_density_it_is_over_100x_smaller_than_fp32(density: float) -> None:
    spec = TopkSpec(density=density)
    x = {"w": torch.randn(64 * spec.chunk), "b": torch.randn(300)}
    wire, meta = encode(x, "topk", sparse=spec)
    on_wire = sum(t.numel() * t.element_size() for t in wire.values())
    assert on_wire == wire_nbytes(layout_of(x), "topk", sparse=spec)
    fp32 = sum(t.numel() * 4 for t in x.values())
    assert fp32 / on_wire >= 100
    stored = len(save(wire, metadata=meta))  # what crosses the store, safetensors header included
    assert fp32 / stored >= 95


def test_the_byte_count_is_exact() -> None:
    """102 kept per chunk of 4096: 5 low bits each (floor(log2(4096 / 102))) and a bitmap of 102 + 128 bits, so
    2 x 102 x 5 bits = 128 bytes and 2 x 230 bits = 58 bytes; the 100-element tail keeps ceil(102 * 100 / 4096) =
    3: 5 low bits each (2 bytes) and a bitmap of 3 + 4 bits (1 byte). Codes 2 bits each, 2 fp32 levels a chunk."""
    wire, _ = encode({"v": torch.randn(2 * SPEC.chunk + 100)}, "topk")
    kept = 2 * 102 + 3
    assert wire["v:idx"].numel() == 128 + 58 + 2 + 1
    assert wire["v:q"].numel() == bitpack.packed_nbytes(kept, 2) == 52
    assert wire["v:scale"].numel() == 3 * 2 and wire["v:scale"].dtype == torch.float32


def test_bad_parameters_name_the_parameter_and_the_fix() -> None:
    with pytest.raises(ValueError, match="topk density: 0 .*0.01 to 0.03"):
        TopkSpec(density=0)
    with pytest.raises(ValueError, match="topk chunk: 1 "):
        TopkSpec(chunk=1)
    with pytest.raises(ValueError, match="topk value_bits: 9"):
        TopkSpec(value_bits=9)
    with pytest.raises(ValueError, match="4 magnitude groups, more than the 2 values"):
        TopkSpec(density=0.5, chunk=4, value_bits=3)


# ---------------------------------------------------------------- determinism
def test_encoding_is_deterministic_to_the_bit_with_ties_broken_by_position() -> None:
    x = torch.randn(2 * SPEC.chunk)
    x[100:400] = 0.75  # many equal magnitudes: which of them are kept is decided by position
    x[500:520] = -0.75
    a, _ = encode({"v": x}, "topk")
    b, _ = encode({"v": x.clone()}, "topk")
    assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
    kept = round_trip({"v": x})["v"]
    ties = (x.abs() == 0.75).nonzero().flatten()
    chosen = ties[kept[ties] != 0]
    assert chosen.tolist() == ties[: chosen.numel()].tolist()  # the smallest positions among the tied


# ---------------------------------------------------------------- corrupt payloads
def test_a_tampered_or_mismatched_payload_is_corrupt() -> None:
    x = payload(2)
    layout = layout_of(x)
    wire, meta = encode(x, "topk")
    with pytest.raises(CorruptObjectError, match="'topk', expected 'int8'"):
        decode(wire, meta, layout, fmt="int8")
    with pytest.raises(CorruptObjectError, match="chunk=4096, k=102, value_bits=2, expected chunk=4096, k=128"):
        decode(wire, meta, layout, fmt="topk", sparse=TopkSpec(density=1 / 32))
    with pytest.raises(CorruptObjectError, match="not a valid chunk, k and value_bits"):
        decode(wire, {**meta, "k": "many"}, layout)
    with pytest.raises(CorruptObjectError, match="missing \\['w:idx'\\]"):
        decode({n: t for n, t in wire.items() if n != "w:idx"}, meta, layout)
    with pytest.raises(CorruptObjectError, match="wire tensor 'w:q'"):
        decode({**wire, "w:q": wire["w:q"][:-1]}, meta, layout)
    with pytest.raises(CorruptObjectError, match="codes its positions as fixed-width fields, not elias-fano"):
        decode(wire, {n: v for n, v in meta.items() if n != "positions"}, layout)
    repeated = topk.encode_positions(torch.tensor([[5, 5, 9]]), 100)  # a stream that is well formed ...
    with pytest.raises(CorruptObjectError, match="not strictly increasing"):
        topk.decode_positions(repeated, 1, 100, 3)  # ... but names position 5 twice
    bitmap_at = 2 * 102 * 5 // 8  # the first chunk's upper bitmap: a bit more or fewer than kept is corrupt
    extra = wire["w:idx"].clone()
    extra[bitmap_at:] = 0xFF
    with pytest.raises(CorruptObjectError, match="does not mark exactly 102 elements"):
        decode({**wire, "w:idx": extra}, meta, layout)


def test_a_position_past_a_short_last_chunk_is_corrupt() -> None:
    x = {"v": torch.randn(100)}  # one chunk of 100: positions must stay below 100
    wire, meta = encode(x, "topk")
    kept = SPEC.kept_in(100)  # 3, with 5 low bits each: a bitmap of 3 + 4 bits after 2 bytes of low bits
    positions = topk.decode_positions(wire["v:idx"], 1, 100, kept)
    assert positions.shape == (1, kept)
    past = topk.encode_positions(torch.tensor([[positions[0, 0], positions[0, 1], 127]]), 128)
    assert past.numel() == wire["v:idx"].numel()  # the same bytes' worth, read as positions in 100
    with pytest.raises(CorruptObjectError, match="within their chunk of 100 elements"):
        decode({**wire, "v:idx": past}, meta, layout_of(x))


# ---------------------------------------------------------------- error feedback
def test_error_feedback_sends_over_later_rounds_what_one_round_dropped() -> None:
    """One round keeps 2.5% of a steady signal and drops the rest; fed back, what was dropped goes out in later
    rounds: the residual stays bounded, so the relative gap between what was sent in total and the inputs' sum
    shrinks like 1 / rounds. Without feedback the dropped 98% is lost every round."""
    gen = torch.Generator().manual_seed(3)
    signal = torch.randn(SPEC.chunk, generator=gen) * 0.01
    inputs = [{"g": signal + torch.randn(SPEC.chunk, generator=gen) * 0.001} for _ in range(160)]
    assert int((ErrorFeedback("topk").compress(inputs[0])[2]["g"] != 0).sum()) == 102

    def gap(enabled: bool, rounds: int) -> float:
        ef = ErrorFeedback("topk", enabled=enabled)
        sent = sum(ef.compress(x)[2]["g"] for x in inputs[:rounds])
        truth = sum(x["g"] for x in inputs[:rounds])
        return float((sent - truth).norm() / truth.norm())

    assert gap(True, 160) < min(0.2, gap(True, 40) / 2.5)
    assert gap(False, 160) > 0.9


def test_compress_returns_what_peers_decode_and_keeps_the_rest_as_residual() -> None:
    ef = ErrorFeedback("topk")
    x = payload(4)
    wire, meta, decoded = ef.compress(x)
    peer = decode(load(save(wire, metadata=meta)), meta, layout_of(x), fmt="topk")
    assert all(torch.equal(decoded[n], peer[n]) for n in x)
    residual = ef.state_dict()
    assert all(torch.equal(residual[n], x[n] - decoded[n]) for n in x)


# ---------------------------------------------------------------- accumulating
def test_decode_into_adds_exactly_what_decode_returns() -> None:
    x = payload(5)
    wire, meta = encode(x, "topk")
    layout = layout_of(x)
    acc = {n: torch.randn(t.shape) for n, t in x.items()}
    expected = {n: acc[n] + t for n, t in decode(wire, meta, layout).items()}
    decode_into(wire, meta, layout, acc, mode="add")
    assert all(torch.equal(acc[n], expected[n]) for n in x)


def test_the_sharded_strategy_refuses_topk_naming_gather() -> None:
    with pytest.raises(ConfigError, match="store.compression: topk needs allreduce gather"):
        create_allreduce(f"memory://{uuid.uuid4().hex}", 0, 2, allreduce="sharded", compression="topk")


def test_a_gather_all_reduce_carries_topk_with_identical_means_on_every_rank(tmp_path: Any) -> None:
    """Ranks as threads on a file:// store, three rounds with error feedback: every rank ends each round with the
    same bits, the mean of what each rank's PayloadCodec sent, and each contribution crossed the store at over
    100x fewer bytes than fp32."""
    world, rounds = 3, 3
    uri = f"file://{tmp_path}/rdv"

    def inputs(rank: int, k: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * rank + k)
        return {"w": torch.randn(64 * SPEC.chunk, generator=g), "b": torch.randn(17, generator=g)}

    def rank_fn(rank: int) -> tuple[list[dict[str, torch.Tensor]], int]:
        outs = []
        with create_allreduce(uri, rank, world, compression="topk", timeout_s=60, poll_interval_s=0.01) as ar:
            for k in range(rounds):
                tensors = inputs(rank, k)
                ar.allreduce(tensors)
                outs.append(tensors)
            return outs, ar.stats.bytes_written

    results = run_ranks(world, rank_fn, timeout=120)
    codecs = [PayloadCodec("topk") for _ in range(world)]  # each rank's sender, replayed
    for k in range(rounds):
        sent = [codecs[r].encode_contribution(("w", "b"), inputs(r, k))[2] for r in range(world)]
        for name in ("w", "b"):
            mean = sum(s[name] for s in sent) / world
            for rank in range(world):
                assert torch.equal(results[rank][0][k][name].view(torch.uint8), results[0][0][k][name]
                                   .view(torch.uint8)), (k, name, rank)
            assert torch.allclose(results[0][0][k][name], mean, rtol=0, atol=1e-6), (k, name)
    fp32_per_round = (64 * SPEC.chunk + 17) * 4  # 1 MiB: the object header (~1 KiB) counts too
    ratios = [fp32_per_round * rounds / written for _, written in results]
    assert all(ratio >= 100 for ratio in ratios), ratios


def test_a_topk_payload_goes_packed_so_its_object_stays_over_100x_smaller_than_fp32() -> None:
    """On the wire a topk payload is three tensors whatever the model (``compression.pack``): with three header
    entries per parameter, the built-in model's object would be only 45x smaller than fp32; packed it is over
    100x. A packed part of the wrong length is refused like any corrupt payload."""
    from diloco.store.codec import encode_tensors
    from diloco.trainers.gpt_model import GPTConfig, build_model

    model = build_model(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64), seed=0)
    tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
    codec = PayloadCodec("topk")
    wire, meta = codec.encode_wire("layout", tensors)
    assert sorted(wire) == ["*:idx", "*:q", "*:scale"] and meta["packed"] == "1"
    identity = {"round": "1", "rank": "0", "run_id": "diloco-20261202-000000-abcdefgh", "world_size": "4"}
    assert len(encode_tensors(tensors, identity)) / len(encode_tensors(wire, {**meta, **identity})) > 100
    layout = compression.layout_of(tensors)
    codec.check(wire, meta, layout, "peer")
    assert codec.decode(wire, meta, layout, "peer").keys() == tensors.keys()
    short = {**wire, "*:q": wire["*:q"][:-1]}
    with pytest.raises(CorruptObjectError, match=r"peer: packed topk payload: \*:q is"):
        codec.check(short, meta, layout, "peer")
