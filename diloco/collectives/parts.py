"""Parts: each local process of a sharded replica exchanges its own rows of the contribution through the store.

Why: a replica whose model is sharded over K local processes (FSDP2) holds each parameter's rows spread over
them (``diloco.collectives.part_layout``). Gathering the pseudo-gradient to one process would put the whole model
in one process's memory and the whole payload on one network path. Instead every local process runs its own
collective over the rows it holds, in parallel with its siblings: per process, the snapshot, the accumulator and
the bytes moved are about 1/K of the payload, and the replica's bandwidth is the sum of its processes'.

One round, for local process p of a replica of K (``PartsExchange``):

1. **Publish** ``round_NNNNNN/rank_RRRR/part_PPPP.safetensors`` (``diloco.store.layout.part_key``): the rows it
   holds, one piece per tensor (``<name>@<first row>-<end row>``, flattened), each piece encoded on its own with
   the run's ``store.compression`` (error feedback per piece), streamed (``codec.encode_stream``). The metadata
   names the round, the replica, the part, K (``parts``), a digest of the whole payload's names and shapes, and
   lists the pieces with the wire tensors each was encoded to and the format's tag of each.
2. **Reduce.** For every replica in rank order 0..N-1: our own decoded pieces, or, for a peer, its part 0's header
   (which says its K), then, of each of its parts whose rows overlap ours (a pure function of its K and the
   shapes, checked against the part's list), the overlapping pieces: verified ranged GETs of their wire bytes, in
   batches of at most ``BATCH_BYTES``, decoded and added. A peer with our K holds exactly our rows in its part p:
   one header probe of its part 0, one of part p, and one GET per batch.
3. The sum is divided by N. That is the mean.

Identical results: every element's mean is the sum over replicas in rank order, in fp32, divided by N: the very
operations ``diloco.collectives.reduce.average`` performs, so uncompressed means are bitwise those of gather, and
the same on every replica whatever its K. Compressed, a piece is quantised in blocks from its own first element;
a reader always decodes whole pieces (never a block cut out of one), so every replica, the writer included, uses
the same decoded values of every piece, whatever its own partition.

A replica that died in the middle of uploading (a local process killed after its part landed, before its
siblings' did) leaves its contribution incomplete: peers may already have read and added the parts that landed,
so those bytes are final. Relaunched, each of its processes whose part of that round is in the store publishes
nothing and reads its own rows back from that part, as every peer does, while the others publish theirs: every
replica then averages the very same contribution (``PartsExchange.publish``). A contribution that is complete is
never recomputed: the replica waits for that round to commit instead (``replica_contributed``, used by the
manager's rejoin). A relaunch with another number of processes in such a round cannot complete it, and says so.

Failures are the other strategies': a part missing past ``timeout_s`` is an ``AllReduceTimeout`` naming the round
and the rank; a part that fails its digests, or is of another round, replica, run, world size, payload, partition
or format, is re-read a few times, then a ``CorruptObjectError``. Not supported here: ``min_replicas`` (partial
participation) and fp64 payloads (averaged in fp32).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diloco.collectives.driver import Deadline, RoundDriver, RoundIO
from diloco.collectives.part_layout import (
    Piece,
    ShardSpec,
    check_specs,
    payload_digest,
    pieces_of,
    pieces_of_part,
)
from diloco.collectives.wire import PayloadCodec
from diloco.errors import CorruptObjectError, DilocoError
from diloco.store import codec
from diloco.store.layout import check_spread, part_key, part_prefix

if TYPE_CHECKING:
    import torch

    from diloco.store.objects import ObjectStore

#: Verification granularity of a part (``codec.encode_stream``'s ``chunk_bytes``): a ranged read of a few pieces
#: fetches at most this much more than it needs at each end.
CHUNK_BYTES = 2**20
#: Wire bytes of a peer's pieces read, decoded and added at a time: what a round holds in flight on top of the
#: snapshot and the accumulator.
BATCH_BYTES = 16 * 2**20
#: Metadata keys of a part.
PARTS_KEY, PIECES_KEY = "parts", "pieces"


@dataclass
class _Snapshot:
    shapes: dict[str, tuple[int, ...]]  # the whole tensors' shapes, by name
    local_shapes: dict[str, tuple[int, ...]]  # the caller's tensors' shapes (its rows)
    pieces: list[Piece]
    flats: dict[str, torch.Tensor]  # piece label -> fp32 CPU copy, flattened


@dataclass
class _Published:
    shapes: dict[str, tuple[int, ...]]
    local_shapes: dict[str, tuple[int, ...]]
    pieces: list[Piece]
    decoded: dict[str, torch.Tensor]  # piece label -> what peers decode of it (dropped once added)
    digest: str = field(default="")
    #: Our part was in the store already (written before a restart): our own rows are read back from it.
    reused: bool = False


@dataclass(frozen=True)
class _Wanted:
    """Rows ``[lo, hi)`` that one of our pieces (``mine``) needs from a peer's piece (``theirs``)."""

    mine: Piece
    theirs: Piece
    lo: int
    hi: int


