"""The built-in trainer: a small byte-level GPT trained with DiLoCo through the object store.

``diloco_train`` is the ``trainer_fn`` the replica entrypoint calls by default, with ``manager``, ``rank`` and
``world_size`` injected. It reads like nanoGPT's ``train.py``: flat, commented defaults; build the model and the
inner AdamW; enter ``make_diloco_outer_loop`` (its hook on ``inner_optimizer.step`` runs the outer round every
``sync_every`` steps, so the loop below is an ordinary training loop); evaluate and record after each round.

What it leaves in the store (``manager.store``, the rendezvous root):

* ``metrics/rank_{RRRR}.jsonl``: one JSON object per line, ``kind`` ``init`` (before training), ``round`` (after
  every outer round), ``final``; rewritten whole each time because object stores cannot append.
* ``final/rank_{RRRR}.safetensors``: the final *global* weights, with the model config as JSON in the metadata
  (``model_config``) so ``collect`` can rebuild the model. Also ``$SM_MODEL_DIR/model.safetensors`` on SageMaker.

Every rank starts from identical weights (common ``seed``), samples batches with its own seed from its own
disjoint shard, and evaluates on the same held-out batches. ``total_steps`` must be a multiple of ``sync_every``
so training ends right after an outer sync: with ``fragment_update_alpha = 0`` the model then *is* the global
model, bitwise identical on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from diloco import envvars
from diloco.data import DEFAULT_MAX_CORPUS_BYTES
from diloco.errors import ConfigError
from diloco.layout import FINAL_KEY, METRICS_KEY

if TYPE_CHECKING:
    import torch

    from diloco.manager import ObjectStoreManager
    from diloco.model import GPT

log = logging.getLogger("diloco.trainer")

SM_MODEL_FILE = "model.safetensors"


def diloco_train(
    *,
    manager: ObjectStoreManager,
    rank: int,
    world_size: int,
    # schedule: total inner steps, and an outer round every sync_every of them
    total_steps: int = 200,
    sync_every: int = 50,
    # model (a GPTConfig)
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 64,
    block_size: int = 64,
    # inner optimizer: AdamW on each replica's own shard
    batch_size: int = 16,
    lr: float = 3e-3,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,  # 0 disables clipping
    # outer optimizer: Nesterov SGD on the averaged pseudo-gradient (DiLoCo paper defaults)
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    # Streaming DiLoCo: the model in `fragments` parts synced in turn; the all-reduce of a part starts
    # fragment_sync_delay inner steps before its outer step (overlap)
    fragments: int = 1,
    fragment_sync_delay: int = 0,
    # data and evaluation
    seed: int = 1337,
    eval_batches: int = 8,
    eval_fraction: float = 0.1,
    corpus: str | None = None,
    max_corpus_bytes: int = DEFAULT_MAX_CORPUS_BYTES,
    # execution
    device: str = "auto",
    threads: int = 1,  # torch CPU threads; 1 because several replicas often share one machine's cores
) -> dict[str, Any]:
    """Train the built-in model on this replica; returns a summary (losses, rounds, the final object's key).

    Raises ``ConfigError`` naming the argument for invalid values (before any training or store traffic),
    and lets store/all-reduce errors (``AllReduceTimeout`` naming the round and missing ranks) propagate.
    """
    import torch

    from diloco.data import eval_batches as make_eval_batches
    from diloco.data import load_corpus, sample_batch, split_corpus
    from diloco.model import GPTConfig, build_model, split_fragments
    from diloco.outer import make_diloco_outer_loop

    _validate(total_steps=total_steps, sync_every=sync_every, batch_size=batch_size, lr=lr,
              weight_decay=weight_decay, grad_clip=grad_clip, outer_lr=outer_lr, outer_momentum=outer_momentum,
              fragments=fragments, fragment_sync_delay=fragment_sync_delay, eval_batches=eval_batches,
              threads=threads, rank=rank, world_size=world_size, manager=manager)
    try:
        config = GPTConfig(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    dev = _resolve_device(device)
    if threads:
        torch.set_num_threads(threads)

    # --- data: this rank's disjoint shard; the held-out tail is shared by all ranks
    split = split_corpus(load_corpus(corpus, max_corpus_bytes), rank=rank, world_size=world_size,
                         block_size=block_size, eval_fraction=eval_fraction)
    batches = make_eval_batches(split.eval, n_batches=eval_batches, batch_size=batch_size,
                                block_size=block_size, seed=seed)
    train_gen = torch.Generator().manual_seed(seed + 7919 * (rank + 1))  # per-rank batch order

    # --- model: the common seed makes every rank's initial weights identical (no broadcast needed)
    model = build_model(config, seed=seed, device=dev)
    inner_opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    try:  # the outer loop checks the schedule (sync_every, fragments, fragment_sync_delay, outer_*) itself
        model_fragments = split_fragments(model, fragments)
        diloco = make_diloco_outer_loop(
            manager=manager, model_fragments=model_fragments, inner_optimizer=inner_opt, outer_lr=outer_lr,
            outer_momentum=outer_momentum, nesterov=nesterov, sync_every=sync_every,
            fragment_sync_delay=fragment_sync_delay, fragment_update_alpha=0.0,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    log.info("model %s (%d params) on %s; shard bytes [%d, %d) of %d-byte corpus; %d steps, sync every %d",
             config.to_json(), model.num_params(), dev, *split.train_range, split.eval_range[1],
             total_steps, sync_every)

    metrics = _MetricsLog(manager, rank=rank, total_steps=total_steps)
    init_eval = _evaluate(model, batches, dev)
    metrics.record("init", round_=0, step=0, train_loss=None, eval_loss=init_eval, tokens_per_s=0.0)
    log.info("round 0 step 0/%d eval_loss %.4f", total_steps, init_eval)

    tokens_per_round = sync_every * batch_size * block_size
    model.train()
    train_loss: float | None = None
    eval_loss = init_eval
    t_start = t_round = time.perf_counter()
    with diloco:
        loss_sum = torch.zeros((), device=dev)
        for step in range(1, total_steps + 1):
            x, y = sample_batch(split.train, batch_size=batch_size, block_size=block_size, generator=train_gen)
            _, loss = model(x.to(dev), y.to(dev))
            inner_opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            inner_opt.step()  # every sync_every-th call also runs the outer round: blocks on the store
            loss_sum += loss.detach()
            if step % sync_every:
                continue
            round_ = step // sync_every
            train_loss = (loss_sum / sync_every).item()  # a device sync point, once per round
            tps = tokens_per_round / max(time.perf_counter() - t_round, 1e-9)
            eval_loss = _evaluate(model, batches, dev)
            metrics.record("round", round_=round_, step=step, train_loss=train_loss, eval_loss=eval_loss,
                           tokens_per_s=tps)
            log.info("round %d step %d/%d train_loss %.4f eval_loss %.4f tok/s %.0f sync_s %.2f", round_, step,
                     total_steps, train_loss, eval_loss, tps, _stats(manager)["sync_s"])
            loss_sum.zero_()
            t_round = time.perf_counter()

    rounds = total_steps // sync_every
    total_tps = rounds * tokens_per_round / max(time.perf_counter() - t_start, 1e-9)
    # Export the global weights. With one fragment the model already holds them (the last step was an outer
    # sync with alpha 0); with several, the fragments synced earlier have trained locally since.
    diloco.restore_global_parameters()
    if fragments > 1:
        eval_loss = _evaluate(model, batches, dev)
    metrics.record("final", round_=rounds, step=total_steps, train_loss=train_loss, eval_loss=eval_loss,
                   tokens_per_s=total_tps)
    key = _write_final(manager, model, config, rank=rank, world_size=world_size, step=total_steps, rounds=rounds)
    log.info("done: %d rounds, eval_loss %.4f -> %.4f, final weights at %s", rounds, init_eval, eval_loss,
             manager.store.url(key))
    return {"rank": rank, "rounds": rounds, "steps": total_steps, "init_eval_loss": init_eval,
            "final_eval_loss": eval_loss, "final_key": key}


# ------------------------------------------------------------------------------------------------ helpers
def _validate(*, manager: Any, rank: int, world_size: int, **values: Any) -> None:
    """Check every argument once, before anything is built; ``ConfigError`` names the argument and the fix."""
    ints = {"total_steps": 1, "sync_every": 1, "batch_size": 1, "fragments": 1, "fragment_sync_delay": 0,
            "eval_batches": 1, "threads": 0}
    for name, low in ints.items():
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {v!r}")
    for name in ("lr", "weight_decay", "grad_clip", "outer_lr", "outer_momentum"):
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"{name} must be a number >= 0, got {v!r}")
    total, every = values["total_steps"], values["sync_every"]
    if total % every:
        lower, upper = max(every, total - total % every), total - total % every + every
        raise ConfigError(
            f"total_steps ({total}) must be a multiple of sync_every ({every}) so training ends on an outer sync "
            f"and every rank exports the same global weights",
            hint=f"use total_steps={lower} or {upper}",
        )
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside 0..{world_size - 1} for world_size {world_size}")
    for attr, want in (("rank", rank), ("world_size", world_size)):
        got = getattr(manager, attr, want)
        if got != want:
            raise ConfigError(f"manager.{attr} is {got} but the trainer was given {attr}={want}")


def _resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; anything else is passed to ``torch.device``."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"device {device!r} is not a torch device: {exc}",
                          hint="use auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for but this machine has no usable CUDA device",
                          hint="use device auto or cpu, or run on a GPU instance")
    return dev


def _evaluate(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]], dev: torch.device) -> float:
    """Mean loss over the fixed held-out batches (the same on every rank and every round)."""
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        losses = [model(x.to(dev), y.to(dev))[1] for x, y in batches]
        value = torch.stack(losses).mean().item()
    model.train(was_training)
    return value


def _stats(manager: Any) -> dict[str, float | int]:
    """The cumulative all-reduce counters of the metrics schema."""
    s = manager.stats
    return {"sync_s": float(s.seconds_blocked), "bytes_written": int(s.bytes_written),
            "bytes_read": int(s.bytes_read)}


class _MetricsLog:
    """``metrics/rank_{RRRR}.jsonl`` in the store, rewritten whole on every record (stores cannot append)."""

    def __init__(self, manager: Any, *, rank: int, total_steps: int) -> None:
        self._manager = manager
        self._key = METRICS_KEY.format(rank=rank)
        self._total_steps = total_steps
        self._lines: list[str] = []

    def record(self, kind: str, *, round_: int, step: int, train_loss: float | None, eval_loss: float,
               tokens_per_s: float) -> None:
        row = {"kind": kind, "round": round_, "step": step, "total_steps": self._total_steps,
               "train_loss": train_loss, "eval_loss": eval_loss, "tokens_per_s": tokens_per_s,
               **_stats(self._manager), "time": time.time()}
        self._lines.append(json.dumps(row) + "\n")
        self._manager.store.put(self._key, "".join(self._lines).encode())


def _write_final(manager: Any, model: GPT, config: Any, *, rank: int, world_size: int, step: int,
                 rounds: int) -> str:
    """Encode the (global) weights once; put them in the store and, on SageMaker, in ``$SM_MODEL_DIR``."""
    from diloco.codec import encode_tensors
    from diloco.store import write_file_atomic

    data = encode_tensors(model.state_dict(), {
        "rank": rank, "world_size": world_size, "step": step, "round": rounds,
        "model": "diloco.model:GPT", "model_config": config.to_json(),
    })
    key = FINAL_KEY.format(rank=rank)
    manager.store.put(key, data)
    model_dir = os.environ.get(envvars.SM_MODEL_DIR)
    if model_dir:  # atomic: a half-written model.safetensors is never what SageMaker uploads
        write_file_atomic(os.path.join(model_dir, SM_MODEL_FILE), data)
    return key
