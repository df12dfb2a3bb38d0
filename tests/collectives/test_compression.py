"""The wire formats of diloco.collectives.compression: error bounds, sizes, determinism, edge cases, tag checks, and error
feedback keeping the sum of what was sent close to the sum of the true pseudo-gradients."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load, save

from diloco.collectives.compression import (
    DEFAULT_BLOCK,
    FORMATS,
    ErrorFeedback,
    check,
    decode,
    decode_into,
    encode,
    layout_of,
    wire_nbytes,
)
from diloco.errors import ConfigError, CorruptObjectError
from diloco.trainers.gpt_model import GPTConfig, build_model


def model_like_payload(seed: int = 0) -> dict[str, torch.Tensor]:
    """Pseudo-gradient-shaped tensors of the built-in model: matrices, vectors, biases of odd sizes."""
    model = build_model(GPTConfig(), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) * 1e-3 for name, p in model.named_parameters()}


def random_payload(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(37, 129, generator=gen) * 0.01,  # 4773 elements: a short last block, odd for int4
        "b": torch.randn(3, generator=gen),
        "s": torch.tensor(-0.25),
    }


def round_trip(tensors: dict[str, torch.Tensor], fmt: str, block: int = DEFAULT_BLOCK) -> dict[str, torch.Tensor]:
    """Through encode, real safetensors bytes, and decode, as the all-reduce does it."""
    wire, meta = encode(tensors, fmt, block=block)
    return decode(load(save(wire, metadata=meta)), meta, layout_of(tensors), fmt=fmt, block=block)


def block_scales(x: torch.Tensor, qmax: int, block: int) -> torch.Tensor:
    """Each element's block scale (absmax / qmax), computed independently of the module."""
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), block):
        out[start : start + block] = flat[start : start + block].abs().max() / qmax
    return out


# ---------------------------------------------------------------- error bounds
@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("block", [DEFAULT_BLOCK, 64, 7])
def test_integer_formats_err_by_at_most_half_a_step_of_their_block(fmt: str, qmax: int, block: int) -> None:
    x = random_payload(1)
    out = round_trip(x, fmt, block)
    for name, t in x.items():
        assert out[name].shape == t.shape and out[name].dtype == torch.float32
        err = (out[name] - t).reshape(-1).abs()
        bound = block_scales(t, qmax, block) / 2
        # one rounding of the division and one of the product on top of the half step
        assert torch.all(err <= bound * (1 + 1e-5) + t.reshape(-1).abs() * 1e-6), name


def test_integer_formats_are_not_lossless() -> None:
    """Guards the bound test above against a format that silently sends fp32."""
    x = random_payload(2)
    for fmt in ("int8", "int4"):
        assert not torch.equal(round_trip(x, fmt)["w"], x["w"])


def test_bf16_relative_error_is_at_most_2_to_the_minus_8() -> None:
    x = random_payload(3)
    out = round_trip(x, "bf16")
    for name, t in x.items():
        assert torch.all((out[name] - t).abs() <= t.abs() * 2**-8), name
        assert torch.equal(out[name], t.to(torch.bfloat16).float())  # torch's own round-to-nearest-even


def test_none_is_exact() -> None:
    x = random_payload(4)
    out = round_trip(x, "none")
    assert all(torch.equal(out[name], t) for name, t in x.items())


# ---------------------------------------------------------------- sizes
def test_wire_nbytes_counts_the_wire_tensors() -> None:
    x = random_payload(5)
    for fmt in FORMATS:
        wire, _ = encode(x, fmt)
        assert wire_nbytes(layout_of(x), fmt) == sum(t.numel() * t.element_size() for t in wire.values())


def test_int8_is_at_least_3_5x_and_int4_about_7x_smaller_than_fp32_with_scales() -> None:
    payload = model_like_payload()
    layout = layout_of(payload)
    fp32 = wire_nbytes(layout, "none")
    assert fp32 == sum(t.numel() * 4 for t in payload.values())
    assert fp32 / wire_nbytes(layout, "bf16") == pytest.approx(2.0)
    assert fp32 / wire_nbytes(layout, "int8") >= 3.5
    assert 7.0 <= fp32 / wire_nbytes(layout, "int4") < 8.0
    # the bytes that actually cross the store, safetensors header included
    stored = {fmt: len(save(*encode(payload, fmt))) for fmt in FORMATS}
    assert stored["none"] / stored["int8"] >= 3.5
    assert stored["none"] / stored["int4"] >= 7.0


