"""The Hugging Face trainer, unchanged, in a replica that SIGKILLs itself once after a planned inner step.

Why from inside: the kill must land mid-round, after a committed round and before the next round's upload, exactly
once. A process-wide optimizer step hook counts the inner AdamW's steps of replica ``kill_rank``; at ``kill_step``
it creates ``done_dir/killed`` (so the relaunched replica does not kill itself again) and sends itself a SIGKILL:
a real ``kill -9``, no exception, no clean-up. The launcher relaunches it; it rejoins at the committed round.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from diloco.trainers import hf


def train(*, manager: Any, rank: int, world_size: int, kill_rank: int = 1, kill_step: int = 0, done_dir: str = "",
          **kwargs: Any) -> dict[str, Any]:
    marker = os.path.join(done_dir, "killed")
    if kill_step and rank == kill_rank and not os.path.exists(marker):
        steps = [0]

        def count(optimizer: torch.optim.Optimizer, args: Any, kw: Any) -> None:
            if not isinstance(optimizer, torch.optim.AdamW):  # the outer loop's SGD steps are not inner steps
                return
            steps[0] += 1
            if steps[0] == kill_step:
                open(marker, "w").close()
                print(f"SIGKILL replica {rank} after inner step {kill_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        register_optimizer_step_post_hook(count)
    return hf.train(manager=manager, rank=rank, world_size=world_size, **kwargs)
