"""The payload framing around the wire formats, and the error feedback that keeps their rounding from accumulating.

Why: a pseudo-gradient is the whole model's size every round, and the store's bandwidth is what a DiLoCo round
costs. Streaming DiLoCo sends 4-bit outer gradients without loss (arXiv 2501.18512), INTELLECT-1 sent int8
(arXiv 2412.01152), SparseLoCo sends 1-3% of the entries at 2 bits each (arXiv 2508.15706). This module is pure
tensor arithmetic (no I/O): the all-reduce encodes its contribution with ``encode`` (or ``ErrorFeedback.compress``),
stores the wire tensors with ``diloco.store.codec`` (safetensors, never pickle) and turns every peer's wire tensors
back into fp32 with ``decode`` (or adds them straight into its sum with ``decode_into``) before it accumulates (in
fp32, in rank order: the caller's job).

The formats are registered classes, one module each (``diloco.formats``: ``none``, ``bf16``, ``int8``, ``int4``,
``topk``; their module docstrings are the bit layouts). A format is given here as an instance with its parameters
(``Int8(block=128)``, ``Topk(density=0.01)``) or by name (its defaults; ``block`` and ``sparse`` set the integer
formats' block and topk's parameters, for callers that name the format). This module does what is the same for
every format: one tag per payload (``compression`` and the format's parameters, ``WireFormat.meta``), every wire
tensor's name, dtype and shape checked against what the format makes of the layout before anything is decoded,
packing, and error feedback.

Determinism: every built-in format's steps are IEEE-754 operations with one correctly rounded result, casts,
integer comparisons or copies, with no randomness and no sum, so the same input gives the same bits on every
machine and device, and every rank decodes its own contribution to the very values its peers decode (one caveat:
a process that flushes subnormals to zero, ``torch.set_flush_denormal(True)``, rounds blocks whose absmax is below
~1e-36 differently; diloco never sets it).

Edge cases, on purpose: an all-zero block (chunk) decodes to exact zeros; a block (chunk) holding a NaN or an
infinity decodes to NaN in every element (a diverged replica stays visible in the mean instead of being clipped
into plausible numbers); empty tensors and 0-d tensors round-trip with their shape.

Where the work happens: on the tensor's device (a CUDA pseudo-gradient is encoded on the GPU and only the wire
tensors are copied to the host).

``decode`` checks the tag, the parameters and every wire tensor's name, dtype and shape against the layout, and
raises ``CorruptObjectError`` on any mismatch: a peer using another format is corrupt, never silently decoded.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from diloco.errors import CorruptObjectError
from diloco.formats import registry
from diloco.formats.base import (
    BLOCK_KEY,
    CODES_SUFFIX,
    DEFAULT_BLOCK,
    FORMAT_KEY,
    INDEX_SUFFIX,
    MODES,
    SCALE_SUFFIX,
    Allocator,
    BlockTagged,
    WireFormat,
    check_block,
    numel,
)
from diloco.formats.kernels.topk import TopkSpec
from diloco.formats.topk import POSITIONS_CODING, POSITIONS_KEY, TOPK_KEYS, Topk

if TYPE_CHECKING:
    import torch

#: The formats known when this module is imported: the built-ins in their documented order, then installed entry
#: points (``diloco.formats.registry.names()`` is the live list, with formats registered since).
FORMATS: tuple[str, ...] = registry.names()

#: name -> (shape, original dtype) of a payload: what ``decode`` needs to rebuild it.
Layout = Mapping[str, "tuple[tuple[int, ...], torch.dtype]"]

__all__ = ["BLOCK_KEY", "CODES_SUFFIX", "DEFAULT_BLOCK", "FORMATS", "FORMAT_KEY", "INDEX_SUFFIX", "POSITIONS_CODING",
           "POSITIONS_KEY", "SCALE_SUFFIX", "TOPK_KEYS", "ErrorFeedback", "TopkSpec", "WireFormat", "check",
           "check_block", "check_format", "decode", "decode_into", "encode", "layout_of", "resolve", "wire_nbytes"]


# ---------------------------------------------------------------- validation
def check_format(fmt: str) -> str:
    """``fmt`` if it names a registered format, else a ``ConfigError`` naming the setting and the choices."""
    registry.get(fmt)
    return fmt


def resolve(fmt: str | WireFormat, block: int | None = None, sparse: TopkSpec | None = None) -> WireFormat:
    """The format instance ``fmt`` names: an instance as it is; a name with its defaults, ``block`` for a blocked
    format and ``sparse`` for ``topk``. ``ConfigError`` for an unknown name, ``ValueError`` for a bad block."""
    if not isinstance(fmt, str):
        return fmt
    cls = registry.get(fmt)
    if block is not None:
        check_block(block)
    if issubclass(cls, BlockTagged):
        return cls(block=DEFAULT_BLOCK if block is None else block)
    if issubclass(cls, Topk) and sparse is not None:
        return Topk.of(sparse)
    return cls()


def layout_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The layout ``decode`` needs for a payload shaped like ``tensors``."""
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


