"""A Hugging Face causal-LM trainer: the user's model, the user's text, DiLoCo across replicas through the store.

``train`` is a ``trainer_fn`` (``diloco launch --trainer diloco.trainers.hf:train -k model=... -k data=...``), with
``manager``, ``rank`` and ``world_size`` injected by the replica entrypoint. It follows the built-in trainer
(``diloco.trainers.gpt``): flat, commented defaults; build the model and the inner AdamW; enter
``make_diloco_outer_loop`` (its hook on ``inner_optimizer.step`` runs the outer round every ``sync_every`` steps);
evaluate after each round with ``diloco.report``. What it adds is what a real model needs:

* **Model**: ``model=`` a hub name or a local ``save_pretrained`` directory (``AutoModelForCausalLM``), or
  ``model_config=`` a dict with ``model_type`` (e.g. ``{"model_type": "llama", "hidden_size": 64, ...}``) for a
  fresh model, initialised from ``seed`` so every replica starts from identical weights without a broadcast.
  A hub name (``model`` or ``tokenizer``) is checked first (``diloco.trainers.hub``): from the cache when the
  Hub cannot be reached, else a one-line ``ConfigError`` in seconds, before torch is imported.
* **Data**: ``data=`` a local file or directory, or an ``s3://`` prefix (read through ``diloco.store.objects``, so the
  run's S3 settings apply), holding ``.txt``/``.md`` (one document per file), ``.jsonl`` (one document per line,
  ``text_field``) and ``.parquet`` (column ``text_field``; needs pyarrow) files, read in key order. Documents are
  tokenized with the model's tokenizer (or ``tokenizer=``), joined with EOS and packed into ``block_size`` blocks.
  The last ``eval_fraction`` of the blocks is the held-out split every rank evaluates on; the rest are dealt
  round-robin, block ``i`` to rank ``i % world_size``: disjoint shards, identical on every machine.
  Each rank visits its shard in a per-rank, per-epoch permutation; its position (epoch, blocks consumed) is the
  ``BlockSampler`` state, so a resumed replica continues where it stopped instead of re-reading its shard: a
  replica restarted mid-run rejoins at the last committed round (``on_rejoin``) and trains only the remaining
  steps, its sampler and inner schedule moved on by the steps done.
* **Streamed data** (``diloco.trainers.hf_data``): ``data=hf:NAME[:CONFIG][@SPLIT]`` (a ``datasets`` dataset,
  streamed; or a local ``save_to_disk``/Parquet path) and pre-tokenized shards (``.bin``/``.npy`` token files or
  Parquet of ``token_field`` id lists, local or ``s3://``) are read as training goes, never tokenized whole at
  start, and dealt per process deterministically. Each process saves its exact position with every committed
  round (``diloco.trainers.data_positions``, JSON in the store) and a relaunched one restores the position of the
  round it rejoins at. ``data_log=DIR`` appends each inner step's token-id digest, to check that.
* **Evaluation**: by default every rank evaluates the held-out blocks after every round; ``eval_every=K`` has
  rank 0 alone evaluate the committed global model every K rounds (and after the last), a cheap held-out loss in
  the metrics rows that status and the TensorBoard/MLflow/W&B sinks show.
* **Inner loop**: bf16 (or fp16 with a loss scaler) autocast on GPU, fp32 weights; ``grad_accum`` micro-batches
  per inner step; gradient clipping; linear warmup then cosine decay to ``min_lr_ratio * lr``.
* **Several processes per replica** (``--procs-per-replica K``, default one per GPU): the replica entrypoint
  starts K processes with torch's elastic launcher (``diloco.replica.local_group``); each wraps the model in DDP and
  reads every K-th block of the replica's shard (a disjoint sub-shard), so ``batch_size`` is per process and a
  replica steps on ``K * batch_size * grad_accum`` blocks. Only local rank 0 talks to the store, evaluates,
  reports and saves; the round's mean reaches the others by broadcast, so every process ends on the same
  weights, bitwise (each logs their sha256 at the end).
* **FSDP2** (``fsdp``: ``auto`` by default, ``true``, ``false``; ``diloco.trainers.hf_fsdp``): a model that does
  not fit one GPU is sharded over the replica's local processes (``fully_shard`` per decoder layer, bf16 compute
  with fp32 master weights, ``activation_checkpointing`` as an option). Each process then keeps the DiLoCo state
  of its own rows only and exchanges them through the store itself (``diloco.collectives.parts``); every process
  evaluates (a forward is collective), local rank 0 reports and saves the gathered weights.
* **Export**: the outer loop writes the global weights to ``final/rank_RRRR.safetensors`` as for every trainer;
  this trainer also writes ``save_pretrained`` (safetensors) plus the tokenizer: rank 0 under ``hf_model/`` in
  the store, every rank into ``$SM_MODEL_DIR`` on SageMaker, so the result loads with
  ``AutoModelForCausalLM.from_pretrained``.

``total_steps`` must be a multiple of ``sync_every``: training then ends on an outer sync, and every rank holds
(and exports) the same global weights, bitwise. ``check_config`` validates every knob, at start and as the
preflight hook, so ``diloco launch`` rejects a bad value in one line before any replica starts.

Imports of torch, transformers, tokenizers and pyarrow are lazy: the launcher reads this module's signature on a
machine that may have none of them.
"""

