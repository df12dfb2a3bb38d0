"""The sparse format's small CPU tensors encoded, checked and decoded together: the very bits of one at a time.

Why: a model's biases and norms are tensors of a few hundred values, and a payload holds dozens of them (the
built-in model: 29 tensors, 137K values). One at a time, each cost some thirty NumPy operations whatever its
size, which was most of a small model's sparse round: 9 ms to encode a contribution with error feedback and 3 ms
to add one into the sum, on one core, where fp32's whole round costs 4. Here the chunks of every tensor that share a width and a kept count (the whole chunks of every tensor,
and each distinct tail length) are selected, described and decoded as one array, so that fixed cost is paid per
group, a handful per payload; what is left per tensor is slicing its rows and packing or unpacking its bits.

The wire does not change: each tensor's positions, codes and levels are exactly what ``topk.encode`` makes of it
alone (``diloco.formats.topk`` has the layout), since a peer may encode one tensor at a time (a GPU replica takes
the general path for every tensor). ``tests/collectives/test_topk_many.py`` compares the two on random, tied and
non-finite data and on corrupt streams. Bits are packed with ``numpy.packbits`` (``bitorder="little"``), which
is ``bitpack``'s layout: field ``i`` of ``b`` bits in stream bits ``[i * b, (i + 1) * b)``, least significant
first.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.errors import CorruptObjectError
from diloco.formats.kernels import bitpack
from diloco.formats.kernels.content_memo import ContentMemo
from diloco.formats.kernels.topk_layout import describe_rows, low_bits, upper_bits

if TYPE_CHECKING:
    import numpy as np

    from diloco.formats.kernels.topk_layout import TopkSpec


@dataclass(frozen=True)
class _Member:
    """One run of chunks of one tensor (``spec.parts``) inside its group."""

    tensor: int
    run: int  # its place in spec.parts: 0 the whole chunks (or a short tensor's only chunk), 1 the tail
    rows: int
    width: int
    kept: int
    first_element: int  # the run's first element in its tensor
    first_chunk: int  # its first chunk's row of the tensor's levels
    first_code: int  # its first kept element among the tensor's codes
    lows_at: int  # the run's low bits in the tensor's positions stream: bytes [lows_at, lows_at + lows_nbytes)
    lows_nbytes: int
    upper_nbytes: int  # its bitmaps follow them


@dataclass(frozen=True)
class _Plan:
    """Where every run of every tensor of a payload of these sizes goes: its group (width, kept), in order."""

    groups: tuple[tuple[tuple[int, int], tuple[_Member, ...]], ...]
    index_nbytes: tuple[int, ...]  # per tensor: its positions stream's length
    kept: tuple[int, ...]  # per tensor: its kept elements (codes)
    chunks: tuple[int, ...]  # per tensor: its chunks (level rows)


@functools.lru_cache(maxsize=64)
def _plan(sizes: tuple[int, ...], spec: TopkSpec) -> _Plan:
    """The plan of a payload of tensors of ``sizes`` elements; cached, since a run sends one layout every round."""
    grouped: dict[tuple[int, int], list[_Member]] = {}
    index_nbytes = []
    for i, n in enumerate(sizes):
        full = n // spec.chunk
        chunk_row = code = at = 0
        for run, (rows, width, kept) in enumerate(spec.parts(n)):
            low = low_bits(width, kept)
            lows_nbytes = bitpack.packed_nbytes(rows * kept, low) if low else 0
            upper_nbytes = bitpack.packed_nbytes(rows * upper_bits(width, kept), 1)
            first = 0 if run == 0 else full * spec.chunk  # the whole chunks, then the tail after them
            grouped.setdefault((width, kept), []).append(
                _Member(i, run, rows, width, kept, first, chunk_row, code, at, lows_nbytes, upper_nbytes))
            chunk_row += rows
            code += rows * kept
            at += lows_nbytes + upper_nbytes
        index_nbytes.append(at)
    return _Plan(tuple((key, tuple(members)) for key, members in grouped.items()), tuple(index_nbytes),
                 tuple(spec.kept(n) for n in sizes), tuple(spec.num_chunks(n) for n in sizes))


def _bit_planes(values: np.ndarray, bits: int) -> np.ndarray:
    """(..., bits) uint8: bit ``j`` of every value, least significant first (what ``packbits`` lays out)."""
    import numpy as np

    return ((values[..., None] >> np.arange(bits, dtype=np.int64)) & 1).astype(np.uint8)


def _field_bits(stream: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The bits of the first ``count`` fields of ``bits`` bits of a packed stream (``_fields`` of them, or of
    several such arrays joined, reads the fields)."""
    import numpy as np

    return np.unpackbits(stream, count=count * bits, bitorder="little")


