"""Lossy wire formats for pseudo-gradients, and the error feedback that keeps their rounding from accumulating.

Why: a pseudo-gradient is the whole model's size every round, and the store's bandwidth is what a DiLoCo round
costs. Streaming DiLoCo sends 4-bit outer gradients without loss (arXiv 2501.18512), INTELLECT-1 sent int8
(arXiv 2412.01152). This module is pure tensor arithmetic (no I/O): the all-reduce encodes its contribution with
``encode`` (or ``ErrorFeedback.compress``), stores the wire tensors with ``diloco.store.codec`` (safetensors, never
pickle) and turns every peer's wire tensors back into fp32 with ``decode`` before it accumulates (in fp32, in rank
order: the caller's job).

Formats (``FORMATS``), per tensor, over the tensor flattened in C order:

* ``none``: the tensor as it is (fp32 for pseudo-gradients). Wire: ``<name>``.
* ``bf16``: torch's own fp32 -> bf16 cast (round to nearest even). Wire: ``<name>`` in bf16. Relative error per
  element at most 2^-8 (finite values in bf16's normal range).
* ``int8``: symmetric round-to-nearest (ties to even) with one fp32 absmax scale per block of ``block`` elements
  (the last block of a tensor may be shorter): ``scale = max|x| / 127``, ``q = round(x / scale)`` in [-127, 127],
  decoded as ``q * scale``. Error per element at most ``scale / 2`` of its block. Wire: ``<name>:q`` (int8, one
  per element) and ``<name>:scale`` (fp32, one per block), both 1-D.
* ``int4``: the same with ``scale = max|x| / 7`` and ``q`` in [-7, 7], stored offset by 8 (so 1..15) as a nibble,
  two per uint8: element ``2i`` in the low nibble (bits 0-3) of byte ``i``, element ``2i + 1`` in the high nibble
  (bits 4-7). An odd element count pads the last high nibble with 8 (the code of zero). Wire: ``<name>:q`` (uint8,
  ``ceil(n / 2)`` bytes) and ``<name>:scale``.

The integer formats cost ``1 + 4 / block`` (int8) and ``0.5 + 4 / block`` (int4) bytes per element: at the default
block of 256, 3.94x and 7.76x smaller than fp32.

Determinism: every step is an IEEE-754 operation with one correctly rounded result (absmax, a division, a
round-half-to-even, a product) or a cast, on the CPU, block by block, with no randomness. The same input gives the
same bits on every machine, so every rank decodes its own contribution to the very values its peers decode (one
caveat: a process that flushes subnormals to zero, ``torch.set_flush_denormal(True)``, rounds blocks whose absmax
is below ~1e-36 differently; diloco never sets it).

Edge cases, on purpose:

* An all-zero block has scale 0 and decodes to exact zeros.
* A block holding a NaN or an infinity gets a non-finite scale (NaN or inf), codes 0, and decodes to NaN in every
  element: a diverged replica stays visible in the mean instead of being clipped into plausible numbers.
* Empty tensors (no codes, no scales) and 0-d tensors (one element, one scale) round-trip with their shape.

Every wire payload is tagged in its metadata (``compression`` and ``block``); ``decode`` checks the tag, the block
size and every wire tensor's name, dtype and shape against the layout, and raises ``CorruptObjectError`` on any
mismatch: a peer using another format is corrupt, never silently decoded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from diloco.errors import ConfigError, CorruptObjectError

if TYPE_CHECKING:
    import torch

FORMATS: tuple[str, ...] = ("none", "bf16", "int8", "int4")
DEFAULT_BLOCK = 256  # elements per scale block for int8/int4

#: Metadata keys of the tag ``encode`` writes and ``decode`` checks.
FORMAT_KEY = "compression"
BLOCK_KEY = "block"

#: Wire-name suffixes of the integer formats.
CODES_SUFFIX = ":q"
SCALE_SUFFIX = ":scale"

#: Largest code magnitude per integer format (symmetric: -QMAX..QMAX).
_QMAX = {"int8": 127, "int4": 7}

#: Elements processed at a time, so temporaries stay a few MiB whatever the tensor's size.
_CHUNK_ELEMENTS = 1 << 20

#: name -> (shape, original dtype) of a payload: what ``decode`` needs to rebuild it.
Layout = Mapping[str, "tuple[tuple[int, ...], torch.dtype]"]


# ---------------------------------------------------------------- validation
def check_format(fmt: str) -> str:
    """``fmt`` if it is one of ``FORMATS``, else a ``ConfigError`` naming the setting and the choices."""
    if fmt not in FORMATS:
        raise ConfigError(f"store.compression: {fmt!r} is not a compression format; use one of {', '.join(FORMATS)}")
    return fmt


def check_block(block: int) -> int:
    """``block`` if it is a positive int, else a ``ValueError`` naming it (a zero block has no scale)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"compression block: {block!r} is not a positive number of elements; "
                         f"use the default {DEFAULT_BLOCK}")
    return block


