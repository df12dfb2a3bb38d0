"""DiLoCo training through every collective and wire format: replicas end with bitwise-identical weights.

Three replicas (threads) train a small two-layer model on different data through the real outer loop
(``make_diloco_outer_loop``), the manager and ``create_allreduce`` over a ``memory://`` store, with Streaming
DiLoCo's two fragments and a delay of one step (the round runs in the background while a step trains). Whatever
the strategy (gather, sharded) and the format (none, bf16, int8 with and without error feedback, int4), every
replica's final weights must be the same bits, and training must have moved them.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from support.ranks import run_ranks
from torch import nn

from diloco.collectives.allreduce import create_allreduce
from diloco.replica.manager import ObjectStoreManager
from diloco.replica.outer import make_diloco_outer_loop

WORLD = 3
STEPS = 12
SYNC_EVERY = 4


def build_model() -> nn.Sequential:
    """Every replica starts from the same weights (no broadcast): a fixed generator, not the global RNG, which
    the replica threads would race on."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 300), nn.Tanh(), nn.Linear(300, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def train(uri: str, rank: int, strategy: str, compression: str, error_feedback: bool) -> dict[str, torch.Tensor]:
    model = build_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    allreduce = create_allreduce(uri, rank, WORLD, allreduce=strategy, compression=compression,
                                 error_feedback=error_feedback, timeout_s=30, poll_interval_s=0.005)
    manager = ObjectStoreManager(allreduce, total_steps=STEPS)
    data = torch.Generator().manual_seed(rank)
    with make_diloco_outer_loop(manager=manager, model_fragments=[model[0], model[2]], inner_optimizer=inner,
                                sync_every=SYNC_EVERY, fragment_sync_delay=1, model=model) as loop:
        for _ in range(STEPS):
            x = torch.randn(16, 8, generator=data)
            loss = (model(x) - x[:, :3]).pow(2).mean()
            inner.zero_grad()
            loss.backward()
            inner.step()
        # The fragment synced first has trained locally since its last round: compare the global weights.
        loop.restore_global_parameters()
    allreduce.close()
    final = model.state_dict()
    assert any(not torch.equal(final[k], initial[k]) for k in final), "training did not move the weights"
    return final


@pytest.mark.parametrize("strategy", ["gather", "sharded"])
@pytest.mark.parametrize(("compression", "error_feedback"),
                         [("none", True), ("bf16", True), ("int8", True), ("int8", False), ("int4", True)])
def test_replicas_end_with_bitwise_identical_weights(strategy: str, compression: str, error_feedback: bool) -> None:
    uri = f"memory://train-{uuid.uuid4().hex[:8]}"
    finals = run_ranks(WORLD, lambda rank: train(uri, rank, strategy, compression, error_feedback), timeout=120)
    for rank in range(1, WORLD):
        for name, t in finals[0].items():
            assert torch.equal(finals[rank][name].view(torch.int32), t.view(torch.int32)), (rank, name)


def test_gather_and_sharded_train_to_the_same_bits_without_compression() -> None:
    """Same sums in the same order: the strategy changes the traffic, never the result."""
    results = {}
    for strategy in ("gather", "sharded"):
        uri = f"memory://train-{uuid.uuid4().hex[:8]}"
        results[strategy] = run_ranks(WORLD, lambda rank, s=strategy, u=uri: train(u, rank, s, "none", True),
                                      timeout=120)[0]
    for name, t in results["gather"].items():
        assert torch.equal(results["sharded"][name], t), name