# ---------------------------------------------------------------- sizes
def wire_nbytes(layout: Layout, fmt: str | WireFormat, block: int = DEFAULT_BLOCK, *,
                sparse: TopkSpec | None = None) -> int:
    """Bytes of the wire tensors ``encode`` produces for a payload of this layout (safetensors header excluded)."""
    wire_format = resolve(fmt, block, sparse)
    return sum(wire_format.wire_nbytes(tuple(shape), dtype) for shape, dtype in layout.values())


# ---------------------------------------------------------------- encode / decode
def encode(
    tensors: Mapping[str, torch.Tensor], fmt: str | WireFormat, *, block: int | None = None,
    sparse: TopkSpec | None = None, empty: Allocator | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Floating tensors -> (CPU wire tensors storable by safetensors, the metadata tag).

    Wire names derive from the input names (the format's module docstring has the bit layout). ``none`` passes
    each tensor through (CPU, contiguous, its own dtype); the lossy formats read every floating dtype as fp32 and
    do their work on the tensor's device, copying only the wire tensors to the host. ``empty(shape, dtype)`` makes
    the payload-sized wire tensors of CPU tensors (memory the caller has spare; never the input's own)."""
    wire, meta = _encode_on_device(tensors, resolve(fmt, block, sparse), empty)
    return {name: t.to("cpu") for name, t in wire.items()}, meta


def decode(
    wire: Mapping[str, torch.Tensor],
    meta: Mapping[str, str],
    layout: Layout,
    *,
    fmt: str | WireFormat | None = None,
    block: int | None = None,
    sparse: TopkSpec | None = None,
) -> dict[str, torch.Tensor]:
    """Inverse of ``encode``: fp32 tensors named and shaped as in ``layout`` (``none``: the original dtype), on
    the wire tensors' device.

    ``CorruptObjectError`` when the metadata's tag is missing or unknown, differs from what the caller expects
    (``fmt``, an instance or a name with ``block``/``sparse``; as the all-reduce does: a peer using another format
    is corrupt), or when the wire tensors are not exactly the ones ``layout`` implies (names, dtypes, shapes)."""
    got = _checked(wire, meta, layout, fmt, block, sparse)
    return {name: got.decode_new(wire, name, numel(tuple(shape))).view(tuple(shape))
            for name, (shape, _dtype) in layout.items()}


def decode_into(
    wire: Mapping[str, torch.Tensor],
    meta: Mapping[str, str],
    layout: Layout,
    out: Mapping[str, torch.Tensor],
    *,
    mode: str,
    fmt: str | WireFormat | None = None,
    block: int | None = None,
    sparse: TopkSpec | None = None,
) -> None:
    """``decode`` straight into ``out`` (contiguous tensors shaped as in ``layout``, fp32 or fp64): ``mode``
    "write" overwrites them, "add" adds the decoded values and "subtract" subtracts them, with exactly the
    operations ``out += decode(...)`` (``-=``) would perform (the same bits), but without a payload-sized
    temporary. For ``topk`` "add" and "subtract" touch only the kept positions (a sum of N sparse contributions
    costs N * k elements per chunk). Same checks and errors as ``decode``, all made before ``out`` is touched."""
    if mode not in MODES:
        raise ValueError(f"decode_into mode: {mode!r}; use one of {', '.join(MODES)}")
    got = _checked(wire, meta, layout, fmt, block, sparse)
    for name in layout:
        if not out[name].is_contiguous():
            raise ValueError(f"decode_into: the output for {name!r} must be contiguous")
    got.decode_payload(wire, {name: out[name].view(-1) for name in layout}, mode)


def check(wire: Mapping[str, torch.Tensor], meta: Mapping[str, str], layout: Layout, *,
          fmt: str | WireFormat | None = None, block: int | None = None, sparse: TopkSpec | None = None) -> None:
    """Raise ``CorruptObjectError`` exactly when ``decode`` would: the tag, the wire tensors and whatever else the
    format checks (``topk``: every kept position) are checked, nothing is decoded. What a reader runs before it
    adds a payload to a running sum, so a corrupt payload is refused whole, never half added."""
    got = _checked(wire, meta, layout, fmt, block, sparse)
    got.check_payload(wire, {name: numel(tuple(shape)) for name, (shape, _dtype) in layout.items()})


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

    def __init__(self, fmt: str | WireFormat, *, block: int | None = None, enabled: bool = True,
                 sparse: TopkSpec | None = None, decay: float = 1.0) -> None:
        self.format = resolve(fmt, block, sparse)
        self.fmt = self.format.name
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
            raise ValueError(f"error feedback decay: {decay!r} is not in (0, 1]; use 1 (plain) or 0.9-0.99")
        self.decay = float(decay)
        self.enabled = enabled and not self.format.lossless
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, torch.Tensor]]:
        """-> (wire, meta, decoded): ``wire`` on the CPU; ``decoded`` (on the tensors' device) is exactly
        ``decode(wire, meta, layout)``, which is what this rank must average as its own contribution, so every rank
        averages identical values (bitwise-identical results). ``tensors`` are not modified."""
        wire, meta = self._compress(tensors)
        decoded = decode(wire, meta, layout_of(tensors), fmt=self.format)
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
        decode(wire)``, subtracted in place (``decode_into``, mode "subtract": no decoded tensor is made).

        What is encoded is always memory of ours (the residual, or a copy of ``x`` made before encoding where no
        residual is kept yet), never the caller's tensor: with error feedback, ``empty`` may hand out the
        caller's memory for the wire tensors (a sharded round puts a shard's wire in the fp32 snapshot it was
        encoded from, which it no longer needs)."""
        if not self.enabled:
            return _encode_on_device(_as_fp32(tensors), self.format, empty)
        inputs, owned = self._with_residuals(tensors)
        residuals = {name: sent.contiguous() if name in owned else sent.clone(memory_format=_contiguous())
                     for name, sent in inputs.items()}  # never the caller's tensor
        wire, meta = _encode_on_device(residuals, self.format, empty)
        decode_into(wire, meta, layout_of(tensors), residuals, mode="subtract", fmt=self.format)
        if not self.format.residual_finite(wire):
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


def _contiguous() -> torch.memory_format:
    import torch

    return torch.contiguous_format


def _as_fp32(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch

    return {name: t.detach().to(torch.float32) for name, t in tensors.items()}


# ---------------------------------------------------------------- per-tensor work
def _encode_on_device(tensors: Mapping[str, torch.Tensor], wire_format: WireFormat,
                      empty: Allocator | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``encode``, leaving the lossy formats' wire tensors on the input's device; ``empty`` makes the wire tensors
    of CPU inputs (the payload-sized ones)."""
    return wire_format.encode_payload(tensors, empty), wire_format.meta()


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


