"""What a contribution looks like on the wire: the run's compression format, with error feedback, per rank.

``store.compression: none`` sends the tensors as they are; any other format goes through ``diloco.collectives.compression``:
the rank encodes ``x + residual`` and keeps what the format lost for the next round (error feedback), and it
averages the *decoded* version of its own contribution, exactly what its peers decode from its object, so every
rank sums identical values and the means stay bitwise identical. The strategies add every contribution, their
own included, to their sum straight from its wire tensors (``encode_wire``, ``check``, ``add_into``): the same
operations on every rank, and no decoded copy of any contribution.

Error-feedback memory is keyed by the payload's layout (names, shapes, dtypes; plus the shard for the sharded
strategy): Streaming DiLoCo's fragments each get their own residual as long as their layouts differ. Two fragments
with identical layouts share one (a documented approximation). The residuals are part of a replica's own state
(``state_dict``): the outer loop keeps them with the inner optimizer's after each committed round, and a
rejoining replica restores them (``load_state_dict``), so its next contributions still carry what it owed.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

from diloco.collectives import compression
from diloco.collectives.reduce import Allocator, accumulate
from diloco.errors import CorruptObjectError
from diloco.formats import registry
from diloco.formats.base import WireFormat

if TYPE_CHECKING:
    import torch

    from diloco.store.settings import StoreSettings

NONE = "none"

Layout = Mapping[str, tuple[tuple[int, ...], "torch.dtype"]]
Wire = tuple[dict[str, "torch.Tensor"], dict[str, str], dict[str, "torch.Tensor"]]


class PayloadCodec:
    """One rank's wire format: encode its contributions (with error feedback) and decode its peers'."""

    def __init__(self, fmt: str | WireFormat = NONE, *, error_feedback: bool = True, block: int | None = None,
                 sparse: compression.TopkSpec | None = None, feedback_decay: float = 1.0) -> None:
        #: The format with its parameters (a name takes its defaults, ``block`` and ``sparse`` aside).
        self.format = compression.resolve(fmt, block, sparse)
        self.fmt = self.format.name
        self.block = self.format.alignment  # the sharded strategy aligns every tensor to it
        self.error_feedback = error_feedback
        self.feedback_decay = feedback_decay
        self._feedback: dict[Hashable, Any] = {}  # layout key -> compression.ErrorFeedback
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # restored residuals, by layout id, not yet used

    @classmethod
    def from_settings(cls, settings: StoreSettings) -> PayloadCodec:
        """The wire format the store settings name (``diloco.store.settings``): the format with its parameters
        (``diloco.formats.registry.from_settings``), error feedback and its decay."""
        return cls(registry.from_settings(settings), error_feedback=settings.error_feedback,
                   feedback_decay=settings.error_feedback_decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every error-feedback residual as ``<layout id>/<name>`` -> fp32 CPU tensor (safetensors-storable): what
        a rejoining replica restores, so the rounds it sends next still carry what earlier rounds did not send."""
        return {f"{layout_id(key)}/{name}": residual for key, feedback in self._feedback.items()
                for name, residual in feedback.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Residuals ``state_dict`` returned, applied to each payload layout when its first round is encoded (a
        rejoining replica knows its layouts only then)."""
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        for full, tensor in state.items():
            layout, _, name = full.partition("/")
            self._pending.setdefault(layout, {})[name] = tensor

    @property
    def compressed(self) -> bool:
        return not self.format.lossless

    def encode_contribution(self, key: Hashable, tensors: Mapping[str, torch.Tensor]) -> Wire:
        """``(wire tensors, metadata, decoded)`` of this rank's contribution; ``decoded`` is what peers will see.

        Uncompressed, all three are the tensors themselves (no copy, no tag: the objects of a run without
        compression are what they always were). Compressed, the residual of the payload layout ``key`` is added
        before encoding and updated after (unless error feedback is off)."""
        if not self.compressed:
            return dict(tensors), {}, dict(tensors)
        return self._feedback_for(key).compress(as_fp32(tensors))

    def _feedback_for(self, key: Hashable) -> compression.ErrorFeedback:
        """The error-feedback memory of the payload layout ``key``."""
        feedback = self._feedback.get(key)
        if feedback is None:
            feedback = self._feedback[key] = compression.ErrorFeedback(self.format, enabled=self.error_feedback,
                                                                       decay=self.feedback_decay)
            restored = self._pending.pop(layout_id(key), None)
            if restored is not None:
                feedback.load_state_dict(restored)
        return feedback

    def encode_wire(self, key: Hashable, tensors: Mapping[str, torch.Tensor], *, empty: Allocator | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """``encode_contribution`` without the decoded tensors: for a reader that adds its own contribution to
        its sum from the wire tensors (``add_into``), exactly as it adds its peers'. Uncompressed, the tensors
        themselves and no tag. ``empty(shape, dtype)`` makes the payload-sized wire tensors of CPU tensors
        (``torch.empty`` by default; a round passes its spare buffers)."""
        if not self.compressed:
            return dict(tensors), {}
        wire, meta = self._feedback_for(key).compress_wire(as_fp32(tensors), empty=empty)
        return compression.pack(wire, meta) if self.format.packed else (wire, meta)

    def _unpacked(self, wire: Mapping[str, torch.Tensor], meta: Mapping[str, str],
                  layout: Layout) -> Mapping[str, torch.Tensor]:
        """A packed payload's wire tensors (views), or ``wire`` itself when it was not packed."""
        if meta.get(compression.PACKED_KEY) != "1":
            return wire
        return compression.unpack(wire, meta, layout, fmt=self.format)

    def check(self, wire: Mapping[str, torch.Tensor], meta: Mapping[str, str], layout: Layout, source: str) -> None:
        """``CorruptObjectError`` naming ``source`` unless a payload is in this run's format and decodes whole
        (checked before anything of it is added to a sum)."""
        sent = meta.get(compression.FORMAT_KEY, NONE)
        if sent != self.fmt:
            raise CorruptObjectError(f"{source} is compressed as {sent!r}, but this run uses store.compression "
                                     f"{self.fmt!r}")
        if self.compressed:
            try:
                compression.check(self._unpacked(wire, meta, layout), meta, layout, fmt=self.format)
            except CorruptObjectError as exc:
                raise CorruptObjectError(f"{source}: {exc}") from exc

    def add_into(self, acc: dict[str, torch.Tensor], wire: Mapping[str, torch.Tensor], meta: Mapping[str, str],
                 layout: Layout, *, owned: bool = False, empty: Allocator | None = None) -> None:
        """Add one contribution (ours or a peer's, already ``check``-ed) to the running sum ``acc`` (fp32, fp64
        for fp64 tensors); the first one creates it. Compressed payloads are decoded straight into the sum
        (``compression.decode_into``: no decoded copy per contribution). Every rank performs the same operations
        for every contribution, so every rank sums identical bits. ``owned``: the uncompressed tensors are this
        rank's private copy, so the first may become the sum itself instead of being copied. ``empty(shape,
        dtype)`` makes the sum's tensors (``torch.empty`` by default; a round passes its spare buffers)."""
        if not self.compressed:
            accumulate(acc, wire, owned=owned, empty=empty)
            return
        import torch

        first = not acc
        if first:
            for name, (shape, _dtype) in layout.items():
                acc[name] = empty(tuple(shape), torch.float32) if empty is not None else \
                    torch.empty(tuple(shape), dtype=torch.float32)
        compression.decode_into(self._unpacked(wire, meta, layout), meta, layout, acc,
                                mode="write" if first else "add", fmt=self.format)

    def encode_plain(self, tensors: Mapping[str, torch.Tensor]) -> Wire:
        """Like ``encode_contribution`` but without error feedback: for a value sent once (a reduced shard)."""
        if not self.compressed:
            return dict(tensors), {}, dict(tensors)
        fp32 = as_fp32(tensors)
        wire, meta = compression.encode(fp32, self.format)
        layout = compression.layout_of(fp32)
        return wire, meta, compression.decode(wire, meta, layout, fmt=self.format)

    def encode_plain_into(self, tensors: Mapping[str, torch.Tensor], out: Mapping[str, torch.Tensor], *,
                          empty: Allocator | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """``encode_plain`` whose decoded values are written into ``out`` (fp32 tensors shaped like ``tensors``,
        which may be ``tensors`` themselves) instead of a fresh payload-sized copy. Uncompressed, ``out`` gets
        the tensors as they are (no copy where they are ``out`` already). ``empty(shape, dtype)`` makes the wire
        tensors (memory the caller has spare, neither ``tensors``' nor ``out``'s)."""
        if not self.compressed:
            for name, t in tensors.items():
                if t.data_ptr() != out[name].data_ptr():
                    out[name].copy_(t)
            return dict(tensors), {}
        fp32 = as_fp32(tensors)
        wire, meta = compression.encode(fp32, self.format, empty=empty)
        compression.decode_into(wire, meta, compression.layout_of(fp32), out, mode="write", fmt=self.format)
        return wire, meta

    def decode_into(self, wire: Mapping[str, torch.Tensor], meta: Mapping[str, str], layout: Layout,
                    out: Mapping[str, torch.Tensor], source: str) -> None:
        """``decode`` written into ``out`` (contiguous fp32 tensors shaped as in ``layout``) instead of new
        tensors: a reader that assembles a payload from pieces decodes each straight into its place. Every check
        is made before ``out`` is touched."""
        sent = meta.get(compression.FORMAT_KEY, NONE)
        if sent != self.fmt:
            raise CorruptObjectError(f"{source} is compressed as {sent!r}, but this run uses store.compression "
                                     f"{self.fmt!r}")
        if not self.compressed:
            for name in layout:
                out[name].copy_(wire[name])
            return
        try:
            compression.decode_into(self._unpacked(wire, meta, layout), meta, layout, out, mode="write",
                                    fmt=self.format)
        except CorruptObjectError as exc:
            raise CorruptObjectError(f"{source}: {exc}") from exc

    def decode(self, wire: Mapping[str, torch.Tensor], meta: Mapping[str, str], layout: Layout,
               source: str) -> dict[str, torch.Tensor]:
        """A peer's tensors as named in ``layout``; ``CorruptObjectError`` naming ``source`` when its format is
        not this run's (a peer of another configuration is corrupt, never silently decoded)."""
        sent = meta.get(compression.FORMAT_KEY, NONE)
        if sent != self.fmt:
            raise CorruptObjectError(f"{source} is compressed as {sent!r}, but this run uses store.compression "
                                     f"{self.fmt!r}")
        if not self.compressed:
            return dict(wire)
        try:
            return compression.decode(self._unpacked(wire, meta, layout), meta, layout, fmt=self.format)
        except CorruptObjectError as exc:
            raise CorruptObjectError(f"{source}: {exc}") from exc


def as_fp32(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 CPU versions (no copy when already fp32 on the CPU): what the compression formats take."""
    import torch

    return {name: t.detach().to("cpu", torch.float32) for name, t in tensors.items()}


def layout_id(key: Hashable) -> str:
    """A payload layout's stable name across processes (a rejoining replica must find its residuals again)."""
    import hashlib

    return hashlib.sha256(repr(key).encode()).hexdigest()[:16]
