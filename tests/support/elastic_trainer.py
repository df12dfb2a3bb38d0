"""A tiny trainer on the real outer loop for elastic runs: gates at chosen steps that the test opens, so a scale
lands at a known round boundary, and one planned SIGKILL of one rank.

At each step in ``gates`` a rank writes ``gate_dir/step{S}.rank{R}.waiting`` and holds until ``gate_dir/step{S}.open``
exists (after the step's inner update, before the round that step belongs to starts its all-reduce). Each step's data
depends only on (rank, step), and ``on_rejoin`` puts a joining or relaunched replica at the run's step.
``kill_rank``/``kill_at_step``: that rank SIGKILLs itself once after that step, past its gate if the step has one
(a marker in ``gate_dir`` makes it once): a replica killed during a scale change.

Data: each step takes ``per_step`` blocks of an epoch of ``epoch_blocks``, dealt by the round's membership
(``diloco.trainers.dealing.MembershipDealer`` over the manager's ``members_of``, the built-in trainer's dealing);
before its update every step appends ``step block block ...`` to ``gate_dir/steps.rank{R}``, so a test can count
the blocks trained on.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from diloco.replica.outer import make_diloco_outer_loop
from diloco.trainers.dealing import MembershipDealer


def _hold(gate_dir: str, step: int, rank: int) -> None:
    with open(os.path.join(gate_dir, f"step{step}.rank{rank}.waiting"), "w") as marker:
        marker.write("waiting\n")
    while not os.path.exists(os.path.join(gate_dir, f"step{step}.open")):
        time.sleep(0.05)


def train(*, manager: Any, rank: int, world_size: int, total_steps: int = 18, sync_every: int = 2,
          gate_dir: str = "", gates: str = "", kill_rank: int = -1, kill_at_step: int = 0, per_step: int = 2,
          epoch_blocks: int = 1000) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = [0]
    holds = {int(s) for s in gates.split(",") if s}
    dealer = MembershipDealer(manager.members_of, steps_per_round=sync_every, per_step=per_step,
                              total=epoch_blocks, seed=0)

    def on_rejoin(inner_step: int) -> None:
        start[0] = inner_step

    with make_diloco_outer_loop(manager=manager, model_fragments=[model], inner_optimizer=opt,
                                sync_every=sync_every, outer_lr=0.7, outer_momentum=0.9, on_rejoin=on_rejoin):
        for step in range(start[0] + 1, total_steps + 1):
            blocks = dealer.blocks(step - 1, rank)
            with open(os.path.join(gate_dir, f"steps.rank{rank}"), "a") as log:
                log.write(" ".join(map(str, [step, *blocks])) + "\n")
            g = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(8, 4, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step in holds and gate_dir:
                _hold(gate_dir, step, rank)
            killed = os.path.join(gate_dir, f"killed.rank{rank}")
            if rank == kill_rank and step == kill_at_step and not os.path.exists(killed):
                open(killed, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