# ---------------------------------------------------------------- edge cases
@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_0d_and_odd_sized_tensors_keep_their_shapes(fmt: str) -> None:
    x = {"empty": torch.zeros(0, 5), "scalar": torch.tensor(1.5), "odd": torch.arange(7.0) - 3, "one": torch.ones(1)}
    out = round_trip(x, fmt)
    assert {n: t.shape for n, t in out.items()} == {n: t.shape for n, t in x.items()}
    assert out["scalar"].item() == pytest.approx(1.5, rel=2**-8)
    assert torch.equal(out["one"], torch.ones(1))


def test_int4_packs_two_codes_per_byte_low_nibble_first() -> None:
    """Element 2i in bits 0-3, element 2i+1 in bits 4-7, codes offset by 8; an odd tail pads with 8 (zero)."""
    x = {"v": torch.tensor([7.0, -7.0, 0.0, 1.0, 2.0])}  # scale 1: codes 7, -7, 0, 1, 2
    wire, _ = encode(x, "int4")
    assert wire["v:q"].dtype == torch.uint8
    assert wire["v:q"].tolist() == [(15) | (1 << 4), 8 | (9 << 4), 10 | (8 << 4)]
    assert wire["v:scale"].tolist() == [1.0]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_an_all_zero_block_decodes_to_exact_zeros(fmt: str) -> None:
    x = {"v": torch.cat([torch.zeros(DEFAULT_BLOCK), torch.randn(10)])}
    wire, _ = encode(x, fmt)
    assert wire["v:scale"][0].item() == 0.0
    out = round_trip(x, fmt)
    assert torch.equal(out["v"][:DEFAULT_BLOCK], torch.zeros(DEFAULT_BLOCK))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_turns_its_block_to_nan_and_leaves_the_others_alone(fmt: str, bad: float) -> None:
    x = {"v": torch.ones(2 * DEFAULT_BLOCK)}
    x["v"][3] = bad
    out = round_trip(x, fmt)
    assert torch.isnan(out["v"][:DEFAULT_BLOCK]).all()
    assert torch.equal(out["v"][DEFAULT_BLOCK:], torch.ones(DEFAULT_BLOCK))


# ---------------------------------------------------------------- determinism and tags
@pytest.mark.parametrize("fmt", FORMATS)
def test_encoding_is_deterministic_to_the_bit(fmt: str) -> None:
    (a, meta_a), (b, meta_b) = encode(model_like_payload(7), fmt), encode(model_like_payload(7), fmt)
    assert meta_a == meta_b and set(a) == set(b)
    for name in a:  # bit for bit, NaN-safe: compare the raw bytes
        assert a[name].dtype == b[name].dtype
        assert a[name].contiguous().view(torch.uint8).tolist() == b[name].contiguous().view(torch.uint8).tolist()


def test_metadata_tags_format_and_block() -> None:
    _, meta = encode(random_payload(0), "int8", block=128)
    assert meta == {"compression": "int8", "block": "128"}


@pytest.mark.parametrize("sent,expected", [("int8", "int4"), ("bf16", "none"), ("none", "bf16"), ("int4", "int8")])
def test_a_peer_using_another_format_is_corrupt_naming_both(sent: str, expected: str) -> None:
    x = random_payload(8)
    wire, meta = encode(x, sent)
    with pytest.raises(CorruptObjectError, match=f"{sent}.*expected '{expected}'"):
        decode(wire, meta, layout_of(x), fmt=expected, block=DEFAULT_BLOCK)


def test_a_lying_tag_is_caught_by_the_wire_tensors() -> None:
    """Even without an expected format, the tag must match what the wire tensors are."""
    x = random_payload(9)
    wire, _ = encode(x, "bf16")
    with pytest.raises(CorruptObjectError, match="wire tensor 'w' is torch.bfloat16"):
        decode(wire, {"compression": "none", "block": "256"}, layout_of(x))
    wire, meta = encode(x, "int8")
    with pytest.raises(CorruptObjectError, match="missing"):
        decode({k: v for k, v in wire.items() if k != "w:scale"}, meta, layout_of(x))


def test_another_block_size_is_corrupt_naming_both() -> None:
    x = random_payload(10)
    wire, meta = encode(x, "int8", block=128)
    with pytest.raises(CorruptObjectError, match="block=128, expected 256"):
        decode(wire, meta, layout_of(x), fmt="int8", block=256)


