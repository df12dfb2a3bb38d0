"""bench/sparse_variants.py's variants do what their rows say, and bench/convergence.py counts the bytes the store
holds: checked on small tensors, without training."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from support.bench_scripts import load_bench_script

from diloco.collectives.wire import PayloadCodec
from diloco.store.codec import encode_tensors

convergence = load_bench_script("convergence")
load_bench_script("convergence_warm")
variants = load_bench_script("sparse_variants")

SMALL = convergence.GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)


def _replicas(n: int, seed: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(model=convergence.build_model(SMALL, seed=seed)) for _ in range(n)]


def _drift(replicas: list[SimpleNamespace], generator: torch.Generator) -> None:
    with torch.no_grad():
        for r in replicas:
            for p in r.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.01)


def test_each_replicas_own_nesterov_update_is_fp32_diloco_when_nothing_is_lost() -> None:
    """Lossless, sending each replica's Nesterov update and applying the mean with lr 1 is the papers' outer
    step on the mean: the variant's check row measures the variant's machinery, not a different method."""
    paper = dataclasses.replace(convergence.Setting(replicas=3), **variants.PAPER)
    local = dataclasses.replace(paper, outer_lr=1.0, outer_momentum=0.0)
    a, b = _replicas(3, seed=1), _replicas(3, seed=1)
    reference = convergence.OuterStep(paper, a[0].model)
    variant = variants.LocalMomentum(local, b[0].model)
    for round_seed in range(4):
        _drift(a, torch.Generator().manual_seed(round_seed))
        _drift(b, torch.Generator().manual_seed(round_seed))
        reference(a)
        variant(b)
    for name, g in reference.global_params.items():
        torch.testing.assert_close(variant.global_params[name], g, rtol=1e-5, atol=1e-6)
    start = dict(convergence.build_model(SMALL, seed=1).named_parameters())
    assert sum(float((g - start[name].detach()).abs().sum()) for name, g in reference.global_params.items()) > 0


def test_contributor_mean_applies_a_value_one_replica_sent_whole() -> None:
    step = variants.ContributorMean.__new__(variants.ContributorMean)
    one = torch.tensor([2.0, 0.0, 4.0])
    other = torch.tensor([0.0, 0.0, 2.0])
    assert step.combined([one, other]).tolist() == [2.0, 0.0, 3.0]
    assert convergence.OuterStep.combined(step, [one, other]).tolist() == [1.0, 0.0, 3.0]


def test_dct_variant_sends_one_coefficient_of_a_block_exactly() -> None:
    """A block that is one DCT basis pattern has one non-zero coefficient: kept alone, it comes back whole."""
    basis = variants._dct_matrix(64)
    torch.testing.assert_close(basis @ basis.T, torch.eye(64), atol=1e-5, rtol=0)
    pattern = 3.0 * torch.outer(basis[5], basis[9])
    x = torch.zeros(128, 64)
    x[64:] = pattern
    decoded, nbytes = variants.dct_topk(x, density=1 / 4096)
    torch.testing.assert_close(decoded, x, atol=1e-5, rtol=0)
    assert nbytes > 0
    vector, cost = variants.dct_topk(torch.linspace(-1, 1, 64))
    assert cost == 64 + 4 and float((vector - torch.linspace(-1, 1, 64)).abs().max()) < 1 / 127


def test_rank_one_variant_is_exact_on_a_rank_one_matrix_and_costs_its_factors() -> None:
    x = torch.outer(torch.arange(1.0, 7.0), torch.tensor([1.0, -2.0, 0.5, 3.0]))
    decoded, nbytes = variants.rank_one(x)
    torch.testing.assert_close(decoded, x, atol=1e-4, rtol=1e-5)
    assert nbytes == 4 * (6 + 4)


def test_bytes_at_the_store_are_the_objects_a_round_writes() -> None:
    """The sparse format goes to the store packed (three tensors, whatever the model): the bench counts that
    object, not one with three wire tensors per model tensor."""
    model = convergence.build_model(SMALL, seed=3)
    delta = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) for n, p in model.named_parameters()}
    for fmt in ("topk", "int8"):
        spec = convergence.sparse_spec(convergence.Setting()) if fmt == "topk" else None
        wire, meta, _ = convergence.wire_codec(fmt, True, 1, sparse=spec)(0, delta)
        sent = PayloadCodec(fmt, sparse=spec).encode_wire("payload", delta)
        assert convergence.stored_nbytes(fmt, wire, meta) == len(encode_tensors(*sent))
    assert convergence.stored_nbytes("none", delta, {}) == len(encode_tensors(delta, {}))


def test_shared_positions_are_every_replicas_and_cost_two_bits_a_value_and_the_levels() -> None:
    """The shared-* rows: in a round every replica sends values at the same positions (so the mean is exact there),
    at two levels a chunk; the next round draws others; with last_mean half of them are the largest of the last
    round's mean; bytes are 2 bits a value and two fp32 levels a chunk, no positions."""
    codec = variants.SharedPositions(world=2, decay=0.95, density=1 / 8, chunk=64)
    generator = torch.Generator().manual_seed(0)
    deltas = [{"w": torch.randn(3, 50, generator=generator)} for _ in range(2)]  # 150: two chunks of 64, a tail of 22
    sent = [codec(rank, d) for rank, d in enumerate(deltas)]
    where = [s[2]["w"].reshape(-1) != 0 for s in sent]
    assert torch.equal(where[0], where[1]) and int(where[0].sum()) == 2 * 8 + 3
    assert sent[0][0]["wire"].numel() == -(-(2 * (2 * 8 + 64) + (2 * 3 + 64)) // 8)
    for rank, (s, d) in enumerate(zip(sent, deltas, strict=True)):
        values = s[2]["w"].reshape(-1)[where[0]]
        assert len(set(values.abs().tolist())) <= 2 * 3  # two levels in each of the three runs
        torch.testing.assert_close(codec.residuals[rank]["w"], d["w"] - s[2]["w"])
    next_round = codec(0, deltas[0])[2]["w"].reshape(-1) != 0
    assert not torch.equal(next_round, where[0])

    chosen = variants.SharedPositions(world=1, decay=1.0, density=1 / 8, chunk=64, last_mean=True)
    chosen.previous = {"w": torch.zeros(64)}
    chosen.previous["w"][[5, 40, 63, 7]] = torch.tensor([9.0, -8.0, 7.0, 6.0])
    at = chosen.positions("w", 3, rows=1, width=64, k=8)[0].tolist()
    assert {5, 40, 63, 7} <= set(at) and len(set(at)) == 8


def test_vectors_apart_sends_vectors_in_their_format_and_matrices_sparse() -> None:
    """``vectors-*``: every vector arrives whole (fp32) or within int8's rounding, each matrix keeps the sparse
    format's 2.5% per chunk, and the wire bytes count both parts."""
    setting = dataclasses.replace(convergence.Setting(replicas=2), **variants.SPARSELOCO_RULE)
    generator = torch.Generator().manual_seed(0)
    delta = {"w": torch.randn(64, 64, generator=generator), "b": torch.randn(64, generator=generator)}
    whole_wire, _, whole = variants.VectorsApart(setting, "none")(0, delta)
    int8_wire, _, int8 = variants.VectorsApart(setting, "int8")(0, delta)
    assert torch.equal(whole["b"], delta["b"])
    torch.testing.assert_close(int8["b"], delta["b"], atol=float(delta["b"].abs().max()) / 100, rtol=0)
    assert not torch.equal(int8["b"], delta["b"])
    for decoded in (whole, int8):
        assert int((decoded["w"] != 0).sum()) == convergence.sparse_spec(setting).kept(64 * 64)
    nbytes = [sum(t.numel() * t.element_size() for t in wire.values()) for wire in (whole_wire, int8_wire)]
    assert nbytes[0] - nbytes[1] >= 64 * 4 - (64 + 4 * 4)  # 4 bytes a value against 1, and a few fp32 scales
