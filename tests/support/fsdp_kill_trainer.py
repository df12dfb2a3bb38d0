"""The Hugging Face trainer, unchanged, in a replica one of whose local processes SIGKILLs itself once, mid-run.

Why from inside: the test needs the kill to land between two rounds of a sharded replica (after a committed
round, before the next one's upload), on one local process only, exactly once. A process-wide optimizer step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``) counts the inner AdamW's steps of local process
``kill_local_rank`` of replica ``kill_rank``; at ``kill_step`` it creates ``done_dir/killed`` (so the relaunched
replica does not kill itself again) and sends itself a SIGKILL: no exception, no clean-up. Its siblings then fail
in their next collective, the replica exits, the launcher relaunches it.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from diloco.replica.local_group import current_local_group, supports_local_processes
from diloco.trainers import hf


@supports_local_processes
def train(*, manager: Any, rank: int, world_size: int, kill_rank: int = 1, kill_local_rank: int = 1,
          kill_step: int = 0, done_dir: str = "", **kwargs: Any) -> dict[str, Any]:
    group = current_local_group()
    marker = os.path.join(done_dir, "killed")
    if kill_step and rank == kill_rank and group is not None and group.rank == kill_local_rank \
            and not os.path.exists(marker):
        steps = [0]

        def count(optimizer: torch.optim.Optimizer, args: Any, kw: Any) -> None:
            if not isinstance(optimizer, torch.optim.AdamW):  # the outer loop's SGD steps too: not counted
                return
            steps[0] += 1
            if steps[0] == kill_step:
                open(marker, "w").close()
                print(f"SIGKILL local process {group.rank} of replica {rank} after inner step {kill_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        register_optimizer_step_post_hook(count)
    return hf.train(manager=manager, rank=rank, world_size=world_size, **kwargs)
