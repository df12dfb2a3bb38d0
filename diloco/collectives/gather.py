"""Gather: every rank publishes its whole contribution as one object and reads every peer's.

Per rank per round, for a payload of S bytes on the wire and N ranks: written S (1 PUT; a multipart upload above
the store's threshold), read (N-1)·S, plus the polling (one HEAD per peer per ``poll_interval_s`` until it
appears, after up to four quicker ones). Uncompressed, each peer's object is read as a header probe (64 KiB,
``codec.HEADER_PROBE_BYTES``) and verified ranged GETs of ``WINDOW_BYTES`` (32 MiB) that are accumulated as they
arrive, so memory stays at the snapshot plus the accumulator plus one window: (N-1)·(1 + ceil(S / 32 MiB)) GETs.
Compressed payloads (S/4 or less) are read whole: N-1 GETs. Small contributions, compressed or not (every peer's
payload together at most ``CONCURRENT_READ_MAX_BYTES`` at fp32), are read whole and all at once, each on a thread
of its own, so a round of small objects on a store with per-request latency (S3's tens of milliseconds) waits
about one request's time for its peers' objects instead of one per peer; they are still added in rank order, so the sum's
bits do not depend on which arrived first. Fewest requests and a single phase, so the lowest latency for small
payloads or small N; reads grow with N (the sharded strategy reads under 2·S whatever N is).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.collectives.driver import Deadline, RoundDriver, RoundIO
from diloco.collectives.reduce import accumulation_dtype, finish_mean, layout_of, number
from diloco.collectives.spares import Spares
from diloco.collectives.wire import PayloadCodec
from diloco.errors import ConfigError, CorruptObjectError, DilocoError
from diloco.store import codec
from diloco.store.codec import ReadBuffer
from diloco.store.layout import ROUND_MANIFEST_KEY, check_spread, contribution_key

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: Bytes of a peer's object read (and verified) per ranged GET when accumulating it: what a round holds in flight
#: on top of the snapshot and the accumulator (a multiple of ``codec.CHUNK_BYTES``, so reads need no widening).
WINDOW_BYTES = 8 * codec.CHUNK_BYTES
#: Contributions are fetched whole and concurrently (each into memory of its own, checked on its own thread and
#: held until it is added) when every peer's payload together, at its fp32 size, is at most this many bytes: a
#: model of up to 5.6M parameters at N = 4, whatever the format. The payload's size decides, not the wire's: what
#: a fetch holds and works through once it has checked a contribution (the sparse format's decoded positions and
#: the check's temporaries) scales with the payload, and at 1 GiB, N = 4, checking three sparse contributions at
#: once took a rank's peak from 2.24x the payload to 2.62x, and its round from 6.5 to 7.5 s. Larger ones are read
#: one after another (compressed: whole, into one buffer; uncompressed: by windows, ``WINDOW_BYTES``), where a
#: request's latency is nothing beside the round.
CONCURRENT_READ_MAX_BYTES = 64 * 2**20
#: Fetches at once, at most (the rest start as these finish).
MAX_CONCURRENT_READS = 16


@dataclass
class _Published:
    """What the reduce step needs of our own contribution: what peers read (the wire tensors and their tag,
    added to our sum exactly as peers add them), and its layout."""

    wire: dict[str, torch.Tensor]
    meta: dict[str, str]
    reference: dict[str, tuple[tuple[int, ...], torch.dtype]]

    @property
    def wire_bytes(self) -> int:
        """The data bytes of our object (a peer's, in the same format and layout, has as many)."""
        return sum(t.numel() * t.element_size() for t in self.wire.values())

    @property
    def payload_bytes(self) -> int:
        """The bytes of the payload at fp32 (a peer's has the same layout): what checking one contribution works
        through, whatever its wire format."""
        return sum(4 * math.prod(shape) for shape, _ in self.reference.values())


class GatherExchange:
    """The gather strategy's round: one object per rank, all of them read by everyone."""

    def __init__(self, codec: PayloadCodec, *, spread: int = 1, min_replicas: int | None = None,
                 elastic: bool = False) -> None:
        self.codec = codec
        self.spread = check_spread(spread)
        self.min_replicas = min_replicas
        #: Membership is data (``diloco.collectives.membership``): every round commits a manifest naming its
        #: members and the next round's.
        self.elastic = elastic
        self._next: dict[int, list[int]] = {}  # elastic: round -> the members its manifest names for the next
        self._spares = Spares()  # buffers of the latest round, for the next one's snapshot and sum
        self._reads = ReadBuffer()  # every peer object (or window of one) is read into it, in turn
        self._means: dict[int, dict[str, torch.Tensor]] = {}  # round -> its mean, until the caller has it

    def snapshot(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A CPU copy of the caller's tensors, into buffers an earlier round gave back when there are some
        (``diloco.collectives.spares``: fresh memory costs a page fault per 4 KiB, more than the copy itself)."""
        return {name: self._spares.empty(t.shape, t.dtype).copy_(t.detach()) for name, t in tensors.items()}

    def publish(self, io: RoundIO, round_: int, snapshot: dict[str, torch.Tensor]) -> _Published:
        """Stream our contribution to the store (``codec.encode_stream`` + ``put_stream``: never one joined copy
        of the payload in memory), tagged with our identity and, compressed, the format."""
        reference = layout_of(snapshot)
        wire, meta = self.codec.encode_wire(tuple(reference.items()), snapshot, empty=self._spares.empty)
        if self.codec.compressed:  # the wire tensors are others: the snapshot can hold this round's sum
            self._spares.give(round_, snapshot.values())
        size, chunks = codec.encode_stream(wire, {**meta, **io.identity(round_, io.rank)})
        io.wrote(io.store.put_stream(self._key(round_, io.rank), chunks, size))
        return _Published(wire, meta, reference)

    def reduce(self, io: RoundIO, round_: int, published: _Published) -> dict[str, torch.Tensor]:
        """Accumulate every rank's contribution in rank order 0..N-1 (our own from the wire tensors peers read,
        by the very operations they use; uncompressed, our snapshot, which may become the sum itself)."""
        deadline = io.deadline()
        if self.elastic:
            members: Sequence[int] = self._agree_on_members(io, round_, deadline, self._expected(io, round_))
        elif self.min_replicas is None:
            members = range(io.world_size)
        else:
            members = self._agree_on_members(io, round_, deadline, list(range(io.world_size)))
        acc: dict[str, torch.Tensor] = {}
        peers = [peer for peer in members if peer != io.rank]
        fetches = _PeerFetches(self, io, round_, peers, published, deadline) if \
            len(peers) > 1 and len(peers) * published.payload_bytes <= CONCURRENT_READ_MAX_BYTES else None
        try:
            for peer in members:
                if peer == io.rank:
                    self.codec.add_into(acc, published.wire, published.meta, published.reference, owned=True,
                                        empty=self._spares.empty)
                elif fetches is not None:
                    wire, meta = fetches.result(peer)
                    self.codec.add_into(acc, wire, meta, published.reference, empty=self._spares.empty)
                    del wire
                elif self.codec.compressed:  # a quarter of the payload or less: read whole, check, decode into the sum
                    wire, meta = self._fetch(io, round_, peer, published, deadline, self._reads)
                    self.codec.add_into(acc, wire, meta, published.reference, empty=self._spares.empty)
                else:
                    io.await_object(round_, peer, lambda r: self._key(round_, r), deadline)
                    self._accumulate_streamed(io, round_, peer, self._key(round_, peer), published.reference, acc)
        finally:
            if fetches is not None:
                fetches.close()
        # our wire tensors (uncompressed: the snapshot) were summed, or became the sum: what is not the sum is free
        summed = {t.data_ptr() for t in acc.values()}
        self._spares.give(round_, [t for t in published.wire.values() if t.data_ptr() not in summed])
        self._means = {round_: acc}
        return finish_mean(acc, len(members))

    def release(self, round_: int) -> None:
        """The caller has ``round_``'s mean: its buffers may hold the next round's snapshot or sum."""
        mean = self._means.pop(round_, None)
        if mean is not None:
            self._spares.give(round_, mean.values())

    def close(self) -> None:
        """Drop the buffers kept for later rounds."""
        self._means = {}
        self._spares.clear()
        self._reads = ReadBuffer()

    def members_after(self, round_: int) -> list[int] | None:
        """Elastic: the members round ``round_``'s manifest names for the next round (None: not elastic, or that
        round has not been reduced here)."""
        return self._next.get(round_)

    def _expected(self, io: RoundIO, round_: int) -> list[int]:
        """Elastic: the ranks this round waits for, from the previous round's manifest (read once per round; a
        rank that reduced the previous round here has it already)."""
        from diloco.collectives.membership import round_members

        known = self._next.get(round_ - 1)
        if known is not None:
            return known
        members = round_members(io.store, round_, io.world_size)
        if members is None:
            raise CorruptObjectError(f"all-reduce round {number(round_)}: the previous round's manifest "
                                     f"{io.store.url(ROUND_MANIFEST_KEY.format(round=round_ - 1))} is missing, so "
                                     "this round's members are unknown")
        return members

    def _agree_on_members(self, io: RoundIO, round_: int, deadline: Deadline, expected: list[int]) -> list[int]:
        """Partial participation (``min_replicas``) and elastic rounds: the ranks this round averages, the same on
        every rank.

        Wait until every rank's contribution exists, or until the deadline (extended while a peer is being
        relaunched) has passed with at least ``min_replicas`` of them, or, with that many, until every missing rank
        is one the launcher left behind (``RoundIO.left``: failed for good, so waiting for it is only lost time);
        propose the ranks present as the round's
        manifest, created exactly once (``put_if_absent``: a conditional create on S3, a hard link on
        ``file://``), and adopt whichever proposal won. A contribution that lands after the manifest is not
        averaged: its rank gets ``DroppedFromRound`` and rejoins at the next round (a relaunch). Fewer than
        ``min_replicas`` past the deadline is an ``AllReduceTimeout`` naming the missing ranks."""
        import json

        quorum = len(expected) if self.min_replicas is None else min(self.min_replicas, len(expected))
        key_of = lambda r: self._key(round_, r)  # noqa: E731
        manifest_key = ROUND_MANIFEST_KEY.format(round=round_)
        while True:
            if io.store.exists(manifest_key):
                break
            present = [r for r in expected if r == io.rank or io.store.exists(key_of(r))]
            missing = [r for r in expected if r not in present]
            # ranks the launcher left behind are owed nothing: with a quorum present, commit without them now
            gone = missing if missing and len(present) >= quorum and all(io.left(r) for r in missing) else []
            if gone:
                logger.info("round %d: rank(s) %s were left behind by the launcher; committing without them",
                            number(round_), ", ".join(map(str, gone)))
            if not missing or gone or (deadline.remaining_for(missing, round_) <= 0 and len(present) >= quorum):
                proposal: dict[str, object] = {"round": round_, "members": present, "proposed_by": io.rank,
                                               "run_id": io.run_id or ""}
                if self.elastic:  # the target read now is the next round's membership, for everyone
                    from diloco.collectives.membership import members_for_next

                    proposal["next"] = members_for_next(io.store, expected)
                io.store.put_if_absent(manifest_key, json.dumps(proposal).encode())
                break
            if len(present) < quorum:
                if deadline.remaining_for(missing, round_) > 0:  # a missing rank may be owed more time
                    io.wait_a_poll(round_)
                else:
                    io.await_object(round_, missing[0], key_of, deadline)  # times out naming every missing rank
            else:
                io.wait_a_poll(round_)
        manifest = json.loads(io.store.get(manifest_key))
        members = [int(r) for r in manifest.get("members", [])]
        if manifest.get("round") != round_ or manifest.get("run_id", "") != (io.run_id or "") or \
                len(members) < quorum:
            raise CorruptObjectError(f"all-reduce round {number(round_)}: the manifest at "
                                     f"{io.store.url(manifest_key)} is not this round's: {manifest}")
        if self.elastic:
            from diloco.collectives.membership import next_of

            self._next = {round_: next_of(manifest) or members}  # only the latest round's is ever asked for
        if io.rank not in members:
            raise DroppedFromRound(round_=number(round_), rank=io.rank, members=members,
                                   min_replicas=quorum)
        if len(members) < len(expected):
            logger.warning("round %d averages %d of %d replicas: %s (min_replicas %d)", number(round_),
                           len(members), len(expected), members, quorum)
        return members

    def own_keys(self, round_: int, rank: int) -> list[str]:
        return [self._key(round_, rank)]

    # ---------------------------------------------------------------- internals
    def _key(self, round_: int, rank: int) -> str:
        return contribution_key(round_, rank, self.spread)

    def _accumulate_streamed(self, io: RoundIO, round_: int, peer: int, key: str,
                             reference: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                             acc: dict[str, torch.Tensor]) -> None:
        """Add ``peer``'s uncompressed contribution into ``acc`` window by window (``WINDOW_BYTES`` verified
        ranged GETs), so a round holds the snapshot, the accumulator and one window, never a whole peer object.

        Each window is verified against its chunk digests *before* it is added, and a failed read is retried
        window by window, so nothing unverified is ever accumulated and a retry never adds a window twice. The
        first contribution (rank 0, unless it is ours) is copied, not added to zeros, so a -0.0 stays -0.0 as in
        ``accumulate`` (the same bits whichever rank's view)."""
        url = io.store.url(key)
        header = io.read_verified(round_, peer, "contribution", url, lambda: codec.read_header(io.store, key))
        io.read(header.data_offset)
        check_header(header.metadata, header.tensors, io.identity(round_, peer), reference, round_, peer, url)
        first = not acc
        if first:
            for name, (shape, dtype) in reference.items():
                acc[name] = self._spares.empty(shape, accumulation_dtype(dtype))
        flat = {name: t.view(-1) for name, t in acc.items()}
        for begin in range(0, header.data_size, WINDOW_BYTES):
            end = min(begin + WINDOW_BYTES, header.data_size)
            data = io.read_verified(round_, peer, "contribution", url, lambda b=begin, e=end: codec.read_data(
                io.store, key, header, b, e, buffer=self._reads))
            io.read(len(data))
            _add_window(flat, codec.tensors_from_data(header, data, begin, end), first)
            del data  # with the views gone (they lived in _add_window), the window's buffer is freed now

    def _fetch(self, io: RoundIO, round_: int, peer: int, published: _Published, deadline: Deadline,
               buffer: ReadBuffer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Wait for ``peer``'s contribution and read it whole into ``buffer``, checked (retried when it reads
        corrupt): what ``add_into`` takes."""
        io.await_object(round_, peer, lambda r: self._key(round_, r), deadline)
        key = self._key(round_, peer)
        return io.read_verified(round_, peer, "contribution", io.store.url(key),
                                lambda: self._read(io, round_, peer, key, published, buffer))

    def _read(self, io: RoundIO, round_: int, peer: int, key: str, published: _Published, buffer: ReadBuffer
              ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Fetch and verify ``peer``'s whole object: one GET into one buffer (``codec.read_object``: our own
        object's size is the hint, every rank's is the same), its chunk digests, its identity, then its format and
        wire tensors against our layout (uncompressed: ``check_header``, as a streamed read checks them):
        everything ``add_into`` needs, so nothing unverified is ever half added. The wire tensors are views of
        that buffer (no copy)."""
        source = io.store.url(key)
        header, data = codec.read_object(io.store, key, data_bytes_hint=published.wire_bytes, buffer=buffer)
        io.read(header.data_offset + len(data))
        meta = header.metadata
        if not self.codec.compressed:  # its identity, its format and its tensors' shapes and dtypes
            check_header(meta, header.tensors, io.identity(round_, peer), published.reference, round_, peer, source)
        else:
            for name, want in io.identity(round_, peer).items():
                if meta.get(name) != str(want):
                    raise CorruptObjectError(f"{source} has {name}={meta.get(name)!r}, expected {str(want)!r}")
        wire = {name: view.view(header.tensors[name].shape)
                for name, (_, view) in codec.tensors_from_data(header, data, 0, header.data_size).items()}
        self.codec.check(wire, meta, published.reference, source)
        return wire, meta


class _PeerFetches:
    """Every peer's (small) contribution fetched at once, each on a thread of its own into memory of its own
    (``GatherExchange._fetch``: its wait, its read, its checks), handed out by peer. ``close`` cancels what is
    still waiting (a round that failed on one peer leaves no other polling) and joins the threads."""

    def __init__(self, exchange: GatherExchange, io: RoundIO, round_: int, peers: Sequence[int],
                 published: _Published, deadline: Deadline) -> None:
        self._cancelled = threading.Event()
        helper = io.cancellable(self._cancelled)
        self._pool = ThreadPoolExecutor(min(len(peers), MAX_CONCURRENT_READS), thread_name_prefix="diloco-fetch")
        self._futures: dict[int, Future[tuple[dict[str, torch.Tensor], dict[str, str]]]] = {
            peer: self._pool.submit(exchange._fetch, helper, round_, peer, published, deadline, ReadBuffer())
            for peer in peers}

    def result(self, peer: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """``peer``'s wire tensors and tag once fetched; its failure (a timeout, a corrupt object) raised here."""
        future = self._futures.pop(peer)
        return future.result()

    def close(self) -> None:
        self._cancelled.set()
        self._futures.clear()  # what was fetched and not taken is dropped with its buffer
        self._pool.shutdown(wait=True, cancel_futures=True)


class DroppedFromRound(DilocoError):
    """With ``min_replicas``, this rank's contribution came too late for a round that committed without it.

    Not an error of the replica's making: its peers went on without it, and its rounds no longer line up with
    theirs. The replica exits with the dropped exit code (``diloco.replica_exit.EXIT_DROPPED``), which every
    backend treats as curable; relaunched, it rejoins at its peers' next round from the latest committed one
    (``diloco.replica.manager.ObjectStoreManager.rejoin``)."""

    def __init__(self, *, round_: int, rank: int, members: list[int], min_replicas: int) -> None:
        super().__init__(f"all-reduce round {round_}: rank {rank}'s contribution arrived after the round committed "
                         f"with ranks {members} (min_replicas {min_replicas}), so it was not averaged",
                         hint="the replica is relaunched and rejoins at the next round (diloco launch does this "
                              "within --max-restarts)")
        self.round = round_  # numbered from 1, as in the logs
        self.rank = rank
        self.members = members
        self.min_replicas = min_replicas


def _add_window(flat: Mapping[str, torch.Tensor], views: Mapping[str, tuple[int, torch.Tensor]], first: bool) -> None:
    """Copy (first contribution) or add one window's tensor views into the flat accumulators. A function of its
    own so the views, which keep the window's buffer alive, are gone before the next window is read."""
    for name, (offset, view) in views.items():
        target = flat[name][offset:offset + view.numel()]
        if first:
            target.copy_(view)
        else:
            target.add_(view.to(target.dtype))


def check_header(meta: Mapping[str, str], tensors: Mapping[str, codec.TensorEntry],
                 identity: Mapping[str, str | int], reference: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 round_: int, peer: int, source: str) -> None:
    """A streamed peer object must be that peer's, this round's, uncompressed, and shaped exactly like ours."""
    from diloco.collectives.reduce import number

    for key, want in identity.items():
        if meta.get(key) != str(want):
            raise CorruptObjectError(f"round {number(round_)}: rank {peer}'s object {source} has "
                                     f"{key}={meta.get(key)!r}, expected {str(want)!r}")
    sent = meta.get("compression", "none")
    if sent != "none":
        raise CorruptObjectError(f"round {number(round_)}: rank {peer}'s object {source} is compressed as "
                                 f"{sent!r}, but this run uses store.compression 'none'")
    check_same_layout({n: _Shaped(e.shape, e.dtype) for n, e in tensors.items()}, reference, round_, peer)


@dataclass(frozen=True)
class _Shaped:
    """A tensor's shape and dtype without its data (what a header says), for ``check_same_layout``."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def check_same_layout(tensors: Mapping[str, torch.Tensor | _Shaped],
                      reference: Mapping[str, tuple[tuple[int, ...], torch.dtype]], round_: int, peer: int,
                      *, compressed: bool = False) -> None:
    """A peer must contribute the same tensor names, shapes and dtypes as we do, or averaging is meaningless
    (compressed payloads decode to fp32, so only names and shapes are compared then)."""
    from diloco.collectives.reduce import number

    if set(tensors) != set(reference):
        extra = sorted(set(tensors) - set(reference))
        lacking = sorted(set(reference) - set(tensors))
        raise CorruptObjectError(
            f"round {number(round_)}: rank {peer} contributed different tensors (extra {extra}, missing {lacking})"
        )
    for name, (shape, dtype) in reference.items():
        got = tensors[name]
        if tuple(got.shape) != shape or (not compressed and got.dtype != dtype):
            raise CorruptObjectError(
                f"round {number(round_)}: rank {peer}'s {name!r} is {got.dtype} {tuple(got.shape)}, "
                f"expected {dtype} {shape}"
            )


class ObjectStoreAllReduce(RoundDriver[dict, _Published]):
    """The gather all-reduce (see the module docstring). Only the constructor is its own: the round machinery
    is ``RoundDriver``'s, the wire format ``GatherExchange``'s."""

    strategy = "gather"

    def __init__(self, uri: str, rank: int, world_size: int, timeout_s: float = 1800, poll_interval_s: float = 1.0,
                 run_id: str | None = None, *, compression: str = "none", error_feedback: bool = True,
                 spread: int = 1, min_replicas: int | None = None, codec: PayloadCodec | None = None,
                 elastic: bool = False) -> None:
        bound = max(world_size, rank + 1) if elastic else world_size
        if min_replicas is not None and (isinstance(min_replicas, bool) or not isinstance(min_replicas, int)
                                         or not 1 <= min_replicas <= bound):
            raise ConfigError(f"min_replicas must be an integer in [1, {world_size}] (the replicas), got "
                              f"{min_replicas!r}", hint="leave it unset to average every round over all replicas")
        codec = codec or PayloadCodec(compression, error_feedback=error_feedback)
        exchange = GatherExchange(codec, spread=spread, elastic=elastic,
                                  min_replicas=None if min_replicas == world_size and not elastic else min_replicas)
        super().__init__(uri, rank, world_size, exchange=exchange, timeout_s=timeout_s,
                         poll_interval_s=poll_interval_s, run_id=run_id, spread=spread, elastic=elastic)