from __future__ import annotations

import inspect
import io
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from diloco.errors import ConfigError
from diloco.replica.local_group import supports_local_processes
from diloco.trainers.preflight import (
    MIB,
    MemoryEstimate,
    PreflightContext,
    memory_estimate,
    params_in_name,
    preflight,
)

if TYPE_CHECKING:
    import torch

    from diloco.replica.local_group import LocalGroup
    from diloco.replica.manager import ObjectStoreManager
    from diloco.store.objects import ObjectStore
    from diloco.trainers.data_positions import DataPositions
    from diloco.trainers.hf_feed import Feed
    from diloco.trainers.hub import Field as HubField

log = logging.getLogger("diloco.trainers.hf")

#: The diloco extras this trainer imports: a bootstrap installs them where the image lacks them (the launcher reads
#: this line from the source, without importing the module).
DILOCO_EXTRAS = ("hf",)
#: Where rank 0 writes the ``save_pretrained`` directory in the run's store.
HF_MODEL_PREFIX = "hf_model/"
#: File suffixes read as data, by format.
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
Precision = Literal["auto", "bf16", "fp16", "fp32"]


def _preflight(kwargs: dict[str, Any], context: PreflightContext) -> None:
    check_config(kwargs, on_this_machine=context.on_this_machine)


#: This trainer's process before its model: torch, transformers, tokenizers and the data loader.
PROCESS_BASE_MIB = 1536
#: Host bytes per parameter of loading the model on the CPU before it goes to the device.
LOAD_BYTES_PER_PARAM = 4


def _memory(kwargs: Mapping[str, Any]) -> MemoryEstimate | None:
    """Sized from the parameter count in the model's name (``Qwen/Qwen2.5-0.5B``: 0.5 B), per docs/trainers.md
    "Memory" (``diloco.replica.host_memory``): on the host each process keeps the outer loop's fp32 state and
    pseudo-gradient and loads the model on the CPU first, and local process 0 holds a round's peak on top. Upper
    side for a sharded model too (each of its K processes holds about 1/K of that), since the number of processes
    is the backend's to choose. A name without a size says nothing (the backend's fallback names the setting)."""
    from diloco.replica.host_memory import outer_loop_host_bytes

    params = params_in_name(str(kwargs.get("model") or ""))
    if params is None:
        return None
    outer = outer_loop_host_bytes(params)
    return MemoryEstimate(PROCESS_BASE_MIB * MIB + outer.per_process + LOAD_BYTES_PER_PARAM * params,
                          f"the Hugging Face trainer with {params / 1e9:g} B parameters, from the model's name",
                          shared_bytes=outer.leader_extra, shared_basis="for a round")