def unpack(packed: Mapping[str, torch.Tensor], meta: Mapping[str, str], layout: Layout, *,
           fmt: str | WireFormat | None = None, block: int | None = None, sparse: TopkSpec | None = None
           ) -> dict[str, torch.Tensor]:
    """``pack`` undone, as views of ``packed``: the wire tensors ``encode`` made for ``layout``.
    ``CorruptObjectError`` when a packed tensor is not exactly as long as its parts."""
    tag = _read_tag(meta, fmt, block, sparse)
    expected = _expected_wire(layout, tag)
    by_kind = _by_kind(tuple(expected))
    if set(packed) != {f"{PACKED_NAME}:{kind}" for kind in by_kind}:
        raise CorruptObjectError(f"packed {tag.name} payload holds {sorted(packed)}, expected "
                                 f"{sorted(f'{PACKED_NAME}:{k}' for k in by_kind)}")
    wire: dict[str, torch.Tensor] = {}
    for kind, names in by_kind.items():
        flat = packed[f"{PACKED_NAME}:{kind}"]
        sizes = [numel(expected[n][0]) for n in names]
        dtypes = {expected[n][1] for n in names}
        if flat.dim() != 1 or flat.numel() != sum(sizes) or dtypes != {flat.dtype}:
            raise CorruptObjectError(f"packed {tag.name} payload: {PACKED_NAME}:{kind} is {flat.dtype} "
                                     f"{tuple(flat.shape)}, expected {sum(sizes)} elements of {dtypes}")
        for name, part in zip(names, flat.split(sizes), strict=True):
            wire[name] = part.view(expected[name][0])
    return wire


