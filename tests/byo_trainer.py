# ruff: noqa: E702, I001, B007 - kept exactly as README shows it
# The README's "Bring your own trainer" example, verbatim (as mypkg/train.py there), plus the one optional
# `diloco.report(...)` line (and its import) that feeds the table's loss and tok/s columns. Everything else the
# table and `collect` show (step, round, sync time, bytes, the final global weights) is recorded by the outer loop.
import torch
import diloco
from diloco.outer import make_diloco_outer_loop

def train(*, manager, rank, world_size, total_steps=1000, sync_every=100, lr=1e-3):
    torch.manual_seed(0)                       # identical initial weights on every replica
    model = torch.nn.Linear(16, 1)
    inner = torch.optim.AdamW(model.parameters(), lr=lr)
    with make_diloco_outer_loop(manager=manager, model_fragments=[model], inner_optimizer=inner,
                                sync_every=sync_every, outer_lr=0.7, outer_momentum=0.9):
        for step in range(total_steps):
            x = torch.randn(32, 16)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            inner.zero_grad(); loss.backward()
            inner.step()                       # every sync_every steps the outer round runs in here
            diloco.report(train_loss=loss.item(), tokens=len(x))   # optional: the loss and tok/s columns