def layout_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The layout ``decode`` needs for a payload shaped like ``tensors``."""
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


# ---------------------------------------------------------------- sizes
def wire_nbytes(layout: Layout, fmt: str, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of the wire tensors ``encode`` produces for a payload of this layout (safetensors header excluded)."""
    import torch

    check_format(fmt)
    check_block(block)
    total = 0
    for shape, dtype in layout.values():
        n = _numel(shape)
        if fmt == "none":
            total += n * _itemsize(dtype)
        elif fmt == "bf16":
            total += n * torch.bfloat16.itemsize
        else:
            total += _code_bytes(n, fmt) + 4 * _num_blocks(n, block)
    return total


# ---------------------------------------------------------------- encode / decode
def encode(
    tensors: Mapping[str, torch.Tensor], fmt: str, *, block: int = DEFAULT_BLOCK
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """fp32 CPU tensors -> (wire tensors storable by safetensors, metadata ``{"compression", "block"}``).

    Wire names derive from the input names: ``<name>`` for none/bf16, ``<name>:q`` and ``<name>:scale`` for
    int8/int4 (see the module docstring for the bit layout). ``none`` passes each tensor through (CPU,
    contiguous, its own dtype); the lossy formats read every floating dtype as fp32."""
    check_format(fmt)
    check_block(block)
    wire: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        wire.update(_encode_one(name, tensor, fmt, block))
    return wire, {FORMAT_KEY: fmt, BLOCK_KEY: str(block)}


def decode(
    wire: Mapping[str, torch.Tensor],
    meta: Mapping[str, str],
    layout: Layout,
    *,
    fmt: str | None = None,
    block: int | None = None,
) -> dict[str, torch.Tensor]:
    """Inverse of ``encode``: fp32 CPU tensors named and shaped as in ``layout`` (``none``: the original dtype).

    ``CorruptObjectError`` when the metadata's tag is missing or unknown, differs from ``fmt``/``block`` (when the
    caller says what it expects, as the all-reduce does: a peer using another format is corrupt), or when the wire
    tensors are not exactly the ones ``layout`` implies (names, dtypes, shapes, scale counts)."""
    got_fmt, got_block = _read_tag(meta, fmt, block)
    expected = _expected_wire(layout, got_fmt, got_block)
    _check_wire(wire, expected, got_fmt, got_block)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, _dtype) in layout.items():
        out[name] = _decode_one(wire, name, tuple(shape), got_fmt, got_block)
    return out