@pytest.mark.parametrize("meta", [{}, {"compression": "fp8", "block": "256"}, {"compression": "int8", "block": "0"}])
def test_a_missing_or_unknown_tag_is_corrupt(meta: dict[str, str]) -> None:
    x = random_payload(11)
    wire, _ = encode(x, "int8")
    with pytest.raises(CorruptObjectError, match="compressed payload has"):
        decode(wire, meta, layout_of(x))


def test_bad_arguments_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="store.compression: 'fp8'.*none, bf16, int8, int4"):
        encode({}, "fp8")
    with pytest.raises(ValueError, match="compression block: 0"):
        encode({}, "int8", block=0)
    with pytest.raises(ValueError, match="only floating tensors"):
        encode({"i": torch.arange(3)}, "int8")


# ---------------------------------------------------------------- decoding into a running sum
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_into_writes_adds_or_subtracts_exactly_what_decode_returns(fmt: str) -> None:
    """The all-reduce adds peers into its sum, and error feedback subtracts what was sent from the residual,
    without a decoded temporary: the bits must be those of ``out + decode(...)`` (``-``). The payload spans
    several cache-sized chunks of work."""
    gen = torch.Generator().manual_seed(21)
    x = {"big": torch.randn(300_001, generator=gen), **random_payload(21)}
    layout = layout_of(x)
    wire, meta = encode(x, fmt)
    decoded = decode(wire, meta, layout)
    base = {n: torch.randn(t.shape, generator=gen) for n, t in x.items()}
    for mode, expected in (("write", decoded), ("add", {n: base[n] + decoded[n] for n in x}),
                           ("subtract", {n: base[n] - decoded[n] for n in x})):
        out = {n: b.clone() for n, b in base.items()}
        decode_into(wire, meta, layout, out, mode=mode)
        for n in x:
            assert torch.equal(out[n].view(torch.int32), expected[n].to(torch.float32).view(torch.int32)), (mode, n)


def test_a_corrupt_payload_is_refused_before_the_sum_is_touched() -> None:
    x = random_payload(22)
    wire, meta = encode(x, "int8")
    bad = {**wire, "w:q": wire["w:q"][:-1]}
    out = {n: torch.ones(t.shape) for n, t in x.items()}
    with pytest.raises(CorruptObjectError, match="wire tensor 'w:q'"):
        check(bad, meta, layout_of(x))
    with pytest.raises(CorruptObjectError, match="wire tensor 'w:q'"):
        decode_into(bad, meta, layout_of(x), out, mode="add")
    assert all(bool((t == 1).all()) for t in out.values())
    check(wire, meta, layout_of(x))  # a sound payload passes
    with pytest.raises(ValueError, match="decode_into mode: 'mul'"):
        decode_into(wire, meta, layout_of(x), out, mode="mul")


# ---------------------------------------------------------------- error feedback
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_compress_returns_exactly_what_peers_decode(fmt: str) -> None:
    ef = ErrorFeedback(fmt)
    x = random_payload(12)
    for _ in range(3):
        wire, meta, decoded = ef.compress(x)
        peer = decode(load(save(wire, metadata=meta)), meta, layout_of(x), fmt=fmt)
        assert all(torch.equal(decoded[n], peer[n]) for n in x)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "topk"])
def test_compress_wire_sends_and_remembers_what_compress_does(fmt: str) -> None:
    """The wire-only variant the all-reduce uses keeps the same residuals, round after round."""
    with_decoded, wire_only = ErrorFeedback(fmt), ErrorFeedback(fmt)
    for seed in range(3):
        x = random_payload(30 + seed)
        a, meta_a, _ = with_decoded.compress(x)
        b, meta_b = wire_only.compress_wire(x)
        assert meta_a == meta_b and all(torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
                                        for n in a)
    residual_a, residual_b = with_decoded.state_dict(), wire_only.state_dict()
    assert all(torch.equal(residual_a[n], residual_b[n]) for n in residual_a)


