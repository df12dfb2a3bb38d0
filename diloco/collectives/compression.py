"""Lossy wire formats for pseudo-gradients, and the error feedback that keeps their rounding from accumulating.

Why: a pseudo-gradient is the whole model's size every round, and the store's bandwidth is what a DiLoCo round
costs. Streaming DiLoCo sends 4-bit outer gradients without loss (arXiv 2501.18512), INTELLECT-1 sent int8
(arXiv 2412.01152), SparseLoCo sends 1-3% of the entries at 2 bits each (arXiv 2508.15706). This module is pure
tensor arithmetic (no I/O): the all-reduce encodes its contribution with ``encode`` (or ``ErrorFeedback.compress``),
stores the wire tensors with ``diloco.store.codec`` (safetensors, never pickle) and turns every peer's wire tensors
back into fp32 with ``decode`` (or adds them straight into its sum with ``decode_into``) before it accumulates (in
fp32, in rank order: the caller's job).

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
* ``topk`` (sparse, parameters in ``TopkSpec``: ``chunk`` 4096, ``density`` 2.5% so k = 102 kept per chunk,
  ``value_bits`` 2): the tensor is cut into chunks of ``chunk`` elements (the last may be shorter and keeps
  ``ceil(k * length / chunk)``); in each, the k elements of largest magnitude are kept (ties to the smaller
  position). Their ranks by magnitude split them into ``L = 2**(value_bits - 1)`` groups of equal size; each
  group's fp32 level is the magnitude of its median element, and a kept element's code is ``2 * group + sign``
  (sign 1 for negative), decoded as ``-level`` or ``+level``; every other element decodes to 0. Wire:
  ``<name>:idx`` (the kept elements' positions, ascending within each chunk, as Elias-Fano: for the whole
  chunks, then for the shorter last one, the ``low = floor(log2(width / kept))`` lowest bits of every position,
  chunk after chunk, then every chunk's bitmap of ``kept + ((width - 1) >> low) + 1`` bits in which the ``i``-th
  position ``p`` sets bit ``(p >> low) + i``; ``diloco.collectives.topk.encode_positions``), ``<name>:q`` (the
  codes, ``value_bits`` each, in position order), all packed LSB-first into uint8 streams
  (``diloco.collectives.bitpack``), each part starting on a byte, and ``<name>:scale`` (fp32, ``L`` levels per
  chunk). Why the rest may be dropped: error feedback sends it in later rounds (``ErrorFeedback``).

Sizes: the integer formats cost ``1 + 4 / block`` (int8) and ``0.5 + 4 / block`` (int4) bytes per element: at the
default block of 256, 3.94x and 7.76x smaller than fp32. ``topk`` at its defaults costs 102 x (5 + 2) + 230 bits
of positions and codes and 2 x 4 bytes of levels per 4096 elements: 130x smaller than fp32 (186x at 1/64).

Determinism: every step is an IEEE-754 operation with one correctly rounded result (absmax, a division, a
round-half-to-even, a product), a cast, an integer comparison or a copy, with no randomness and no sum, so the same
input gives the same bits on every machine and device, and every rank decodes its own contribution to the very
values its peers decode (one caveat: a process that flushes subnormals to zero, ``torch.set_flush_denormal(True)``,
rounds blocks whose absmax is below ~1e-36 differently; diloco never sets it).

Edge cases, on purpose:

* An all-zero block (chunk) has scale (levels) 0 and decodes to exact zeros.
* A block (chunk) holding a NaN or an infinity gets a non-finite scale (NaN levels) and decodes to NaN in every
  element: a diverged replica stays visible in the mean instead of being clipped into plausible numbers.
* Empty tensors (no codes, no scales) and 0-d tensors (one element, one scale) round-trip with their shape.

Where the work happens: on the tensor's device (a CUDA pseudo-gradient is encoded on the GPU and only the wire
tensors are copied to the host), vectorised over chunks of blocks sized for the cache (``diloco.collectives.
blockquant``, ``diloco.collectives.topk``).

Every wire payload is tagged in its metadata (``compression`` and ``block``; ``topk``: ``compression``, ``chunk``,
``k``, ``value_bits`` and ``positions``, the position coding: ``elias-fano``); ``decode`` checks the tag, the
parameters and every wire tensor's name, dtype and shape against the layout, and raises ``CorruptObjectError`` on
any mismatch: a peer using another format is corrupt, never silently decoded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from diloco.collectives import blockquant, topk
from diloco.collectives.reduce import Allocator
from diloco.collectives.topk import TopkSpec
from diloco.errors import ConfigError, CorruptObjectError

if TYPE_CHECKING:
    import torch

FORMATS: tuple[str, ...] = ("none", "bf16", "int8", "int4", "topk")
DEFAULT_BLOCK = 256  # elements per scale block for int8/int4

#: Metadata keys of the tag ``encode`` writes and ``decode`` checks.
FORMAT_KEY = "compression"
BLOCK_KEY = "block"
TOPK_KEYS = ("chunk", "k", "value_bits")
#: The topk tag's position coding (``POSITIONS_KEY``): a peer that codes positions otherwise is refused by name.
POSITIONS_KEY = "positions"
POSITIONS_CODING = "elias-fano"

#: Wire-name suffixes of the integer and sparse formats.
CODES_SUFFIX = ":q"
SCALE_SUFFIX = ":scale"
INDEX_SUFFIX = ":idx"

#: Largest code magnitude per integer format (symmetric: -QMAX..QMAX).
_QMAX = {"int8": 127, "int4": 7}

#: name -> (shape, original dtype) of a payload: what ``decode`` needs to rebuild it.
Layout = Mapping[str, "tuple[tuple[int, ...], torch.dtype]"]

__all__ = ["BLOCK_KEY", "CODES_SUFFIX", "DEFAULT_BLOCK", "FORMATS", "FORMAT_KEY", "INDEX_SUFFIX", "SCALE_SUFFIX",
           "ErrorFeedback", "TopkSpec", "check", "check_block", "check_format", "decode", "decode_into",
           "encode", "layout_of", "wire_nbytes"]


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
def wire_nbytes(layout: Layout, fmt: str, block: int = DEFAULT_BLOCK, *, sparse: TopkSpec | None = None) -> int:
    """Bytes of the wire tensors ``encode`` produces for a payload of this layout (safetensors header excluded)."""
    import torch

    check_format(fmt)
    check_block(block)
    spec = sparse or TopkSpec()
    total = 0
    for shape, dtype in layout.values():
        n = _numel(shape)
        if fmt == "none":
            total += n * int(dtype.itemsize)
        elif fmt == "bf16":
            total += n * torch.bfloat16.itemsize
        elif fmt == "topk":
            total += spec.wire_nbytes(n)
        else:
            total += _code_bytes(n, fmt) + 4 * blockquant.num_blocks(n, block)
    return total


# ---------------------------------------------------------------- encode / decode
def encode(
    tensors: Mapping[str, torch.Tensor], fmt: str, *, block: int = DEFAULT_BLOCK, sparse: TopkSpec | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Floating tensors -> (CPU wire tensors storable by safetensors, the metadata tag).

    Wire names derive from the input names (see the module docstring for the bit layout). ``none`` passes each
    tensor through (CPU, contiguous, its own dtype); the lossy formats read every floating dtype as fp32 and do
    their work on the tensor's device, copying only the wire tensors to the host. ``sparse`` sets ``topk``'s
    parameters (``TopkSpec()`` by default)."""
    wire, meta = _encode_on_device(tensors, fmt, block, sparse)
    return {name: t.to("cpu") for name, t in wire.items()}, meta


