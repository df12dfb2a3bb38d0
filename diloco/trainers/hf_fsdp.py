"""FSDP2 for the Hugging Face trainer: a model too big for one GPU, sharded over the replica's local processes.

Why these choices:

* **Whether** (``fsdp``): ``true`` shards, ``false`` keeps the model whole on every process (DDP), ``auto`` (the
  default) shards when the model cannot train on one device: its weights, gradients and AdamW moments, 16 bytes
  per parameter before activations, above ``FIT_FRACTION`` of one GPU's memory. The decision and its numbers are
  logged. A replica of one process has nothing to shard over: ``true`` then keeps the model whole but exchanges
  it by rows, so it meets sharded replicas (every replica of a run must exchange the same way: with replicas of
  different GPUs, say ``fsdp=true`` rather than letting each decide).
* **How**: ``torch.distributed.fsdp.fully_shard`` on every decoder layer (the model's ``_no_split_modules``
  classes), then on the root, over the replica's local process group (a one-dimensional mesh), each parameter a
  ``DTensor`` sharded on dim 0. Mixed precision is FSDP2's own (``MixedPrecisionPolicy``: bf16 compute and
  all-gathers, fp32 gradient reduction, fp32 sharded master weights), not autocast. Activation checkpointing
  (``activation_checkpointing=true``) is the model's own non-reentrant ``gradient_checkpointing_enable``.
* **Building without the whole model in every process**: local rank 0 builds the real model on the CPU (from the
  hub, a directory, or seeded from a config, as without FSDP); the others build it on the ``meta`` device (no
  memory); after sharding, ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends each tensor's rows to
  its owner, and the buffers (rotary frequencies) are broadcast. Only local rank 0 ever holds the whole model,
  once, while loading.
* **Saving**: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` gathers the whole weights on local
  rank 0, one tensor at a time, into the CPU; ``save_pretrained`` writes them, so the directory loads with
  ``from_pretrained`` as a plain model.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from diloco.replica.local_group import LocalGroup

log = logging.getLogger("diloco.trainers.hf")

#: Device bytes per parameter to train with AdamW in fp32 master weights: weights, gradients, two moments.
TRAIN_BYTES_PER_PARAM = 16
#: The share of a device's memory the model's training state may take before ``auto`` shards it (the rest is
#: activations, the CUDA context and the allocator's slack).
FIT_FRACTION = 0.6
GIB = 2**30


def check_fsdp(fsdp: object, activation_checkpointing: object, precision: object) -> None:
    """``ConfigError`` naming the knob when ``fsdp`` or ``activation_checkpointing`` is not a valid value."""
    if fsdp not in (True, False, "auto"):
        raise ConfigError(f"fsdp must be true, false or auto, got {fsdp!r}")
    if not isinstance(activation_checkpointing, bool):
        raise ConfigError(f"activation_checkpointing must be true or false, got {activation_checkpointing!r}")
    if fsdp is True and precision == "fp16":
        raise ConfigError("precision fp16 with fsdp: FSDP2's mixed precision here is bf16 (fp16 would need a "
                          "sharded loss scaler)", hint="use precision bf16 (or auto) with fsdp")


def choose_fsdp(fsdp: bool | str, *, params: int, local_size: int, device: torch.device,
                device_bytes: int | None = None) -> tuple[bool, str]:
    """Whether to shard the model, and why (one line for the log). ``device_bytes``: the device's memory (read
    from CUDA when not given)."""
    if fsdp is True:
        return True, "fsdp=true"
    if fsdp is False:
        return False, "fsdp=false"
    need = TRAIN_BYTES_PER_PARAM * params
    sizes = f"{params / 1e9:.2f} B parameters need about {need / GIB:.1f} GiB for weights, gradients and AdamW"
    if device.type != "cuda":
        return False, f"fsdp=auto: no GPU ({device}), the model is kept whole on every process"
    if device_bytes is None:
        import torch

        device_bytes = int(torch.cuda.get_device_properties(device).total_memory)
    if need <= FIT_FRACTION * device_bytes:
        return False, f"fsdp=auto: {sizes}, which fits one {device_bytes / GIB:.0f} GiB GPU: kept whole"
    if local_size < 2:
        return False, (f"fsdp=auto: {sizes}, more than one {device_bytes / GIB:.0f} GiB GPU holds, but this replica "
                       f"has one process: kept whole (use --procs-per-replica and more GPUs)")
    return True, f"fsdp=auto: {sizes}, more than one {device_bytes / GIB:.0f} GiB GPU holds: sharded over " \
                 f"{local_size} processes"


def decoder_layers(net: Any) -> list[Any]:
    """The model's repeated blocks (``_no_split_modules``: ``LlamaDecoderLayer``, ...), each sharded on its own so
    only one block's weights are gathered at a time."""
    kinds = set(getattr(net, "_no_split_modules", None) or ())
    return [m for m in net.modules() if type(m).__name__ in kinds]


def shard_model(build: Callable[[], Any], build_meta: Callable[[], Any], group: LocalGroup,
                amp_dtype: torch.dtype | None, *, activation_checkpointing: bool) -> Any:
    """The model sharded over ``group`` on each process's device (see the module docstring): ``build()`` makes the
    real model (called on local rank 0 only), ``build_meta()`` the same on the meta device."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    net = build() if group.is_leader else build_meta()
    full = net.state_dict() if group.is_leader else {}
    if activation_checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(group.device.type, (group.size,))
    policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32) if amp_dtype is not None \
        else MixedPrecisionPolicy()
    layers = decoder_layers(net)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    if group.is_leader:
        net.to(group.device)
    else:
        net.to_empty(device=group.device)
    set_model_state_dict(net, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    with torch.no_grad():
        for _, buffer in sorted(net.named_buffers()):
            dist.broadcast(buffer, src=0)
    log.info("FSDP2 over %d local processes: %d decoder layers sharded on their own, %s compute%s", group.size,
             len(layers), "fp32" if amp_dtype is None else str(amp_dtype).removeprefix("torch."),
             ", activation checkpointing" if activation_checkpointing else "")
    return net


def full_weights(net: Any) -> dict[str, torch.Tensor] | None:
    """The whole state dict on local rank 0 (CPU), ``{}`` elsewhere: every process must call it (it gathers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
