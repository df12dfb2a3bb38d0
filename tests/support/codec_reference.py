"""A slow, obviously-correct implementation of the wire layouts documented in diloco.collectives.compression.

It follows the module docstring word for word, one block (or chunk) and one element at a time, in numpy fp32 (whose
division and ``rint`` are correctly rounded, ties to even) and Python integers (bit streams), sharing no code with
the module. The tests compare the fast codecs with it bit for bit: a payload written by either decodes with the
other, whatever machine wrote it.
"""

from __future__ import annotations

import numpy as np

QMAX = {"int8": 127, "int4": 7}


# ---------------------------------------------------------------- int8 / int4
def encode_blocks(x: np.ndarray, fmt: str, block: int) -> dict[str, np.ndarray]:
    """``:q`` and ``:scale`` of one flat fp32 array: per block ``scale = max|x| / qmax``, ``q = round(x / scale)``
    clamped to ``[-qmax, qmax]`` (0 for an all-zero or non-finite block)."""
    qmax = QMAX[fmt]
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    codes = np.zeros(flat.size, dtype=np.int8)
    scales = np.zeros(-(-flat.size // block), dtype=np.float32)
    with np.errstate(all="ignore"):
        for b in range(scales.size):
            part = flat[b * block : (b + 1) * block]
            scale = np.float32(np.max(np.abs(part))) / np.float32(qmax)
            scales[b] = scale
            if not np.isfinite(scale) or scale == 0:
                continue
            q = np.rint(part / scale)
            codes[b * block : b * block + part.size] = np.clip(q, -qmax, qmax).astype(np.int8)
    if fmt == "int8":
        return {":q": codes, ":scale": scales}
    nibbles = [int(c) + 8 for c in codes] + ([8] if codes.size % 2 else [])
    packed = np.array([nibbles[i] | (nibbles[i + 1] << 4) for i in range(0, len(nibbles), 2)], dtype=np.uint8)
    return {":q": packed, ":scale": scales}


def decode_blocks(wire: dict[str, np.ndarray], fmt: str, n: int, block: int) -> np.ndarray:
    """``q * scale`` per element; a block with a non-finite scale is NaN throughout."""
    if fmt == "int8":
        codes = wire[":q"].astype(np.int64)
    else:
        codes = np.array([((int(b) >> shift) & 0xF) - 8 for b in wire[":q"] for shift in (0, 4)][:n])
    out = np.empty(n, dtype=np.float32)
    with np.errstate(all="ignore"):
        for i in range(n):
            scale = wire[":scale"][i // block]
            out[i] = np.float32(codes[i]) * scale if np.isfinite(scale) else np.float32("nan")
    return out


# ---------------------------------------------------------------- topk
def encode_topk(x: np.ndarray, chunk: int, k: int, value_bits: int) -> dict[str, np.ndarray]:
    """``:idx``, ``:q``, ``:scale`` of one flat fp32 array, chunk by chunk, element by element."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    levels_per_chunk = 1 << (value_bits - 1)
    positions: list[list[int]] = []  # per chunk, ascending
    codes: list[int] = []
    levels: list[float] = []
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk]
        kept = k if part.size == chunk else max(1, -(-k * part.size // chunk))
        magnitude = [int(v) & 0x7FFFFFFF for v in part.view(np.int32)]
        ranked = sorted(range(part.size), key=lambda i: (-magnitude[i], i))[:kept]  # ties: smaller position
        group_of = {i: rank * levels_per_chunk // kept for rank, i in enumerate(ranked)}
        for g in range(levels_per_chunk):
            members = [i for i in ranked if group_of[i] == g]
            median = members[(len(members) - 1) // 2] if members else None
            levels.append(float(np.int32(magnitude[median]).view(np.float32)) if median is not None else 0.0)
        if magnitude[ranked[0]] >= 0x7F800000:  # a NaN or an infinity: every level NaN
            levels[-levels_per_chunk:] = [float("nan")] * levels_per_chunk
        positions.append(sorted(ranked))
        for i in positions[-1]:
            codes.append(2 * group_of[i] + (1 if int(part.view(np.int32)[i]) < 0 else 0))
    widths = [min(chunk, flat.size - s) for s in range(0, flat.size, chunk)]
    return {":idx": elias_fano(positions, widths), ":q": pack_bits(codes, value_bits),
            ":scale": np.array(levels, dtype=np.float32)}


def elias_fano(positions: list[list[int]], widths: list[int]) -> np.ndarray:
    """The ``:idx`` stream: for each run of chunks of one width (the whole chunks, then the last), the ``low``
    lowest bits of every position (``low = floor(log2(width / kept))``), then per chunk a bitmap of ``kept +
    ((width - 1) >> low) + 1`` bits where the ``i``-th position ``p`` sets bit ``(p >> low) + i``; each packed
    LSB-first, each starting on a byte."""
    stream = b""
    for run in _runs(positions, widths):
        width, kept = widths[run[0]], len(positions[run[0]])
        low = (width // kept).bit_length() - 1
        slots = kept + ((width - 1) >> low) + 1
        lows = [p & ((1 << low) - 1) for c in run for p in positions[c]]
        bitmap = []
        for c in run:
            marked = {(p >> low) + i for i, p in enumerate(positions[c])}
            bitmap += [1 if b in marked else 0 for b in range(slots)]
        stream += (pack_bits(lows, low).tobytes() if low else b"") + pack_bits(bitmap, 1).tobytes()
    return np.frombuffer(stream, dtype=np.uint8).copy()


def elias_fano_positions(stream: np.ndarray, counts: list[int], widths: list[int]) -> list[list[int]]:
    """Every chunk's positions from ``elias_fano``'s stream."""
    out: list[list[int]] = [[] for _ in counts]
    data, at = stream.tobytes(), 0
    for run in _runs([[0] * c for c in counts], widths):
        width, kept = widths[run[0]], counts[run[0]]
        low = (width // kept).bit_length() - 1
        slots = kept + ((width - 1) >> low) + 1
        low_bytes = -(-len(run) * kept * low // 8)
        lows = unpack_bits(np.frombuffer(data[at : at + low_bytes], dtype=np.uint8), low, len(run) * kept) \
            if low else [0] * (len(run) * kept)
        at += low_bytes
        map_bytes = -(-len(run) * slots // 8)
        bitmap = unpack_bits(np.frombuffer(data[at : at + map_bytes], dtype=np.uint8), 1, len(run) * slots)
        at += map_bytes
        for j, c in enumerate(run):
            set_bits = [b for b in range(slots) if bitmap[j * slots + b]]
            out[c] = [((b - i) << low) | lows[j * kept + i] for i, b in enumerate(set_bits)]
    return out


def _runs(positions: list[list[int]], widths: list[int]) -> list[list[int]]:
    """Chunk indices grouped as the stream groups them: runs of chunks with the same width and count."""
    runs: list[list[int]] = []
    for c in range(len(widths)):
        if runs and (widths[runs[-1][0]], len(positions[runs[-1][0]])) == (widths[c], len(positions[c])):
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs


def decode_topk(wire: dict[str, np.ndarray], n: int, chunk: int, k: int, value_bits: int) -> np.ndarray:
    levels_per_chunk = 1 << (value_bits - 1)
    out = np.zeros(n, dtype=np.float32)
    counts = [k if min(chunk, n - s) == chunk else max(1, -(-k * (n - s) // chunk)) for s in range(0, n, chunk)]
    widths = [min(chunk, n - s) for s in range(0, n, chunk)]
    positions = [p for chunk_positions in elias_fano_positions(wire[":idx"], counts, widths)
                 for p in chunk_positions]
    codes = unpack_bits(wire[":q"], value_bits, sum(counts))
    at = 0
    for c, count in enumerate(counts):
        chunk_levels = wire[":scale"][c * levels_per_chunk : (c + 1) * levels_per_chunk]
        for j in range(at, at + count):
            level = chunk_levels[codes[j] >> 1]
            out[c * chunk + positions[j]] = -level if codes[j] & 1 else level
        if not np.all(np.isfinite(chunk_levels)):
            out[c * chunk : (c + 1) * chunk] = np.float32("nan")
        at += count
    return out


def pack_bits(values: list[int], bits: int) -> np.ndarray:
    """Field i at stream bits [i * bits, (i + 1) * bits), least significant bit first; byte j holds stream bits
    [8j, 8j + 8)."""
    stream = 0
    for i, v in enumerate(values):
        assert 0 <= v < 1 << bits
        stream |= v << (i * bits)
    nbytes = -(-len(values) * bits // 8)
    return np.frombuffer(stream.to_bytes(nbytes, "little"), dtype=np.uint8).copy() if nbytes else \
        np.zeros(0, dtype=np.uint8)


def unpack_bits(stream: np.ndarray, bits: int, count: int) -> list[int]:
    value = int.from_bytes(bytes(stream.tobytes()), "little")
    return [(value >> (i * bits)) & ((1 << bits) - 1) for i in range(count)]