def decode(
    wire: Mapping[str, torch.Tensor],
    meta: Mapping[str, str],
    layout: Layout,
    *,
    fmt: str | None = None,
    block: int | None = None,
    sparse: TopkSpec | None = None,
) -> dict[str, torch.Tensor]:
    """Inverse of ``encode``: fp32 tensors named and shaped as in ``layout`` (``none``: the original dtype), on
    the wire tensors' device.

    ``CorruptObjectError`` when the metadata's tag is missing or unknown, differs from ``fmt``/``block``/``sparse``
    (when the caller says what it expects, as the all-reduce does: a peer using another format is corrupt), or
    when the wire tensors are not exactly the ones ``layout`` implies (names, dtypes, shapes, scale counts)."""
    import torch

    got = _checked(wire, meta, layout, fmt, block, sparse)
    if got.fmt == "none":
        return {name: wire[name].reshape(tuple(shape)) for name, (shape, _dtype) in layout.items()}
    out: dict[str, torch.Tensor] = {}
    for name, (shape, _dtype) in layout.items():
        device = wire[name if got.fmt == "bf16" else name + SCALE_SUFFIX].device
        if got.fmt == "topk":  # mostly zeros: fresh zeroed memory costs no pass of its own
            target = torch.zeros(_numel(shape), dtype=torch.float32, device=device)
            assert got.sparse is not None
            topk.decode(wire[name + INDEX_SUFFIX], wire[name + CODES_SUFFIX], wire[name + SCALE_SUFFIX], got.sparse,
                        target, zeroed=True)
        else:
            target = torch.empty(_numel(shape), dtype=torch.float32, device=device)
            _decode_one(wire, name, got, target, mode="write")
        out[name] = target.view(tuple(shape))
    return out