class PartsExchange:
    """One local process's round (see the module docstring). ``expect`` names the rows the next snapshot holds."""

    def __init__(self, codec_: PayloadCodec, *, part: int, parts: int, spread: int = 1) -> None:
        if parts < 1 or not 0 <= part < parts:
            raise ValueError(f"local process {part} is not one of {parts}")
        self.codec = codec_
        self.part, self.parts = part, parts
        self.spread = check_spread(spread)
        self._specs: dict[str, ShardSpec] | None = None

    def expect(self, specs: Mapping[str, ShardSpec]) -> None:
        """The rows of the tensors the next ``snapshot`` receives (without it, each tensor is held whole)."""
        self._specs = dict(specs)

    # ---------------------------------------------------------------- caller's thread
    def snapshot(self, tensors: Mapping[str, torch.Tensor]) -> _Snapshot:
        import torch

        specs, self._specs = self._specs, None
        if specs is None:
            specs = {name: ShardSpec.whole(t.shape) for name, t in tensors.items()}
        if set(specs) != set(tensors):
            raise ValueError(f"the rows given name {sorted(specs)}, the tensors are {sorted(tensors)}")
        check_specs(specs, self.parts, self.part)
        flats: dict[str, torch.Tensor] = {}
        for name, spec in specs.items():
            t = tensors[name]
            if t.dtype == torch.float64:
                raise TypeError(f"{name!r} is float64; a sharded replica's round averages in fp32")
            if t.numel() != spec.rows * spec.row_size:
                raise ValueError(f"{name!r} has {t.numel()} elements, but rows [{spec.row_start}, {spec.row_end}) "
                                 f"of {spec.shape} are {spec.rows * spec.row_size}")
        pieces = pieces_of(specs)
        for piece in pieces:
            flats[piece.label] = tensors[piece.name].detach().reshape(-1).to("cpu", torch.float32, copy=True)
        return _Snapshot({n: s.shape for n, s in specs.items()}, {n: tuple(t.shape) for n, t in tensors.items()},
                         pieces, flats)

    # ---------------------------------------------------------------- round thread: publish
    def publish(self, io: RoundIO, round_: int, snapshot: _Snapshot) -> _Published:
        digest = payload_digest(snapshot.shapes)
        key = part_key(round_, io.rank, self.part, self.spread)
        if io.store.exists(key):  # our previous life uploaded it: peers may have added it already (module docstring)
            header = codec.read_header(io.store, key)
            written = header.metadata.get(PARTS_KEY)
            if written != str(self.parts):
                raise DilocoError(
                    f"round {round_ + 1}: replica {io.rank} had uploaded part of its contribution as {written} local "
                    f"processes before it restarted; as {self.parts} it cannot complete that contribution",
                    hint=f"relaunch the replica with --procs-per-replica {written}")
            snapshot.flats.clear()
            return _Published(snapshot.shapes, snapshot.local_shapes, snapshot.pieces, {}, digest, reused=True)
        wire_all: dict[str, torch.Tensor] = {}
        decoded: dict[str, torch.Tensor] = {}
        listing: list[list[Any]] = []
        for piece in snapshot.pieces:
            flat = snapshot.flats.pop(piece.label)
            wire, meta, dec = self.codec.encode_contribution((digest, piece.label), {piece.label: flat})
            listing.append([piece.name, piece.start, piece.end, sorted(wire), dict(meta)])  # each piece its own tag
            wire_all.update(wire)
            decoded[piece.label] = dec[piece.label]
            del flat, wire, dec
        metadata = {**self._identity(io, round_, io.rank, self.part, digest), PARTS_KEY: self.parts,
                    PIECES_KEY: json.dumps(listing, separators=(",", ":"))}
        size, chunks = codec.encode_stream(wire_all, metadata, chunk_bytes=CHUNK_BYTES)
        del wire_all
        io.wrote(io.store.put_stream(part_key(round_, io.rank, self.part, self.spread), chunks, size))
        return _Published(snapshot.shapes, snapshot.local_shapes, snapshot.pieces, decoded, digest)

    def own_keys(self, round_: int, rank: int) -> list[str]:
        return [part_key(round_, rank, self.part, self.spread)]

    # ---------------------------------------------------------------- round thread: reduce
    def reduce(self, io: RoundIO, round_: int, published: _Published) -> dict[str, torch.Tensor]:
        import torch

        deadline = io.deadline()
        acc: dict[str, torch.Tensor] = {}
        for replica in range(io.world_size):
            first = replica == 0
            if replica == io.rank and published.reused:
                self._add_peer(io, round_, replica, published, acc, first, deadline)
            elif replica == io.rank:
                for piece in published.pieces:
                    own = published.decoded.pop(piece.label)
                    if first:
                        acc[piece.label] = own  # private (our snapshot or its decoded copy): the accumulator
                    else:
                        acc[piece.label].add_(own)
                    del own
            else:
                self._add_peer(io, round_, replica, published, acc, first, deadline)
        mean: dict[str, torch.Tensor] = {}
        by_name = {piece.name: piece for piece in published.pieces}
        for name, local_shape in published.local_shapes.items():
            piece = by_name.get(name)
            if piece is None:
                mean[name] = torch.zeros(local_shape, dtype=torch.float32)
            else:
                mean[name] = acc.pop(piece.label).div_(io.world_size).view(local_shape)
        return mean

    def _add_peer(self, io: RoundIO, round_: int, peer: int, published: _Published, acc: dict[str, torch.Tensor],
                  first: bool, deadline: Deadline) -> None:
        """Add ``peer``'s values of our rows into ``acc`` (copy them when ``first``)."""
        import torch

        header0 = self._await_header(io, round_, peer, 0, None, published, deadline)
        parts = int(header0.metadata[PARTS_KEY])
        for q in range(parts):
            theirs = pieces_of_part(published.shapes, parts, q)
            wanted = [_Wanted(mine, their, *rows) for their in theirs for mine in published.pieces
                      if (rows := mine.overlap(their)) is not None]
            if not wanted:
                continue
            header = header0 if q == 0 else self._await_header(io, round_, peer, q, parts, published, deadline)
            key = part_key(round_, peer, q, self.spread)
            for batch in _batches(wanted, header):
                values = io.read_verified(round_, peer, f"contribution (part {q})", io.store.url(key),
                                          lambda b=batch, h=header, k=key: self._read_batch(io, k, h, b,
                                                                                            published.shapes))
                for want, their_values in zip(batch, values, strict=True):
                    row_size = published.shapes[want.mine.name][1:]
                    size = _numel(row_size)
                    target = acc.get(want.mine.label)
                    if target is None:
                        target = acc[want.mine.label] = torch.empty((want.mine.end - want.mine.start) * size,
                                                                    dtype=torch.float32)
                    lo, hi = (want.lo - want.mine.start) * size, (want.hi - want.mine.start) * size
                    source = their_values[(want.lo - want.theirs.start) * size:(want.hi - want.theirs.start) * size]
                    if first:
                        target[lo:hi].copy_(source)
                    else:
                        target[lo:hi].add_(source)
                del values

    def _await_header(self, io: RoundIO, round_: int, peer: int, part: int, parts: int | None,
                      published: _Published, deadline: Deadline) -> codec.ObjectHeader:
        key = part_key(round_, peer, part, self.spread)
        io.await_object(round_, peer, lambda r: part_key(round_, r, part, self.spread), deadline)
        return io.read_verified(round_, peer, f"contribution (part {part})", io.store.url(key),
                                lambda: self._read_header(io, round_, peer, part, parts, published, key))

    def _read_header(self, io: RoundIO, round_: int, peer: int, part: int, parts: int | None,
                     published: _Published, key: str) -> codec.ObjectHeader:
        """The verified header of ``peer``'s part ``part``: its identity, K and the pieces it lists."""
        header = codec.read_header(io.store, key)
        io.read(header.data_offset)
        source = io.store.url(key)
        meta = header.metadata
        for name, want in self._identity(io, round_, peer, part, published.digest).items():
            if meta.get(name) != str(want):
                raise CorruptObjectError(f"{source} has {name}={meta.get(name)!r}, expected {str(want)!r} (another "
                                         f"round, replica, run or model)")
        try:
            count = int(meta.get(PARTS_KEY, ""))
            listing = json.loads(meta.get(PIECES_KEY, ""))
        except ValueError as exc:
            raise CorruptObjectError(f"{source} does not say how many parts its replica has, or which pieces it "
                                     f"holds: {exc}") from exc
        if count < 1 or part >= count or (parts is not None and count != parts):
            raise CorruptObjectError(f"{source} claims to be part {part} of {count}"
                                     + (f", its part 0 said {parts}" if parts is not None else ""))
        expected = [[p.name, p.start, p.end] for p in pieces_of_part(published.shapes, count, part)]
        if not isinstance(listing, list) or [entry[:3] for entry in listing] != expected:
            raise CorruptObjectError(f"{source} does not hold the rows part {part} of {count} holds of this model")
        for entry in listing:
            missing = [w for w in entry[3] if w not in header.tensors]
            if missing or len(entry) != 5 or not isinstance(entry[4], dict):
                raise CorruptObjectError(f"{source} lists a piece without its wire tensors or its format: {entry[:3]}")
        return header

    def _read_batch(self, io: RoundIO, key: str, header: codec.ObjectHeader,
                    batch: list[_Wanted], shapes: Mapping[str, tuple[int, ...]]) -> list[torch.Tensor]:
        """The decoded values (fp32, flat) of each wanted piece of ``batch``, in order: one verified ranged GET
        per run of contiguous wire bytes."""
        import torch

        names, tags = _wire_names(header), _wire_tags(header)
        spans = sorted({(header.tensors[w].begin, header.tensors[w].end)
                        for want in batch for w in names[want.theirs.label]})
        views: dict[str, torch.Tensor] = {}
        for begin, end in _merged(spans):
            data = codec.read_data(io.store, key, header, begin, end)
            io.read(len(data))
            for name, (_, view) in codec.tensors_from_data(header, data, begin, end).items():
                views[name] = view.view(header.tensors[name].shape)
        source = io.store.url(key)
        out = []
        for want in batch:
            label = want.theirs.label
            size = (want.theirs.end - want.theirs.start) * _numel(shapes[want.theirs.name][1:])
            wire = {w: views[w] for w in names[label]}
            values = self.codec.decode(wire, tags[label], {label: ((size,), torch.float32)}, source)[label]
            if tuple(values.shape) != (size,):
                raise CorruptObjectError(f"{source}: piece {label} decodes to {tuple(values.shape)}, not ({size},)")
            out.append(values)
        return out

    def _identity(self, io: RoundIO, round_: int, rank: int, part: int, digest: str) -> dict[str, str | int]:
        return io.identity(round_, rank, collective="parts", kind="contribution", part=part, payload=digest)