def _fields(field_bits: np.ndarray, bits: int) -> np.ndarray:
    """The fields of ``bits`` bits laid out in ``field_bits`` (one bit a byte, as ``_field_bits`` gives), int64."""
    import numpy as np

    planes = field_bits.reshape(-1, bits)
    packed = np.packbits(planes, axis=1, bitorder="little")  # (count, 1 or 2): each field's own bytes
    if packed.shape[1] == 1:
        return packed[:, 0].astype(np.int64)
    return np.ascontiguousarray(packed).view("<u2")[:, 0].astype(np.int64)


# ---------------------------------------------------------------- encode
def encode_many(flats: Sequence[np.ndarray], spec: TopkSpec) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(positions stream, packed codes, fp32 levels) of every 1-D fp32 array: ``topk.encode``'s, bit for bit."""
    import numpy as np

    plan = _plan(tuple(int(x.size) for x in flats), spec)
    # per tensor, per run (groups are not in a tensor's run order): its positions streams, code bits, levels
    index_of: list[list[list[np.ndarray]]] = [[[], []] for _ in flats]
    codes_of: list[list[list[np.ndarray]]] = [[[], []] for _ in flats]
    levels_of: list[list[list[np.ndarray]]] = [[[], []] for _ in flats]
    groups: Groups = []
    for (width, kept), members in plan.groups:
        blocks = [flats[m.tensor][m.first_element : m.first_element + m.rows * width].reshape(m.rows, width)
                  for m in members]
        cols, codes, levels = describe_rows(blocks[0] if len(blocks) == 1 else np.concatenate(blocks), kept, spec)
        cols.flags.writeable = False
        groups.append((width, kept, members, cols))
        low = low_bits(width, kept)
        slots = upper_bits(width, kept)
        upper = np.zeros((cols.shape[0], slots), dtype=np.uint8)
        np.put_along_axis(upper, (cols >> low) + np.arange(kept, dtype=np.int64), 1, axis=1)
        low_planes = _bit_planes(cols & ((1 << low) - 1), low) if low else None
        code_planes = _bit_planes(codes, spec.value_bits)
        row = 0
        for m in members:
            rows = slice(row, row + m.rows)
            if low_planes is not None:
                index_of[m.tensor][m.run].append(np.packbits(low_planes[rows].reshape(-1), bitorder="little"))
            index_of[m.tensor][m.run].append(np.packbits(upper[rows].reshape(-1), bitorder="little"))
            codes_of[m.tensor][m.run].append(code_planes[rows].reshape(-1))
            levels_of[m.tensor][m.run].append(levels[rows].reshape(-1))
            row += m.rows
    out = []
    for i in range(len(flats)):
        index = _joined([*index_of[i][0], *index_of[i][1]], np.uint8)
        codes = np.packbits(_joined([*codes_of[i][0], *codes_of[i][1]], np.uint8), bitorder="little")
        out.append((index, codes, _joined([*levels_of[i][0], *levels_of[i][1]], np.float32)))
    # the decode that follows an encode (error feedback's subtraction, then the sum) finds the positions it made
    _DECODED.keep((plan, spec), _joined([index for index, _, _ in out], np.uint8), groups,
                  sum(cols.nbytes for *_, cols in groups))
    return out


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    import numpy as np

    if not parts:
        return np.zeros(0, dtype=dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


# ---------------------------------------------------------------- positions, checked
Groups = list[tuple[int, int, tuple[_Member, ...], "np.ndarray"]]
#: Positions decoded and checked lately, by the exact bytes of the streams they came from: a round checks a peer's
#: payload when it reads it and decodes the same positions again when it adds it (and an encode decodes its own
#: to keep the residual, then adds them to the sum), so each is decoded once; kept for reuse (not handed out once,
#: as ``topk``'s large tensors' are), 16 payloads at most, none whose positions take over 4 MiB (its decode is then
#: data, not fixed cost).
_DECODED: ContentMemo[Groups] = ContentMemo(max_bytes=1 << 26, max_entries=16, max_entry_bytes=1 << 22,
                                            take_once=False)


def _positions(streams: Sequence[np.ndarray], plan: _Plan, spec: TopkSpec) -> Groups:
    """Per group: (width, kept, members, positions (rows, kept); read-only), every stream checked as
    ``decode_positions`` checks one: ``CorruptObjectError`` for a wrong length, a bitmap without exactly ``kept``
    marks in a row, or positions not strictly increasing inside their chunk."""
    import numpy as np

    for stream, expected in zip(streams, plan.index_nbytes, strict=True):
        if stream.size != expected:
            raise CorruptObjectError(f"topk payload: {stream.size} bytes of positions, expected {expected}")
    content = _joined(list(streams), np.uint8)
    known = _DECODED.find((plan, spec), content)
    if known is not None:
        return known
    groups = _decoded_positions(streams, plan)
    _DECODED.keep((plan, spec), content, groups, sum(positions.nbytes for *_, positions in groups))
    return groups


def _decoded_positions(streams: Sequence[np.ndarray], plan: _Plan) -> Groups:
    import numpy as np

    out = []
    for (width, kept), members in plan.groups:
        low = low_bits(width, kept)
        slots = upper_bits(width, kept)
        uppers, lows = [], []
        for m in members:
            stream = streams[m.tensor]
            start = m.lows_at + m.lows_nbytes
            uppers.append(np.unpackbits(stream[start : start + m.upper_nbytes], count=m.rows * slots,
                                        bitorder="little"))
            if low:
                lows.append(_field_bits(stream[m.lows_at : m.lows_at + m.lows_nbytes], low, m.rows * kept))
        rows = sum(m.rows for m in members)
        upper = (uppers[0] if len(uppers) == 1 else np.concatenate(uppers)).reshape(rows, slots)
        if rows and not (np.count_nonzero(upper, axis=1) == kept).all():
            raise CorruptObjectError(f"topk payload: a chunk's position bitmap does not mark exactly {kept} "
                                     "elements")
        high = np.flatnonzero(upper).astype(np.int64, copy=False).reshape(rows, kept)
        high -= np.arange(0, rows * slots, slots, dtype=np.int64)[:, None]
        high -= np.arange(kept, dtype=np.int64)
        positions = high << low
        if low:
            positions |= _fields(lows[0] if len(lows) == 1 else np.concatenate(lows), low).reshape(rows, kept)
        if positions.size and (not (positions[:, 1:] > positions[:, :-1]).all()
                               or int(positions[:, -1].max()) >= width):
            raise CorruptObjectError(f"topk payload: kept positions are not strictly increasing positions within "
                                     f"their chunk of {width} elements")
        positions.flags.writeable = False
        out.append((width, kept, members, positions))
    return out


def check_many(streams: Sequence[np.ndarray], sizes: Sequence[int], spec: TopkSpec) -> None:
    """``topk.check_positions`` of every tensor's positions stream (tensors of ``sizes`` elements)."""
    _positions(streams, _plan(tuple(sizes), spec), spec)


# ---------------------------------------------------------------- decode
def decode_many(wires: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], outs: Sequence[np.ndarray],
                spec: TopkSpec, *, mode: str, zeroed: bool = False) -> None:
    """``topk.decode`` of every tensor's (positions, codes, levels) into its 1-D fp32 ``out`` (``mode`` "write",
    "add" or "subtract"): one fp32 addition or store per kept position, the same operations, so the same bits.
    Every stream is checked before any ``out`` is touched."""
    import numpy as np

    plan = _plan(tuple(int(o.size) for o in outs), spec)
    groups = _positions([w[0] for w in wires], plan, spec)
    code_bits = []
    for (_, packed, _), kept in zip(wires, plan.kept, strict=True):
        if packed.size < bitpack.packed_nbytes(kept, spec.value_bits):
            raise ValueError(f"a stream of {packed.size} bytes cannot hold {kept} fields of {spec.value_bits} bits")
        code_bits.append(_field_bits(packed, spec.value_bits, kept))
    all_codes = _fields(np.concatenate(code_bits), spec.value_bits)  # every tensor's, one after another
    starts = np.cumsum((0, *plan.kept))
    codes = [all_codes[starts[i] : starts[i + 1]] for i in range(len(wires))]
    levels = [w[2].reshape(-1, spec.levels) for w in wires]
    if mode == "write" and not zeroed:
        for out in outs:
            out[:] = 0.0
    for width, kept, members, positions in groups:
        row_levels = np.concatenate([levels[m.tensor][m.first_chunk : m.first_chunk + m.rows] for m in members])
        signed = np.stack([row_levels, -row_levels], axis=2).reshape(-1, 2 * spec.levels)
        if mode == "subtract":
            signed = -signed  # a + (-v) is a - v, exactly
        row_codes = np.concatenate([codes[m.tensor][m.first_code : m.first_code + m.rows * kept] for m in members])
        values = np.take_along_axis(signed, row_codes.reshape(-1, kept), axis=1)
        row = 0
        for m in members:
            cols = positions[row : row + m.rows]
            flat = cols + (m.first_element + np.arange(m.rows, dtype=np.int64) * width)[:, None]
            if mode != "write":
                outs[m.tensor][flat] += values[row : row + m.rows]  # unique positions: one addition each
            else:
                outs[m.tensor][flat] = values[row : row + m.rows]
            row += m.rows
    for out, lv, chunks in zip(outs, levels, plan.chunks, strict=True):
        bad = ~np.isfinite(lv).all(axis=1)
        if chunks and bad.any():  # a chunk with a non-finite level decodes to NaN throughout
            full = out.size // spec.chunk
            out[: full * spec.chunk].reshape(full, spec.chunk)[bad[:full]] = np.nan
            if out.size > full * spec.chunk and bad[-1]:
                out[full * spec.chunk :] = np.nan
