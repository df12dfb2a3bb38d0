"""The rows of a parameter this process holds: FSDP2's ``DTensor`` shards, or a plain parameter held whole.

Why: with FSDP2 (``torch.distributed.fsdp.fully_shard``) a parameter is a ``DTensor`` sharded on dim 0 over the
replica's local processes; its local tensor (``to_local()``) is this process's rows, in place (the inner optimizer
updates that very memory). The outer loop keeps its fp32 global copy and outer momentum of those rows only, and
writes the new global rows back into that memory, so a sharded replica never materialises the whole model in one
process. ``ShardSpec`` (``diloco.collectives.part_layout``) says which rows they are; every exchange, commit and
rejoin of a sharded replica is by those rows.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from diloco.collectives.part_layout import ShardSpec, spec_of_part

if TYPE_CHECKING:
    import torch


def is_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ``DTensor`` (FSDP2's sharded parameter).

    Asked without importing ``torch.distributed.tensor`` (0.4-0.6 s on a replica's start, most of what a small
    replica does besides ``import torch``): a ``DTensor`` exists only once that package is loaded, so while it is
    not, nothing is sharded. It is also absent from a torch built without distributed."""
    dtensors = sys.modules.get("torch.distributed.tensor")
    return dtensors is not None and isinstance(param, dtensors.DTensor)


def local_rows(param: torch.Tensor) -> torch.Tensor:
    """The rows this process holds, as a plain tensor sharing ``param``'s memory (writes go into the parameter)."""
    import torch

    if not is_sharded(param):
        return param
    with torch.no_grad():
        return param.to_local()  # type: ignore[attr-defined, no-any-return]


def shard_spec(name: str, param: torch.Tensor) -> ShardSpec:
    """Which rows of ``param`` this process holds. ``ValueError`` naming it when it is sharded other than FSDP2's
    default (one ``Shard(0)`` over a one-dimensional mesh): rows are the unit every sharded exchange uses."""
    if not is_sharded(param):
        return ShardSpec.whole(param.shape)
    from torch.distributed.tensor import Shard

    mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ValueError(f"parameter {name!r} is placed as {placements} over a {mesh.ndim}-d mesh; the outer loop "
                         f"exchanges FSDP2's default placement only (Shard(0) over the replica's local processes)")
    spec = spec_of_part(tuple(param.shape), mesh.size(), mesh.get_local_rank())
    held = local_rows(param)
    if held.numel() != spec.rows * spec.row_size:
        raise ValueError(f"parameter {name!r}: this process holds {tuple(held.shape)} of {tuple(param.shape)}, "
                         f"not rows [{spec.row_start}, {spec.row_end}) as Shard(0) over {mesh.size()} would")
    return spec


def local_position(params: dict[str, torch.Tensor]) -> tuple[int, int] | None:
    """(this process's index, the number of processes) the sharded parameters are spread over, or ``None`` when
    none is sharded."""
    for param in params.values():
        if is_sharded(param):
            mesh = param.device_mesh  # type: ignore[attr-defined]
            return mesh.get_local_rank(), mesh.size()
    return None


def local_optimizer_state(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` with every sharded tensor (a ``DTensor`` moment of a sharded parameter) as
    this process's rows (plain tensors: what safetensors stores)."""
    state = {param: {name: (local_rows(value) if is_sharded(value) else value) for name, value in entries.items()}
             for param, entries in (state_dict.get("state") or {}).items()}
    return {**state_dict, "state": state}


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``local_optimizer_state`` undone for ``optimizer``: a tensor saved for a sharded parameter, shaped as this
    process's rows of it, becomes a ``DTensor`` placed as the parameter is (on its device); the rest is kept."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[Any, dict[str, Any]] = {}
    for index, entries in (state_dict.get("state") or {}).items():
        param = params[int(index)] if 0 <= int(index) < len(params) else None
        out = {}
        for name, value in entries.items():
            if param is not None and is_sharded(param) and getattr(value, "shape", None) == local_rows(param).shape \
                    and value.dim() > 0:
                value = DTensor.from_local(value.to(local_rows(param).device), param.device_mesh,  # type: ignore[attr-defined]
                                           param.placements, run_check=False, shape=param.shape,  # type: ignore[attr-defined]
                                           stride=param.stride())
            out[name] = value
        state[index] = out
    return {**state_dict, "state": state}