def _wire_names(header: codec.ObjectHeader) -> dict[str, list[str]]:
    """Piece label -> its wire tensors, from a verified header's list."""
    listing = json.loads(header.metadata[PIECES_KEY])
    return {Piece(name, start, end).label: list(wires) for name, start, end, wires, _ in listing}


def _wire_tags(header: codec.ObjectHeader) -> dict[str, dict[str, str]]:
    """Piece label -> the metadata its format tagged it with (``compression``, ``block``, ...)."""
    listing = json.loads(header.metadata[PIECES_KEY])
    return {Piece(name, start, end).label: {str(k): str(v) for k, v in tag.items()}
            for name, start, end, _, tag in listing}


def _batches(wanted: list[_Wanted], header: codec.ObjectHeader) -> list[list[_Wanted]]:
    """``wanted`` cut into runs of at most ``BATCH_BYTES`` of wire bytes (a bigger piece alone)."""
    names = _wire_names(header)
    batches: list[list[_Wanted]] = []
    current: list[_Wanted] = []
    size = 0
    for want in wanted:
        nbytes = sum(header.tensors[w].end - header.tensors[w].begin for w in names[want.theirs.label])
        if current and size + nbytes > BATCH_BYTES:
            batches.append(current)
            current, size = [], 0
        current.append(want)
        size += nbytes
    if current:
        batches.append(current)
    return batches


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted byte spans with touching ones joined (one GET each)."""
    out: list[tuple[int, int]] = []
    for begin, end in spans:
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def replica_contributed(store: ObjectStore, round_: int, rank: int, spread: int = 1) -> bool:
    """Whether replica ``rank``'s whole contribution to the round of index ``round_`` is in the store: part 0,
    and every other part of the count part 0 names. A restarted replica then waits for that round to commit; with
    only some parts there, it completes the contribution instead (see the module docstring)."""
    keys = set(store.list(part_prefix(round_, rank, spread)))
    first = part_key(round_, rank, 0, spread)
    if first not in keys:
        return False
    try:
        parts = int(codec.read_header(store, first).metadata.get(PARTS_KEY, ""))
    except (ValueError, CorruptObjectError):
        return False
    return all(part_key(round_, rank, q, spread) in keys for q in range(parts))


class PartsAllReduce(RoundDriver[_Snapshot, _Published]):
    """The parts collective of local process ``part`` of a replica of ``parts`` (see the module docstring).

    ``allreduce_shards_async(tensors, specs)`` averages the rows ``specs`` say the tensors hold; the mean is
    written back into them, as every collective does."""

    strategy = "parts"

    def __init__(self, uri: str, rank: int, world_size: int, *, part: int, parts: int, timeout_s: float = 1800,
                 poll_interval_s: float = 1.0, run_id: str | None = None, compression: str = "none",
                 error_feedback: bool = True, spread: int = 1, store: ObjectStore | None = None) -> None:
        self.part, self.parts = part, parts
        self._parts_exchange = PartsExchange(PayloadCodec(compression, error_feedback=error_feedback), part=part,
                                             parts=parts, spread=spread)
        super().__init__(uri, rank, world_size, exchange=self._parts_exchange, timeout_s=timeout_s,
                         poll_interval_s=poll_interval_s, run_id=run_id, spread=spread, store=store)

    def allreduce_shards_async(self, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec]) -> Any:
        """Start a round over the rows ``specs`` name (see ``allreduce_async`` for the rest)."""
        self._parts_exchange.expect(specs)
        return self.allreduce_async(tensors)

    def has_own_contribution(self, round_: int) -> bool:
        return self.store.exists(part_key(round_, self.rank, self.part, self.spread))

    def replica_contributed(self, round_: int) -> bool:
        """Whether this replica's whole contribution to the round of index ``round_`` is in the store."""
        return replica_contributed(self.store, round_, self.rank, self.spread)