# ---------------------------------------------------------------- checks on read
def _checked(wire: Mapping[str, torch.Tensor], meta: Mapping[str, str], layout: Layout,
             fmt: str | WireFormat | None, block: int | None, sparse: TopkSpec | None) -> WireFormat:
    got = _read_tag(meta, fmt, block, sparse)
    _check_wire(wire, _expected_wire(layout, got), got)
    return got


def _read_tag(meta: Mapping[str, str], fmt: str | WireFormat | None, block: int | None,
              sparse: TopkSpec | None) -> WireFormat:
    """The format and parameters the metadata claims, checked against what the caller expects: all of an
    instance's parameters, or those of ``block`` and ``sparse`` that are given."""
    got_name = meta.get(FORMAT_KEY)
    known = registry.names()
    if got_name not in known:
        raise CorruptObjectError(f"compressed payload has {FORMAT_KEY}={got_name!r}, not one of {', '.join(known)}")
    expected_name = fmt if isinstance(fmt, str) or fmt is None else fmt.name
    if expected_name is not None and got_name != expected_name:
        raise CorruptObjectError(f"compressed payload is {FORMAT_KEY}={got_name!r}, expected {expected_name!r}: "
                                 "the peer uses another store.compression")
    cls = registry.get(got_name)
    got = cls.from_tag(meta)
    if isinstance(fmt, WireFormat):
        expected: WireFormat | None = fmt
    elif block is not None and issubclass(cls, BlockTagged):
        expected = cls(block=block)
    elif sparse is not None and issubclass(cls, Topk):
        expected = Topk.of(sparse)
    else:
        expected = None
    problem = expected.mismatch(got) if expected is not None else None
    if problem:
        raise CorruptObjectError(problem)
    return got


def _expected_wire(layout: Layout, got: WireFormat) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every wire tensor's (shape, dtype) that ``encode`` produces for ``layout`` (not to be modified: a
    payload's is computed once, since every round of a run reads the same layout for every peer)."""
    return _wire_of_layout(got, tuple((name, tuple(shape), dtype) for name, (shape, dtype) in layout.items()))


@functools.lru_cache(maxsize=64)
def _wire_of_layout(got: WireFormat, layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
                    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, shape, dtype in layout:
        expected.update(got.wire_of(name, shape, dtype))
    return expected


@functools.lru_cache(maxsize=64)
def _by_kind(names: tuple[str, ...]) -> dict[str, list[str]]:
    """A packed payload's wire tensor names by kind (``idx``, ``q``, ``scale``), each kind's in sorted order:
    the order ``pack`` lays them out in."""
    by_kind: dict[str, list[str]] = {}
    for name in sorted(names):
        by_kind.setdefault(name.rpartition(":")[2], []).append(name)
    return by_kind


def _check_wire(wire: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                got: WireFormat) -> None:
    what = f"{got.name} payload ({got.describe()})"
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
