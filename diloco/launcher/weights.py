"""Final weights on the launcher side: how ``collect`` checks that every replica agrees, and the model file.

Every replica ends a DiLoCo run holding the same *global* weights (the outer step is computed from identical
inputs in the same order on every rank), so the check is **bitwise**: two replicas agree when every tensor has the
same name, dtype, shape and raw bytes. Comparing bytes, not values, is what makes a diverged run honest: NaN is not
equal to NaN as a number, but two replicas holding the same NaN payloads *do* agree, and saying "DIFFERENT" there
would send the user hunting for a synchronisation bug that does not exist. A max abs difference is reported only
when it is a finite number, so no report ever carries NaN or Infinity (which JSON cannot represent).

Objects read here may be ours (``diloco.store.codec.encode_tensors``: checksum verified) or plain safetensors written
by a trainer itself (``safetensors.torch.save_file``, ``save_pretrained``): both are accepted.

A replica exports its final weights with ``diloco.replica.final_weights``; torch is imported inside the
functions: the CLI imports this module.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diloco.errors import CorruptObjectError, ObjectNotFound
from diloco.store.layout import FINAL_KEY

if TYPE_CHECKING:
    import torch

    from diloco.store.objects import ObjectStore

#: The record both sides share (keys ``FINAL_KEY``) is written by ``diloco.replica.final_weights``.
@dataclass
class WeightsCheck:
    """The verdict on every replica's ``final/rank_RRRR.safetensors``.

    ``identical`` is ``True`` (all bitwise equal), ``False`` (a difference, or an unreadable object) or ``None``
    (not checkable: some replica wrote no final weights). ``detail`` is the one line the CLI prints.
    """

    identical: bool | None
    detail: str
    world_size: int
    tensor_count: int = 0
    value_count: int = 0
    missing_ranks: list[int] = field(default_factory=list)
    differing_rank: int | None = None  # the first rank that differs from rank 0
    differing_tensor: str | None = None  # the first tensor (in name order) that differs
    max_abs_diff: float | None = None  # only when finite; None for NaN/inf differences or layout mismatches
    tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)  # rank 0's, when identical
    metadata: dict[str, str] = field(default_factory=dict)  # rank 0's, when identical
    #: A compacted store's verdict (``diloco.launcher.compaction.compacted_verdict``): the one copy kept and the SHA-256
    #: of its bytes when checked, so the model can be written from those bytes without decoding them.
    kept_key: str | None = None
    kept_sha256: str | None = None


# ---------------------------------------------------------------------------------------------- check
def check_final_weights(store: ObjectStore, world_size: int, ranks: Sequence[int] | None = None) -> WeightsCheck:
    """Compare every rank's final weights with the first one's, bit for bit (see the module docstring).

    ``ranks`` limits the check to those ranks (a ``min_replicas`` run that finished without some replicas: they
    hold no final weights). Holds at most two ranks' tensors in memory at a time. A missing object gives
    ``identical=None``; an unreadable one (corrupt, checksum mismatch) gives ``identical=False`` naming it.
    A compacted store holds one copy: its recorded verdict is ``diloco.launcher.compaction.compacted_verdict``'s.
    """
    from diloco.store.codec import decode

    checked = list(range(world_size)) if ranks is None else sorted(ranks)
    if not checked:
        return WeightsCheck(identical=None, world_size=world_size, detail="no replica finished, so no final weights")
    first_rank = checked[0]
    reference: dict[str, torch.Tensor] | None = None
    ref_meta: dict[str, str] = {}
    missing = [r for r in checked if not store.exists(FINAL_KEY.format(rank=r))]
    if missing:
        first = FINAL_KEY.format(rank=missing[0])
        who = "replica" if len(missing) == 1 else "replicas"
        return WeightsCheck(identical=None, world_size=world_size, missing_ranks=missing,
                            detail=f"{who} {', '.join(map(str, missing))} wrote no final weights "
                                   f"({store.url(first)} is missing)")
    who = (f"{world_size} replica(s)" if len(checked) == world_size
           else f"the {len(checked)} replicas that finished ({', '.join(map(str, checked))} of {world_size})")
    same = byte_identical_verdict(store, checked, world_size, who)
    if same is not None:
        return same
    for rank in checked:
        key = FINAL_KEY.format(rank=rank)
        try:
            tensors, meta = decode(store.get(key), source=store.url(key))
        except ObjectNotFound:  # deleted between the listing and the read
            return WeightsCheck(identical=None, world_size=world_size, missing_ranks=[rank],
                                detail=f"replica {rank} wrote no final weights ({store.url(key)} is missing)")
        except CorruptObjectError as exc:
            return WeightsCheck(identical=False, world_size=world_size, differing_rank=rank, detail=str(exc))
        if reference is None:
            reference, ref_meta = tensors, meta
            continue
        difference = first_difference(reference, tensors)
        if difference is not None:
            return WeightsCheck(identical=False, world_size=world_size, differing_rank=rank,
                                differing_tensor=difference.tensor, max_abs_diff=difference.max_abs_diff,
                                detail=f"replica {rank}'s final weights differ from replica {first_rank}'s "
                                       f"{difference.detail}")
    assert reference is not None  # at least one rank checked
    n = sum(t.numel() for t in reference.values())
    return WeightsCheck(identical=True, world_size=world_size, tensor_count=len(reference), value_count=n,
                        tensors=reference, metadata=ref_meta,
                        detail=f"{who} hold identical final weights ({len(reference)} tensors, {n} values)")


def byte_identical_verdict(store: ObjectStore, ranks: Sequence[int], world_size: int,
                           who: str) -> WeightsCheck | None:
    """The "identical" verdict without torch, or ``None`` to leave the verdict to the decoding check.

    Why: the launcher checks the weights at the end of every waited launch and every ``collect``, and decoding
    them means importing torch (seconds of a snappy CLI's time) only to find, as in every healthy run, the same
    bytes everywhere. Here each copy's tensor table (names, dtypes, shapes, offsets) and data section are hashed
    as bytes; when every copy hashes alike and the first is intact, the copies are bitwise identical. Intact: ours
    with a checksum that holds over those bytes (``diloco.store.codec.tensor_digest``'s definition, computed from
    the raw table), or a plain safetensors file (a trainer's own ``save_file``, ``save_pretrained``) whose table is
    well formed (``well_formed_table``: what safetensors itself checks when it loads one). Anything else (a
    difference, a streamed object, an unknown dtype, a malformed table, an unreadable object) returns ``None``:
    the decoding check then says exactly what and where. The verdict names the first copy (``kept_key``) and its
    hash, from which ``write_agreed_model`` writes the model (decoding a plain copy then, as it must to add the
    checksum).
    """
    import hashlib

    from diloco.store.codec import FORMAT

    reference: tuple[str, str, str, dict[str, str], dict[str, Any]] | None = None
    for rank in ranks:
        key = FINAL_KEY.format(rank=rank)
        try:
            data = store.get(key)
            header = _header(data, source=store.url(key))
        except (ObjectNotFound, CorruptObjectError):
            return None
        meta = header.pop("__metadata__", None) or {}
        n = int.from_bytes(data[:8], "little")
        section = memoryview(data)[8 + n:]
        digest = hashlib.sha256(json_bytes(header))
        digest.update(section)
        if reference is None:
            meta = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
            if meta.get("format") == FORMAT:
                if raw_tensor_digest(header, section) != meta.get("sha256"):
                    return None
            elif not well_formed_table(header, len(section)):
                return None
            reference = (digest.hexdigest(), key, hashlib.sha256(data).hexdigest(), meta, header)
        elif digest.hexdigest() != reference[0]:
            return None
    if reference is None:
        return None
    _, kept_key, kept_sha256, meta, table = reference
    values = sum(math.prod(entry["shape"]) for entry in table.values())
    return WeightsCheck(identical=True, world_size=world_size, tensor_count=len(table), value_count=values,
                        metadata=meta, kept_key=kept_key, kept_sha256=kept_sha256,
                        detail=f"{who} hold identical final weights ({len(table)} tensors, {values} values)")


def raw_tensor_digest(table: Mapping[str, Any], section: memoryview) -> str | None:
    """``diloco.store.codec.tensor_digest`` computed from a safetensors tensor table and its data section, without
    torch: name, torch's dtype name, shape, then the raw bytes, in name order. ``None`` for a table this cannot
    read (an unknown dtype, offsets outside the section)."""
    import hashlib
    import json

    from diloco.store.codec import torch_dtype_name

    h = hashlib.sha256()
    try:
        for name in sorted(table):
            entry = table[name]
            dtype = torch_dtype_name(entry["dtype"])
            begin, end = entry["data_offsets"]
            if dtype is None or not 0 <= begin <= end <= len(section):
                return None
            header = json.dumps([name, dtype, list(entry["shape"])]).encode()
            h.update(len(header).to_bytes(8, "little"))
            h.update(header)
            if math.prod(entry["shape"]):
                h.update(section[begin:end])
    except (KeyError, TypeError, ValueError):
        return None
    return h.hexdigest()


#: Bytes per element of each safetensors dtype code that torch shares (``diloco.store.codec.torch_dtype_name``).
_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def well_formed_table(table: Mapping[str, Any], section_bytes: int) -> bool:
    """Whether a safetensors tensor table (``__metadata__`` removed) describes its data section exactly, as the
    safetensors library validates a file it loads: every dtype known, every shape a list of non-negative integers,
    each tensor's byte range as long as its shape and dtype say, and the ranges, in order, covering the section
    from its first byte to its last with no gap and no overlap."""
    spans: list[tuple[int, int]] = []
    try:
        for entry in table.values():
            size = _ITEM_BYTES.get(entry["dtype"])
            shape = entry["shape"]
            begin, end = entry["data_offsets"]
            if size is None or not all(isinstance(d, int) and d >= 0 for d in shape):
                return False
            if not (isinstance(begin, int) and isinstance(end, int)) or end - begin != math.prod(shape) * size:
                return False
            spans.append((begin, end))
    except (KeyError, TypeError, ValueError):
        return False
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            return False
        position = end
    return position == section_bytes


def json_bytes(value: Any) -> bytes:
    """A canonical JSON encoding (sorted keys, no spaces): two equal tables give equal bytes."""
    import json

    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Difference:
    """Where two sets of weights first differ; ``detail`` completes "... differ from replica 0's"."""

    detail: str
    tensor: str | None = None
    max_abs_diff: float | None = None


def first_difference(reference: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor]) -> Difference | None:
    """``None`` when ``other`` is bitwise identical to ``reference``, else the first difference in name order."""
    if set(other) != set(reference):
        extra, lacking = sorted(set(other) - set(reference)), sorted(set(reference) - set(other))
        return Difference(f"in their tensor names (extra {extra[:3]}, missing {lacking[:3]})")
    for name in sorted(reference):
        a, b = reference[name], other[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            return Difference(f"in {name!r}: {b.dtype} {tuple(b.shape)} instead of {a.dtype} {tuple(a.shape)}",
                              tensor=name)
        if not same_bytes(a, b):
            gap = max_abs_difference(a, b)
            size = "max abs difference " + (f"{gap:.3g}" if gap is not None else "not finite (NaN or inf values)")
            return Difference(f"in {name!r} ({size})", tensor=name, max_abs_diff=gap)
    return None


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Raw-byte equality of two tensors of one dtype and shape: NaN payloads compare like any other bits."""
    import torch

    flat_a, flat_b = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))