def decode_into(
    wire: Mapping[str, torch.Tensor],
    meta: Mapping[str, str],
    layout: Layout,
    out: Mapping[str, torch.Tensor],
    *,
    mode: str,
    fmt: str | None = None,
    block: int | None = None,
    sparse: TopkSpec | None = None,
) -> None:
    """``decode`` straight into ``out`` (contiguous tensors shaped as in ``layout``, fp32 or fp64): ``mode``
    "write" overwrites them, "add" adds the decoded values and "subtract" subtracts them, with exactly the
    operations ``out += decode(...)`` (``-=``) would perform (the same bits), but without a payload-sized
    temporary. For ``topk`` "add" and "subtract" touch only the kept positions (a sum of N sparse contributions
    costs N * k elements per chunk). Same checks and errors as ``decode``, all made before ``out`` is touched."""
    if mode not in blockquant.MODES:
        raise ValueError(f"decode_into mode: {mode!r}; use one of {', '.join(blockquant.MODES)}")
    got = _checked(wire, meta, layout, fmt, block, sparse)
    for name in layout:
        target = out[name]
        if not target.is_contiguous():
            raise ValueError(f"decode_into: the output for {name!r} must be contiguous")
        _decode_one(wire, name, got, target.view(-1), mode=mode)


def check(wire: Mapping[str, torch.Tensor], meta: Mapping[str, str], layout: Layout, *, fmt: str | None = None,
          block: int | None = None, sparse: TopkSpec | None = None) -> None:
    """Raise ``CorruptObjectError`` exactly when ``decode`` would: the tag, the wire tensors and (``topk``) every
    kept position are checked, nothing is decoded. What a reader runs before it adds a payload to a running sum,
    so a corrupt payload is refused whole, never half added."""
    got = _checked(wire, meta, layout, fmt, block, sparse)
    if got.fmt == "topk":
        assert got.sparse is not None
        for name, (shape, _dtype) in layout.items():
            topk.check_positions(wire[name + INDEX_SUFFIX], got.sparse, _numel(tuple(shape)))