@supports_local_processes
@preflight(_preflight)
@memory_estimate(_memory)
def train(
    *,
    manager: ObjectStoreManager,
    rank: int,
    world_size: int,
    # schedule: total inner steps, an outer round every sync_every of them
    total_steps: int = 200,
    sync_every: int = 50,
    # model: exactly one of a hub name / local path, or a config dict for a fresh model
    model: str | None = None,
    model_config: dict[str, Any] | None = None,
    tokenizer: str | None = None,  # default: the model's own
    # data
    data: str | None = None,  # a local file/directory, an s3:// prefix (text or token shards), or hf:NAME[:CFG][@SPLIT]
    text_field: str = "text",  # the JSONL key / Parquet column holding the text
    token_field: str = "input_ids",  # the column of token-id lists (pre-tokenized Parquet, hf: rows without text)
    token_dtype: str = "uint16",  # the dtype of raw .bin token files
    block_size: int = 128,
    eval_fraction: float = 0.1,
    eval_batches: int = 4,
    eval_every: int | None = None,  # None: every rank after every round; K: rank 0 alone, every K rounds and the last
    # inner optimizer
    batch_size: int = 8,  # per process: a replica of K local processes steps on K * batch_size * grad_accum blocks
    grad_accum: int = 1,
    lr: float = 3e-4,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
    grad_clip: float = 1.0,  # 0 disables clipping
    # outer optimizer (DiLoCo paper defaults)
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    # execution
    seed: int = 1337,
    precision: Precision = "auto",  # auto: bf16 on a GPU that has it, else fp32
    device: str = "auto",
    fsdp: bool | Literal["auto"] = "auto",  # shard the model over the local processes; auto: when it cannot fit one GPU
    activation_checkpointing: bool = False,  # recompute each layer's activations in the backward (less memory)
    threads: int = 1,  # torch CPU threads; 1 because several replicas often share one machine's cores
    data_log: str | None = None,  # a directory: each process appends its per-step token-id digests (for checks)
) -> dict[str, Any]:
    """Train a causal LM on this replica's shard with DiLoCo; returns a summary (losses, rounds, where the model is).

    Raises ``ConfigError`` naming the argument for invalid values before any training or store traffic."""
    check_config({k: v for k, v in locals().items() if k in _KNOBS})
    sources = check_hub_sources(model=model, tokenizer=tokenizer)  # in seconds, before torch is even imported
    import torch

    from diloco import report
    from diloco.replica.local_group import current_local_group
    from diloco.replica.outer import make_diloco_outer_loop
    from diloco.trainers.hf_feed import DataLog, restore_position
    from diloco.trainers.hf_fsdp import choose_fsdp, full_weights, shard_model

    members_of = getattr(manager, "members_of", None)
    members_of = members_of if callable(members_of) and members_of(0) is not None else None  # an elastic run
    if members_of is None and not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside 0..{world_size - 1} for world_size {world_size}")
    if threads:
        torch.set_num_threads(threads)
    group = current_local_group()
    local_rank, local_size = (group.rank, group.size) if group is not None else (0, 1)
    leader = local_rank == 0  # the one process of the replica that evaluates, reports and saves
    dev = _replica_device(device, group)
    amp_dtype = _resolve_precision(precision, dev)

    tok = load_tokenizer(tokenizer or model, cache_only=sources["tokenizer" if tokenizer else "model"])
    assert isinstance(data, str)  # check_config
    feed = _open_data(data, tok, rank=rank, world_size=world_size, local_rank=local_rank, local_size=local_size,
                      block_size=block_size, eval_fraction=eval_fraction, eval_blocks=eval_batches * batch_size,
                      seed=seed, text_field=text_field, token_field=token_field, token_dtype=token_dtype,
                      members_of=members_of, dealing=(sync_every, grad_accum * batch_size))
    eval_set = feed.eval[: eval_batches * batch_size]
    positions = _positions(manager, rank=rank, local_rank=local_rank, data=data)
    digests = DataLog(data_log, rank=rank, local_rank=local_rank) if data_log else None

    def build(meta: bool = False) -> Any:
        return build_model(model=model, model_config=model_config, vocab_size=len(tok), seed=seed,
                           cache_only=sources["model"], meta=meta)

    sharded, why = choose_fsdp(fsdp, params=_count_params(build(meta=True)), local_size=local_size, device=dev)
    log.info("%s", why)
    if sharded and amp_dtype == torch.float16:
        raise ConfigError("precision fp16 with a sharded model: FSDP2's mixed precision here is bf16 (fp16 would "
                          "need a sharded loss scaler)", hint="use precision bf16 (or auto), or fsdp=false")
    if sharded and group is not None:
        net = shard_model(build, lambda: build(meta=True), group, amp_dtype,
                          activation_checkpointing=activation_checkpointing)
        amp_dtype = None  # FSDP2's mixed precision policy computes in bf16 itself
    else:
        net = build().to(dev)
        if activation_checkpointing:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fsdp_net = net if sharded and group is not None else None
    ddp = None if sharded else _data_parallel(net, group)  # before the outer loop copies the weights: rank 0's
    inner_opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        inner_opt, lambda step: lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps,
                                          min_ratio=min_lr_ratio))
    scaler = torch.amp.GradScaler(dev.type) if amp_dtype == torch.float16 else None
    done = [0]  # inner steps the run had done when this replica (re)joined it: 0 unless it restarted mid-run

    def on_rejoin(inner_step: int) -> None:
        """Position hook (a restart rejoining the run): skip the steps done, so the data order (each process's
        sampler) and the inner schedule continue where they were."""
        done[0] = inner_step
        restore_position(feed, positions, round_number=inner_step // sync_every,
                          blocks_per_round=sync_every * grad_accum * batch_size)
        schedule.last_epoch = inner_step
        for group_, base in zip(inner_opt.param_groups, schedule.base_lrs, strict=True):
            group_["lr"] = base * lr_factor(inner_step, warmup_steps=warmup_steps, total_steps=total_steps,
                                            min_ratio=min_lr_ratio)

    diloco = make_diloco_outer_loop(
        manager=manager, model_fragments=[net], inner_optimizer=inner_opt, outer_lr=outer_lr,
        outer_momentum=outer_momentum, nesterov=nesterov, sync_every=sync_every, model=net,
        export_metadata={"model": "transformers:AutoModelForCausalLM", "model_config": net.config.to_json_string()},
        on_rejoin=on_rejoin, shard_exchange=True if sharded else None,
    )
    log.info("%s (%d params) on %s, %s; %s; %d steps of %d x %d%s", net.config.model_type,
             sum(p.numel() for p in net.parameters()), dev, precision_name(amp_dtype), feed.describe, total_steps,
             grad_accum, batch_size, f" x {local_size} processes" if group is not None else "")

    tokens_per_step = grad_accum * batch_size * block_size * local_size
    net.train()
    init_eval = eval_loss = None
    # a sharded forward is collective: every process of an evaluating replica takes part
    evaluates = (leader or fsdp_net is not None) and (eval_every is None or rank == 0)
    with diloco:
        if evaluates:
            init_eval = eval_loss = evaluate(net, eval_set, batch_size=batch_size, device=dev, amp_dtype=amp_dtype)
        if leader:
            report(**_present(eval_loss=init_eval), total_steps=total_steps)  # amends the loop's `init` row
        loss_sum = torch.zeros((), device=dev)
        committed = manager.current_step()
        for step in range(done[0] + 1, total_steps + 1):
            loss = _accumulate(net, None, None, grad_accum=grad_accum, batch_size=batch_size, device=dev,
                               amp_dtype=amp_dtype, scaler=scaler, ddp=ddp, fsdp=fsdp_net, batches=feed.take,
                               on_step=digests.step(step) if digests else None)
            _inner_step(net, inner_opt, scaler, grad_clip=grad_clip)  # every sync_every-th runs the outer round
            schedule.step()
            report(tokens=tokens_per_step)
            loss_sum += loss
            if step % sync_every:
                continue
            if positions is not None and manager.current_step() > committed:  # this step committed a round
                committed = manager.current_step()
                positions.save(committed, feed.state_dict())
            train_loss = (group.mean(loss_sum) if group is not None else loss_sum).item() / sync_every
            due = eval_every is None or step == total_steps or (step // sync_every) % eval_every == 0
            evaluated = evaluates and due
            if evaluated:
                eval_loss = evaluate(net, eval_set, batch_size=batch_size, device=dev, amp_dtype=amp_dtype)
            if leader:
                report(train_loss=train_loss, **_present(eval_loss=eval_loss if evaluated else None),
                       lr=schedule.get_last_lr()[0])
            loss_sum.zero_()

    weights = full_weights(fsdp_net) if fsdp_net is not None else None  # gathered on local rank 0 only
    saved = save_model(net, tok, manager=manager, rank=rank, state_dict=weights) if leader else []
    if fsdp_net is None:
        digest = weights_digest(net)
    elif leader:
        assert weights is not None
        digest = tensors_digest({name: weights[name] for name, _ in net.named_parameters()})
    else:
        digest = "(held by local process 0: this process holds rows of a sharded model)"
    if leader:
        log.info("done: %d rounds, eval_loss %s -> %s; save_pretrained at %s; final weights sha256 %s",
                 manager.current_step(), _loss(init_eval), _loss(eval_loss), ", ".join(saved) or "-", digest)
    else:
        log.info("done: %d rounds as local process %d/%d; final weights sha256 %s", manager.current_step(),
                 local_rank, local_size, digest)
    return {"rank": rank, "local_rank": local_rank, "local_processes": local_size, "sharded": sharded,
            "rounds": manager.current_step(),
            "steps": total_steps, "init_eval_loss": init_eval, "final_eval_loss": eval_loss, "saved": saved,
            "data_position": feed.state_dict(), "weights_sha256": digest}


def _present(**values: float | None) -> dict[str, float]:
    """The values that are there (a metric not measured this round is left out of the row, not written as null)."""
    return {k: v for k, v in values.items() if v is not None}


def _open_data(data: str, tok: Any, *, rank: int, world_size: int, local_rank: int, local_size: int,
               block_size: int, eval_fraction: float, eval_blocks: int, seed: int, text_field: str,
               token_field: str, token_dtype: str, members_of: Callable[[int], Any] | None = None,
               dealing: tuple[int, int] = (1, 1)) -> Feed:
    """This process's data: a stream (``hf:``, pre-tokenized shards; ``diloco.trainers.hf_data``) dealt to slot
    ``rank * local_size + local_rank``, or the text under ``data`` tokenized whole and split (``split_blocks``).

    An elastic run (``members_of``, the manager's) deals the in-memory blocks by each round's membership instead
    (``diloco.trainers.dealing``; ``dealing``: inner steps per round, blocks per process per step); streamed data
    is dealt to fixed slots and is refused there."""
    from diloco.trainers import hf_data
    from diloco.trainers.hf_feed import MemoryFeed, StreamFeed

    streamed = hf_data.is_streamed(data, text_field=text_field, token_field=token_field)
    if members_of is not None:
        if streamed:
            raise ConfigError(f"data: {data} is streamed to fixed slots, but this run is elastic (--max-replicas), "
                              "whose data is dealt by each round's members",
                              hint="train an elastic run on in-memory text data, or launch without --max-replicas")
        from diloco.trainers.dealing import DealtFeed, MembershipDealer

        blocks = load_blocks(data, tok, block_size=block_size, text_field=text_field)
        split = split_blocks(blocks, rank=0, world_size=1, eval_fraction=eval_fraction)
        steps_per_round, per_step = dealing
        dealer = MembershipDealer(members_of, steps_per_round=steps_per_round, per_step=per_step,
                                  total=len(split.train), seed=seed, procs=local_size)
        return DealtFeed(split.train, split.eval, dealer, rank=rank, proc=local_rank, per_step=per_step,
                         describe=f"{len(blocks)} blocks of {block_size} tokens dealt by each round's members, "
                                  f"{len(split.eval)} held out")
    if streamed:
        slot, slots = rank * local_size + local_rank, world_size * local_size
        stream = hf_data.open_stream(data, tok, block_size=block_size, slot=slot, slots=slots, n_eval=eval_blocks,
                                     text_field=text_field, token_field=token_field, token_dtype=token_dtype)
        what = "rows" if stream.kind == "hf" else "blocks"
        return StreamFeed(stream, f"{data} streamed, {what} dealt to slot {slot} of {slots}, {eval_blocks} blocks "
                                  f"of {block_size} tokens held out")
    blocks = load_blocks(data, tok, block_size=block_size, text_field=text_field)
    split = split_blocks(blocks, rank=rank, world_size=world_size, eval_fraction=eval_fraction)
    shard = local_shard(split.train, local_rank=local_rank, local_size=local_size)
    sampler = BlockSampler(len(shard), seed=seed + 7919 * (rank + 1) + 104729 * local_rank)
    return MemoryFeed(shard, sampler, split.eval, f"{len(blocks)} blocks of {block_size} tokens: {len(shard)} in "
                      f"this {'sub-shard' if local_size > 1 else 'shard'}, {len(split.eval)} held out")


def _positions(manager: Any, *, rank: int, local_rank: int, data: str) -> DataPositions | None:
    """Where this process saves its data position per committed round: the run's store (none without one)."""
    from diloco.trainers.data_positions import DataPositions

    store = getattr(manager, "store", None)
    return DataPositions(store, rank=rank, local_rank=local_rank, data=data) if store is not None else None


def _count_params(net: Any) -> int:
    """Parameters of a model (one built on the meta device: shapes only), tied ones once."""
    return sum(p.numel() for p in net.parameters())


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def weights_digest(net: Any) -> str:
    """sha256 of the model's parameters (``tensors_digest``). Logged by every process at the end, so that a
    multi-process replica's agreement can be checked from its log."""
    return tensors_digest(dict(net.named_parameters()))


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names and raw bytes, in name order: equal digests mean bitwise equal weights (the exported
    ``final/rank_RRRR.safetensors`` of a model has its parameters' digest)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ local processes
def local_shard(blocks: torch.Tensor, *, local_rank: int, local_size: int) -> torch.Tensor:
    """This process's part of the replica's shard: every ``local_size``-th block from ``local_rank`` (disjoint
    between the replica's processes, together the whole shard)."""
    shard = blocks[local_rank::local_size]
    if len(shard) < 1:
        raise ConfigError(f"data: this replica's shard has {len(blocks)} block(s), too few for {local_size} local "
                          f"processes (each needs >= 1)",
                          hint="add data, lower block_size, or lower --procs-per-replica")
    return shard


def _replica_device(device: str, group: LocalGroup | None) -> torch.device:
    """``device`` resolved; in a multi-process replica each process's own device (``cuda:<local rank>`` or the
    CPU), and a ``device`` that contradicts it is refused."""
    import torch

    if group is None:
        return _resolve_device(device)
    if device != "auto" and torch.device(device).type != group.device.type:
        raise ConfigError(f"device {device!r} with {group.size} local processes: each process runs on "
                          f"{group.device.type} (one GPU per process where CUDA is available)",
                          hint="use device auto, or --procs-per-replica 1")
    return group.device


def _data_parallel(net: Any, group: LocalGroup | None) -> Any:
    """The model wrapped in DDP over the replica's local processes (``None`` in a one-process replica)."""
    if group is None:
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(net, device_ids=[group.device.index] if group.device.type == "cuda" else None)


# ------------------------------------------------------------------------------------------------ inner step
def _accumulate(net: Any, train_blocks: torch.Tensor | None, sampler: BlockSampler | None, *, grad_accum: int,
                batch_size: int, device: torch.device, amp_dtype: torch.dtype | None, scaler: Any, ddp: Any = None,
                fsdp: Any = None, batches: Callable[[int], torch.Tensor] | None = None,
                on_step: Callable[[list[torch.Tensor]], None] | None = None) -> torch.Tensor:
    """Forward and backward ``grad_accum`` micro-batches; returns the mean loss (detached, on the device).

    The micro-batches come from ``batches(batch_size)`` (the trainer's data feed), or are ``train_blocks`` rows
    chosen by ``sampler``; ``on_step`` gets them all (the data log).

    With ``ddp`` (several local processes) the forward goes through it and the gradients are averaged across the
    processes once, on the last micro-batch (``no_sync`` before it); with ``fsdp`` (the sharded model itself) the
    gradients are reduce-scattered once, on the last micro-batch, too."""
    import contextlib

    import torch

    model = ddp if ddp is not None else net
    total = torch.zeros((), device=device)
    taken = []
    for i in range(grad_accum):
        if batches is not None:
            x = batches(batch_size)
        else:
            assert train_blocks is not None and sampler is not None
            x = train_blocks[sampler.take(batch_size)]
        taken.append(x)
        x = x.to(device)
        last = i == grad_accum - 1
        if fsdp is not None:
            fsdp.set_requires_gradient_sync(last)
        with contextlib.nullcontext() if ddp is None or last else ddp.no_sync():
            with _autocast(device, amp_dtype):
                loss = model(input_ids=x, labels=x).loss / grad_accum
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach()
    if on_step is not None:
        on_step(taken)
    return total


def _inner_step(net: Any, opt: torch.optim.Optimizer, scaler: Any, *, grad_clip: float) -> None:
    """Clip, step, zero. Always calls ``opt.step()``: the outer loop counts inner steps by that call, so an fp16
    step with non-finite gradients steps with zero gradients instead of being skipped (a skipped step would put
    this replica's rounds out of line with its peers')."""
    import torch

    if scaler is not None:
        scaler.unscale_(opt)
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            for g in grads:
                g.zero_()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip)
    opt.step()
    if scaler is not None:
        scaler.update()
    opt.zero_grad(set_to_none=True)


def _autocast(device: torch.device, amp_dtype: torch.dtype | None) -> Any:
    import contextlib

    import torch

    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype)


