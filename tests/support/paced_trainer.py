"""A paced trainer on the real outer loop, shipped into the SageMaker and Kubernetes emulators' "images".

Each step's data depends only on (rank, step), and ``on_rejoin`` puts a restarted replica at its peers' step, so a
run interrupted after a committed round must still end with bitwise-identical weights.
"""
import os
import sys
import time

import torch

from diloco.replica.outer import make_diloco_outer_loop


def train(*, manager, rank, world_size, total_steps=40, sync_every=5, step_s=0.1, exit_rank=-1, exit_at_step=0):
    """``exit_rank``/``exit_at_step``: that rank exits with its own error (code 1, not relaunched) after that
    inner step, a replica dead for good."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = [0]

    def on_rejoin(inner_step):
        start[0] = inner_step
        print(f"rank {rank} rejoined at step {inner_step}", flush=True)

    with make_diloco_outer_loop(manager=manager, model_fragments=[model], inner_optimizer=opt,
                                sync_every=sync_every, outer_lr=0.7, outer_momentum=0.9, on_rejoin=on_rejoin):
        for step in range(start[0] + 1, total_steps + 1):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(8, 4, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(step_s)
            if rank == exit_rank and step == exit_at_step:
                print(f"diloco: error: rank {rank}: dies for good after step {step} (test)", file=sys.stderr,
                      flush=True)
                os._exit(1)