# ---------------------------------------------------------------- error feedback
class ErrorFeedback:
    """Per-rank residual memory: ``compress(x)`` encodes ``x + residual`` and keeps
    ``residual = (x + residual) - decode(wire)``.

    Why: with a lossy format each round's rounding error would otherwise be lost for good; fed back, it is sent in
    a later round, so the *sum* over rounds of what was sent tracks the sum of the true pseudo-gradients within one
    round's quantization error (error feedback, as in 1-bit SGD and EF-SGD). It costs one fp32 copy of the payload
    in host memory. ``enabled=False`` (or ``fmt="none"``, which is lossless) keeps no residual.

    Non-finite entries of a residual are reset to 0: a NaN or inf shows in the round that produced it (its block
    decodes to NaN) but is not fed into every later round."""

    def __init__(self, fmt: str, *, block: int = DEFAULT_BLOCK, enabled: bool = True) -> None:
        self.fmt = check_format(fmt)
        self.block = check_block(block)
        self.enabled = enabled and fmt != "none"
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, torch.Tensor]]:
        """-> (wire, meta, decoded): ``decoded`` is exactly ``decode(wire, meta, layout)``, which is what this rank
        must average as its own contribution, so every rank averages identical values (bitwise-identical
        results). ``tensors`` are not modified."""
        layout = layout_of(tensors)
        inputs, owned = self._with_residuals(tensors) if self.enabled else (dict(tensors), set())
        wire, meta = encode(inputs, self.fmt, block=self.block)
        decoded = decode(wire, meta, layout, fmt=self.fmt, block=self.block)
        if self.enabled:
            self._residuals = {name: self._new_residual(inputs[name], decoded[name], name in owned)
                               for name in inputs}
        return wire, meta, decoded

    @staticmethod
    def _new_residual(sent: torch.Tensor, decoded: torch.Tensor, owned: bool) -> torch.Tensor:
        """``sent - decoded`` with non-finite entries zeroed; in place when ``sent`` is our own temporary (saves
        one payload-sized allocation per round), never in the caller's tensor."""
        import torch

        residual = sent.sub_(decoded) if owned else sent - decoded
        return residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0) if not bool(torch.isfinite(residual).all()) \
            else residual

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals (fp32, safetensors-storable copies), so a rejoining rank resumes with them."""
        return {name: r.clone() for name, r in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the residuals with ``state`` (as ``state_dict`` returned it); an empty state clears them."""
        import torch

        for name, r in state.items():
            if not r.is_floating_point():
                raise ValueError(f"error feedback state: residual {name!r} is {r.dtype}, expected a float tensor")
        self._residuals = {name: r.detach().to("cpu", torch.float32, copy=True) for name, r in state.items()}

    def _with_residuals(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
        """fp32 ``x + residual`` per name (``x`` itself where no residual is kept yet), and the names whose
        tensor is a fresh temporary of ours rather than the caller's."""
        import torch

        out: dict[str, torch.Tensor] = {}
        owned: set[str] = set()
        for name, t in tensors.items():
            x = t.detach().to("cpu", torch.float32)
            residual = self._residuals.get(name)
            if residual is not None and residual.shape != x.shape:
                raise ValueError(f"error feedback: {name!r} is now {tuple(x.shape)} but its residual is "
                                 f"{tuple(residual.shape)}; the payload's layout must not change between rounds")
            if residual is not None:
                out[name] = x + residual
                owned.add(name)
            else:
                out[name] = x
                if x.data_ptr() != t.data_ptr() or x.numel() == 0:
                    owned.add(name)  # the cast or move made a copy
        return out, owned


# ---------------------------------------------------------------- per-tensor work
def _encode_one(name: str, tensor: torch.Tensor, fmt: str, block: int) -> dict[str, torch.Tensor]:
    import torch

    t = tensor.detach().to("cpu").contiguous()
    if fmt == "none":
        return {name: t}
    if not t.is_floating_point():
        raise ValueError(f"compression {fmt}: tensor {name!r} is {t.dtype}; only floating tensors can be compressed")
    x = t.to(torch.float32)
    if fmt == "bf16":
        return {name: x.to(torch.bfloat16)}
    codes, scales = _quantize(x.reshape(-1), _QMAX[fmt], block)
    if fmt == "int4":
        codes = _pack_nibbles(codes)
    return {name + CODES_SUFFIX: codes, name + SCALE_SUFFIX: scales}


def _decode_one(wire: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], fmt: str,
                block: int) -> torch.Tensor:
    import torch

    if fmt == "none":
        return wire[name].reshape(shape)
    if fmt == "bf16":
        return wire[name].to(torch.float32).reshape(shape)
    n = _numel(shape)
    codes = wire[name + CODES_SUFFIX]
    if fmt == "int4":
        codes = _unpack_nibbles(codes, n)
    return _dequantize(codes, wire[name + SCALE_SUFFIX], block).reshape(shape)


