"""Named tensors to bytes and back, with safetensors (never pickle) and a content checksum.

Every object that crosses the store carries string metadata: a format tag, the writer's identity (round, rank,
whatever the caller adds) and a SHA-256 over the tensors' names, dtypes, shapes and raw bytes. ``decode_tensors``
recomputes it, so a truncated or corrupted object raises ``CorruptObjectError`` instead of being averaged.

Two readers, on purpose:

* ``decode_tensors`` is strict: the object must be ours (format tag and checksum). All-reduce contributions are
  read with it, because an unverifiable contribution must never be averaged.
* ``decode`` also accepts plain safetensors (``safetensors.torch.save_file``, ``save_pretrained``: no checksum,
  perhaps ``format: pt``), which is what a trainer that exports its own final weights writes. Our checksum is
  still verified whenever it is present, so a corrupted object of ours is a ``CorruptObjectError`` either way.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from diloco.errors import CorruptObjectError

if TYPE_CHECKING:
    import torch

FORMAT = "diloco.tensors/1"
_CHECKSUM_KEY = "sha256"
_FORMAT_KEY = "format"


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors in name order: name, dtype, shape, then raw bytes (CPU, contiguous)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        header = json.dumps([name, str(t.dtype), list(t.shape)]).encode()
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        if t.numel():
            t = t.to("cpu").contiguous()
            # Hash the tensor's memory in place (no numpy, no copy): it stays alive for the update.
            raw = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
            h.update(memoryview(raw))
    return h.hexdigest()


def encode_tensors(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str | int] | None = None) -> bytes:
    """Serialize CPU copies of ``tensors`` with ``metadata`` (values stringified) and a checksum."""
    from safetensors.torch import save

    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    meta[_FORMAT_KEY] = FORMAT
    meta[_CHECKSUM_KEY] = tensor_digest(cpu)
    return save(cpu, metadata=meta)


def decode_tensors(
    data: bytes, *, expect: Mapping[str, str | int] | None = None, source: str = "object"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse ``data``; verify format, checksum and every ``expect``-ed metadata value.

    Raises ``CorruptObjectError`` naming ``source`` when the bytes are truncated, corrupted or not the object
    the caller expected (a stale round, the wrong rank).
    """
    from safetensors.torch import load

    try:
        tensors = load(data)
        meta = _read_metadata(data)
    except Exception as exc:  # safetensors raises its own error types for malformed bytes
        raise CorruptObjectError(f"{source} is not a readable safetensors object ({len(data)} bytes): {exc}") from exc
    if meta.get(_FORMAT_KEY) != FORMAT:
        raise CorruptObjectError(f"{source} has format {meta.get(_FORMAT_KEY)!r}, expected {FORMAT!r}")
    digest = tensor_digest(tensors)
    if meta.get(_CHECKSUM_KEY) != digest:
        raise CorruptObjectError(f"{source} failed its checksum (stored {meta.get(_CHECKSUM_KEY)}, computed {digest})")
    for key, want in (expect or {}).items():
        if meta.get(key) != str(want):
            raise CorruptObjectError(f"{source} has {key}={meta.get(key)!r}, expected {str(want)!r}")
    return tensors, meta


def decode(
    data: bytes, *, expect: Mapping[str, str | int] | None = None, source: str = "object"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse ``data`` written by ``encode_tensors`` *or* by plain safetensors; verify what can be verified.

    Our checksum is checked when the metadata carries one (a mismatch is a ``CorruptObjectError``), and so is
    every ``expect``-ed metadata value. Plain safetensors (no checksum) are accepted as they are: safetensors
    itself rejects truncated or malformed bytes, so only a bit flip inside tensor data would go unnoticed.
    """
    from safetensors.torch import load

    try:
        tensors = load(data)
        meta = _read_metadata(data)
    except Exception as exc:  # safetensors raises its own error types for malformed bytes
        raise CorruptObjectError(f"{source} is not a readable safetensors object ({len(data)} bytes): {exc}") from exc
    if _CHECKSUM_KEY in meta or meta.get(_FORMAT_KEY) == FORMAT:  # ours: the checksum must be there and match
        digest = tensor_digest(tensors)
        if meta.get(_CHECKSUM_KEY) != digest:
            raise CorruptObjectError(
                f"{source} failed its checksum (stored {meta.get(_CHECKSUM_KEY)}, computed {digest})")
    for key, want in (expect or {}).items():
        if meta.get(key) != str(want):
            raise CorruptObjectError(f"{source} has {key}={meta.get(key)!r}, expected {str(want)!r}")
    return tensors, meta


def has_checksum(metadata: Mapping[str, str]) -> bool:
    """Whether an object's metadata carries our checksum (so ``decode`` verified its tensors bit for bit)."""
    return _CHECKSUM_KEY in metadata


def _read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` block of a safetensors buffer (8-byte little-endian header length, then JSON)."""
    if len(data) < 8:
        raise ValueError("shorter than the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise ValueError(f"header of {n} bytes runs past the end")
    header = json.loads(data[8 : 8 + n])
    return dict(header.get("__metadata__") or {})
