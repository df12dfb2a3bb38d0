"""The built-in trainer: a small byte-level GPT trained with DiLoCo through the object store.

``diloco_train`` is the ``trainer_fn`` the replica entrypoint calls by default, with ``manager``, ``rank`` and
``world_size`` injected. It reads like nanoGPT's ``train.py``: flat, commented defaults; build the model and the
inner AdamW; enter ``make_diloco_outer_loop`` (its hook on ``inner_optimizer.step`` runs the outer round every
``sync_every`` steps, so the loop below is an ordinary training loop); evaluate after each round.

It records nothing itself that any other trainer could not: the outer loop writes the progress rows and the final
global weights (``diloco.replica.metrics``, ``diloco.replica.outer``), and the trainer adds its losses and token counts with
``diloco.report(...)``, exactly as a user's trainer would. What ends up in the store (``manager.store``):

* ``metrics/rank_{RRRR}.jsonl`` and ``progress/rank_{RRRR}.json``: ``init`` (with the eval loss before training),
  one ``round`` row per outer round (with the round's mean train loss and the eval loss after it), ``final``.
* ``final/rank_{RRRR}.safetensors``: the final *global* weights, with the model config as JSON in the metadata
  (``model_config``) so ``collect`` can rebuild the model. Also ``$SM_MODEL_DIR/model.safetensors`` on SageMaker.

Every rank starts from identical weights (common ``seed``), samples batches with its own seed from its own
disjoint shard, and evaluates on the same held-out batches. ``total_steps`` must be a multiple of ``sync_every``
so training ends right after an outer sync: with ``fragment_update_alpha = 0`` the model then *is* the global
model, bitwise identical on every rank.

``check_config`` is the one place the knobs are validated: at the start of ``diloco_train``, and before launch as
the trainer's preflight hook (``@preflight``), so ``diloco launch`` rejects ``-k lrr=0.1``, ``n_embd=33`` or
``device=cuda`` on a machine without CUDA before any replica starts.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError
from diloco.trainers.data import DEFAULT_MAX_CORPUS_BYTES
from diloco.trainers.preflight import (
    MIB,
    MemoryEstimate,
    PreflightContext,
    memory_estimate,
    preflight,
    signature_defaults,
)

if TYPE_CHECKING:
    import torch

    from diloco.replica.manager import ObjectStoreManager
    from diloco.trainers.gpt_model import GPT

log = logging.getLogger("diloco.trainers.gpt")

#: Device strings accepted without importing torch: a device type, optionally ``:index``.
_DEVICE = re.compile(r"^(auto|cpu|cuda|mps|xpu|hpu|npu|meta)(:\d+)?$")


def _preflight(kwargs: dict[str, Any], context: PreflightContext) -> None:
    check_config(kwargs, world_size=context.world_size, on_this_machine=context.on_this_machine)
    if context.store is not None:
        check_outer_rule_store(kwargs, context.store)


def check_outer_rule_store(kwargs: Mapping[str, Any], store: Mapping[str, Any]) -> None:
    """SparseLoCo's outer rule replaces the outer momentum with the wire's error feedback, which only a lossy
    format with ``store.error_feedback`` on gives (``diloco.replica.outer``'s run-time refusal): checked before
    launch, where the store settings are known, so a run is not started only for every replica to exit 1."""
    if kwargs.get("outer_rule", "nesterov") != "sparseloco":
        return
    from diloco.formats import registry

    name = str(store.get("compression", "none"))
    if name in registry.names() and registry.get(name).lossless:
        why = f"store.compression is {name}"
    elif store.get("error_feedback", True) is False:
        why = "store.error_feedback is false"
    else:
        return
    raise ConfigError(f"train.trainer_kwargs.outer_rule: sparseloco needs error feedback, but {why} (the "
                      f"pseudo-gradients would cross the store without it)",
                      hint="add --compression topk (or another lossy format) with store.error_feedback on, or "
                           "drop -k outer_rule=sparseloco")


#: One replica of this trainer before its model and data: Python, torch and diloco's replica side (measured at
#: about 330 MiB RSS on Linux x86-64 with torch 2.x for the default, 120k-parameter model).
PROCESS_BASE_MIB = 340
_VOCAB = 256  # diloco.trainers.gpt_model.VOCAB_SIZE (the byte values), not imported here: gpt_model imports torch


def _memory(kwargs: Mapping[str, Any]) -> MemoryEstimate:
    """One process of this trainer: the process itself, its model's float32 state and its data, from the same
    defaults the trainer uses (its signature). An upper-side estimate, not a measurement."""
    defaults = signature_defaults(diloco_train)

    def knob(name: str) -> int:
        try:
            return max(1, int(float(kwargs.get(name, defaults[name]))))
        except (TypeError, ValueError):  # a bad value: the trainer check rejects it with its own message
            return max(1, int(defaults[name]))

    n_layer, n_head, n_embd = knob("n_layer"), knob("n_head"), knob("n_embd")
    block, batch = knob("block_size"), knob("batch_size")
    params = n_layer * (12 * n_embd * n_embd + 13 * n_embd) + (_VOCAB + block) * n_embd + 2 * n_embd
    # weights, gradients, AdamW's two moments, the outer loop's global copy, momentum and running average, the
    # upload's bytes, and one peer's contribution (bytes and tensors) at a time while averaging
    state = 4 * params * 10
    activations = 4 * batch * block * (24 * n_embd * n_layer + 2 * n_head * block * n_layer + 3 * _VOCAB)
    corpus = 10 * knob("max_corpus_bytes")  # the bytes, a copy, and one int64 per byte as a tensor
    evals = 16 * knob("eval_batches") * batch * block
    return MemoryEstimate(PROCESS_BASE_MIB * MIB + state + activations + corpus + evals,
                          "the built-in trainer's model and data")


@preflight(_preflight)
@memory_estimate(_memory)
def diloco_train(
    *,
    manager: ObjectStoreManager,
    rank: int,
    world_size: int,
    # schedule: total inner steps, and an outer round every sync_every of them
    total_steps: int = 200,
    sync_every: int = 50,
    # model (a GPTConfig), and the weights every replica starts from: None (the seed's initialisation), or a
    # safetensors file of this model's parameters (a path or a store URI, e.g. a collected model) for a warm start
    init_from: str | None = None,
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 64,
    block_size: int = 64,
    # inner optimizer: AdamW on each replica's own shard
    batch_size: int = 16,
    lr: float = 3e-3,
    # inner schedule over the run's global step (never restarted per round): linear warm-up, then cosine decay
    # to lr * min_lr_ratio at total_steps (1 = constant)
    warmup_steps: int = 0,
    min_lr_ratio: float = 1.0,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,  # 0 disables clipping
    # outer optimizer: Nesterov SGD on the averaged pseudo-gradient. Tuned for short runs of this model
    # (bench/convergence.py): the paper's lr 0.7 / momentum 0.9 is made for hundreds of rounds and here overshoots
    # in the first rounds and never recovers within ~12; plain averaging (1, 0) under-steps.
    outer_lr: float = 1.0,
    outer_momentum: float = 0.8,
    nesterov: bool = True,
    outer_momentum_warmup: int = 4,  # ramp the outer momentum in over this many outer steps (0: off)
    # "nesterov", or "sparseloco": no outer momentum, the wire's error feedback instead (needs a lossy
    # store.compression such as topk; diloco.replica.outer.make_diloco_outer_loop)
    outer_rule: str = "nesterov",
    # Streaming DiLoCo: the model in `fragments` parts synced in turn; the all-reduce of a part starts
    # fragment_sync_delay inner steps before its outer step (overlap)
    fragments: int = 1,
    fragment_sync_delay: int = 0,
    # data and evaluation
    seed: int = 1337,
    eval_batches: int = 8,
    # None: every replica evaluates after every round; K: replica 0 alone, every K rounds and after the last (the
    # other replicas hold the same global model after a round, so one evaluation says it for all)
    eval_every: int | None = None,
    eval_batch_size: int = 0,  # 0: batch_size. Fix it to compare runs of different batch sizes on the same data
    eval_fraction: float = 0.1,
    corpus: str | None = None,
    max_corpus_bytes: int = DEFAULT_MAX_CORPUS_BYTES,
    # execution
    device: str = "auto",
    threads: int = 1,  # torch CPU threads; 1 because several replicas often share one machine's cores
    # "sync": DiLoCo rounds; "async": rank 0 is the master, the others workers (diloco.replica.async_diloco)
    mode: str = "sync",
    # a deliberately slow replica (benchmarks): rank slow_rank sleeps (slow_factor - 1) x its compute per step
    slow_rank: int = -1,
    slow_factor: float = 1.0,
) -> dict[str, Any]:
    """Train the built-in model on this replica; returns a summary (losses, rounds, the final object's key).

    Raises ``ConfigError`` naming the argument for invalid values (before any training or store traffic),
    and lets store/all-reduce errors (``AllReduceTimeout`` naming the round and missing ranks) propagate.
    """
    import torch

    from diloco import report
    from diloco.replica.outer import make_diloco_outer_loop
    from diloco.store.layout import FINAL_KEY
    from diloco.trainers.data import eval_batches as make_eval_batches
    from diloco.trainers.data import load_corpus, split_corpus
    from diloco.trainers.gpt_model import GPTConfig, build_model, split_fragments

    check_config({k: v for k, v in locals().items() if k in _KNOBS}, world_size=world_size)
    members_of = _elastic_members(manager, mode)
    _check_identity(manager, rank=rank, world_size=world_size, elastic=members_of is not None)
    config = GPTConfig(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    dev = _resolve_device(device)
    if threads:
        torch.set_num_threads(threads)

    # --- data: this rank's disjoint shard; the held-out tail is shared by all ranks. An elastic run deals the
    # whole training region by each round's members instead (diloco.trainers.dealing).
    split = split_corpus(load_corpus(corpus, max_corpus_bytes), rank=0 if members_of else rank,
                         world_size=1 if members_of else world_size, block_size=block_size,
                         eval_fraction=eval_fraction)
    batches = make_eval_batches(split.eval, n_batches=eval_batches, batch_size=eval_batch_size or batch_size,
                                block_size=block_size, seed=seed)
    train_gen = torch.Generator().manual_seed(seed + 7919 * (rank + 1))  # per-rank batch order

    # --- model: the common seed (or the common init_from file) makes every rank's initial weights identical (no
    # broadcast needed)
    model = build_model(config, seed=seed, device=dev)
    if init_from is not None:
        load_initial_weights(model, init_from)
    inner_opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    position = [0]  # inner steps taken in the run so far (a rejoining replica starts where the run is)
    draw = None
    if members_of is not None:
        from diloco.trainers.dealing import MembershipDealer

        dealer = MembershipDealer(members_of, steps_per_round=sync_every // fragments, per_step=batch_size,
                                  total=(len(split.train) - 1) // block_size, seed=seed)
        draw = functools.partial(_dealt_batch, dealer, split.train, rank=rank, block_size=block_size)
    inner_step = _inner_step(model, inner_opt, split.train, train_gen, dev, batch_size=batch_size,
                             block_size=block_size, grad_clip=grad_clip, draw=draw,
                             slow_factor=slow_factor if rank == slow_rank else 1.0, position=position,
                             lr_at=lambda step: inner_lr_at(step, lr=lr, warmup_steps=warmup_steps,
                                                            total_steps=total_steps, min_lr_ratio=min_lr_ratio))
    done = [0]  # inner steps the run had done when this replica (re)joined it: 0 unless it restarted mid-run

    def on_rejoin(inner_step: int) -> None:
        """Position hook (a restart rejoining the run, in either mode): skip the steps done and draw their
        batches' random numbers, so the data order and the inner schedule continue where they were. AdamW's
        state restarts fresh (it is not committed)."""
        done[0] = position[0] = inner_step
        high = len(split.train) - block_size - 1
        for _ in range(inner_step):
            torch.randint(0, high, (batch_size,), generator=train_gen)  # exactly what sample_batch draws

    if mode == "async":
        return _train_async(manager=manager, rank=rank, world_size=world_size, model=model, inner_opt=inner_opt,
                            inner_step=inner_step, batches=batches, dev=dev, config=config,
                            total_steps=total_steps, sync_every=sync_every,
                            tokens_per_step=batch_size * block_size, outer_lr=outer_lr,
                            outer_momentum=outer_momentum, nesterov=nesterov, on_rejoin=on_rejoin)
    diloco = make_diloco_outer_loop(
        manager=manager, model_fragments=split_fragments(model, fragments), inner_optimizer=inner_opt,
        outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov, sync_every=sync_every,
        fragment_sync_delay=fragment_sync_delay, fragment_update_alpha=0.0, model=model,
        export_metadata={"model": "diloco.trainers.gpt_model:GPT", "model_config": config.to_json()},
        on_rejoin=on_rejoin, outer_momentum_warmup=outer_momentum_warmup, outer_rule=outer_rule,
    )
    log.info("model %s (%d params) on %s; shard bytes [%d, %d) of %d-byte corpus; %d steps, sync every %d",
             config.to_json(), model.num_params(), dev, *split.train_range, split.eval_range[1],
             total_steps, sync_every)

    tokens_per_step = batch_size * block_size
    model.train()
    evaluates = eval_every is None or rank == 0
    init_eval: float | None = None
    eval_loss: float | None = None
    with diloco:  # report() goes to this replica's metrics while the loop is open
        if evaluates:
            init_eval = eval_loss = _evaluate(model, batches, dev)
        report(**_present(eval_loss=init_eval), total_steps=total_steps)  # amends the loop's `init` row
        loss_sum = torch.zeros((), device=dev)
        for step in range(done[0] + 1, total_steps + 1):
            loss = inner_step()  # every sync_every-th step also runs the outer round: blocks on the store
            report(tokens=tokens_per_step)
            loss_sum += loss.detach()
            if step % sync_every:
                continue
            train_loss = (loss_sum / sync_every).item()  # a device sync point, once per sync_every steps
            due = evaluates and (eval_every is None or step == total_steps or (step // sync_every) % eval_every == 0)
            if due:
                eval_loss = _evaluate(model, batches, dev)
            # amends the row of the round just completed
            report(train_loss=train_loss, **_present(eval_loss=eval_loss if due else None))
            loss_sum.zero_()
        # With one fragment the model already holds the global weights (the last step was an outer sync with
        # alpha 0); with several, the fragments synced earlier have trained locally since: evaluate the global
        # model, which is what the loop exports on leaving.
        if fragments > 1:
            diloco.restore_global_parameters()
            if evaluates:
                eval_loss = _evaluate(model, batches, dev)
                report(eval_loss=eval_loss)

    key = FINAL_KEY.format(rank=rank)
    log.info("done: %d rounds, eval_loss %s -> %s, final weights at %s", manager.current_step(),
             _loss_text(init_eval), _loss_text(eval_loss), manager.store.url(key))
    return {"rank": rank, "rounds": manager.current_step(), "steps": total_steps, "init_eval_loss": init_eval,
            "final_eval_loss": eval_loss, "final_key": key}


def _present(**values: float | None) -> dict[str, float]:
    """The keyword arguments that carry a value: a replica that did not evaluate reports no eval loss, not None."""
    return {k: v for k, v in values.items() if v is not None}


def _loss_text(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def load_initial_weights(model: torch.nn.Module, source: str) -> None:
    """Copy the parameters in the safetensors file ``source`` (a local path or a store URI: ``s3://``,
    ``file://``) into ``model``: every name and shape must match the model's parameters, else a ``ConfigError``
    naming ``init_from`` and what differs. A collected model (``diloco collect``) or a trainer's own export fits."""
    import torch
    from safetensors.torch import load

    data = read_init_file(source)
    try:
        tensors = load(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for bad bytes
        raise ConfigError(f"init_from: {source} is not a safetensors file ({type(exc).__name__}: {exc})",
                          hint="point init_from at a model file, e.g. one written by diloco collect") from None
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    wrong = [n for n in params if n in tensors and tuple(tensors[n].shape) != tuple(params[n].shape)]
    if missing or unexpected or wrong:
        what = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected
                else f"{wrong[0]} is {tuple(tensors[wrong[0]].shape)}, the model's {tuple(params[wrong[0]].shape)}")
        raise ConfigError(f"init_from: {source} does not fit this model ({what})",
                          hint="give the model the same n_layer, n_head, n_embd and block_size as the file's")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name].to(device=param.device, dtype=param.dtype))
    log.info("initial weights from %s (%d tensors)", source, len(params))


def read_init_file(source: str) -> bytes:
    """The bytes of ``init_from``: a local file, or an object named by its store URI; ``ConfigError`` when absent."""
    from pathlib import Path

    from diloco.errors import ObjectNotFound
    from diloco.store.objects import ObjectStore

    if "://" not in source:
        try:
            return Path(source).expanduser().read_bytes()
        except OSError as exc:
            raise ConfigError(f"init_from: cannot read {source}: {exc.strerror or exc}",
                              hint="give the path of a safetensors model file") from None
    folder, _, key = source.rstrip("/").rpartition("/")
    try:
        return ObjectStore(folder).get(key)
    except ObjectNotFound:
        raise ConfigError(f"init_from: no object at {source}", hint="give the URI of a safetensors model file") from None


# ------------------------------------------------------------------------------------------------ checks
#: Minimum of every integer knob.
_INT_MINIMUMS = {"total_steps": 1, "sync_every": 1, "n_layer": 1, "n_head": 1, "n_embd": 1, "block_size": 1,
                 "batch_size": 1, "fragments": 1, "fragment_sync_delay": 0, "eval_batches": 1, "threads": 0,
                 "warmup_steps": 0, "eval_batch_size": 0, "outer_momentum_warmup": 0,
                 "max_corpus_bytes": 1, "seed": -(2**63), "slow_rank": -1}
_NON_NEGATIVE = ("lr", "weight_decay", "grad_clip", "outer_lr", "outer_momentum")


def check_config(values: Mapping[str, Any], *, world_size: int | None = None, on_this_machine: bool = False) -> None:
    """Everything ``diloco_train`` would reject at start, as one ``ConfigError`` naming the knob.

    Pure arithmetic unless ``on_this_machine`` (the replicas run here): then also that ``device`` exists here
    (imports torch only for a non-CPU device) and that the corpus exists and is large enough for ``world_size``
    shards. Keys that are absent are not checked (the preflight hook always gets them all)."""
    for name, low in _INT_MINIMUMS.items():
        v = values.get(name, low)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{name} must be an integer{f' >= {low}' if low >= 0 else ''}, got {v!r}")
    for name in _NON_NEGATIVE:
        v = values.get(name, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ConfigError(f"{name} must be a number >= 0, got {v!r}")
    if not values.get("outer_lr", 1) > 0:
        raise ConfigError(f"outer_lr must be > 0, got {values['outer_lr']!r}")
    if not values.get("outer_momentum", 0) < 1:
        raise ConfigError(f"outer_momentum must be in [0, 1), got {values['outer_momentum']!r}")
    ratio = values.get("min_lr_ratio", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ConfigError(f"min_lr_ratio must be in [0, 1] (1 = no decay), got {ratio!r}")
    fraction = values.get("eval_fraction", 0.1)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError(f"eval_fraction must be in (0, 1), got {fraction!r}")
    if not isinstance(values.get("nesterov", True), bool):
        raise ConfigError(f"nesterov must be true or false, got {values['nesterov']!r}")
    _check_schedule(values)
    factor = values.get("slow_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise ConfigError(f"slow_factor must be a number >= 1 (1 = not slowed), got {factor!r}")
    every = values.get("eval_every")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ConfigError(f"eval_every must be an integer >= 1 (rounds between evaluations), got {every!r}")
    if every is not None and values.get("mode", "sync") == "async":
        raise ConfigError("eval_every: the asynchronous mode evaluates on its own schedule; drop eval_every "
                          "(or use --mode sync)")
    if values.get("outer_rule", "nesterov") not in ("nesterov", "sparseloco"):
        raise ConfigError(f"outer_rule must be 'nesterov' or 'sparseloco', got {values['outer_rule']!r}")
    if values.get("mode", "sync") not in ("sync", "async"):
        raise ConfigError(f"mode must be 'sync' or 'async', got {values['mode']!r}")
    if values.get("mode") == "async" and values.get("fragments", 1) != 1:
        raise ConfigError(f"fragments must be 1 in async mode (whole-model deltas), got {values['fragments']!r}")
    _check_model_shape(values)
    device = values.get("device", "auto")
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise ConfigError(f"device {device!r} is not a torch device", hint="use auto, cpu, cuda or cuda:N")
    corpus = values.get("corpus")
    if corpus is not None and not isinstance(corpus, str):
        raise ConfigError(f"corpus must be a path (a string), got {corpus!r}")
    init_from = values.get("init_from")
    if init_from is not None and (not isinstance(init_from, str) or not init_from.strip()):
        raise ConfigError(f"init_from must be a path or a store URI of a safetensors file, got {init_from!r}")
    if on_this_machine:
        if device not in ("auto", "cpu"):
            _resolve_device(device)
        if world_size is not None:
            _check_corpus_size(corpus, values.get("max_corpus_bytes", DEFAULT_MAX_CORPUS_BYTES), world_size=world_size,
                               block_size=values.get("block_size", 64), eval_fraction=fraction)


def _check_schedule(values: Mapping[str, Any]) -> None:
    if "total_steps" in values and "sync_every" in values:
        total, every = values["total_steps"], values["sync_every"]
        if total % every:
            lower, upper = max(every, total - total % every), total - total % every + every
            raise ConfigError(
                f"total_steps ({total}) must be a multiple of sync_every ({every}) so training ends on an outer "
                f"sync and every rank exports the same global weights",
                hint=f"use total_steps={lower} or {upper}",
            )
    fragments, every = values.get("fragments", 1), values.get("sync_every", 50)
    if every % fragments:
        raise ConfigError(f"sync_every ({every}) must be a multiple of fragments ({fragments}): each fragment syncs "
                          f"every sync_every steps, one every sync_every // fragments steps")
    delay = values.get("fragment_sync_delay", 0)
    if delay >= every // fragments:
        raise ConfigError(f"fragment_sync_delay must be below sync_every // fragments = {every // fragments}, "
                          f"got {delay}")


def _check_model_shape(values: Mapping[str, Any]) -> None:
    n_embd, n_head = values.get("n_embd", 64), values.get("n_head", 2)
    if n_embd % n_head:
        raise ConfigError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head}): each head gets "
                          f"n_embd // n_head channels", hint=f"e.g. n_embd={n_embd - n_embd % n_head or n_head}")
    units = values.get("n_layer", 2) + 2  # embeddings, each block, final norm + head (diloco.trainers.gpt_model.split_fragments)
    if values.get("fragments", 1) > units:
        raise ConfigError(f"fragments must be between 1 and {units} (n_layer + 2) for this model, got "
                          f"{values['fragments']}")


def _check_corpus_size(corpus: str | None, max_bytes: int, *, world_size: int, block_size: int,
                       eval_fraction: float) -> None:
    """The size test of ``diloco.trainers.data.split_corpus``, from file sizes (nothing is read, torch is not needed)."""
    from diloco.trainers.data import _FILE_SEPARATOR, corpus_files

    size = min(max_bytes, sum(os.path.getsize(f) + len(_FILE_SEPARATOR) for f in corpus_files(corpus)))
    n_train = int(size * (1.0 - eval_fraction))
    need = block_size + 2
    if n_train // world_size < need or size - n_train < need:
        raise ConfigError(
            f"corpus of {size} bytes is too small for {world_size} shard(s) and an eval split of "
            f"block_size {block_size} (each needs >= {need} bytes)",
            hint="raise max_corpus_bytes, use a larger corpus or lower block_size",
        )


def _elastic_members(manager: Any, mode: str) -> Callable[[int], list[int]] | None:
    """The manager's ``members_of`` when the run is elastic (``--max-replicas``, synchronous), else None."""
    members_of = getattr(manager, "members_of", None)
    if mode == "sync" and callable(members_of) and members_of(0) is not None:
        return members_of  # type: ignore[no-any-return]
    return None


def _dealt_batch(dealer: Any, data: torch.Tensor, step: int, *, rank: int,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An elastic run's batch at inner step ``step`` (zero-based): the blocks the round's membership deals this
    rank (``MembershipDealer``), block ``b`` being the window ``data[b*block_size : (b+1)*block_size]`` and its
    next-byte targets."""
    import torch

    starts = [b * block_size for b in dealer.blocks(step, rank)]
    x = torch.stack([data[s:s + block_size] for s in starts])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts])
    return x, y


def _check_identity(manager: Any, *, rank: int, world_size: int, elastic: bool = False) -> None:
    if elastic:  # a rank added to an elastic run lies past the world it was launched with
        return
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


def _inner_step(model: GPT, inner_opt: torch.optim.Optimizer, data: Any, train_gen: torch.Generator,
                dev: torch.device, *, batch_size: int, block_size: int, grad_clip: float,
                slow_factor: float, position: list[int], lr_at: Callable[[int], float],
                draw: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
                ) -> Callable[[], torch.Tensor]:
    """One inner AdamW step on this rank's next batch, as a function of no arguments returning the loss: the
    same step in both modes (the outer loop's optimizer hook runs the outer round inside ``inner_opt.step()``).

    ``position[0]`` counts the run's inner steps (the rejoin hook moves it); the step sets AdamW's lr to
    ``lr_at(step)`` for the step it is about to take. ``draw(step)``: the batch of zero-based inner step ``step``
    (an elastic run's dealing), instead of random windows of this rank's shard."""
    import torch

    from diloco.trainers.data import sample_batch

    def step() -> torch.Tensor:
        began = time.perf_counter()
        if draw is not None:
            x, y = draw(position[0])
        else:
            x, y = sample_batch(data, batch_size=batch_size, block_size=block_size, generator=train_gen)
        _, loss = model(x.to(dev), y.to(dev))
        inner_opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        _slow_down(began, slow_factor)
        position[0] += 1
        for group in inner_opt.param_groups:
            group["lr"] = lr_at(position[0])
        inner_opt.step()
        return loss

    return step


def _train_async(*, manager: Any, rank: int, world_size: int, model: GPT, inner_opt: torch.optim.Optimizer,
                 inner_step: Callable[[], torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]],
                 dev: torch.device, config: Any, total_steps: int, sync_every: int, tokens_per_step: int,
                 outer_lr: float, outer_momentum: float, nesterov: bool,
                 on_rejoin: Callable[[int], None]) -> dict[str, Any]:
    """``mode="async"``: the same model, data, inner step and rejoin hook, coordinated by
    ``diloco.replica.async_diloco``."""
    from diloco.replica.async_diloco import run_builtin_async

    model.train()
    return run_builtin_async(
        manager=manager, rank=rank, world_size=world_size, model=model, inner_optimizer=inner_opt,
        train_step=lambda: float(inner_step().detach()), evaluate=lambda: _evaluate(model, batches, dev),
        total_steps=total_steps, sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum,
        nesterov=nesterov, tokens_per_step=tokens_per_step, on_rejoin=on_rejoin,
        export_metadata={"model": "diloco.trainers.gpt_model:GPT", "model_config": config.to_json()})


def inner_lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The inner learning rate of the ``step``-th inner step (1-based, counted over the whole run).

    Linear warm-up over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio`` at ``total_steps``
    (``min_lr_ratio = 1``: constant). The schedule follows the run's global step, never the round: restarting it
    every outer round would re-warm the replicas away from the global model each time."""
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    if min_lr_ratio >= 1:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _slow_down(began: float, factor: float) -> None:
    """Sleep ``factor - 1`` times the compute since ``began``: this replica runs ``factor`` times slower (a
    straggler for benchmarks), whatever the machine."""
    if factor > 1:
        time.sleep((factor - 1) * (time.perf_counter() - began))


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


#: The knobs ``check_config`` validates: every parameter except the injected ones.
_KNOBS = frozenset(inspect.signature(diloco_train).parameters) - {"manager", "rank", "world_size"}