def evaluate(net: Any, blocks: torch.Tensor, *, batch_size: int, device: torch.device | str = "cpu",
             amp_dtype: torch.dtype | None = None) -> float:
    """Mean next-token loss over ``blocks`` (the same held-out blocks on every rank and every round)."""
    import torch

    device = torch.device(device)
    was_training = net.training
    net.eval()
    losses = []
    with torch.no_grad():
        for start in range(0, len(blocks), batch_size):
            x = blocks[start:start + batch_size].to(device)
            with _autocast(device, amp_dtype):
                losses.append(net(input_ids=x, labels=x).loss.float() * len(x))
    net.train(was_training)
    return (torch.stack(losses).sum() / len(blocks)).item()


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """The inner learning rate's multiplier after ``step`` steps: linear warmup from ``1/warmup_steps`` to 1, then
    cosine decay to ``min_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------------------ data
class BlockSampler:
    """Indices into one rank's shard: a fresh permutation each epoch (seeded by ``seed`` and the epoch), consumed in
    order. The whole state is ``(epoch, position)``, so resuming it replays nothing and skips nothing."""

    def __init__(self, n: int, *, seed: int) -> None:
        if n < 1:
            raise ConfigError("data: this rank's shard has no blocks", hint="use more data or fewer replicas")
        self.n, self.seed, self.epoch, self.position = n, seed, 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        import torch

        generator = torch.Generator().manual_seed(self.seed + 1_000_003 * epoch)
        return torch.randperm(self.n, generator=generator).tolist()

    def take(self, count: int) -> list[int]:
        out = []
        for _ in range(count):
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def advance(self, count: int) -> None:
        """Skip ``count`` indices, exactly as ``take(count)`` would (a rejoining replica skips the steps done)."""
        full, rest = divmod(self.position + count, self.n)
        if full:
            self.epoch, self.position = self.epoch + full, rest
            self._order = self._permutation(self.epoch)
        else:
            self.position = rest

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if not 0 <= position <= self.n or epoch < 0:
            raise ValueError(f"sampler state {dict(state)} does not fit a shard of {self.n} blocks")
        self.epoch, self.position, self._order = epoch, position, self._permutation(epoch)


@dataclass
class BlockSplit:
    train: torch.Tensor  # this rank's shard, [n, block_size]
    eval: torch.Tensor  # the held-out blocks, identical on every rank


def split_blocks(blocks: torch.Tensor, *, rank: int, world_size: int, eval_fraction: float) -> BlockSplit:
    """The last ``eval_fraction`` of the blocks (at least one) held out; the rest dealt round-robin to the ranks."""
    n_eval = max(1, int(len(blocks) * eval_fraction))
    n_train = len(blocks) - n_eval
    if n_train < world_size:
        raise ConfigError(f"data: {len(blocks)} blocks are too few for {world_size} replica(s) and a held-out "
                          f"split (each rank needs >= 1 training block)",
                          hint="add data, lower block_size or eval_fraction, or use fewer replicas")
    return BlockSplit(train=blocks[:n_train][rank::world_size], eval=blocks[n_train:])


def load_blocks(data: str, tokenizer: Any, *, block_size: int, text_field: str = "text") -> torch.Tensor:
    """Every document under ``data`` tokenized, joined with EOS and packed into ``[n, block_size]`` (the ragged
    tail dropped). Deterministic: files in key order, documents in file order."""
    import torch

    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for name, payload in data_files(data):
        docs = parse_documents(name, payload, text_field=text_field)
        for doc in tokenizer(docs, add_special_tokens=False)["input_ids"] if docs else []:
            ids += doc + ([eos] if eos is not None else [])
    n = len(ids) // block_size
    if n < 2:
        raise ConfigError(f"data: {data} holds {len(ids)} tokens, fewer than 2 blocks of block_size {block_size}",
                          hint="add data or lower block_size")
    return torch.tensor(ids[: n * block_size], dtype=torch.long).view(n, block_size)


def data_files(data: str) -> list[tuple[str, bytes]]:
    """``(name, bytes)`` of every data file under ``data`` (a local file or directory, or a store URI), by name."""
    suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
    if "://" not in data or data.startswith("file://"):
        path = data.removeprefix("file://")
        if os.path.isfile(path):
            return [(path, _read(path))]
        if not os.path.isdir(path):
            raise ConfigError(f"data: {data} is neither a file nor a directory", hint="pass an existing path or an "
                              "s3:// prefix")
        names = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
        found = [(n, _read(os.path.join(path, n))) for n in names if _wanted(n, suffixes)]
    else:
        store = _store(data)
        found = [(key, store.get(key)) for key in store.list() if _wanted(key, suffixes)]
    if not found:
        raise ConfigError(f"data: no {'/'.join(suffixes)} files under {data}",
                          hint="point data at the folder or prefix holding your text files")
    return found


def _wanted(name: str, suffixes: tuple[str, ...]) -> bool:
    return name.lower().endswith(suffixes) and not os.path.basename(name).startswith(".")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _store(uri: str) -> ObjectStore:
    from diloco.store.objects import ObjectStore

    return ObjectStore(uri)


def parse_documents(name: str, payload: bytes, *, text_field: str) -> list[str]:
    """The documents of one file: a text file is one document; a JSONL line or a Parquet row is one each."""
    lower = name.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return _parquet_documents(name, payload, text_field)
    text = payload.decode("utf-8", errors="replace")
    if lower.endswith(TEXT_SUFFIXES):
        return [text] if text.strip() else []
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ConfigError(f"data: {name} line {number} is not JSON", hint="one JSON object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
            raise ConfigError(f"data: {name} line {number} has no string field {text_field!r}",
                              hint="set text_field to the key holding the text")
        docs.append(row[text_field])
    return docs


def _parquet_documents(name: str, payload: bytes, text_field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"data: {name} is Parquet, which needs pyarrow", hint="pip install pyarrow") from None
    table = pq.read_table(io.BytesIO(payload))
    if text_field not in table.column_names:
        raise ConfigError(f"data: {name} has no column {text_field!r} (columns: {', '.join(table.column_names)})",
                          hint="set text_field to the column holding the text")
    return [t for t in table.column(text_field).to_pylist() if isinstance(t, str)]


# ------------------------------------------------------------------------------------------------ model
def check_hub_sources(*, model: str | None, tokenizer: str | None) -> dict[str, bool]:
    """``model`` and ``tokenizer`` checked to be loadable (``diloco.trainers.hub.check_source``): a local
    directory, a Hub name in the cache, or a reachable Hub; ``ConfigError`` naming the field otherwise. Returns,
    per field, whether to load it from the cache alone (the Hub unreachable, or ``HF_HUB_OFFLINE``)."""
    from diloco.trainers.hub import check_source

    fields: tuple[tuple[HubField, str | None], ...] = (("model", model), ("tokenizer", tokenizer))
    return {field: isinstance(name, str) and check_source(field, name).cache_only for field, name in fields}


def load_tokenizer(name_or_path: str | None, *, cache_only: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained`` (from the Hugging Face cache alone with ``cache_only``); a tokenizer
    without EOS gets none added (documents are then joined without a separator)."""
    from transformers import AutoTokenizer

    if name_or_path is None:
        raise ConfigError("tokenizer: required with model_config (a fresh model has no tokenizer of its own)",
                          hint="pass -k tokenizer=<hub name or directory>")
    return AutoTokenizer.from_pretrained(name_or_path, local_files_only=cache_only)


