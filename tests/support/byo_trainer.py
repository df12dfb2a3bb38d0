# ruff: noqa: E702, I001, B007 - kept exactly as README shows it
# The README's "Bring your own trainer" example, verbatim (as mypkg/train.py there; tests/test_readme_trainer.py
# checks that the two agree and runs the README's own copy through `diloco launch`). Everything the table and
# `collect` show besides the optional `diloco.report(...)` line (step, round, sync time, bytes, the final global
# weights) is recorded by the outer loop.
import torch
import diloco
from diloco.replica.outer import make_diloco_outer_loop

def train(*, manager, rank, world_size, total_steps=1000, sync_every=100, lr=1e-3):
    torch.manual_seed(0)                       # the same initial weights and dataset on every replica
    model = torch.nn.Linear(16, 1)
    inputs = torch.randn(4096, 16)             # your dataset (here: learn y = x.sum())
    targets = inputs.sum(1, keepdim=True)
    shard = torch.arange(rank, len(inputs), world_size)    # this replica's own share of it
    order = torch.Generator().manual_seed(1000 + rank)     # and its own batch order
    inner = torch.optim.AdamW(model.parameters(), lr=lr)
    with make_diloco_outer_loop(manager=manager, model_fragments=[model], inner_optimizer=inner,
                                sync_every=sync_every, outer_lr=0.7, outer_momentum=0.9):
        for step in range(total_steps):
            batch = shard[torch.randint(len(shard), (32,), generator=order)]
            loss = (model(inputs[batch]) - targets[batch]).pow(2).mean()
            inner.zero_grad(); loss.backward()
            inner.step()                       # every sync_every steps the outer round runs in here
            diloco.report(train_loss=loss.item(), tokens=len(batch))   # optional: the loss and tok/s columns
