"""State dicts as the coordinator handles them: fp32 CPU copies, pseudo-gradients, installation into a model,
and safetensors files (``diloco.store.codec``, never pickle)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger("diloco.async")


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the whole state dict, floats in fp32 (the baseline's precision)."""
    import torch

    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        out[name] = t.to(torch.float32).clone() if t.is_floating_point() else t.clone()
    return out


def compute_pseudo_gradient(baseline: Mapping[str, torch.Tensor],
                            current: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``baseline - current`` for every floating-point entry (positive where training moved weights down).

    Raises ``ValueError`` naming the first key or shape that differs: such a delta must not be uploaded."""
    if set(baseline) != set(current):
        missing, extra = sorted(set(baseline) - set(current)), sorted(set(current) - set(baseline))
        raise ValueError(f"model keys changed since the baseline (missing {missing[:3]}, new {extra[:3]})")
    delta = {}
    for name, b in baseline.items():
        c = current[name]
        if b.shape != c.shape:
            raise ValueError(f"{name!r} has shape {tuple(c.shape)}, the baseline {tuple(b.shape)}")
        if b.is_floating_point():
            delta[name] = b - c
    return delta


def delta_norm(delta: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm over all tensors of a delta (what the resume test compares)."""
    return float(sum(float(t.double().pow(2).sum()) for t in delta.values()) ** 0.5)


def install_state(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> int:
    """Load the entries whose key and shape match the model (``strict=False``); returns how many were loaded."""
    local = model.state_dict()
    filtered = {k: v.to(local[k].dtype) for k, v in tensors.items() if k in local and local[k].shape == v.shape}
    skipped = len(tensors) - len(filtered)
    if skipped:
        log.warning("global state: %d entr%s skipped (unknown key or other shape)", skipped,
                    "y" if skipped == 1 else "ies")
    model.load_state_dict(filtered, strict=False)
    return len(filtered)


def tensors_with_prefix(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under ``prefix``, with it removed (the inverse of naming them ``prefix + name``)."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def save_tensor_file(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
    """Safetensors with checksum (``diloco.store.codec``), written atomically."""
    from diloco.store.codec import encode_tensors
    from diloco.store.objects import write_file_atomic

    write_file_atomic(str(path), encode_tensors(tensors, {k: str(v) for k, v in metadata.items()}))


def load_tensor_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``save_tensor_file``'s inverse; ``CorruptObjectError`` when the file is damaged."""
    from diloco.store.codec import decode_tensors

    return decode_tensors(path.read_bytes(), source=str(path))