def build_model(*, model: str | None, model_config: Mapping[str, Any] | None, vocab_size: int, seed: int,
                cache_only: bool = False, meta: bool = False) -> Any:
    """The causal LM in fp32: from ``model`` (name or path; from the Hugging Face cache alone with ``cache_only``),
    or fresh from ``model_config`` seeded by ``seed``, so every replica builds the same initial weights.
    ``vocab_size`` fills a config that does not set it. ``meta``: the same model on the meta device (shapes
    only, no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    if meta:
        if model is not None:
            config = AutoConfig.from_pretrained(model, local_files_only=cache_only)
        else:
            assert model_config is not None
            fields = dict(model_config)
            fields.setdefault("vocab_size", vocab_size)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif model is not None:
        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, local_files_only=cache_only)
    else:
        assert model_config is not None
        fields = dict(model_config)
        fields.setdefault("vocab_size", vocab_size)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        net = AutoModelForCausalLM.from_config(config)
    net.config.use_cache = False  # no KV cache while training
    return net


def save_model(net: Any, tokenizer: Any, *, manager: Any, rank: int,
               state_dict: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """``save_pretrained`` (safetensors) with the tokenizer: rank 0 into the store under ``hf_model/``, every rank
    into ``$SM_MODEL_DIR`` (each SageMaker job uploads its own). Returns where it wrote. ``state_dict``: the whole
    weights of a sharded model (gathered), written in place of the model's own."""
    from diloco import envvars

    written = []
    store = getattr(manager, "store", None)
    if store is not None and rank == 0:
        with tempfile.TemporaryDirectory(prefix="diloco-hf-") as tmp:
            _save_pretrained(net, tokenizer, tmp, state_dict)
            for name in sorted(os.listdir(tmp)):
                store.put(HF_MODEL_PREFIX + name, _read(os.path.join(tmp, name)))
        written.append(store.url(HF_MODEL_PREFIX))
    model_dir = os.environ.get(envvars.SM_MODEL_DIR)
    if model_dir:
        _save_pretrained(net, tokenizer, model_dir, state_dict)  # replaces the outer loop's model.safetensors with HF's
        written.append(model_dir)
    return written


