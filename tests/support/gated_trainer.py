"""A tiny trainer on the real outer loop that reports its loss every step, holds still at a gate until the test
opens it, and can SIGKILL itself once at a planned moment (``support.kill_trainer``'s plan and manager): the status
page tests' replica. Held at the gate, nothing it reports changes, so a page and ``status -o json`` read at different
moments must agree.

At ``gate_step`` each rank writes ``gate_dir/rank_R.waiting`` (after its progress for that step is written) and then
waits until ``gate_dir/open`` exists. Each step's data depends only on (rank, step), and ``on_rejoin`` puts a
relaunched replica at its peers' step.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import diloco
from diloco.replica.outer import make_diloco_outer_loop
from support.kill_trainer import _KillingManager, planned_kills


def _hold(gate_dir: str, rank: int) -> None:
    with open(os.path.join(gate_dir, f"rank_{rank}.waiting"), "w") as marker:
        marker.write("waiting\n")
    while not os.path.exists(os.path.join(gate_dir, "open")):
        time.sleep(0.05)


def train(*, manager: Any, rank: int, world_size: int, total_steps: int = 12, sync_every: int = 3,
          gate_step: int = 6, gate_dir: str = "", kills: list[dict[str, Any]] | None = None,
          done_dir: str = "") -> None:
    die = planned_kills(kills, rank, done_dir)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    start = [0]

    def on_rejoin(inner_step: int) -> None:
        start[0] = inner_step

    with make_diloco_outer_loop(manager=_KillingManager(manager, die), model_fragments=[model], inner_optimizer=opt,
                                sync_every=sync_every, outer_lr=0.7, outer_momentum=0.9, on_rejoin=on_rejoin):
        for step in range(start[0] + 1, total_steps + 1):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(8, 4, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            diloco.report(train_loss=float(loss), tokens=8)
            within = step % sync_every
            if within:
                die("mid_round", step // sync_every + 1, within)
            if step == gate_step and gate_dir:
                _hold(gate_dir, rank)
