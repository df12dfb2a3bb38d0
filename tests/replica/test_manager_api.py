"""The outer loop asks a manager for what ``diloco.replica.manager_api`` types: diloco's own managers are
``RoundKeeper``s (and ``ShardKeeper``s), a torchft-style manager with only its four calls is wrapped and trains
without committed rounds, and a model exchanged by rows is refused with a manager that cannot do it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch
from torch import nn

from diloco.collectives.allreduce import ObjectStoreAllReduce
from diloco.replica.manager import ObjectStoreManager
from diloco.replica.manager_api import ForeignManager, RoundKeeper, ShardKeeper, as_round_keeper
from diloco.replica.outer import make_diloco_outer_loop


class _Done:
    def wait(self, timeout: object = None) -> bool:
        return True


class TorchftStyleManager:
    """A manager with torchft's four calls only, for one replica: the all-reduce of one is the identity."""

    def __init__(self) -> None:
        self.step = 0
        self.quorums = 0
        self.errors: list[BaseException] = []

    def start_quorum(self) -> None:
        self.quorums += 1

    def allreduce(self, tensor_or_tensors: Any) -> _Done:
        return _Done()

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step

    def report_error(self, exc: BaseException) -> None:
        self.errors.append(exc)


def _store_manager() -> ObjectStoreManager:
    uri = f"memory://rdv-{uuid.uuid4().hex[:8]}"
    return ObjectStoreManager(ObjectStoreAllReduce(uri, 0, 1, timeout_s=10, poll_interval_s=0.01))


def test_the_entrypoints_manager_is_a_round_keeper_and_a_shard_keeper_and_is_used_as_it_is() -> None:
    manager = _store_manager()
    assert isinstance(manager, RoundKeeper) and isinstance(manager, ShardKeeper)
    assert as_round_keeper(manager) is manager
    assert not isinstance(TorchftStyleManager(), RoundKeeper)


def test_a_torchft_style_manager_trains_through_the_loop_with_neutral_additions() -> None:
    """Four calls are enough: the loop runs its rounds through them (the outer step with outer lr 1 and one
    replica lands on the local weight), commits and rejoins nothing and exports nothing."""
    manager = TorchftStyleManager()
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with make_diloco_outer_loop(manager=manager, model_fragments=[model], inner_optimizer=opt, outer_lr=1.0,
                                outer_momentum=0.0, nesterov=False, sync_every=2,
                                checkpoint_dir="/nonexistent-never-written") as diloco:
        assert isinstance(diloco.manager, ForeignManager)
        assert diloco.rejoined_round is None
        for _ in range(4):
            model.weight.grad = torch.ones_like(model.weight)
            opt.step()
        state = diloco.state_dict()
    assert manager.quorums == 2 and manager.step == 2
    assert torch.equal(model.weight.detach(), torch.tensor([[-1.0]]))  # 1 - 4 * 0.5
    assert state["manager"] == {}  # it has no state_dict of its own


def test_a_failed_round_is_reported_to_a_foreign_managers_own_report_error() -> None:
    manager = TorchftStyleManager()
    manager.should_commit = lambda: (_ for _ in ()).throw(RuntimeError("peer lost"))  # type: ignore[method-assign]
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="peer lost"):
        with make_diloco_outer_loop(manager=manager, model_fragments=[model], inner_optimizer=opt, sync_every=1):
            model.weight.grad = torch.ones_like(model.weight)
            opt.step()
    assert [str(e) for e in manager.errors] == ["peer lost"]


def test_a_model_exchanged_by_rows_is_refused_with_a_manager_that_cannot_exchange_rows() -> None:
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not a ShardKeeper.*allreduce_shards.*replica entrypoint's manager"):
        make_diloco_outer_loop(manager=TorchftStyleManager(), model_fragments=[model], inner_optimizer=opt,
                               sync_every=1, shard_exchange=True)
