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

Streamed, range-verifiable objects (``encode_stream``): the same safetensors file, produced as a header plus views
of the tensors' memory (never one joined buffer), whose metadata also carries a CRC-32 per ``chunk_bytes`` of the
data section and a digest of the tensor table. A reader can then fetch the header (``read_header``, 1-2 ranged
GETs) and any byte range of the data (``read_data``, one ranged GET widened to whole chunks and verified), and view
the tensors it covers in place (``tensors_from_data``): a shard of a multi-GB contribution is read, verified and
accumulated without ever materialising the whole object. ``decode_tensors``/``decode`` read a streamed object like
any other, verifying its chunk digests in place of the whole-object checksum. Why a CRC-32 and not a SHA-256 per
chunk: ``diloco.store.digests``; objects written with a SHA-256 per chunk (``chunk_sha256``) are verified as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.errors import CorruptObjectError
from diloco.store.digests import CRC32, SHA256, checksum_all

if TYPE_CHECKING:
    import torch

    from diloco.store.objects import ObjectStore

FORMAT = "diloco.tensors/1"
_CHECKSUM_KEY = "sha256"
_FORMAT_KEY = "format"
_CHUNK_BYTES_KEY = "chunk_bytes"
_CHUNK_DIGESTS_KEY = "chunk_crc32"  # comma-separated hex CRC-32s, one per chunk of the data section
#: Each metadata key chunk checksums may be under, with its checksum (``diloco.store.digests``): objects written
#: before the CRC-32s carry a SHA-256 per chunk, and are read and verified as they were.
_CHUNK_CHECKSUM_KEYS = {_CHUNK_DIGESTS_KEY: CRC32, "chunk_sha256": SHA256}
_LAYOUT_KEY = "layout_sha256"  # digest of the tensor table and the chunk digests: a flipped header bit is caught

#: Default verification granularity of streamed objects: a ranged read fetches at most one extra chunk at each
#: end, and the header holds 9 characters per chunk (8 hex digits and a comma: 2.3 KiB of header per GiB of data).
CHUNK_BYTES = 4 * 2**20
#: The first ranged GET of ``read_header``; a header larger than this costs one more.
HEADER_PROBE_BYTES = 64 * 2**10

#: safetensors dtype names (only those torch and safetensors share).
_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def torch_dtype_name(safetensors_dtype: str) -> str | None:
    """What ``str(tensor.dtype)`` says for a safetensors dtype code (``"F32"`` -> ``"torch.float32"``), without
    importing torch; ``None`` for a code torch and safetensors do not share."""
    name = _DTYPE_NAMES.get(safetensors_dtype)
    return None if name is None else f"torch.{name}"


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
    _verify_checksum(data, tensors, meta, source)
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
        _verify_checksum(data, tensors, meta, source)
    for key, want in (expect or {}).items():
        if meta.get(key) != str(want):
            raise CorruptObjectError(f"{source} has {key}={meta.get(key)!r}, expected {str(want)!r}")
    return tensors, meta


def _verify_checksum(data: bytes, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str], source: str) -> None:
    """Our object's integrity: the whole-object SHA-256 (``encode_tensors``) or, for a streamed object
    (``encode_stream``), its layout digest and every chunk digest over the raw data section."""
    if _CHECKSUM_KEY not in meta and _chunk_checksum_key(meta) is not None:
        n = int.from_bytes(data[:8], "little")
        header = _parse_header(json.loads(data[8 : 8 + n]), key=source, data_offset=8 + n)
        if len(data) != header.data_offset + header.data_size:
            raise CorruptObjectError(f"{source} has {len(data)} bytes, its header says "
                                     f"{header.data_offset + header.data_size}")
        _verify_chunks(header, memoryview(data)[header.data_offset :], 0)
        return
    digest = tensor_digest(tensors)
    if meta.get(_CHECKSUM_KEY) != digest:
        raise CorruptObjectError(f"{source} failed its checksum (stored {meta.get(_CHECKSUM_KEY)}, computed {digest})")