@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("int4", 7)])
def test_error_feedback_keeps_the_sum_of_sent_values_within_one_step_of_the_true_sum(fmt: str, qmax: int) -> None:
    """sum(decoded_k) = sum(x_k) - residual_K, and the residual is at most half a step of the last round;
    without feedback the rounding errors add up round after round."""
    rounds = 40
    gen = torch.Generator().manual_seed(13)
    # a persistent small component under one quantization step, as in slowly moving weights
    bias = torch.full((512,), 0.004)
    inputs = [{"g": torch.randn(512, generator=gen) * 0.1 + bias} for _ in range(rounds)]
    true_sum = sum(x["g"] for x in inputs)
    sums = {}
    for enabled in (True, False):
        ef = ErrorFeedback(fmt, enabled=enabled)
        sums[enabled] = sum(ef.compress(x)[2]["g"] for x in inputs)
    drift_fb = (sums[True] - true_sum).abs().max().item()
    drift_plain = (sums[False] - true_sum).abs().max().item()
    max_step = max(x["g"].abs().max().item() + 0.5 for x in inputs) / qmax  # absmax of x + residual, generously
    assert drift_fb <= max_step / 2 * 1.01
    assert drift_plain > 3 * drift_fb


def test_error_feedback_disabled_or_lossless_keeps_no_residual() -> None:
    x = random_payload(14)
    for ef in (ErrorFeedback("int8", enabled=False), ErrorFeedback("none")):
        ef.compress(x)
        assert ef.state_dict() == {}
    once, twice = ErrorFeedback("int8", enabled=False), ErrorFeedback("int8", enabled=False)
    twice.compress(x)
    assert torch.equal(once.compress(x)[2]["w"], twice.compress(x)[2]["w"])


def test_error_feedback_state_round_trips_through_safetensors() -> None:
    x, y = random_payload(15), random_payload(16)
    original = ErrorFeedback("int4")
    original.compress(x)
    state = original.state_dict()
    assert set(state) == set(x) and all(t.dtype == torch.float32 for t in state.values())
    resumed = ErrorFeedback("int4")
    resumed.load_state_dict(load(save(state)))
    a, b = original.compress(y)[2], resumed.compress(y)[2]
    assert all(torch.equal(a[n], b[n]) for n in y)
    fresh = ErrorFeedback("int4").compress(y)[2]
    assert not torch.equal(fresh["w"], a["w"])  # the residual did change what was sent


def test_error_feedback_does_not_carry_a_non_finite_value_into_later_rounds() -> None:
    ef = ErrorFeedback("int8")
    bad = {"g": torch.ones(DEFAULT_BLOCK)}
    bad["g"][0] = float("nan")
    assert torch.isnan(ef.compress(bad)[2]["g"]).all()
    assert torch.isfinite(ef.compress({"g": torch.ones(DEFAULT_BLOCK)})[2]["g"]).all()


def test_error_feedback_refuses_a_changed_layout() -> None:
    ef = ErrorFeedback("int8")
    ef.compress({"g": torch.ones(4)})
    with pytest.raises(ValueError, match="'g' is now \\(5,\\) but its residual is \\(4,\\)"):
        ef.compress({"g": torch.ones(5)})


def test_inputs_are_not_modified() -> None:
    x = random_payload(17)
    before = {n: t.clone() for n, t in x.items()}
    ef = ErrorFeedback("int4")
    ef.compress(x)
    ef.compress(x)
    assert all(torch.equal(x[n], before[n]) for n in x)


GOLDEN_SHA256 = {  # the wire bits of the input below: the same on every machine, every torch build
    "bf16": "cc93de846a2ad34782892d815564535006f58c3bd39d251cbee563de4e0f9224",
    "int8": "b15ce40d21c709a4baa1ccdbe5633fdd13ad87b35c3679f370b98a7092e10c3b",
    "int4": "0def9912faaef418897a2ca50efc8ffb2c96ca76b72f353606f3976bf7db25cd",
}


@pytest.mark.parametrize("fmt", sorted(GOLDEN_SHA256))
def test_wire_bits_match_the_recorded_ones(fmt: str) -> None:
    """Catches a change of rounding, block layout or nibble order, which would make old and new ranks disagree.
    The input is built from integers and one correctly rounded division, so it is itself the same everywhere."""
    import hashlib

    x = {"v": (torch.arange(5000, dtype=torch.int64) * 7919 % 1001 - 500).to(torch.float32) / 337.0}
    wire, _ = encode(x, fmt)
    digest = hashlib.sha256()
    for name in sorted(wire):
        digest.update(wire[name].contiguous().view(torch.uint8).numpy().tobytes())
    assert digest.hexdigest() == GOLDEN_SHA256[fmt]
