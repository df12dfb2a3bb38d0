"""The built-in trainer's asynchronous mode (``mode="async"``): rank 0 is the master, the others workers, all in
the run's store; a relaunched rank rejoins where it was; at the end every rank exports the master's last version."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.replica.async_diloco.config import AsyncDiLoCoConfig
from diloco.replica.async_diloco.coordinator import AsyncDiLoCoCoordinator
from diloco.replica.async_diloco.record import DONE_KEY, node_of_rank

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diloco.store.objects import ObjectStore

log = logging.getLogger("diloco.async")


def run_builtin_async(*, manager: Any, rank: int, world_size: int, model: nn.Module,
                      inner_optimizer: torch.optim.Optimizer, train_step: Any, evaluate: Any, total_steps: int,
                      sync_every: int, outer_lr: float, outer_momentum: float, nesterov: bool,
                      tokens_per_step: int, export_metadata: Mapping[str, str | int],
                      on_rejoin: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The built-in trainer's asynchronous mode: rank 0 is the master, the others workers, all in one store.

    ``train_step()`` runs one inner step and returns its (detached) loss; ``evaluate()`` returns the eval loss.
    The outer learning rate is ``outer_lr / world_size`` per delta: synchronous DiLoCo applies it once to the mean
    of ``world_size`` deltas, here every delta gets its own outer step. ``max_staleness`` is ``4 * world_size``
    (at least 8): with N nodes a delta is typically N - 1 versions stale, more while the master drains at the end.
    (``staleness_grace = world_size - 1`` was tried and converged worse on the tests' tiny runs, so it stays 0.)
    The inner optimizer's state is reset only when global weights were installed (``SyncResult.loaded_global``),
    never on a mere push.

    **Rejoining.** A rank relaunched into its run (a killed process, a lost instance) finds its position in the
    store (``nodes/replica-<rank>.json``: the last step whose delta it handed over) and resumes after it, on the
    newest global (the master: on its own committed state, momentum included). ``on_rejoin(step)`` is the
    trainer's position hook, as in synchronous mode: it skips the data and the learning-rate schedule to ``step``.
    The inner optimizer starts fresh, as it would on installing any global in this mode.

    At the end every node waits for the same final global version (workers mark themselves done, the master
    applies what is left and publishes ``final.json``), so every rank exports identical weights, as in sync mode.
    """
    import hashlib

    from diloco.replica.final_weights import write_final_weights
    from diloco.replica.metrics import report

    store: ObjectStore = manager.store
    metrics = getattr(manager, "metrics", None)
    config = AsyncDiLoCoConfig(role="master" if rank == 0 else "worker", node_id=node_of_rank(rank),
                               inner_steps=sync_every, poll_interval_s=1.0, outer_lr=outer_lr / max(1, world_size),
                               outer_momentum=outer_momentum, nesterov=nesterov, master_poll_interval_s=0.1,
                               max_staleness=max(8, 4 * world_size))
    run_key = hashlib.sha256(store.url().encode()).hexdigest()[:16]  # one run, one local cache folder
    state_dir = Path(tempfile.gettempdir()) / "diloco-async" / run_key
    timeout_s = float(getattr(getattr(manager, "_allreduce", None), "timeout_s", 1800.0))
    run_id = getattr(getattr(manager, "rounds", None), "run_id", None)
    coord = AsyncDiLoCoCoordinator(config, model, store=store, state_dir=state_dir, run_id=run_id)
    position = coord.read_position()
    first = 0
    init_eval: float | None = None
    if position is not None and position.step > 0:
        first = min(position.step, total_steps)
        coord.resume_at(position)
        if on_rejoin is not None:
            on_rejoin(first)
        if metrics is not None:
            metrics.resume(0, step=first)  # keep the rows written before the restart
        log.info("async %s %s rejoins the run at step %d of %d (its last delta before the restart was against "
                 "global version %d)", config.role, coord.node_id, first, total_steps, position.base_version)
    else:
        init_eval = evaluate()  # before start(): a worker may install an already trained global there
    coord.start()
    if metrics is not None:
        metrics.begin(first)
    if init_eval is not None:
        report(eval_loss=init_eval, total_steps=total_steps)
    loss_sum = 0.0
    try:
        for step in range(first + 1, total_steps + 1):
            loss_sum += float(train_step())
            report(tokens=tokens_per_step)
            result = coord.after_optimizer_step(model, step)
            if result.loaded_global and config.reset_inner_optimizer:
                inner_optimizer.state.clear()
            boundary = step % sync_every == 0
            if metrics is not None:
                (metrics.on_round if boundary else metrics.on_step)(step)
            if boundary:
                report(train_loss=loss_sum / sync_every, eval_loss=evaluate(), global_version=coord.last_global_step,
                       delta_upload_skipped=coord.events["delta_upload_skipped"])
                loss_sum = 0.0
        version = _finish(coord, world_size, timeout_s)
    finally:
        coord.stop()
    final_eval = evaluate()
    report(eval_loss=final_eval, global_version=version)
    tensors = {name: p.detach().to("cpu") for name, p in model.named_parameters()}
    key = write_final_weights(store, rank, tensors, {"rank": rank, "world_size": world_size, "step": total_steps,
                                                     "round": version, **export_metadata})
    if metrics is not None:
        metrics.finish(total_steps)
    log.info("async %s done: global version %d, eval_loss %s -> %.4f", config.role, version,
             f"{init_eval:.4f}" if init_eval is not None else "(before the restart)", final_eval)
    return {"rank": rank, "rounds": version, "steps": total_steps, "init_eval_loss": init_eval,
            "final_eval_loss": final_eval, "final_key": key, "mode": "async", "resumed_at_step": first}


def _finish(coord: AsyncDiLoCoCoordinator, world_size: int, timeout_s: float) -> int:
    """Agree on one final global version (see ``run_builtin_async``), install it and return it."""
    coord.wait_for_uploads(timeout_s)
    if coord.role == "master":
        workers = [node_of_rank(r) for r in range(1, world_size)]
        deadline = time.monotonic() + timeout_s
        while not all(coord.store.exists(DONE_KEY.format(node=w)) for w in workers):
            if time.monotonic() > deadline:
                coord.log.warning("async: not every worker finished within %.0f s; publishing the final global "
                                  "without them", timeout_s)
                break
            time.sleep(0.2)
        coord.stop()
        while coord.process_deltas():
            pass
        version = coord.publish_final()
        assert coord.outer is not None
        version, snapshot = coord.outer.snapshot()
        coord.install(snapshot, version)
        return version
    coord.store.put(DONE_KEY.format(node=coord.node_id), b"{}")
    coord.stop()
    deadline = time.monotonic() + timeout_s
    while (final := coord.fetch_final()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"async: the master published no final global within {timeout_s:.0f} s")
        time.sleep(0.2)
    version, tensors = final
    coord.install(tensors, version)
    return version