def create_parts_allreduce(uri: str, rank: int, world_size: int, settings: Any = None, *, run_id: str | None = None,
                           part: int, parts: int) -> PartsAllReduce:
    """Local process ``part``'s collective, with the store settings a replica has (``timeout_s``,
    ``poll_interval_s``, ``compression``, ``error_feedback``, ``spread``; ``allreduce`` does not apply: a sharded
    replica always exchanges parts). ``ConfigError`` naming ``store.min_replicas`` when partial participation is
    asked for: a round of parts averages every replica."""
    from pydantic import ValidationError

    from diloco.errors import ConfigError, validation_line
    from diloco.store.settings import StoreSettings

    base = settings.model_dump(include=set(StoreSettings.model_fields)) if settings is not None else {}
    try:
        s = StoreSettings.model_validate(base)
    except ValidationError as exc:
        raise ConfigError(f"store.{validation_line(exc)}", hint="see docs/reference/configuration.md") from None
    if s.min_replicas is not None:
        raise ConfigError(f"store.min_replicas ({s.min_replicas}): a replica whose model is sharded over its local "
                          f"processes (FSDP) averages every replica's rows each round",
                          hint="drop --min-replicas, or train without fsdp")
    return PartsAllReduce(uri, rank, world_size, part=part, parts=parts, timeout_s=s.timeout_s,
                          poll_interval_s=s.poll_interval_s, run_id=run_id, compression=s.compression,
                          error_feedback=s.error_feedback, spread=s.spread)
