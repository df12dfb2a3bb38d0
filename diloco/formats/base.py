"""What a wire format is (``WireFormat``) and what every format shares: the tag's keys and the wire-name suffixes.

A format is a frozen dataclass: its fields are its parameters (``int8``'s block, ``topk``'s density, chunk and
value bits), so one instance is one fully specified wire format, the thing the codec, the error feedback and the
all-reduce carry instead of a name plus every format's parameters. The payload framing around the formats (one tag
per payload, the wire tensors checked against the layout before anything is decoded, packing, error feedback) is
``diloco.collectives.compression``'s; a format only says what it does with one tensor.

Light on purpose: this module and every format module import no torch and nothing of the collectives at import
time, so the store settings can validate a format's name and parameters (``diloco.formats.registry``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from diloco.errors import CorruptObjectError

if TYPE_CHECKING:
    from typing import Self

    import torch

#: Metadata key of a payload's tag: the format's name (the rest of the tag is the format's parameters).
FORMAT_KEY = "compression"
#: Tag key of the dense formats' block (their quantisation block; the sharded strategy's alignment).
BLOCK_KEY = "block"
#: Elements per scale block of the integer formats, and the sharded strategy's alignment for every dense format.
DEFAULT_BLOCK = 256
#: Wire-name suffixes of formats that make several tensors of one: codes, scales, positions.
CODES_SUFFIX = ":q"
SCALE_SUFFIX = ":scale"
INDEX_SUFFIX = ":idx"
#: How a decoder treats its output: overwrite it, add the decoded values, or subtract them (error feedback's
#: residual is what was sent minus what was decoded).
MODES = ("write", "add", "subtract")

#: wire name -> (shape, dtype): the wire tensors a format makes of one tensor.
WireSpec = dict[str, tuple[tuple[int, ...], "torch.dtype"]]
#: ``empty(shape, dtype)``: where a caller wants the payload-sized wire tensors of a CPU tensor made.
Allocator = Callable[[tuple[int, ...], "torch.dtype"], "torch.Tensor"]


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """One wire format with its parameters. Subclasses set ``name`` (its ``store.compression`` value and its tag)
    and implement ``wire_of``, ``encode_tensor`` and ``decode_tensor``; the rest has defaults.

    ``encode_tensor`` and ``decode_tensor`` must be deterministic (the same bits on every machine): every rank
    decodes its own contribution to exactly what its peers decode, and the means stay bitwise identical."""

    #: The format's name: ``store.compression``'s value and the payload tag's ``compression``.
    name: ClassVar[str]
    #: One line for ``--compression``'s help and the docs.
    summary: ClassVar[str] = ""
    #: Decodes to exactly what was encoded: no error feedback is kept (``none``).
    lossless: ClassVar[bool] = False
    #: Its payloads go on the wire packed (``compression.pack``): a few tensors whatever the model, so the object's
    #: header does not outweigh a small payload.
    packed: ClassVar[bool] = False
    #: Why the sharded strategy cannot carry it (it re-encodes every reduced shard); None: it can.
    not_shardable: ClassVar[str | None] = None

    # ------------------------------------------------------------ parameters
    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        """The format with these parameters (``store.compression_options``): ``ValueError`` naming an unknown option
        or a value the format's rules refuse (``__post_init__``)."""
        known = sorted(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(options) - set(known))
        if unknown:
            takes = f"it takes {', '.join(known)}" if known else "it takes none"
            raise ValueError(f"compression_options: {', '.join(unknown)} is not an option of {cls.name} ({takes})")
        try:
            return cls(**options)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"compression_options: {exc}") from None

    @classmethod
    def from_settings(cls, settings: Any) -> Self:
        """The format as the store settings configure it (``diloco.store.settings.StoreSettings``): by default
        from ``store.compression_options``."""
        return cls.from_options(getattr(settings, "compression_options", None) or {})

    @property
    def alignment(self) -> int:
        """Elements the sharded strategy aligns every tensor to, so no block of the format mixes two tensors."""
        return DEFAULT_BLOCK

    def describe(self) -> str:
        """The parameters, for messages (``block 256``)."""
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in dataclasses.fields(self)) or "no parameters"

    # ------------------------------------------------------------ tag
    def tag(self) -> dict[str, str]:
        """The metadata this format's payloads carry besides their name: by default every parameter as text."""
        return {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def meta(self) -> dict[str, str]:
        """A payload's whole tag: its name, then its parameters."""
        return {FORMAT_KEY: self.name, **self.tag()}

    @classmethod
    def from_tag(cls, meta: Mapping[str, str]) -> Self:
        """The format a payload's tag says it was encoded with; ``CorruptObjectError`` when its parameters are
        missing or invalid. By default each parameter is read back from its key as its field's type."""
        params: dict[str, Any] = {}
        try:
            for f in dataclasses.fields(cls):
                raw = meta[f.name]
                kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
                params[f.name] = {"int": int, "float": float, "bool": lambda v: v == "True"}.get(kind, str)(raw)
            return cls(**params)
        except (KeyError, TypeError, ValueError):
            found = {f.name: meta.get(f.name) for f in dataclasses.fields(cls)}
            raise CorruptObjectError(f"compressed payload ({cls.name}) has {found}, not valid parameters") from None

    def mismatch(self, got: WireFormat) -> str | None:
        """Why a payload in ``got`` (the same format, read from its tag) may not be decoded by a run that expects
        ``self``, or None. By default any other parameter is refused."""
        if got == self:
            return None
        return (f"compressed payload ({self.name}) has {got.describe()}, expected {self.describe()}: the peer "
                f"uses other {self.name} parameters")

    # ------------------------------------------------------------ one tensor
    def wire_of(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> WireSpec:
        """Every wire tensor (name, shape, dtype) ``encode_tensor`` makes of a tensor of this shape and dtype."""
        raise NotImplementedError

    def encode_tensor(self, name: str, tensor: torch.Tensor, empty: Allocator | None = None
                      ) -> dict[str, torch.Tensor]:
        """The wire tensors of one tensor, on its device (``empty`` makes the payload-sized ones of a CPU
        tensor when given). Floating tensors only, unless the format says otherwise (``fp32`` checks)."""
        raise NotImplementedError

    def decode_tensor(self, wire: Mapping[str, torch.Tensor], name: str, out: torch.Tensor, mode: str) -> None:
        """Decode one tensor's wire tensors (already checked against ``wire_of``) into the flat fp32/fp64 ``out``:
        ``mode`` "write" overwrites it, "add" adds the decoded values, "subtract" subtracts them, each with the
        one operation per element that ``out += decoded`` would perform."""
        raise NotImplementedError

    def decode_new(self, wire: Mapping[str, torch.Tensor], name: str, numel: int) -> torch.Tensor:
        """One tensor decoded into a new flat fp32 tensor on the wire tensors' device."""
        import torch

        first = next(iter(self.wire_of(name, (numel,), torch.float32)))
        out = torch.empty(numel, dtype=torch.float32, device=wire[first].device)
        self.decode_tensor(wire, name, out, "write")
        return out

    def check_tensor(self, wire: Mapping[str, torch.Tensor], name: str, numel: int) -> None:
        """``CorruptObjectError`` when wire tensors of the right names, dtypes and shapes still do not decode
        (``topk``'s positions); nothing to check by default."""

    # ------------------------------------------------------------ a whole payload
    def encode_payload(self, tensors: Mapping[str, torch.Tensor], empty: Allocator | None = None
                       ) -> dict[str, torch.Tensor]:
        """The wire tensors of every tensor, in the payload's order (``encode_tensor`` of each, ``empty`` for the
        CPU ones). A format whose fixed cost per tensor dominates small tensors may do them together, with the
        same bits."""
        wire: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            wire.update(self.encode_tensor(name, tensor, empty if tensor.device.type == "cpu" else None))
        return wire

    def decode_payload(self, wire: Mapping[str, torch.Tensor], outs: Mapping[str, torch.Tensor], mode: str) -> None:
        """``decode_tensor`` of every flat output in ``outs`` (by name), with the same bits."""
        for name, out in outs.items():
            self.decode_tensor(wire, name, out, mode)

    def check_payload(self, wire: Mapping[str, torch.Tensor], numels: Mapping[str, int]) -> None:
        """``check_tensor`` of every tensor (name -> its elements)."""
        for name, n in numels.items():
            self.check_tensor(wire, name, n)

    def residual_finite(self, wire: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``x - decode(encode(x))`` is known finite everywhere from the wire alone (the error feedback
        then skips its pass that resets non-finite residuals); False when it cannot say."""
        return False

    def wire_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes of the wire tensors of one tensor (safetensors header excluded)."""
        return sum(numel(s) * d.itemsize for s, d in self.wire_of("t", shape, dtype).values())

    # ------------------------------------------------------------ helpers for subclasses
    def fp32(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as a contiguous fp32 tensor on its device; ``ValueError`` for a non-floating one."""
        import torch

        if not tensor.is_floating_point():
            raise ValueError(f"compression {self.name}: tensor {name!r} is {tensor.dtype}; only floating tensors "
                             "can be compressed")
        return tensor.detach().to(torch.float32).contiguous()


def check_block(block: object) -> int:
    """``block`` if it is a positive int, else a ``ValueError`` naming it (a zero block has no scale)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"compression block: {block!r} is not a positive number of elements; "
                         f"use the default {DEFAULT_BLOCK}")
    return block


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclasses.dataclass(frozen=True)
class BlockTagged(WireFormat):
    """A dense format tagged with a ``block``: the integer formats' quantisation block, and for every dense
    format the sharded strategy's alignment."""

    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        check_block(self.block)

    @property
    def alignment(self) -> int:
        return self.block

    def describe(self) -> str:
        return f"block {self.block}"

    @classmethod
    def from_tag(cls, meta: Mapping[str, str]) -> Self:
        raw = meta.get(BLOCK_KEY)
        try:
            return cls(block=check_block(int(raw)))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise CorruptObjectError(f"compressed payload has {BLOCK_KEY}={raw!r}, not a positive integer") from None

    def mismatch(self, got: WireFormat) -> str | None:
        """Only the quantising formats refuse another block; for the others it is the sender's alignment."""
        return None
