"""The arithmetic every collective shares (no I/O): fp32 accumulation in rank order, and the caller's tensors.

Why it is one module: bitwise-identical results across ranks, and across the gather and sharded strategies, come
from performing the same floating-point operations in the same order; keeping them in one place keeps them equal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: What callers may pass: named tensors, or a list (named ``t0``..``tN`` on the wire).
Tensors = Mapping[str, "torch.Tensor"] | Sequence["torch.Tensor"]
#: ``empty(shape, dtype)``: a new contiguous CPU tensor, contents undefined (``torch.empty``, or a round's spares).
Allocator = Callable[[tuple[int, ...], "torch.dtype"], "torch.Tensor"]


def number(round_index: int) -> int:
    """The round's number in every message: rounds are numbered from 1 for people (round 1 is the first outer
    sync, as in the metrics and the CLI's table); ``round_index`` counts from 0 on the wire and in the keys."""
    return round_index + 1


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every floating type up to 32 bits (bf16/fp16 sums lose integers past 256/2048); fp64 stays."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def average(contributions: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of ``contributions``, summed in the order given, on the CPU, in fp32 (or fp64).

    The all-reduce calls this with contributions in rank order, so every rank performs the same floating-point
    operations in the same order and gets bitwise-identical results. Inputs are not modified.
    """
    if not contributions:
        raise ValueError("average() needs at least one contribution")
    acc: dict[str, torch.Tensor] = {}
    for contribution in contributions:
        accumulate(acc, contribution)
    return finish_mean(acc, len(contributions))


def accumulate(acc: dict[str, torch.Tensor], contribution: Mapping[str, torch.Tensor], *,
               owned: bool = False, empty: Allocator | None = None) -> None:
    """``acc += contribution`` in the accumulation dtype; the first contribution is copied in (``owned``: it is
    the caller's private copy, so a tensor already in the accumulation dtype becomes the sum itself), into a
    tensor ``empty(shape, dtype)`` makes when given."""
    for name, t in contribution.items():
        t = t.detach().to("cpu")
        if name not in acc:
            dtype = accumulation_dtype(t.dtype)
            if owned and t.dtype == dtype and t.is_contiguous():
                acc[name] = t
            elif empty is not None:
                acc[name] = empty(tuple(t.shape), dtype).copy_(t)
            else:
                acc[name] = t.to(dtype, copy=True)
        else:
            acc[name].add_(t.to(acc[name].dtype))


def finish_mean(acc: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Divide the sums by ``n`` in place (the last operation of every strategy's mean)."""
    for t in acc.values():
        t.div_(n)
    return acc


def as_named(tensors: Tensors) -> dict[str, torch.Tensor]:
    """Named view of the caller's tensors: a mapping as is, a sequence as ``t0``..``tN``."""
    import torch

    if isinstance(tensors, torch.Tensor):
        raise TypeError("pass a dict or a list of tensors, not a single tensor (wrap it: [t])")
    named = dict(tensors) if isinstance(tensors, Mapping) else {f"t{i}": t for i, t in enumerate(tensors)}
    if not named:
        raise ValueError("all-reduce needs at least one tensor")
    for name, t in named.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, expected a torch.Tensor")
        if not t.is_floating_point():
            raise TypeError(f"{name!r} has dtype {t.dtype}; only floating-point tensors can be averaged")
    return named


def layout_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype): what every peer's contribution must match, and what ``compression.decode`` takes."""
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
