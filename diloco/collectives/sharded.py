"""Sharded: reduce-scatter then all-gather through the store, reading under 2·S per rank per round whatever N is.

The payload (every tensor, flattened in name order into one fp32 vector, each tensor starting at a multiple of the
compression block so a quantisation block never mixes two tensors, zero-padded) is cut into N equal shards of L
elements (L a multiple of the block, so no block straddles two shards). Rank r owns shard r.

1. **Publish.** Each rank writes ONE object, ``round_NNNNNN/rank_RRRR.safetensors``, holding its N shards as N
   uint8 tensors ``shard_0000``..: each is one shard's wire bytes (the compression format's tensors, packed),
   padded to the same P bytes, with a CRC-32 per shard (``diloco.store.codec.encode_stream`` with ``chunk_bytes = P``,
   so every shard is exactly one verified chunk).
2. **Reduce-scatter.** Rank r reads shard r of every peer's object, in rank order 0..N-1 (compressed, after
   adding its own: see below): ``codec.read_header`` then ``codec.read_data`` of exactly that shard's P bytes (one
   ranged GET, verified against its digest), decodes it to fp32 and accumulates; its own shard is the decoded
   version of what it sent. The mean is divided by N.
3. **Publish the reduced shard** as ``round_NNNNNN/shard_RRRR.safetensors`` (compressed again with the run's format,
   without error feedback; the owner uses the decoded version itself, so every rank holds the same bits).
4. **All-gather.** Rank r reads the N-1 other reduced shards (one GET each) and assembles the mean.

Per rank per round, with S the payload's wire size (fp32: 4 bytes per element; int8 about 1):

    written   S (1 PUT, its contribution) + S/N (1 PUT, its reduced shard)
    read      2·S·(N-1)/N  (N-1 shard ranges + N-1 reduced shards), plus per peer one header probe
              (``codec.HEADER_PROBE_BYTES``, 64 KiB, a few % below 2 MiB shards, negligible above)
    requests  2 PUTs; 2(N-1) header/data GETs + (N-1) reduced-shard GETs = 3(N-1) GETs; polling HEADs

against gather's S written, (N-1)·S read, 1 PUT and N-1 GETs: sharded reads less from N = 3 on (2S(N-1)/N vs
(N-1)S), at three times the GETs and one more phase (a round waits for the slowest rank twice). Which is faster
depends on whether the store's bandwidth or its per-request latency dominates: ``bench/allreduce_traffic.py``.

Identical results: an owner sums its shard in rank order 0..N-1 in fp32 and divides by N, the very operations
gather performs per element, so uncompressed sharded and gather means are bitwise equal; compressed, each
reduced shard is quantised once by its owner and every rank (the owner too) uses the decoded values. A compressed
owner adds its own shard first and then its peers' in rank order: only it sums that shard, so the order only has to
be fixed, and its encoded shard is then freed before the first peer's is read (at N = 2 a round held both: 2.77x
the payload at its peak for bf16 instead of 2.52x, ``bench/round_memory.py``).

Failures are gather's: a contribution or reduced shard missing past ``timeout_s`` is an ``AllReduceTimeout``
naming the round and the missing ranks (a reduced shard is named by its owner's rank); a shard that fails its
digest, or an object of another round, rank, run, world size, layout or format, is re-read a few times and then a
``CorruptObjectError`` naming the round and the rank. The payload must be fp32, bf16 or fp16 (it is averaged in
fp32); fp64 tensors need ``store.allreduce: gather``. Polling waits at most ``timeout_s`` per phase.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.collectives.driver import RoundDriver, RoundIO
from diloco.collectives.spares import Spares
from diloco.collectives.wire import PayloadCodec
from diloco.errors import ConfigError, CorruptObjectError
from diloco.formats.base import Allocator
from diloco.store import codec
from diloco.store.codec import ReadBuffer
from diloco.store.layout import check_spread, contribution_key, reduced_shard_key

if TYPE_CHECKING:
    import torch

#: Packed wire pieces and padded shards start at multiples of this (every dtype's alignment; codec's chunk unit).
ALIGN = 8
#: What the read buffer holds beyond a shard's wire bytes: a reduced shard's header and the probe read with it.
READ_RESERVE = 3 * codec.HEADER_PROBE_BYTES
#: Name of the single fp32 tensor a shard is, as far as the compression format is concerned.
SHARD_TENSOR = "x"


def shard_name(shard: int) -> str:
    return f"shard_{shard:04d}"


@dataclass(frozen=True)
class PayloadLayout:
    """How the caller's tensors map onto the flat fp32 vector and its N shards of L elements each."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]  # element offset of each tensor in the flat vector (a multiple of the block)
    total: int  # elements up to the end of the last tensor's last block (the rest of N*L is zero padding)
    shards: int
    shard_elements: int

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], shards: int, block: int) -> PayloadLayout:
        import torch

        names = tuple(sorted(tensors))
        for name in names:
            if tensors[name].dtype == torch.float64:
                raise TypeError(f"{name!r} is float64; the sharded all-reduce averages in fp32, so use "
                                "store.allreduce: gather for fp64 payloads")
        offsets, total = [], 0
        for name in names:  # every tensor starts a block: a block never mixes two tensors' magnitudes
            offsets.append(total)
            total += -(-tensors[name].numel() // block) * block
        per_shard = -(-max(total, 1) // shards)
        shard_elements = -(-per_shard // block) * block
        return cls(names, tuple(tuple(tensors[n].shape) for n in names), tuple(tensors[n].dtype for n in names),
                   tuple(offsets), total, shards, shard_elements)

    @property
    def key(self) -> tuple[object, ...]:
        """Identifies the payload's layout (error-feedback memory is kept per layout and shard)."""
        return (self.names, self.shapes, self.dtypes, self.shards)

    def split(self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One fp32 CPU copy of every tensor, in name order, zero-padded to N*L elements, in ``out`` (N*L fp32
        elements, or a new tensor): the N shards, as views of it. The same buffer later holds the gathered mean,
        so a round needs one payload-sized buffer for both."""
        import torch

        flat = out if out is not None else torch.empty(self.shards * self.shard_elements, dtype=torch.float32)
        done = 0
        for name, offset in zip(self.names, self.offsets, strict=True):
            flat[done:offset].zero_()  # the padding that ends the previous tensor's last block
            source = tensors[name].detach().reshape(-1)
            flat[offset:offset + source.numel()].copy_(source)  # to the CPU and fp32 at once
            done = offset + source.numel()
        flat[done:].zero_()
        return [self.shard(flat, j) for j in range(self.shards)]

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` shaped as the caller's tensors (fp32)."""
        return {name: flat[offset:offset + _numel(shape)].view(shape)
                for name, shape, offset in zip(self.names, self.shapes, self.offsets, strict=True)}

    def shard(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        return flat[index * self.shard_elements:(index + 1) * self.shard_elements]


@dataclass(frozen=True)
class WirePiece:
    """One wire tensor of a shard inside its packed bytes: name, dtype, shape and byte range."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class _Snapshot:
    layout: PayloadLayout
    flat: torch.Tensor  # N*L fp32 elements: the payload, padded; later the gathered mean
    shards: list[torch.Tensor]  # views of ``flat``


@dataclass
class _Published:
    layout: PayloadLayout
    own_shard: tuple[dict[str, torch.Tensor], dict[str, str]] | None  # our shard's wire tensors and tag, as peers
    # read them (dropped once summed)
    pieces: tuple[WirePiece, ...]  # how a shard's wire bytes are packed (identical for every shard and rank)
    shard_bytes: int  # P
    flat: torch.Tensor  # the snapshot's buffer, sent: the all-gather writes the mean into it


class ShardedExchange:
    """The sharded strategy's round (see the module docstring)."""

    def __init__(self, codec_: PayloadCodec, *, world_size: int, spread: int = 1) -> None:
        if codec_.format.not_shardable:
            raise ConfigError(f"store.compression {codec_.fmt} works with store.allreduce gather only: "
                              f"{codec_.format.not_shardable}", hint=f"use --allreduce gather with {codec_.fmt}")
        self.codec = codec_
        self.world_size = world_size  # the number of shards
        self.spread = check_spread(spread)
        self._spares = Spares()  # the latest round's buffer, for the next round's snapshot
        self._means: dict[int, torch.Tensor] = {}  # round -> the buffer holding its mean, until the caller has it
        self._reads = ReadBuffer()  # the reduced shards are read into it, in turn

    def snapshot(self, tensors: Mapping[str, torch.Tensor]) -> _Snapshot:
        """The payload as one padded fp32 vector, in a buffer an earlier round gave back when there is one
        (``diloco.collectives.spares``), cut into N shard views."""
        import torch

        layout = PayloadLayout.of(tensors, self.world_size, self.codec.block)
        flat = self._spares.empty((layout.shards * layout.shard_elements,), torch.float32)
        return _Snapshot(layout, flat, layout.split(tensors, out=flat))

    # ---------------------------------------------------------------- phase 1: publish
    def publish(self, io: RoundIO, round_: int, snapshot: _Snapshot) -> _Published:
        layout = snapshot.layout
        blobs: dict[str, torch.Tensor] = {}
        pieces: tuple[WirePiece, ...] = ()
        meta: dict[str, str] = {}
        own_shard = None
        for j in range(layout.shards):
            wire, meta = self.codec.encode_wire((layout.key, j), {SHARD_TENSOR: snapshot.shards[j]},
                                                empty=self._wire_memory(snapshot.shards[j], j == io.rank))
            blob, pieces = pack(wire)
            blobs[shard_name(j)] = blob
            if j == io.rank:
                # uncompressed: the snapshot's own shard itself (no copy); compressed: views of its blob, which
                # holds the same bytes (the wire tensors packed into one, copied where there are several)
                own_shard = (wire if not self.codec.compressed else unpack(blob, pieces), meta)
            del wire  # packed into the blob: a copy of several wire tensors is not held beside them
        shard_bytes = len(blobs[shard_name(0)])
        metadata = {**meta, **self._identity(io, round_, io.rank, layout, "contribution")}
        size, chunks = codec.encode_stream(blobs, metadata, chunk_bytes=shard_bytes)
        written = io.store.put_stream(contribution_key(round_, io.rank, self.spread), chunks, size)
        io.wrote(written)
        assert own_shard is not None
        return _Published(layout, own_shard, pieces, shard_bytes, snapshot.flat)

    def _wire_memory(self, shard: torch.Tensor, own: bool) -> Allocator | None:
        """Where a shard's wire tensors go: into the shard's own fp32 snapshot memory, which is not read again once
        the shard is encoded (error feedback encodes from its residual, never from the snapshot), until the
        all-gather writes that shard's mean there; so a round holds the snapshot, the residual and its read
        buffer, not every shard encoded for the upload beside them (at N = 2, bf16: 2.5x the payload). Not
        without error feedback (the encoder reads the snapshot itself): None, fresh memory. Our own shard's go
        into the read buffer, idle between rounds, since our shard of the snapshot is where its sum is added up
        (from our encoded shard, before any peer's is read into that buffer)."""
        if not (self.codec.compressed and self.codec.error_feedback):
            return None
        return self._read_memory() if own else carve(shard)

    def _read_memory(self) -> Allocator:
        """The read buffer's memory as it is now (never grown: a piece that does not fit gets fresh memory)."""
        import torch

        capacity = self._reads.capacity
        return carve(torch.frombuffer(self._reads.view(capacity), dtype=torch.uint8) if capacity else
                     torch.empty(0, dtype=torch.uint8))

    # ---------------------------------------------------------------- phases 2-4
    def reduce(self, io: RoundIO, round_: int, published: _Published) -> dict[str, torch.Tensor]:
        """Reduce-scatter, publish our reduced shard, all-gather. Each step drops what the next does not need
        (boxes, not locals, carry the big tensors), so a round holds at most the gathered mean plus one shard."""
        layout, flat = published.layout, published.flat
        size = self._publish_reduced(io, round_, layout, self._reduce_scatter(io, round_, published), flat)
        self._means = {round_: flat}
        return layout.unflatten(self._all_gather(io, round_, layout, flat, size))

    def release(self, round_: int) -> None:
        """The caller has ``round_``'s mean: its buffer may hold the next round's snapshot."""
        flat = self._means.pop(round_, None)
        if flat is not None:
            self._spares.give(round_, [flat])

    def close(self) -> None:
        """Drop the buffers kept for later rounds."""
        self._means = {}
        self._spares.clear()
        self._reads = ReadBuffer()

    def _publish_reduced(self, io: RoundIO, round_: int, layout: PayloadLayout, mean: torch.Tensor,
                         flat: torch.Tensor) -> int:
        """Publish our shard's mean (compressed once, without error feedback), streamed, and write what every
        rank will use of it into our shard of ``flat`` (the snapshot's buffer: its shards were all sent, so it
        can hold the mean; decoded in place, no shard-sized copy); -> the object's size (every owner's is the
        same give or take a few metadata digits). Compressed, the wire tensors go into the read buffer, idle
        between the reduce-scatter's reads (sized for a peer's encoded shard, the same size give or take the
        pieces' alignment) and the all-gather's, which start once the upload is done."""
        empty = self._read_memory() if self.codec.compressed else None
        wire, meta = self.codec.encode_plain_into({SHARD_TENSOR: mean}, {SHARD_TENSOR: layout.shard(flat, io.rank)},
                                                  empty=empty)
        size, chunks = codec.encode_stream(wire, {**meta, **self._identity(io, round_, io.rank, layout, "reduced")})
        io.wrote(io.store.put_stream(reduced_shard_key(round_, io.rank, self.spread), chunks, size))
        return size

    def own_keys(self, round_: int, rank: int) -> list[str]:
        return [contribution_key(round_, rank, self.spread), reduced_shard_key(round_, rank, self.spread)]

    def members_after(self, round_: int) -> list[int] | None:
        """A sharded round's shards belong to a fixed set of ranks: never elastic."""
        return None

    def _reduce_scatter(self, io: RoundIO, round_: int, published: _Published) -> torch.Tensor:
        """Our shard's sum over every rank (fp32, in ``_summing_order``), divided by N: every contribution, ours
        included, added from its wire tensors (decoded straight into the sum when compressed, the sum then being
        our shard of the snapshot's buffer, which was sent: no shard-sized accumulator)."""
        import torch

        deadline = io.deadline()
        shard_layout = {SHARD_TENSOR: ((published.layout.shard_elements,), torch.float32)}
        acc: dict[str, torch.Tensor] = {}
        empty = self._spares.empty
        if self.codec.compressed:  # our shard of the snapshot was encoded and sent: the sum can live there
            mine = published.layout.shard(published.flat, io.rank)
            empty = lambda shape, dtype: mine if (tuple(shape), dtype) == (tuple(mine.shape), mine.dtype) \
                else self._spares.empty(shape, dtype)  # noqa: E731
        for peer in self._summing_order(io.rank, io.world_size):
            if peer == io.rank:
                part, published.own_shard = published.own_shard, None
                assert part is not None
            else:
                if self.codec.compressed:
                    self._size_reads(published.shard_bytes)
                io.await_object(round_, peer, lambda r: contribution_key(round_, r, self.spread), deadline)
                key = contribution_key(round_, peer, self.spread)
                part = io.read_verified(round_, peer, f"contribution (shard {io.rank})", io.store.url(key),
                                        lambda peer=peer, key=key: self._read_shard(io, round_, peer, key, published))
            # ours or a freshly read buffer: private, so an uncompressed first one can be the accumulator
            self.codec.add_into(acc, part[0], part[1], shard_layout, owned=True, empty=empty)
            del part
        return acc[SHARD_TENSOR].div_(io.world_size)

    def _size_reads(self, shard_bytes: int) -> None:
        """Grow the read buffer once for the round, before its first read and with nothing else of the round held
        (our own encoded shard is added and dropped by then): every read and the reduced shard's wire tensors then
        fit without growing it again (a growth holds the old buffer and the new one at once)."""
        if self._reads.capacity < shard_bytes + READ_RESERVE:
            self._reads.view(shard_bytes + READ_RESERVE)

    def _summing_order(self, rank: int, world_size: int) -> list[int]:
        """The order our shard's contributions are added in. Uncompressed: ranks 0..N-1, the order gather sums
        in, so the two strategies give the same bits. Compressed: our own first, then the peers in rank order;
        the sum is still the same for every run of the round (one owner sums each shard, in a fixed order), and
        our encoded shard is dropped before the first peer's is read, so a round never holds both."""
        peers = [r for r in range(world_size) if r != rank]
        return [rank, *peers] if self.codec.compressed else list(range(world_size))

    def _all_gather(self, io: RoundIO, round_: int, layout: PayloadLayout, flat: torch.Tensor,
                    size_bound: int) -> torch.Tensor:
        """The whole mean vector, written into ``flat`` (the snapshot's buffer, which holds our reduced shard
        already): every other owner's reduced shard, read in owner order and decoded straight into its place."""
        deadline = io.deadline()
        for owner in range(io.world_size):
            if owner == io.rank:
                continue
            io.await_object(round_, owner, lambda r: reduced_shard_key(round_, r, self.spread), deadline)
            key = reduced_shard_key(round_, owner, self.spread)
            io.read_verified(round_, owner, "reduced shard", io.store.url(key),
                             lambda owner=owner, key=key: self._read_reduced(io, round_, owner, key, layout,
                                                                             size_bound, layout.shard(flat, owner)))
        return flat

    # ---------------------------------------------------------------- reads
    def _read_shard(self, io: RoundIO, round_: int, peer: int, key: str,
                    published: _Published) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Our shard of ``peer``'s contribution: header, then one verified ranged GET of its P bytes; its wire
        tensors (views of the read buffer) and tag, checked against our shard's layout."""
        import torch

        source = io.store.url(key)
        header = codec.read_header(io.store, key)
        io.read(header.data_offset)
        self._check_identity(header.metadata, io, round_, peer, published.layout, "contribution", source)
        entry = header.tensors.get(shard_name(io.rank))
        if entry is None or entry.dtype != torch.uint8 or entry.shape != (published.shard_bytes,) or \
                len(header.tensors) != published.layout.shards:
            raise CorruptObjectError(f"{source} does not hold {published.layout.shards} shards of "
                                     f"{published.shard_bytes} bytes (another layout or format)")
        # compressed, a shard is decoded into the sum before the next is read: every read can reuse one buffer;
        # uncompressed, the first shard read may become the sum itself, so each is read into memory of its own
        data = codec.read_data(io.store, key, header, entry.begin, entry.end,
                               buffer=self._reads if self.codec.compressed else None)
        io.read(len(data))
        blob = torch.frombuffer(data, dtype=torch.uint8)  # read_data returns writable memory: no copy
        wire = unpack(blob, published.pieces)
        shard_layout = {SHARD_TENSOR: ((published.layout.shard_elements,), torch.float32)}
        self.codec.check(wire, header.metadata, shard_layout, source)
        return wire, header.metadata

    def _read_reduced(self, io: RoundIO, round_: int, owner: int, key: str, layout: PayloadLayout,
                      size_bound: int, target: torch.Tensor) -> None:
        """``owner``'s reduced shard, decoded into ``target`` (its place in the mean): ``codec.read_object``, one
        GET into one buffer (our own reduced object's size is the hint: every owner's is the same give or take a
        few metadata digits), verified chunk by chunk and viewed in place (``get`` + ``decode_tensors`` would hold
        the shard two or three times), then decoded straight into ``target`` once every check passed (a decoded
        copy would cost a shard of fp32 more at the round's peak)."""
        import torch

        source = io.store.url(key)
        header, data = codec.read_object(io.store, key, data_bytes_hint=size_bound, buffer=self._reads)
        io.read(header.data_offset + len(data))
        meta = header.metadata
        wire = {name: view.view(header.tensors[name].shape)
                for name, (_, view) in codec.tensors_from_data(header, data, 0, header.data_size).items()}
        self._check_identity(meta, io, round_, owner, layout, "reduced", source)
        shard_layout = {SHARD_TENSOR: ((layout.shard_elements,), torch.float32)}
        if not self.codec.compressed:  # a compressed payload's tensors are checked against the layout on decode
            part = wire.get(SHARD_TENSOR)
            if set(wire) != {SHARD_TENSOR} or part is None or tuple(part.shape) != (layout.shard_elements,) or \
                    part.dtype != torch.float32:
                found = f"{part.dtype} {tuple(part.shape)}" if part is not None else f"tensors {sorted(wire)}"
                raise CorruptObjectError(f"{source} holds {found}, expected float32 ({layout.shard_elements},)")
        self.codec.decode_into(wire, meta, shard_layout, {SHARD_TENSOR: target}, source)

    # ---------------------------------------------------------------- identity
    def _identity(self, io: RoundIO, round_: int, rank: int, layout: PayloadLayout, kind: str) -> dict[str, str | int]:
        return io.identity(round_, rank, collective="sharded", kind=kind, shards=layout.shards,
                           shard_elements=layout.shard_elements, payload=layout_digest(layout))

    def _check_identity(self, meta: Mapping[str, str], io: RoundIO, round_: int, rank: int, layout: PayloadLayout,
                        kind: str, source: str) -> None:
        for key, want in self._identity(io, round_, rank, layout, kind).items():
            if meta.get(key) != str(want):
                raise CorruptObjectError(f"{source} has {key}={meta.get(key)!r}, expected {str(want)!r}")


# ---------------------------------------------------------------- packing a shard's wire tensors into bytes
def pack(wire: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[WirePiece, ...]]:
    """The wire tensors' bytes in name order, each starting at a multiple of ``ALIGN``, padded to ``ALIGN``:
    one uint8 tensor (a view of the tensor itself when there is one piece that needs no padding)."""
    import torch

    pieces, offset = [], 0
    for name in sorted(wire):
        t = wire[name].detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        pieces.append(WirePiece(name, t.dtype, tuple(t.shape), offset, offset + nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    total = max(offset, ALIGN)
    if len(pieces) == 1 and pieces[0].end == total:
        return wire[pieces[0].name].detach().contiguous().reshape(-1).view(torch.uint8), tuple(pieces)
    blob = torch.zeros(total, dtype=torch.uint8)
    for piece in pieces:
        t = wire[piece.name].detach().to("cpu").contiguous().reshape(-1)
        if piece.end > piece.begin:
            blob[piece.begin:piece.end].copy_(t.view(torch.uint8))
    return blob, tuple(pieces)


def carve(region: torch.Tensor) -> Allocator:
    """An allocator handing out consecutive pieces of ``region``'s memory (a contiguous CPU tensor), each
    starting on a 64-byte boundary, and fresh memory for a request that no longer fits."""
    import torch

    raw = region.view(-1).view(torch.uint8)
    used = [0]

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        start = -(-used[0] // 64) * 64
        nbytes = _numel(shape) * dtype.itemsize
        if region.device.type != "cpu" or start + nbytes > raw.numel():
            return torch.empty(shape, dtype=dtype)
        used[0] = start + nbytes
        return raw[start:start + nbytes].view(dtype).view(shape)

    return empty


def unpack(blob: torch.Tensor, pieces: tuple[WirePiece, ...]) -> dict[str, torch.Tensor]:
    """Inverse of ``pack`` (views of ``blob``), given the pieces of our own shard (every shard packs alike)."""
    return {p.name: blob[p.begin:p.end].view(p.dtype).view(p.shape) for p in pieces}


def layout_digest(layout: PayloadLayout) -> str:
    """A short digest of the payload's names, shapes and dtypes: a peer averaging another model is corrupt."""
    import hashlib

    text = repr([(n, s, str(d)) for n, s, d in zip(layout.names, layout.shapes, layout.dtypes, strict=True)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class ShardedAllReduce(RoundDriver[_Snapshot, _Published]):
    """The sharded all-reduce (see the module docstring). Only the constructor is its own: the round machinery
    is ``RoundDriver``'s, the wire format ``ShardedExchange``'s."""

    strategy = "sharded"

    def __init__(self, uri: str, rank: int, world_size: int, timeout_s: float = 1800, poll_interval_s: float = 1.0,
                 run_id: str | None = None, *, compression: str = "none", error_feedback: bool = True,
                 spread: int = 1, codec: PayloadCodec | None = None) -> None:
        codec = codec or PayloadCodec(compression, error_feedback=error_feedback)
        exchange = ShardedExchange(codec, world_size=world_size, spread=spread)
        super().__init__(uri, rank, world_size, exchange=exchange, timeout_s=timeout_s,
                         poll_interval_s=poll_interval_s, run_id=run_id, spread=spread)