# ---------------------------------------------------------------- error feedback
class ErrorFeedback:
    """Per-rank residual memory: ``compress(x)`` encodes ``x + residual`` and keeps
    ``residual = (x + residual) - decode(wire)``.

    Why: with a lossy format each round's rounding error (or, with ``topk``, everything not kept) would otherwise
    be lost for good; fed back, it is sent in a later round, so the *sum* over rounds of what was sent tracks the
    sum of the true pseudo-gradients within one round's compression error (error feedback, as in 1-bit SGD,
    EF-SGD and SparseLoCo). It costs one fp32 copy of the payload, on the payload's device. ``enabled=False`` (or
    ``fmt="none"``, which is lossless) keeps no residual.

    Non-finite entries of a residual are reset to 0: a NaN or inf shows in the round that produced it (its block
    decodes to NaN) but is not fed into every later round.

    ``decay`` (SparseLoCo's beta, in (0, 1]): what is sent is ``x + decay * residual``, so an old residual fades
    instead of being carried for ever; 1 is plain error feedback. SparseLoCo uses it in place of the outer
    Nesterov momentum (``diloco.replica.outer``'s outer step then has none)."""

    def __init__(self, fmt: str, *, block: int = DEFAULT_BLOCK, enabled: bool = True,
                 sparse: TopkSpec | None = None, decay: float = 1.0) -> None:
        self.fmt = check_format(fmt)
        self.block = check_block(block)
        self.sparse = sparse or TopkSpec()
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
            raise ValueError(f"error feedback decay: {decay!r} is not in (0, 1]; use 1 (plain) or 0.9-0.99")
        self.decay = float(decay)
        self.enabled = enabled and fmt != "none"
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, torch.Tensor]]:
        """-> (wire, meta, decoded): ``wire`` on the CPU; ``decoded`` (on the tensors' device) is exactly
        ``decode(wire, meta, layout)``, which is what this rank must average as its own contribution, so every rank
        averages identical values (bitwise-identical results). ``tensors`` are not modified."""
        wire, meta = self._compress(tensors)
        decoded = decode(wire, meta, layout_of(tensors), fmt=self.fmt, block=self.block, sparse=self.sparse)
        return {name: t.to("cpu") for name, t in wire.items()}, meta, decoded

    def compress_wire(self, tensors: Mapping[str, torch.Tensor], *, empty: Allocator | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """``compress`` without ``decoded``: for a caller that adds its own contribution to its sum from the wire
        tensors (``decode_into``), as it does its peers', which spares a payload-sized tensor per round.
        ``empty(shape, dtype)`` makes the wire tensors of CPU inputs (a round passes its spare buffers)."""
        wire, meta = self._compress(tensors, empty)
        return {name: t.to("cpu") for name, t in wire.items()}, meta

    def _compress(self, tensors: Mapping[str, torch.Tensor], empty: Allocator | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Encode ``x + residual`` (wire tensors left on the input's device) and keep ``residual = sent -
        decode(wire)``, subtracted in place (``decode_into``, mode "subtract": no decoded tensor is made)."""
        if not self.enabled:
            return _encode_on_device(_as_fp32(tensors), self.fmt, self.block, self.sparse, empty)
        inputs, owned = self._with_residuals(tensors)
        wire, meta = _encode_on_device(inputs, self.fmt, self.block, self.sparse, empty)
        residuals = {name: sent.contiguous() if name in owned else sent.clone(memory_format=_contiguous())
                     for name, sent in inputs.items()}  # never the caller's tensor
        decode_into(wire, meta, layout_of(tensors), residuals, mode="subtract", fmt=self.fmt, block=self.block,
                    sparse=self.sparse)
        if not _all_finite_after_decode(wire, self.fmt):
            for residual in residuals.values():
                residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        self._residuals = residuals
        return wire, meta

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals (fp32 CPU copies, safetensors-storable), so a rejoining rank resumes with them."""
        return {name: r.to("cpu", copy=True) for name, r in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the residuals with ``state`` (as ``state_dict`` returned it); an empty state clears them."""
        import torch

        for name, r in state.items():
            if not r.is_floating_point():
                raise ValueError(f"error feedback state: residual {name!r} is {r.dtype}, expected a float tensor")
        self._residuals = {name: r.detach().to("cpu", torch.float32, copy=True) for name, r in state.items()}

    def _with_residuals(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
        """fp32 ``x + residual`` per name (``x`` itself where no residual is kept yet), and the names whose
        tensor is a temporary of ours (the residual itself, updated in place) rather than the caller's."""

        fp32 = _as_fp32(tensors)
        for name, x in fp32.items():
            residual = self._residuals.get(name)
            if residual is not None and residual.shape != x.shape:
                raise ValueError(f"error feedback: {name!r} is now {tuple(x.shape)} but its residual is "
                                 f"{tuple(residual.shape)}; the payload's layout must not change between rounds")
        out: dict[str, torch.Tensor] = {}
        owned: set[str] = set()
        for name, x in fp32.items():
            residual = self._residuals.get(name)
            if residual is not None:
                residual = residual.to(x.device)
                if self.decay != 1.0:
                    residual.mul_(self.decay)
                out[name] = residual.add_(x)  # the residual's memory becomes what is sent
                owned.add(name)
            else:
                out[name] = x
                if x.data_ptr() != tensors[name].data_ptr() or x.numel() == 0:
                    owned.add(name)  # the cast made a copy
        return out, owned


def _all_finite_after_decode(wire: Mapping[str, torch.Tensor], fmt: str) -> bool:
    """Whether ``x - decode(encode(x))`` is finite everywhere, read from the scales alone: an integer or sparse
    block (chunk) with a finite scale held only finite values and decodes to values no larger than them. bf16 can
    round a finite value up to infinity, so it is never vouched for here."""
    import torch

    if fmt not in ("int8", "int4", "topk"):
        return False
    return all(bool(torch.isfinite(t).all()) for name, t in wire.items() if name.endswith(SCALE_SUFFIX))


def _contiguous() -> torch.memory_format:
    import torch

    return torch.contiguous_format


def _as_fp32(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch

    return {name: t.detach().to(torch.float32) for name, t in tensors.items()}


# ---------------------------------------------------------------- per-tensor work
class _Tag:
    """What a payload's metadata says: its format and that format's parameters."""

    def __init__(self, fmt: str, block: int, sparse: TopkSpec | None) -> None:
        self.fmt = fmt
        self.block = block
        self.sparse = sparse

    def meta(self) -> dict[str, str]:
        if self.fmt == "topk":
            assert self.sparse is not None
            return {FORMAT_KEY: "topk", "chunk": str(self.sparse.chunk), "k": str(self.sparse.k),
                    "value_bits": str(self.sparse.value_bits), POSITIONS_KEY: POSITIONS_CODING}
        return {FORMAT_KEY: self.fmt, BLOCK_KEY: str(self.block)}


def _encode_on_device(tensors: Mapping[str, torch.Tensor], fmt: str, block: int, sparse: TopkSpec | None,
                      empty: Allocator | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``encode``, leaving the lossy formats' wire tensors on the input's device; ``empty`` makes the wire tensors
    of CPU inputs (bf16, int8 and int4: the payload-sized ones)."""
    check_format(fmt)
    check_block(block)
    tag = _Tag(fmt, block, (sparse or TopkSpec()) if fmt == "topk" else None)
    wire: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        wire.update(_encode_one(name, tensor, tag, empty if tensor.device.type == "cpu" else None))
    return wire, tag.meta()


def _encode_one(name: str, tensor: torch.Tensor, tag: _Tag, empty: Allocator | None = None
                ) -> dict[str, torch.Tensor]:
    import torch

    fmt = tag.fmt
    if fmt == "none":
        return {name: tensor.detach().to("cpu").contiguous()}
    if not tensor.is_floating_point():
        raise ValueError(f"compression {fmt}: tensor {name!r} is {tensor.dtype}; only floating tensors can be "
                         "compressed")
    x = tensor.detach().to(torch.float32).contiguous()
    if fmt == "bf16":
        return {name: x.to(torch.bfloat16) if empty is None else empty(tuple(x.shape), torch.bfloat16).copy_(x)}
    flat = x.view(-1)
    if fmt == "topk":
        assert tag.sparse is not None
        index, codes, levels = topk.encode(flat, tag.sparse)
        return {name + INDEX_SUFFIX: index, name + CODES_SUFFIX: codes, name + SCALE_SUFFIX: levels}
    encoder = blockquant.encode_int8 if fmt == "int8" else blockquant.encode_int4
    codes, scales = encoder(flat, _QMAX[fmt], tag.block, empty=empty)
    return {name + CODES_SUFFIX: codes, name + SCALE_SUFFIX: scales}


def _decode_one(wire: Mapping[str, torch.Tensor], name: str, tag: _Tag, out: torch.Tensor, *,
                mode: str) -> torch.Tensor:
    """Decode one tensor's wire tensors into the flat ``out`` (or add them to it, or subtract them from it)."""
    fmt = tag.fmt
    if fmt in ("none", "bf16"):
        value = wire[name].reshape(-1)
        if mode == "write":
            return out.copy_(value)
        step = blockquant.chunk_elements(1, out.device)  # chunks: a bf16 payload is widened in cache, not whole
        for start in range(0, out.numel(), step):
            part = value[start : start + step].to(out.dtype)
            blockquant.combine(out[start : start + step], part, mode)
        return out
    if fmt == "topk":
        assert tag.sparse is not None
        return topk.decode(wire[name + INDEX_SUFFIX], wire[name + CODES_SUFFIX], wire[name + SCALE_SUFFIX],
                           tag.sparse, out, mode=mode)
    decoder = blockquant.decode_int8 if fmt == "int8" else blockquant.decode_int4
    return decoder(wire[name + CODES_SUFFIX], wire[name + SCALE_SUFFIX], tag.block, out, mode=mode)


# ---------------------------------------------------------------- checks on read
# ---------------------------------------------------------------- packing
#: Metadata key of a packed payload (``pack``): every wire tensor of one kind in one tensor.
PACKED_KEY = "packed"
#: Name prefix of a packed payload's tensors: ``*:idx``, ``*:q``, ``*:scale``.
PACKED_NAME = "*"


def pack(wire: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The payload with its wire tensors of each kind (``:idx``, ``:q``, ``:scale``) concatenated in name order.

    Why: a safetensors header names every tensor with its dtype, shape and offsets, about 80 bytes each. A sparse
    payload of a small model is a few bytes per tensor, so three header entries per parameter outweigh the data
    (the built-in model's topk payload is 4 KB of data behind an 8 KB header); packed, the header is three entries
    whatever the model. The layout says how long each part is, so ``unpack`` needs nothing else."""
    import torch

    groups: dict[str, list[torch.Tensor]] = {}
    for name in sorted(wire):
        _, _, kind = name.rpartition(":")
        groups.setdefault(kind, []).append(wire[name].reshape(-1))
    packed = {f"{PACKED_NAME}:{kind}": torch.cat(parts) for kind, parts in groups.items()}
    return packed, {**meta, PACKED_KEY: "1"}


def unpack(packed: Mapping[str, torch.Tensor], meta: Mapping[str, str], layout: Layout, *, fmt: str | None = None,
           block: int | None = None, sparse: TopkSpec | None = None) -> dict[str, torch.Tensor]:
    """``pack`` undone, as views of ``packed``: the wire tensors ``encode`` made for ``layout``.
    ``CorruptObjectError`` when a packed tensor is not exactly as long as its parts."""
    tag = _read_tag(meta, fmt, block, sparse)
    expected = _expected_wire(layout, tag)
    by_kind: dict[str, list[str]] = {}
    for name in sorted(expected):
        by_kind.setdefault(name.rpartition(":")[2], []).append(name)
    if set(packed) != {f"{PACKED_NAME}:{kind}" for kind in by_kind}:
        raise CorruptObjectError(f"packed {tag.fmt} payload holds {sorted(packed)}, expected "
                                 f"{sorted(f'{PACKED_NAME}:{k}' for k in by_kind)}")
    wire: dict[str, torch.Tensor] = {}
    for kind, names in by_kind.items():
        flat = packed[f"{PACKED_NAME}:{kind}"]
        sizes = [_numel(expected[n][0]) for n in names]
        dtypes = {expected[n][1] for n in names}
        if flat.dim() != 1 or flat.numel() != sum(sizes) or dtypes != {flat.dtype}:
            raise CorruptObjectError(f"packed {tag.fmt} payload: {PACKED_NAME}:{kind} is {flat.dtype} "
                                     f"{tuple(flat.shape)}, expected {sum(sizes)} elements of {dtypes}")
        for name, part in zip(names, flat.split(sizes), strict=True):
            wire[name] = part.view(expected[name][0])
    return wire


def _checked(wire: Mapping[str, torch.Tensor], meta: Mapping[str, str], layout: Layout, fmt: str | None,
             block: int | None, sparse: TopkSpec | None) -> _Tag:
    tag = _read_tag(meta, fmt, block, sparse)
    _check_wire(wire, _expected_wire(layout, tag), tag)
    return tag


def _read_tag(meta: Mapping[str, str], fmt: str | None, block: int | None, sparse: TopkSpec | None) -> _Tag:
    """The format and parameters the metadata claims, checked against what the caller expects."""
    got_fmt = meta.get(FORMAT_KEY)
    if got_fmt not in FORMATS:
        raise CorruptObjectError(f"compressed payload has {FORMAT_KEY}={got_fmt!r}, not one of {', '.join(FORMATS)}")
    if fmt is not None and got_fmt != fmt:
        raise CorruptObjectError(f"compressed payload is {FORMAT_KEY}={got_fmt!r}, expected {fmt!r}: "
                                 "the peer uses another store.compression")
    if got_fmt == "topk":
        return _Tag("topk", DEFAULT_BLOCK, _read_sparse_tag(meta, sparse))
    raw_block = meta.get(BLOCK_KEY)
    try:
        got_block = check_block(int(raw_block))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CorruptObjectError(f"compressed payload has {BLOCK_KEY}={raw_block!r}, not a positive integer") from None
    if block is not None and got_fmt in _QMAX and got_block != block:
        raise CorruptObjectError(f"compressed payload has {BLOCK_KEY}={got_block}, expected {block}: "
                                 "the peer quantizes with another block size")
    return _Tag(got_fmt, got_block, None)


def _read_sparse_tag(meta: Mapping[str, str], expected: TopkSpec | None) -> TopkSpec:
    """The ``TopkSpec`` a topk payload was encoded with (from its ``chunk``, ``k`` and ``value_bits``), once its
    position coding is the one this version reads."""
    if meta.get(POSITIONS_KEY) != POSITIONS_CODING:
        raise CorruptObjectError(f"compressed payload (topk) codes its positions as "
                                 f"{meta.get(POSITIONS_KEY) or 'fixed-width fields'}, not {POSITIONS_CODING}: "
                                 "the peer runs another diloco version; launch every replica from the same one")
    try:
        chunk, k, value_bits = (int(meta[key]) for key in TOPK_KEYS)
        got = TopkSpec(density=k / chunk, chunk=chunk, value_bits=value_bits)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        found = {key: meta.get(key) for key in TOPK_KEYS}
        raise CorruptObjectError(f"compressed payload (topk) has {found}, not a valid chunk, k and value_bits") \
            from None
    if got.k != k:
        raise CorruptObjectError(f"compressed payload (topk) keeps k={k} of chunk={chunk}, not a valid count")
    if expected is not None and (got.chunk, got.k, got.value_bits) != (expected.chunk, expected.k,
                                                                        expected.value_bits):
        raise CorruptObjectError(f"compressed payload (topk) has chunk={got.chunk}, k={got.k}, value_bits="
                                 f"{got.value_bits}, expected chunk={expected.chunk}, k={expected.k}, value_bits="
                                 f"{expected.value_bits}: the peer sparsifies with other parameters")
    return got


def _expected_wire(layout: Layout, tag: _Tag) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every wire tensor's (shape, dtype) that ``encode`` produces for ``layout``."""
    import torch

    from diloco.collectives import bitpack

    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, (shape, dtype) in layout.items():
        shape = tuple(shape)
        n = _numel(shape)
        if tag.fmt == "none":
            expected[name] = (shape, dtype)
        elif tag.fmt == "bf16":
            expected[name] = (shape, torch.bfloat16)
        elif tag.fmt == "topk":
            spec = tag.sparse
            assert spec is not None
            kept = spec.kept(n)
            expected[name + INDEX_SUFFIX] = ((spec.index_nbytes(n),), torch.uint8)
            expected[name + CODES_SUFFIX] = ((bitpack.packed_nbytes(kept, spec.value_bits),), torch.uint8)
            expected[name + SCALE_SUFFIX] = ((spec.num_chunks(n) * spec.levels,), torch.float32)
        else:
            code_dtype = torch.int8 if tag.fmt == "int8" else torch.uint8
            expected[name + CODES_SUFFIX] = ((_code_bytes(n, tag.fmt),), code_dtype)
            expected[name + SCALE_SUFFIX] = ((blockquant.num_blocks(n, tag.block),), torch.float32)
    return expected


def _check_wire(wire: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                tag: _Tag) -> None:
    what = f"{tag.fmt} payload ({_describe(tag)})"
    if set(wire) != set(expected):
        extra = sorted(set(wire) - set(expected))
        missing = sorted(set(expected) - set(wire))
        raise CorruptObjectError(f"{what} holds other wire tensors than its layout implies: "
                                 f"extra {extra}, missing {missing}")
    for name, (shape, dtype) in expected.items():
        t = wire[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise CorruptObjectError(f"{what}: wire tensor {name!r} is {t.dtype} {tuple(t.shape)}, expected "
                                     f"{dtype} {shape}")


def _describe(tag: _Tag) -> str:
    if tag.sparse is not None:
        return f"chunk {tag.sparse.chunk}, k {tag.sparse.k}, {tag.sparse.value_bits}-bit values"
    return f"block {tag.block}"


# ---------------------------------------------------------------- small helpers
def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _code_bytes(n: int, fmt: str) -> int:
    return n if fmt == "int8" else -(-n // 2)