def max_abs_difference(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The largest ``|a - b|`` in float64, or ``None`` when it is not a finite number (NaN or inf involved)."""
    import torch

    if a.numel() == 0:
        return None
    gap = (a.detach().cpu().to(torch.float64) - b.detach().cpu().to(torch.float64)).abs().max().item()
    return gap if math.isfinite(gap) else None


def agreed_tensors(store: ObjectStore, check: WeightsCheck) -> dict[str, torch.Tensor]:
    """The agreed weights of an ``identical`` check as tensors: those it holds, else its kept copy decoded (its
    checksum verified again), for callers that need the values themselves (an export, an evaluation)."""
    from diloco.store.codec import decode

    if check.tensors is not None:
        return dict(check.tensors)
    if check.identical is not True or check.kept_key is None:
        raise CorruptObjectError(f"no agreed weights to read: {check.detail}")
    tensors, _ = decode(store.get(check.kept_key), source=store.url(check.kept_key))
    return tensors


# ---------------------------------------------------------------------------------------------- model file
def write_model(path: str, tensors: Any, meta: Mapping[str, str], run_id: str) -> str:
    """Write the agreed weights as one safetensors file (atomic, our checksum); returns its absolute path.

    The writer's ``rank`` is dropped (the file is the run's model, not one replica's); ``format`` and the checksum
    are set afresh, so a plain-safetensors input gets them too."""
    from diloco.launcher.output_path import make_parent
    from diloco.store.codec import encode_tensors
    from diloco.store.objects import write_file_atomic

    keep = {k: v for k, v in meta.items() if k not in ("rank", "format", "sha256")}
    path = os.path.abspath(path)
    make_parent(path)  # ``--output`` may name directories that do not exist yet (diloco.launcher.output_path)
    write_file_atomic(path, encode_tensors(tensors, {**keep, "run_id": run_id}))
    return path


def write_agreed_model(store: ObjectStore, check: WeightsCheck, path: str, run_id: str) -> str:
    """Write the model of an ``identical`` check to ``path``; returns its absolute path.

    With the check's tensors in hand, ``write_model``. A compacted store's reused verdict has none: the kept copy
    is read, its bytes must still hash to what was checked, and when it is ours (``diloco.store.codec`` checksum in its
    metadata) the model file is those bytes with the model's metadata in the header (``with_model_metadata``), no
    torch needed; a plain safetensors copy (written by a trainer itself) is decoded and written as usual."""
    import hashlib

    from diloco.launcher.output_path import make_parent
    from diloco.store.codec import FORMAT, decode
    from diloco.store.objects import write_file_atomic

    if check.tensors is not None:
        return write_model(path, check.tensors, check.metadata, run_id)
    if check.kept_key is None or check.kept_sha256 is None:
        raise CorruptObjectError("no agreed weights to write: the check kept neither tensors nor a copy")
    url = store.url(check.kept_key)
    data = store.get(check.kept_key)
    digest = hashlib.sha256(data).hexdigest()
    if digest != check.kept_sha256:
        raise CorruptObjectError(f"{url} changed after the replicas' copies were checked and compacted "
                                 f"(sha256 {digest[:12]}..., checked {check.kept_sha256[:12]}...)",
                                 hint="collect again: the weights are checked afresh")
    meta = safetensors_metadata(data, source=url)
    if meta.get("format") != FORMAT or "sha256" not in meta:
        tensors, meta = decode(data, source=url)
        return write_model(path, tensors, meta, run_id)
    keep = {k: v for k, v in meta.items() if k not in ("rank", "format", "sha256")}
    path = os.path.abspath(path)
    make_parent(path)
    write_file_atomic(path, with_model_metadata(data, {**keep, "run_id": run_id, "format": FORMAT,
                                                       "sha256": meta["sha256"]}, source=url))
    return path


def safetensors_metadata(data: bytes, *, source: str) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer (8-byte little-endian header length, then JSON)."""
    header = _header(data, source=source)
    meta = header.get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def with_model_metadata(data: bytes, metadata: Mapping[str, str], *, source: str) -> bytes:
    """``data`` (a safetensors buffer) with its ``__metadata__`` replaced by ``metadata``: the tensor table and
    the data section are kept byte for byte, so our checksum (over names, dtypes, shapes and raw bytes, not the
    metadata) still holds. The header is padded with spaces to 8 bytes, as safetensors itself writes it."""
    import json

    header = _header(data, source=source)
    n = int.from_bytes(data[:8], "little")
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n:]


def _header(data: bytes, *, source: str) -> dict[str, Any]:
    import json

    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    try:
        if n < 0 or 8 + n > len(data):
            raise ValueError(f"header length {n} does not fit in {len(data)} bytes")
        header = json.loads(data[8 : 8 + n])
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except ValueError as exc:
        raise CorruptObjectError(f"{source} is not a readable safetensors object ({len(data)} bytes): {exc}") from exc
    return header
