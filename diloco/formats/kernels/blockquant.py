"""The int8 and int4 formats' arithmetic: block-absmax quantization of a flat fp32 tensor, and its inverse.

The layouts are ``diloco.formats.int8``'s and ``diloco.formats.int4``'s (their module docstrings are the
specification); this module only computes it fast: vectorised over whole chunks of blocks, on the device the tensor lives on (a CUDA tensor is
encoded on the GPU and only the codes travel to the host), with no Python loop over blocks.

How it stays fast on a CPU: a chunk (``CPU_CHUNK_BYTES`` of fp32, whole blocks) is small enough for its
temporaries to stay in the core's cache while the chunk goes through its few passes (absolute values, per-block
max, one division, one rounding, one cast), and large enough for torch's per-call overhead not to matter. Every
step is the one the layout names (``max|x|``, ``/ qmax``, ``x / scale``, round half to even, ``q * scale``), so the
bits are the same as a one-block-at-a-time reference on every machine.

Two rare cases are left out of the fast pass and fixed afterwards, block by block: blocks whose scale is not a
normal finite number (a NaN or infinity in the block, where the codes must be 0, or a subnormal scale, where
``x / scale`` can round past ``qmax`` and must be clamped). A normal scale cannot overflow: ``|x| / (max|x| / qmax)``
is at most ``qmax`` times ``1 + 2**-23``, which rounds to ``qmax``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from diloco.formats.base import Allocator

#: fp32 bytes per CPU chunk: its temporaries stay in a core's cache between passes (1 MiB of L2 on current x86).
CPU_CHUNK_BYTES = 512 * 2**10
#: Elements per chunk on an accelerator: one kernel launch per pass over up to this many elements.
DEVICE_CHUNK_ELEMENTS = 1 << 26
#: The smallest positive normal fp32: scales below it (but above 0) need the clamp.
SMALLEST_NORMAL = 2.0**-126


def chunk_elements(block: int, device: torch.device) -> int:
    """Elements per chunk: a whole and even number of blocks (even so int4 chunks start on a byte)."""
    target = CPU_CHUNK_BYTES // 4 if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
    blocks = max(1, target // block)
    return block * (blocks + blocks % 2)


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


# ---------------------------------------------------------------- encode
def encode_int8(flat: torch.Tensor, qmax: int, block: int, *, empty: Allocator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, one per element; fp32 scales, one per block) of a 1-D fp32 tensor, in tensors ``empty(shape,
    dtype)`` makes (new ones on the tensor's device by default)."""
    import torch

    n = flat.numel()
    empty = empty or _empty_on(flat.device)
    codes = empty((n,), torch.int8)
    scales = empty((num_blocks(n, block),), torch.float32)
    work = _Work(flat, block)
    for start, stop in work.chunks():
        q = work.quantize(flat[start:stop], qmax, scales[start // block : num_blocks(stop, block)])
        codes[start:stop].copy_(q[: stop - start])
    _fix_edge_blocks(flat, qmax, block, codes, scales)
    return codes, scales


def encode_int4(flat: torch.Tensor, qmax: int, block: int, *, empty: Allocator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 nibble pairs, ``ceil(n / 2)`` bytes; fp32 scales) of a 1-D fp32 tensor: code ``q`` is stored as
    ``q + 8``, element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high one, an odd count's last high
    nibble 8 (the code of zero). ``empty`` as in ``encode_int8``."""
    import torch

    n = flat.numel()
    empty = empty or _empty_on(flat.device)
    packed = empty((-(-n // 2),), torch.uint8)
    scales = empty((num_blocks(n, block),), torch.float32)
    work = _Work(flat, block)
    for start, stop in work.chunks():
        work.quantize(flat[start:stop], qmax, scales[start // block : num_blocks(stop, block)])
        work.pack_nibbles(stop - start, packed[start // 2 : -(-stop // 2)])
    if bool(_edge_blocks(scales).any()):  # rare (NaN, inf or subnormal blocks): redo through exact int8 codes
        codes, scales = encode_int8(flat, qmax, block)
        packed = pack_nibbles(codes)
    return packed, scales


class _Work:
    """The reusable temporaries of one tensor's encoding, and the chunks it is cut into."""

    def __init__(self, flat: torch.Tensor, block: int) -> None:
        import torch

        self.n = flat.numel()
        self.block = block
        self.step = chunk_elements(block, flat.device)
        size = min(self.step, num_blocks(self.n, block) * block)
        self.floats = torch.empty(size + 1, dtype=torch.float32, device=flat.device)  # + 1: int4's pad nibble
        self.halves = torch.empty(size // 2 + 1, dtype=torch.float32, device=flat.device)

    def chunks(self) -> list[tuple[int, int]]:
        return [(start, min(start + self.step, self.n)) for start in range(0, self.n, self.step)]

    def quantize(self, x: torch.Tensor, qmax: int, scales: torch.Tensor) -> torch.Tensor:
        """Float codes ``round(x / scale)`` of one chunk (unclamped: see the module docstring), its scales written
        into ``scales``. A chunk ending inside a block (the tensor's tail) is padded with zeros, which change no
        absmax; the caller drops their codes."""
        import torch

        n = x.numel()
        rows_n = num_blocks(n, self.block) * self.block
        if rows_n != n:
            x = torch.cat([x, x.new_zeros(rows_n - n)])
        rows = x.view(-1, self.block)
        buf = self.floats[:rows_n].view(-1, self.block)
        torch.abs(rows, out=buf)
        torch.amax(buf, dim=1, out=scales)  # NaN propagates, and so does inf
        scales.div_(qmax)
        divisor = torch.where(scales > 0, scales, 1.0)  # an all-zero block divides by 1: its codes are 0
        torch.div(rows, divisor[:, None], out=buf)
        return buf.view(-1).round_()

    def pack_nibbles(self, n: int, out: torch.Tensor) -> None:
        """Nibble pairs of the float codes of the last ``quantize`` (``n`` of them) into ``out``:
        ``(q0 + 8) + 16 * (q1 + 8)``, exact in fp32, cast once; an odd count's pad code is 0."""
        import torch

        if n % 2:
            self.floats[n] = 0.0
        pairs = self.floats[: n + n % 2].view(-1, 2)
        both = self.halves[: pairs.shape[0]]
        torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=both)
        out.copy_(both.add_(136))


def _empty_on(device: torch.device) -> Allocator:
    """``torch.empty`` on ``device``, as an ``Allocator``."""
    import torch

    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)


def _edge_blocks(scales: torch.Tensor) -> torch.Tensor:
    """Blocks the fast pass does not cover: scale NaN, infinite, or positive but subnormal."""
    return (scales != 0) & ~((scales >= SMALLEST_NORMAL) & (scales <= 3.4028234663852886e38))


def _fix_edge_blocks(flat: torch.Tensor, qmax: int, block: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Recompute the codes of the edge blocks: clamped for a subnormal scale, 0 for a non-finite one."""
    import torch

    edge = _edge_blocks(scales)
    if not bool(edge.any()):
        return
    n = flat.numel()
    which = edge.nonzero().flatten()
    rows = torch.zeros(which.numel(), block, dtype=torch.float32, device=flat.device)
    full = n // block
    whole = which[which < full]
    rows[: whole.numel()] = flat[: full * block].view(-1, block)[whole]
    if whole.numel() < which.numel():  # the tail block, shorter than ``block``
        rows[-1, : n - full * block] = flat[full * block :]
    s = scales[which][:, None]
    q = (rows / torch.where(s > 0, s, 1.0)).round_().clamp_(-qmax, qmax)
    q = torch.where(torch.isfinite(s), q, 0.0).to(torch.int8)
    codes[: full * block].view(-1, block)[whole] = q[: whole.numel()]
    if whole.numel() < which.numel():
        codes[full * block :] = q[-1, : n - full * block]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] -> uint8 nibble pairs (the int4 layout)."""
    import torch
    from torch.nn import functional as F

    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = F.pad(u, (0, 1), value=8)
    return u[0::2] | (u[1::2] << 4)


# ---------------------------------------------------------------- decode
#: How a decoder treats its output: overwrite it, add the decoded values, or subtract them (error feedback's
#: residual is what was sent minus what was decoded).
MODES = ("write", "add", "subtract")


def decode_int8(codes: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor, *,
                mode: str = "write") -> torch.Tensor:
    """``out = codes * scale`` of their block (``out += ...``, ``out -= ...`` by ``mode``), fp32, 1-D, chunk by
    chunk; a block with a non-finite scale is NaN throughout."""
    import torch

    n = codes.numel()
    step = chunk_elements(block, codes.device)
    tmp = torch.empty(min(step, n), dtype=torch.float32, device=codes.device) if mode != "write" and n else None
    for start in range(0, n, step):
        stop = min(start + step, n)
        target = tmp[: stop - start] if tmp is not None else out[start:stop]
        _scale_chunk(codes[start:stop], scales[start // block : num_blocks(stop, block)], block, target)
        if tmp is not None:
            combine(out[start:stop], target, mode)
    _nan_for_nonfinite(out, scales, block)
    return out


def decode_int4(packed: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor, *,
                mode: str = "write") -> torch.Tensor:
    """Like ``decode_int8`` from nibble pairs (``out`` has the element count; a nibble decodes as itself - 8)."""
    import torch

    n = out.numel()
    step = chunk_elements(block, packed.device)
    size = min(step, n + n % 2)
    pairs = _nibble_pairs(packed.device)
    tmp = torch.empty(size, dtype=torch.float32, device=packed.device) if mode != "write" and n else None
    for start in range(0, n, step):
        stop = min(start + step, n)
        src = packed[start // 2 : -(-stop // 2)]
        # one table lookup per byte gives its two codes, low nibble first (int16 = two int8, little-endian)
        codes = torch.index_select(pairs, 0, src.to(torch.int32)).view(torch.int8)[: stop - start]
        target = tmp[: stop - start] if tmp is not None else out[start:stop]
        _scale_chunk(codes, scales[start // block : num_blocks(stop, block)], block, target)
        if tmp is not None:
            combine(out[start:stop], target, mode)
    _nan_for_nonfinite(out, scales, block)
    return out


_NIBBLE_PAIRS: dict[torch.device, torch.Tensor] = {}


def _nibble_pairs(device: torch.device) -> torch.Tensor:
    """byte -> its two int4 codes as the bytes of one int16 (low nibble's code in the low byte; code = nibble - 8),
    so a lookup writes them interleaved in element order."""
    import sys

    import torch

    table = _NIBBLE_PAIRS.get(device)
    if table is None:
        byte = torch.arange(256, dtype=torch.int32)
        low, high = (byte & 0x0F) - 8, (byte >> 4) - 8
        if sys.byteorder == "little":
            word = (low & 0xFF) | ((high & 0xFF) << 8)
        else:
            word = (high & 0xFF) | ((low & 0xFF) << 8)
        table = _NIBBLE_PAIRS[device] = torch.where(word >= 1 << 15, word - (1 << 16), word).to(torch.int16).to(device)
    return table


def combine_dense(value: torch.Tensor, out: torch.Tensor, mode: str) -> None:
    """Write, add or subtract a dense decoded (or narrower, e.g. bf16) flat tensor into ``out`` (``none`` and
    ``bf16``), widened chunk by chunk in cache rather than whole."""
    if mode == "write":
        out.copy_(value)
        return
    step = chunk_elements(1, out.device)
    for start in range(0, out.numel(), step):
        part = value[start : start + step].to(out.dtype)
        combine(out[start : start + step], part, mode)


def combine(out: torch.Tensor, decoded: torch.Tensor, mode: str) -> None:
    """``out += decoded`` or ``out -= decoded``: one correctly rounded operation per element, as on a whole tensor."""
    if mode == "add":
        out.add_(decoded)
    else:
        out.sub_(decoded)


def _scale_chunk(codes: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """``out = codes * scale`` for one chunk: whole blocks as rows, a shorter last block on its own (one fp32
    product per element, int8 promoted to fp32 exactly)."""
    import torch

    n = codes.numel()
    whole = n - n % block
    if whole:
        torch.mul(codes[:whole].view(-1, block), scales[: whole // block, None], out=out[:whole].view(-1, block))
    if whole < n:
        torch.mul(codes[whole:], scales[-1], out=out[whole:])


def _nan_for_nonfinite(out: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """0 * inf is already NaN, but an inf scale times a nonzero code would be +-inf: the whole block is NaN."""
    bad = ~scales.isfinite()
    if not bool(bad.any()):
        return
    n = out.numel()
    full = n // block
    out[: full * block].view(-1, block)[bad[:full]] = float("nan")
    if full * block < n and bool(bad[-1]):
        out[full * block :] = float("nan")