def has_checksum(metadata: Mapping[str, str]) -> bool:
    """Whether an object's metadata carries our checksum (so ``decode`` verified its tensors bit for bit)."""
    return _CHECKSUM_KEY in metadata or _chunk_checksum_key(metadata) is not None


def _chunk_checksum_key(metadata: Mapping[str, str]) -> str | None:
    """The metadata key a streamed object's chunk checksums are under (``_CHUNK_CHECKSUM_KEYS``), if any."""
    return next((key for key in _CHUNK_CHECKSUM_KEYS if key in metadata), None)


def _read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` block of a safetensors buffer (8-byte little-endian header length, then JSON)."""
    if len(data) < 8:
        raise ValueError("shorter than the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise ValueError(f"header of {n} bytes runs past the end")
    header = json.loads(data[8 : 8 + n])
    return dict(header.get("__metadata__") or {})


# ---------------------------------------------------------------------------------------------- streamed objects
@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in an object's data section: bytes ``[begin, end)``."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ObjectHeader:
    """The parsed, verified header of a streamed object (``encode_stream``)."""

    key: str  # where it was read from, for messages
    data_offset: int  # where the data section starts in the object
    tensors: dict[str, TensorEntry]  # in data-section order
    metadata: dict[str, str]
    chunk_bytes: int
    digests: tuple[str, ...]  # the checksum of each chunk of the data section
    checksum: str = CRC32  # which one (``diloco.store.digests.CHECKSUMS``)

    @property
    def data_size(self) -> int:
        """Bytes in the data section (the object is ``data_offset + data_size`` bytes)."""
        return max((e.end for e in self.tensors.values()), default=0)

    def chunk_aligned(self, begin: int, end: int) -> tuple[int, int]:
        """``[begin, end)`` widened to whole chunks (the last chunk may be short), so it can be verified."""
        if not 0 <= begin <= end <= self.data_size:
            raise ValueError(f"range [{begin}, {end}) is outside the data section [0, {self.data_size})")
        c = self.chunk_bytes
        return (begin // c) * c, min(-(-end // c) * c, self.data_size)


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in _DTYPE_NAMES or not hasattr(torch, _DTYPE_NAMES[name]):
        raise ValueError(f"unsupported dtype {name!r}")
    return getattr(torch, _DTYPE_NAMES[name])


def _dtype_name(dtype: torch.dtype) -> str:
    for name, torch_name in _DTYPE_NAMES.items():
        if str(dtype) == f"torch.{torch_name}":
            return name
    raise TypeError(f"dtype {dtype} cannot be stored in safetensors")


def _raw_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (valid while ``t`` is alive)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def _layout_digest(table: Mapping[str, object], digests: str, chunk_bytes: int) -> str:
    text = json.dumps([sorted((k, v) for k, v in table.items()), digests, chunk_bytes], sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def encode_stream(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str | int] | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    checksum: str = CRC32,
) -> tuple[int, Iterator[memoryview | bytes]]:
    """``(total size, chunks)`` of a safetensors object whose data is never copied into one buffer.

    The header (our format tag, the caller's metadata, a CRC-32 per ``chunk_bytes`` of the data section and a
    digest of the tensor table, which together replace the whole-object checksum: ``decode_tensors`` verifies
    them instead) comes first, then each tensor's bytes as views of at most ``chunk_bytes``. Tensors are laid
    out by element size, largest first (as safetensors does), so each starts aligned to its element size. CPU
    contiguous tensors are not copied; others are copied once to the CPU. The data is checksummed once, before the
    first byte is produced; the caller's tensors must not change until the iterator is exhausted. ``checksum``:
    ``"sha256"`` writes an object as diloco did before the CRC-32s (every reader verifies either)."""
    if checksum not in _CHUNK_CHECKSUM_KEYS.values():
        raise ValueError(f"checksum must be one of {sorted(_CHUNK_CHECKSUM_KEYS.values())}, got {checksum!r}")
    if chunk_bytes <= 0 or chunk_bytes % 8:
        raise ValueError(f"chunk_bytes must be a positive multiple of 8, got {chunk_bytes}")
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    order = sorted(cpu, key=lambda n: (-cpu[n].element_size(), n))
    table: dict[str, object] = {}
    offset = 0
    for name in order:
        t = cpu[name]
        nbytes = t.numel() * t.element_size()
        table[name] = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    views = [_raw_view(cpu[name]) for name in order]
    digests = ",".join(_chunk_digests(views, chunk_bytes, checksum))
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    meta[_FORMAT_KEY] = FORMAT
    meta[_CHUNK_BYTES_KEY] = str(chunk_bytes)
    meta[next(key for key, name in _CHUNK_CHECKSUM_KEYS.items() if name == checksum)] = digests
    meta[_LAYOUT_KEY] = _layout_digest(table, digests, chunk_bytes)
    header = json.dumps({**table, "__metadata__": meta}, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % 8)  # the data section starts 8-aligned, as safetensors writes it
    prefix = len(header).to_bytes(8, "little") + header
    total = len(prefix) + offset

    def chunks() -> Iterator[memoryview | bytes]:
        keep_alive = cpu  # the views point into these tensors' memory
        yield prefix
        for view in views:
            for i in range(0, len(view), chunk_bytes):
                yield view[i : i + chunk_bytes]
        del keep_alive

    return total, chunks()


def _chunk_digests(views: list[memoryview], chunk_bytes: int, checksum: str) -> list[str]:
    """The ``checksum`` (CRC-32 or SHA-256) of each ``chunk_bytes`` piece of the concatenation of ``views`` (never concatenated), several
    chunks at once (``diloco.store.digests``)."""
    chunks: list[list[memoryview]] = []
    current: list[memoryview] = []
    filled = 0
    for view in views:
        pos = 0
        while pos < len(view):
            n = min(len(view) - pos, chunk_bytes - filled)
            current.append(view[pos : pos + n])
            pos += n
            filled += n
            if filled == chunk_bytes:
                chunks.append(current)
                current, filled = [], 0
    if filled:
        chunks.append(current)
    return checksum_all(chunks, checksum)


def read_header(store: ObjectStore, key: str) -> ObjectHeader:
    """The verified header of the streamed object at ``key`` (1 ranged GET, 2 when the header is large).

    ``CorruptObjectError`` naming the key when it is not a streamed object of ours or its header does not add up;
    ``ObjectNotFound`` when it does not exist."""
    return _header_from_prefix(store, key, store.get_range(key, 0, HEADER_PROBE_BYTES), HEADER_PROBE_BYTES)


def _header_from_prefix(store: ObjectStore, key: str, prefix: bytearray | memoryview, asked: int) -> ObjectHeader:
    """Parse the header from the object's first bytes (``asked`` were asked for; fewer mean the object ended);
    one more ranged GET when the header runs past them."""
    source = store.url(key)
    if len(prefix) < 8:
        raise CorruptObjectError(f"{source} is too short for a safetensors header ({len(prefix)} bytes)")
    n = int.from_bytes(prefix[:8], "little")
    if n > 100 * 2**20:
        raise CorruptObjectError(f"{source} claims a header of {n} bytes")
    raw = bytes(prefix[8 : 8 + n])
    if len(raw) < n and len(prefix) == asked:
        raw += store.get_range(key, asked, 8 + n)
    if len(raw) != n:
        raise CorruptObjectError(f"{source} ends inside its header ({8 + len(raw)} of {8 + n} bytes)")
    try:
        return _parse_header(json.loads(raw), key=source, data_offset=8 + n)
    except CorruptObjectError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CorruptObjectError(f"{source} has an unreadable header: {exc}") from exc


class ReadBuffer:
    """One buffer that many reads go into, one after the other (a round reading its peers' objects): a fresh
    buffer per read costs a page fault per 4 KiB, more than the copy itself. A read's result is a view of it,
    valid until the next read into it."""

    def __init__(self) -> None:
        self._data = bytearray()

    @property
    def capacity(self) -> int:
        """Bytes it holds now (a view of up to this many does not grow it)."""
        return len(self._data)

    def view(self, size: int, *, keep: int = 0) -> memoryview:
        """The buffer's first ``size`` bytes, growing it (into new memory: views of the old stay valid) when it is
        shorter; its first ``keep`` bytes are kept when it grows."""
        if len(self._data) < size:
            grown = bytearray(size)
            grown[:keep] = self._data[:keep]
            self._data = grown
        return memoryview(self._data)[:size]


def read_object(store: ObjectStore, key: str, *, data_bytes_hint: int = 0,
                buffer: ReadBuffer | None = None) -> tuple[ObjectHeader, memoryview]:
    """A whole streamed object, verified, in ONE ranged GET when ``data_bytes_hint`` is at least its data size
    (the header's size need not be known: the first ``HEADER_PROBE_BYTES`` beyond the hint cover it); a second
    GET fetches what the hint left out. -> (header, the data section as a view of the one buffer it was read
    into: no copy, writable). For small objects read whole (a reduced shard, a checkpoint), where ``get`` +
    ``decode_tensors`` would hold the object two or three times. ``buffer``: read into it instead of new memory
    (the result is then valid until its next read). ``CorruptObjectError`` naming the key when a chunk fails its
    digest or the object is truncated."""
    asked = data_bytes_hint + HEADER_PROBE_BYTES
    if buffer is None:
        raw: bytearray | memoryview = store.get_range(key, 0, asked)
    else:
        raw = buffer.view(asked)
        raw = raw[: store.get_range_into(key, 0, raw)]
    header = _header_from_prefix(store, key, raw, asked)
    end = header.data_offset + header.data_size
    if len(raw) < end and len(raw) == asked:  # the hint was short: fetch the rest, once
        if buffer is None:
            raw += store.get_range(key, asked, end)  # type: ignore[operator]
        else:
            raw = buffer.view(end, keep=asked)
            raw = raw[: asked + store.get_range_into(key, asked, raw[asked:])]
    if len(raw) < end:
        raise CorruptObjectError(f"{header.key} is truncated: {len(raw)} of {end} bytes")
    data = memoryview(raw)[header.data_offset : end]
    _verify_chunks(header, data, 0)
    return header, data


def _parse_header(header: dict[str, object], *, key: str, data_offset: int) -> ObjectHeader:
    meta = {str(k): str(v) for k, v in dict(header.pop("__metadata__", None) or {}).items()}  # type: ignore[call-overload]
    if meta.get(_FORMAT_KEY) != FORMAT:
        raise CorruptObjectError(f"{key} has format {meta.get(_FORMAT_KEY)!r}, expected {FORMAT!r}")
    checksum_key = _chunk_checksum_key(meta)
    if checksum_key is None or _CHUNK_BYTES_KEY not in meta:
        raise CorruptObjectError(f"{key} carries no chunk digests: it was not written by encode_stream")
    digests = meta[checksum_key]
    chunk_bytes = int(meta[_CHUNK_BYTES_KEY])
    if meta.get(_LAYOUT_KEY) != _layout_digest(header, digests, chunk_bytes):
        raise CorruptObjectError(f"{key} failed its header checksum ({_LAYOUT_KEY})")
    entries: dict[str, TensorEntry] = {}
    expected_begin = 0
    for name, spec in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):  # type: ignore[index]
        begin, end = (int(x) for x in spec["data_offsets"])  # type: ignore[index]
        entry = TensorEntry(_torch_dtype(spec["dtype"]), tuple(int(d) for d in spec["shape"]), begin, end)  # type: ignore[index]
        if begin != expected_begin or end - begin != entry.numel * _itemsize(entry.dtype):
            raise CorruptObjectError(f"{key}: tensor {name!r} has inconsistent offsets [{begin}, {end})")
        entries[name] = entry
        expected_begin = end
    digest_list = tuple(digests.split(",")) if digests else ()
    if len(digest_list) != -(-expected_begin // chunk_bytes):
        raise CorruptObjectError(f"{key} has {len(digest_list)} chunk digests for {expected_begin} data bytes")
    return ObjectHeader(key=key, data_offset=data_offset, tensors=entries, metadata=meta, chunk_bytes=chunk_bytes,
                        digests=digest_list, checksum=_CHUNK_CHECKSUM_KEYS[checksum_key])


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def read_data(store: ObjectStore, key: str, header: ObjectHeader, begin: int, end: int, *,
              buffer: ReadBuffer | None = None) -> bytearray | memoryview:
    """Bytes ``[begin, end)`` of the data section in one ranged GET, verified against the chunk digests.

    The range is widened to whole chunks to verify it, then trimmed: the result is the fetched buffer itself
    when ``[begin, end)`` is chunk-aligned, else a memoryview of it (no copy either way). ``buffer``: read into it
    instead of new memory (the result is then valid until its next read). ``CorruptObjectError`` naming the key
    when a chunk does not match its digest or the object ends early."""
    lo, hi = header.chunk_aligned(begin, end)
    if lo == hi:
        return bytearray()
    if buffer is None:
        raw: bytearray | memoryview = store.get_range(key, header.data_offset + lo, header.data_offset + hi)
    else:
        raw = buffer.view(hi - lo)
        raw = raw[: store.get_range_into(key, header.data_offset + lo, raw)]
    if len(raw) != hi - lo:
        raise CorruptObjectError(f"{header.key} is truncated: data bytes [{lo}, {hi}) returned {len(raw)} bytes")
    _verify_chunks(header, memoryview(raw), lo)
    if lo == begin and hi == end:
        return raw
    return memoryview(raw)[begin - lo : end - lo]


def _verify_chunks(header: ObjectHeader, data: memoryview, lo: int) -> None:
    """Check the whole chunks held in ``data`` (data-section bytes from ``lo``, a chunk boundary), several at once
    (``diloco.store.digests``)."""
    c = header.chunk_bytes
    hi = lo + len(data)
    first = lo // c
    pieces = [data[i * c - lo : min((i + 1) * c, hi) - lo] for i in range(first, -(-hi // c))]
    for i, digest in enumerate(checksum_all([[piece] for piece in pieces], header.checksum), start=first):
        if digest != header.digests[i]:
            raise CorruptObjectError(f"{header.key} failed the checksum of data chunk {i} (bytes [{i * c}, "
                                     f"{min((i + 1) * c, hi)}))")


def tensors_from_data(
    header: ObjectHeader, data: bytes | bytearray | memoryview, begin: int, end: int
) -> dict[str, tuple[int, torch.Tensor]]:
    """The (possibly partial) tensors that data-section bytes ``[begin, end)`` (held in ``data``) cover.

    ``name -> (element offset inside the tensor, flat 1-D view of those elements)``, without a copy: the views
    share ``data``'s memory (read-only when ``data`` is ``bytes``: do not write into them). Tensors with no
    element in the range are left out. ``ValueError`` when the range splits an element."""
    import torch

    if len(data) != end - begin:
        raise ValueError(f"data holds {len(data)} bytes for the range [{begin}, {end})")
    out: dict[str, tuple[int, torch.Tensor]] = {}
    for name, entry in header.tensors.items():
        lo, hi = max(begin, entry.begin), min(end, entry.end)
        if hi <= lo:
            continue
        size = _itemsize(entry.dtype)
        if (lo - entry.begin) % size or (hi - lo) % size:
            raise ValueError(f"range [{begin}, {end}) splits an element of {name!r} ({entry.dtype})")
        with warnings.catch_warnings():  # bytes are read-only; the caller was told not to write
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(data, dtype=entry.dtype, count=(hi - lo) // size, offset=lo - begin)
        out[name] = ((lo - entry.begin) // size, view)
    return out