def _quantize(flat: torch.Tensor, qmax: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, fp32 scales) of a 1-D fp32 tensor, chunk by chunk of whole blocks."""
    import torch

    n = flat.numel()
    codes = torch.empty(n, dtype=torch.int8)
    scales = torch.empty(_num_blocks(n, block), dtype=torch.float32)
    step = _chunk_elements(block)
    for start in range(0, n, step):
        stop = min(start + step, n)
        first_block = start // block
        chunk_scales = scales[first_block : first_block + _num_blocks(stop - start, block)]
        _quantize_chunk(flat[start:stop], qmax, block, codes[start:stop], chunk_scales)
    return codes, scales


def _quantize_chunk(x: torch.Tensor, qmax: int, block: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize one chunk (whole blocks, or the tensor's tail padded with zeros, which change no absmax and whose
    codes are dropped) into ``codes`` and ``scales``."""
    import torch
    from torch.nn import functional as F

    n = x.numel()
    pad = -n % block
    rows = (F.pad(x, (0, pad)) if pad else x).view(-1, block)
    low, high = torch.aminmax(rows, dim=1)  # one pass; NaN propagates, and so does inf
    torch.maximum(high, low.neg_(), out=scales)
    scales.div_(qmax)
    divisor = torch.where(scales > 0, scales, 1.0)  # 0 (all-zero block) and NaN divide by 1; the codes are 0
    q = rows / divisor[:, None]
    q.round_().clamp_(-qmax, qmax)
    finite = torch.isfinite(scales)
    if not bool(finite.all()):
        q[~finite] = 0.0  # a non-finite block: codes 0, decoded as NaN
    codes.copy_(q.view(-1)[:n])


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``codes * scale`` of their block, fp32, 1-D; one product per element, so every rank gets the same bits."""
    import torch

    n = codes.numel()
    out = torch.empty(n, dtype=torch.float32)
    whole = n - n % block
    step = _chunk_elements(block)
    for start in range(0, whole, step):
        stop = min(start + step, whole)
        rows = codes[start:stop].to(torch.float32).view(-1, block)
        torch.mul(rows, scales[start // block : stop // block, None], out=out[start:stop].view(-1, block))
    if whole < n:
        torch.mul(codes[whole:].to(torch.float32), scales[whole // block], out=out[whole:])
    return _nan_for_nonfinite_scales(out, scales, block)


def _nan_for_nonfinite_scales(out: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """0 * inf is already NaN, but an inf scale times a nonzero code would be +-inf: make the whole block NaN."""
    import torch

    bad = (~torch.isfinite(scales)).nonzero().flatten().tolist()
    for b in bad:
        out[b * block : (b + 1) * block] = float("nan")
    return out


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] -> uint8, two per byte: element 2i low nibble, 2i+1 high nibble, offset by 8."""
    import torch
    from torch.nn import functional as F

    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = F.pad(u, (0, 1), value=8)
    return u[0::2] | (u[1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``_pack_nibbles``: the first ``n`` codes as int8."""
    import torch

    low = packed & 0x0F
    high = packed >> 4
    both = torch.stack([low, high], dim=1).reshape(-1)[:n]
    return (both.to(torch.int16) - 8).to(torch.int8)


# ---------------------------------------------------------------- checks on read
def _read_tag(meta: Mapping[str, str], fmt: str | None, block: int | None) -> tuple[str, int]:
    """The (format, block) the metadata claims, checked against what the caller expects."""
    got_fmt = meta.get(FORMAT_KEY)
    if got_fmt not in FORMATS:
        raise CorruptObjectError(f"compressed payload has {FORMAT_KEY}={got_fmt!r}, not one of {', '.join(FORMATS)}")
    if fmt is not None and got_fmt != fmt:
        raise CorruptObjectError(f"compressed payload is {FORMAT_KEY}={got_fmt!r}, expected {fmt!r}: "
                                 "the peer uses another store.compression")
    raw_block = meta.get(BLOCK_KEY)
    try:
        got_block = check_block(int(raw_block))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CorruptObjectError(f"compressed payload has {BLOCK_KEY}={raw_block!r}, not a positive integer") from None
    if block is not None and got_fmt in _QMAX and got_block != block:
        raise CorruptObjectError(f"compressed payload has {BLOCK_KEY}={got_block}, expected {block}: "
                                 "the peer quantizes with another block size")
    return got_fmt, got_block


def _expected_wire(layout: Layout, fmt: str, block: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every wire tensor's (shape, dtype) that ``encode`` produces for ``layout``."""
    import torch

    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, (shape, dtype) in layout.items():
        shape = tuple(shape)
        if fmt == "none":
            expected[name] = (shape, dtype)
        elif fmt == "bf16":
            expected[name] = (shape, torch.bfloat16)
        else:
            n = _numel(shape)
            code_dtype = torch.int8 if fmt == "int8" else torch.uint8
            expected[name + CODES_SUFFIX] = ((_code_bytes(n, fmt),), code_dtype)
            expected[name + SCALE_SUFFIX] = ((_num_blocks(n, block),), torch.float32)
    return expected


def _check_wire(wire: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                fmt: str, block: int) -> None:
    if set(wire) != set(expected):
        extra = sorted(set(wire) - set(expected))
        missing = sorted(set(expected) - set(wire))
        raise CorruptObjectError(f"{fmt} payload (block {block}) holds other wire tensors than its layout implies: "
                                 f"extra {extra}, missing {missing}")
    for name, (shape, dtype) in expected.items():
        t = wire[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise CorruptObjectError(f"{fmt} payload (block {block}): wire tensor {name!r} is {t.dtype} "
                                     f"{tuple(t.shape)}, expected {dtype} {shape}")


# ---------------------------------------------------------------- small helpers
def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def _code_bytes(n: int, fmt: str) -> int:
    return n if fmt == "int8" else -(-n // 2)


def _itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def _chunk_elements(block: int) -> int:
    """A whole, even number of blocks near ``_CHUNK_ELEMENTS`` (even so int4 packs chunk-aligned)."""
    blocks = max(1, _CHUNK_ELEMENTS // block)
    return block * (blocks + blocks % 2)