def _save_pretrained(net: Any, tokenizer: Any, directory: str,
                     state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
    net.config.use_cache = True  # for whoever generates with it
    net.save_pretrained(directory, safe_serialization=True, state_dict=dict(state_dict) if state_dict else None)
    tokenizer.save_pretrained(directory)


# ------------------------------------------------------------------------------------------------ checks
_INT_MINIMUMS = {"total_steps": 1, "sync_every": 1, "block_size": 2, "eval_batches": 1, "batch_size": 1,
                 "grad_accum": 1, "warmup_steps": 0, "threads": 0}
_NON_NEGATIVE = ("lr", "weight_decay", "grad_clip")
_PRECISIONS = ("auto", "bf16", "fp16", "fp32")


def check_config(values: Mapping[str, Any], *, on_this_machine: bool = False) -> None:
    """Everything ``train`` would reject at start, as one ``ConfigError`` naming the knob. Pure arithmetic unless
    ``on_this_machine``: then also that a local ``data`` path exists, that ``model``/``tokenizer`` are loadable
    here (a local directory, a Hub name in the cache, or a Hub that answers one bounded probe) and that
    ``device`` is here."""
    for name, low in _INT_MINIMUMS.items():
        v = values.get(name, low)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {v!r}")
    for name in _NON_NEGATIVE:
        v = values.get(name, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ConfigError(f"{name} must be a number >= 0, got {v!r}")
    _check_ranges(values)
    _check_sources(values, on_this_machine=on_this_machine)
    from diloco.trainers.hf_data import check_data

    check_data(values, on_this_machine=on_this_machine)
    eval_every = values.get("eval_every")
    if eval_every is not None and (isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1):
        raise ConfigError(f"eval_every must be an integer >= 1 (rounds between evaluations) or null, got "
                          f"{eval_every!r}")
    if values.get("data_log") is not None and not isinstance(values["data_log"], str):
        raise ConfigError(f"data_log must be a directory path, got {values['data_log']!r}")
    total, every = values.get("total_steps", 200), values.get("sync_every", 50)
    if total % every:
        lower, upper = max(every, total - total % every), total - total % every + every
        raise ConfigError(f"total_steps ({total}) must be a multiple of sync_every ({every}) so training ends on an "
                          f"outer sync and every rank saves the same global model",
                          hint=f"use total_steps={lower} or {upper}")
    precision, device = values.get("precision", "auto"), values.get("device", "auto")
    if precision not in _PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(_PRECISIONS)}, got {precision!r}")
    from diloco.trainers.hf_fsdp import check_fsdp

    check_fsdp(values.get("fsdp", "auto"), values.get("activation_checkpointing", False), precision)
    if not isinstance(device, str) or not device:
        raise ConfigError(f"device must be a torch device string (auto, cpu, cuda, cuda:N), got {device!r}")
    if on_this_machine and device not in ("auto", "cpu"):
        _resolve_device(device)


def _check_ranges(values: Mapping[str, Any]) -> None:
    checks: list[tuple[str, Callable[[float], bool], str]] = [
        ("eval_fraction", lambda v: 0 < v < 1, "in (0, 1)"), ("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("outer_lr", lambda v: v > 0, "> 0"), ("outer_momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
    ]
    for name, ok, what in checks:
        v = values.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(float(v)):
            raise ConfigError(f"{name} must be a number {what}, got {v!r}")
    if not isinstance(values.get("nesterov", True), bool):
        raise ConfigError(f"nesterov must be true or false, got {values['nesterov']!r}")


def _check_sources(values: Mapping[str, Any], *, on_this_machine: bool) -> None:
    model, config, tokenizer, data = (values.get(k) for k in ("model", "model_config", "tokenizer", "data"))
    if (model is None) == (config is None):
        raise ConfigError("model: give exactly one of model (a hub name or save_pretrained directory) and "
                          "model_config (a dict with model_type, for a fresh model)",
                          hint="e.g. -k model=Qwen/Qwen2.5-0.5B, or -k 'model_config={model_type: llama, ...}'")
    if config is not None and (not isinstance(config, Mapping) or not isinstance(config.get("model_type"), str)):
        raise ConfigError(f"model_config must be a mapping with a model_type (e.g. llama), got {config!r}")
    if config is not None and tokenizer is None:
        raise ConfigError("tokenizer: required with model_config (a fresh model has no tokenizer of its own)",
                          hint="pass -k tokenizer=<hub name or directory>")
    if not isinstance(data, str) or not data:
        raise ConfigError("data: required: a local file or directory, or an s3:// prefix, holding .txt, .jsonl or "
                          ".parquet files or pre-tokenized .bin/.npy shards, or hf:NAME[:CONFIG][@SPLIT]",
                          hint="pass -k data=s3://bucket/corpus/, -k data=./corpus or -k data=hf:./saved_dataset")
    if not isinstance(values.get("text_field", "text"), str):
        raise ConfigError(f"text_field must be a string, got {values['text_field']!r}")
    if on_this_machine and "://" not in data and not data.startswith("hf:") and not os.path.exists(data):
        raise ConfigError(f"data: {data} does not exist on this machine", hint="pass an existing path")
    if on_this_machine:  # the replicas run here: a Hub they cannot reach fails now, in seconds, not in each of them
        check_hub_sources(model=model, tokenizer=tokenizer)


def _resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"device {device!r} is not a torch device: {exc}", hint="use auto, cpu, cuda or cuda:N") \
            from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for but this machine has no usable CUDA device",
                          hint="use device auto or cpu, or run on a GPU instance")
    return dev


def _resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype (``None``: plain fp32). ``auto`` is bf16 on a CUDA device that supports it, else fp32."""
    import torch

    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"precision fp16 needs a CUDA device, this replica runs on {device}",
                          hint="use precision bf16 or fp32 on CPU")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]


def precision_name(amp_dtype: torch.dtype | None) -> str:
    return "fp32" if amp_dtype is None else f"{str(amp_dtype).removeprefix('torch.')} autocast"


#: The knobs ``check_config`` validates: every parameter except the injected ones.
_KNOBS = frozenset(inspect.signature(train).parameters) - {"manager", "rank", "world_size"}
