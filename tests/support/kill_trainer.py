"""A small trainer on the real outer loop that SIGKILLs its own process at a planned moment: the kill harness's
replica (tests/test_rejoin.py).

Why kill from inside: a kill sent from the test at a random wall-clock time mostly lands mid-round, because that is
where a replica spends its time; the issue names four moments (before the first round, mid-round, during an upload,
during the outer step) and each must really be hit. The replica itself knows when it is in each, so it sends itself
the SIGKILL there: a real ``kill -9``, no exception, no clean-up, nothing flushed that was not already written.

The plan (``kills``, a JSON list of ``{"trial", "rank", "moment", "round", "step"}``) comes in as a trainer kwarg,
the same for every rank; each kill happens once (``done_dir/trial_K`` is created first, so a relaunched replica does
not kill itself again). Moments, for round ``round`` (the round being worked towards, numbered from 1):

* ``start``: before the first inner step (``round`` is 1: the replica dies before the first round);
* ``mid_round``: after inner step ``step`` of that round (1 .. sync_every - 1), between two syncs;
* ``upload``: right after the round's all-reduce started (its contribution is being uploaded);
* ``outer_step``: when the round's mean has arrived, before or after the outer step is applied and before the round
  is committed (``step`` 0: before ``should_commit``; 1: in ``commit_round``).

Each step's data depends only on (rank, step), and ``on_rejoin`` puts a restarted replica at its peers' step. AdamW
inner optimizer, so the inner state kept in ``$DILOCO_CHECKPOINT_DIR`` matters.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import torch

from diloco.replica.outer import make_diloco_outer_loop


class _KillingManager:
    """The replica's manager, unchanged, except that it SIGKILLs the process at the planned all-reduce or outer step
    (everything else is delegated to the real manager)."""

    def __init__(self, manager: Any, die: Any) -> None:
        self._manager = manager
        self._die = die

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def allreduce(self, tensors: Any) -> Any:
        work = self._manager.allreduce(tensors)  # the upload is in flight on the all-reduce's thread
        self._die("upload", self._manager.current_step() + 1, 0)
        return work

    def should_commit(self) -> bool:
        self._die("outer_step", self._manager.current_step() + 1, 0)
        return self._manager.should_commit()

    def commit_round(self, tensors: Any) -> None:
        self._die("outer_step", self._manager.current_step(), 1)  # should_commit already counted the round
        self._manager.commit_round(tensors)


def planned_kills(kills: list[dict[str, Any]] | None, rank: int, done_dir: str) -> Callable[[str, int, int], None]:
    """``die(moment, round, step)``: SIGKILL this process when ``kills`` plans one for ``rank`` there, once per
    trial (a marker file in ``done_dir`` says a relaunched replica that its kill already happened)."""
    plan = [k for k in kills or [] if k["rank"] == rank]

    def die(moment: str, round_number: int, step: int) -> None:
        for kill in plan:
            if (kill["moment"], kill["round"], kill["step"]) != (moment, round_number, step):
                continue
            try:
                os.close(os.open(os.path.join(done_dir, f"trial_{kill['trial']}"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return  # this kill happened already: this is the relaunched replica
            print(f"kill trial {kill['trial']}: SIGKILL rank {rank} {moment} of round {round_number}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return die


def train(*, manager: Any, rank: int, world_size: int, total_steps: int = 48, sync_every: int = 4,
          kills: list[dict[str, Any]] | None = None, done_dir: str = "") -> None:
    die = planned_kills(kills, rank, done_dir)

    torch.set_num_threads(1)  # a 4-parameter model: extra threads would only spin against the peers on 2 cores
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    start = [0]

    def on_rejoin(inner_step: int) -> None:
        start[0] = inner_step
        print(f"rank {rank} rejoined at step {inner_step}", flush=True)

    with make_diloco_outer_loop(manager=_KillingManager(manager, die), model_fragments=[model], inner_optimizer=opt,
                                sync_every=sync_every, outer_lr=0.7, outer_momentum=0.9, on_rejoin=on_rejoin):
        die("start", 1, 0)
        for step in range(start[0] + 1, total_steps + 1):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(8, 4, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            within = step % sync_every
            if within:
                die("mid_round", step // sync_every + 1, within)
