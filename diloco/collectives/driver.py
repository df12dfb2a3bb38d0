"""The round machinery every strategy shares: round counter, background thread, ``Work``, polling, reading, stats.

A strategy (``diloco.collectives.gather``, ``diloco.collectives.sharded``) supplies only its ``Exchange``: how a
contribution is snapshotted, published and turned into the mean. Everything that makes a round safe lives here,
once: rounds in lockstep (one in flight, a failure latched), bounded polling with the relaunch extension, re-reads
of a corrupt object before it fails the round, deleting this rank's objects of the previous round, and the
counters (``AllReduceStats``; ``seconds_blocked`` is exactly the time callers spent inside ``Work.wait()``).

Overlap: ``allreduce_async`` takes the snapshot on the caller's thread and hands the whole round (upload, polling,
downloads, reduction, and for sharded the second phase) to a background thread. ``Work.wait()`` only waits for
that thread and copies the mean into the caller's tensors, so with Streaming DiLoCo's delay (the all-reduce
started tau inner steps before it is waited for) a round that fits in those steps costs the loop one copy.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from diloco.collectives.reduce import Tensors, as_named, number
from diloco.errors import (
    AllReduceTimeout,
    ConfigError,
    CorruptObjectError,
    DilocoError,
    ObjectNotFound,
    StoreError,
)
from diloco.store.layout import check_spread, contribution_key
from diloco.store.objects import ObjectStore

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: How many times an object that fails to decode is read before the round fails.
READ_ATTEMPTS = 3
#: A wait for a peer's object polls first after ``poll_interval_s / QUICK_POLLS_DIVISOR``, then twice as long each
#: time up to ``poll_interval_s``: at most four more polls per wait than a fixed interval would make.
QUICK_POLLS_DIVISOR = 16

T = TypeVar("T")
S = TypeVar("S")  # a strategy's snapshot
P = TypeVar("P")  # a strategy's published state


@dataclass
class AllReduceStats:
    """Cumulative counters of one rank's all-reduce traffic (for metrics and the bytes-per-round budget)."""

    rounds: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    seconds_blocked: float = 0.0


class RoundClosed(DilocoError):
    """The all-reduce was closed while a round was still polling (the replica is stopping)."""


class Deadline:
    """How long a round may still wait for one kind of object; extended while the launcher relaunches a peer, and
    for a peer that rejoined the run to contribute to this very round (``RoundIO.extension``)."""

    def __init__(self, io: RoundIO, seconds: float) -> None:
        self._io = io
        self._until = time.monotonic() + seconds

    def remaining(self, peer: int, round_: int) -> float:
        """Seconds left; past the deadline, the extension ``peer`` is owed, if any."""
        return self.remaining_for([peer], round_)

    def remaining_for(self, peers: list[int], round_: int) -> float:
        """Seconds left; past the deadline, the longest extension any of ``peers`` (the missing ones) is owed."""
        remaining = self._until - time.monotonic()
        if remaining > 0:
            return remaining
        owed = [(self._io.extension(peer, round_), peer) for peer in peers]
        (extension, why), peer = max(owed, default=((0.0, ""), -1))
        if extension > 0:
            logger.info("round %d: rank %d %s; waiting %.0fs more", number(round_), peer, why, extension)
            self._until = time.monotonic() + extension
            remaining = extension
        return remaining


class _EitherStop:
    """Set once either event is: what a cancellable copy of a ``RoundIO`` waits on, its own cancel or the
    all-reduce's close. It waits on the cancel and looks at the close every ``SLICE_S`` (an ``Event`` cannot wait
    for two), so a close reaches a cancellable wait within that long."""

    SLICE_S = 0.05

    def __init__(self, closed: threading.Event | _EitherStop, cancelled: threading.Event) -> None:
        self._closed = closed
        self._cancelled = cancelled

    def is_set(self) -> bool:
        return self._cancelled.is_set() or self._closed.is_set()

    def wait(self, timeout: float) -> bool:
        until = time.monotonic() + timeout
        while not self.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return False
            self._cancelled.wait(min(left, self.SLICE_S))
        return True


class RoundIO:
    """What an exchange does on the background thread: identity, polling, verified reads, counted bytes."""

    def __init__(self, store: ObjectStore, rank: int, world_size: int, *, timeout_s: float, poll_interval_s: float,
                 run_id: str | None, spread: int, stats: AllReduceStats, stats_lock: threading.Lock,
                 stop: threading.Event | _EitherStop, trained_s: float = 0.0) -> None:
        self.store = store
        self.trained_s = trained_s  # how long this rank trained before contributing to the round (rejoin slack)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        self.run_id = run_id
        self.spread = spread
        self._stats = stats
        self._stats_lock = stats_lock
        self._stop = stop

    # ---------------------------------------------------------------- identity and counters
    def identity(self, round_: int, rank: int, **extra: str | int) -> dict[str, str | int]:
        """The metadata that says whose object this is and for which round and run: written by us, expected of
        peers (leftovers of another run in a reused prefix are then corrupt, never averaged)."""
        identity: dict[str, str | int] = {"round": round_, "rank": rank, "world_size": self.world_size, **extra}
        if self.run_id:
            identity["run_id"] = self.run_id
        return identity

    def cancellable(self, cancelled: threading.Event) -> RoundIO:
        """This round's I/O for a helper thread: the same store, identity and counters (under their lock), whose
        polls and retries also stop once ``cancelled`` is set (``RoundClosed``), so a round that fails or is closed
        leaves none of them waiting."""
        helper = copy.copy(self)
        helper._stop = _EitherStop(self._stop, cancelled)
        return helper

    def wrote(self, nbytes: int) -> None:
        with self._stats_lock:
            self._stats.bytes_written += nbytes

    def read(self, nbytes: int) -> None:
        with self._stats_lock:
            self._stats.bytes_read += nbytes

    # ---------------------------------------------------------------- polling
    def deadline(self) -> Deadline:
        """A fresh ``timeout_s`` budget for one phase of polling."""
        return Deadline(self, self.timeout_s)

    def await_object(self, round_: int, peer: int, key_of: Callable[[int], str], deadline: Deadline) -> None:
        """Poll until ``key_of(peer)`` exists; ``AllReduceTimeout`` naming every rank still missing past the
        deadline (and the last store error seen, so a denied bucket is not reported as a slow peer).

        The polls start quick and back off (``poll_interval_s / QUICK_POLLS_DIVISOR``, doubling up to
        ``poll_interval_s``): peers finish a phase close together, so an object that was almost there is noticed
        within about as long as we had waited for it, not a whole ``poll_interval_s`` later; a peer that is
        really late costs one poll per ``poll_interval_s``, as before."""
        key = key_of(peer)
        last_error: BaseException | None = None
        interval = self.poll_interval_s / QUICK_POLLS_DIVISOR
        while True:
            try:
                if self.store.exists(key):
                    return
            except (StoreError, OSError) as exc:  # e.g. a 403: keep polling, but report it on timeout
                last_error = exc
                logger.debug("polling %s: %s", self.store.url(key), exc)
            remaining = deadline.remaining(peer, round_)
            if remaining <= 0:
                raise AllReduceTimeout(round_=number(round_),
                                       missing_ranks=self.missing(range(peer, self.world_size), key_of),
                                       timeout_s=self.timeout_s, last_error=last_error)
            if self._stop.wait(min(interval, remaining)):
                raise RoundClosed(f"rank {self.rank}'s all-reduce was closed while round {number(round_)} was "
                                  "waiting for its peers")
            interval = min(2 * interval, self.poll_interval_s)

    def wait_a_poll(self, round_: int) -> None:
        """Sleep one ``poll_interval_s`` (``RoundClosed`` if the all-reduce is closed meanwhile)."""
        if self._stop.wait(self.poll_interval_s):
            raise RoundClosed(f"rank {self.rank}'s all-reduce was closed while round {number(round_)} was "
                              "waiting for its peers")

    def missing(self, candidates: range, key_of: Callable[[int], str]) -> list[int]:
        """The ranks among ``candidates`` (not us) whose ``key_of(rank)`` does not exist (unknown counts as missing)."""
        missing = []
        for peer in candidates:
            if peer == self.rank:
                continue
            try:
                present = self.store.exists(key_of(peer))
            except (StoreError, OSError):
                present = False
            if not present:
                missing.append(peer)
        return missing

    def relaunch_deadline(self, peer: int) -> float | None:
        """The wall-clock time until which the launcher said ``peer`` is being relaunched, if it said so
        (``relaunch/rank_RRRR.json``, written by the launcher's wait: ``diloco.launcher.waiter``)."""
        from diloco.store.layout import RELAUNCH_KEY

        try:
            record = json.loads(self.store.get(RELAUNCH_KEY.format(rank=peer)))
        except (StoreError, OSError, ValueError):
            return None
        until = record.get("until") if isinstance(record, dict) else None
        return float(until) if isinstance(until, (int, float)) else None

    def relaunch_extension(self, peer: int) -> float:
        """Seconds until the relaunch of ``peer`` the launcher recorded runs out (0 when none is recorded)."""
        until = self.relaunch_deadline(peer)
        return max(0.0, until - time.time()) if until is not None else 0.0

    def rejoin_deadline(self, peer: int, round_: int) -> float | None:
        """When a ``peer`` that rejoined the run to contribute to ``round_`` (``rejoin/rank_RRRR.json``, written by
        ``RoundDriver.announce_rejoin``) is owed its contribution: the time it rejoined, plus as long as this rank
        trained for the round, plus one ``timeout_s``. So a relaunched replica, which starts its first round late
        by its whole restart, gets the time its peers had, and the usual slack on top; one slower than that is
        still dropped (with ``min_replicas``) or timed out. ``None`` when ``peer`` rejoined for another round."""
        from diloco.store.layout import REJOIN_KEY

        try:
            record = json.loads(self.store.get(REJOIN_KEY.format(rank=peer)))
        except (StoreError, OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("round") != round_ or record.get("run_id", "") != (
                self.run_id or ""):
            return None
        at = record.get("at")
        return float(at) + self.trained_s + self.timeout_s if isinstance(at, (int, float)) else None

    def left(self, peer: int) -> bool:
        """Whether the launcher left ``peer`` behind (``left/rank_RRRR.json``): failed for good in a
        ``min_replicas`` run, so no round is owed its contribution. A store error reads as not left (the round
        then waits as it would have)."""
        from diloco.store.layout import LEFT_KEY

        try:
            return self.store.exists(LEFT_KEY.format(rank=peer))
        except (StoreError, OSError):
            return False

    def extension(self, peer: int, round_: int) -> tuple[float, str]:
        """Seconds more a round past its deadline waits for ``peer``, and why: the launcher is relaunching it
        (``relaunch_extension``), or it rejoined for this round (``rejoin_deadline``); 0 when neither."""
        relaunch = self.relaunch_extension(peer)
        until = self.rejoin_deadline(peer, round_)
        rejoin = max(0.0, until - time.time()) if until is not None else 0.0
        if rejoin > relaunch:
            return rejoin, "rejoined the run for this round"
        return relaunch, "is being relaunched"

    # ---------------------------------------------------------------- verified reads
    def read_verified(self, round_: int, peer: int, what: str, url: str, read: Callable[[], T]) -> T:
        """``read()`` (which fetches and verifies one object of ``peer``), retried a few times when the object
        is corrupt or vanished, then a ``CorruptObjectError`` naming the round, the rank and ``what`` it was.

        On ``file://`` and S3 an object is complete once visible, so a retry only helps against a flaky read."""
        problem: BaseException | None = None
        for attempt in range(READ_ATTEMPTS):
            if attempt and self._stop.wait(min(self.poll_interval_s, 1.0)):
                break
            try:
                return read()
            except (CorruptObjectError, ObjectNotFound) as exc:
                problem = exc
                logger.warning("round %d: rank %d's %s is unreadable (attempt %d): %s", number(round_), peer, what,
                               attempt + 1, exc)
        raise CorruptObjectError(
            f"all-reduce round {number(round_)}: the {what} of rank {peer} at {url} is unusable after "
            f"{READ_ATTEMPTS} reads, so it was not averaged: {problem}",
            hint=f"check rank {peer}'s logs; a replica of another run or version may share this rendezvous URI",
        ) from problem

    def delete(self, key: str) -> None:
        """Best effort: a failed delete costs storage, not correctness, so it is logged, not raised."""
        try:
            self.store.delete(key)
        except (StoreError, OSError) as exc:
            logger.warning("could not delete %s (the store keeps growing): %s", self.store.url(key), exc)


class Exchange(Protocol[S, P]):
    """One strategy's part of a round. ``snapshot`` runs on the caller's thread; the rest on the round thread."""

    def snapshot(self, tensors: Mapping[str, torch.Tensor]) -> S:
        """A CPU copy of the caller's tensors, taken now (the caller may keep changing its tensors)."""
        ...

    def publish(self, io: RoundIO, round_: int, snapshot: S) -> P:
        """Upload this rank's contribution; what ``reduce`` needs next."""
        ...

    def reduce(self, io: RoundIO, round_: int, published: P) -> dict[str, torch.Tensor]:
        """Poll for, read and reduce the peers' objects: the mean, by the caller's tensor names (fp32 or fp64)."""
        ...

    def own_keys(self, round_: int, rank: int) -> list[str]:
        """Every key this rank wrote in the round (deleted once no peer can still read them)."""
        ...

    def members_after(self, round_: int) -> list[int] | None:
        """Elastic: the members round ``round_``'s manifest names for the next round; None when the exchange has
        no elastic rounds or that round was not reduced here."""
        ...


class ReusingExchange(Exchange[S, P], Protocol):
    """An exchange that hands its buffers from round to round (``diloco.collectives.spares``): told when the caller
    has a round's mean, and when the all-reduce closes. The driver calls these hooks on exchanges that have them."""

    def release(self, round_: int) -> None:
        """The caller's tensors hold ``round_``'s mean: the buffers ``reduce`` returned may serve later rounds."""
        ...

    def close(self) -> None:
        """Drop whatever the exchange keeps between rounds."""
        ...


class AllReduceWork:
    """One round in flight. ``wait()`` blocks until the mean is in the caller's tensors (or raises the round's
    error); ``wait()`` is idempotent: a second call returns at once, or re-raises the round's error."""

    def __init__(self, driver: RoundDriver[Any, Any], round_: int, targets: dict[str, torch.Tensor],
                 uploaded: Future[None], result: Future[dict[str, torch.Tensor]]) -> None:
        self.round = round_
        self._driver = driver
        self._targets = targets
        self._uploaded = uploaded
        self._result = result
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def wait(self, timeout: object = None) -> bool:
        """Block until the round's mean is in the caller's tensors; raise the round's error if it failed.

        ``timeout`` is accepted for signature compatibility with ``torch.distributed.Work`` and ignored: the
        bound is the all-reduce's ``timeout_s``."""
        with self._lock:
            if not self._done:
                try:
                    self._driver.complete(self)
                except BaseException as exc:
                    self._error = exc
                    self._driver.mark_failed(exc)
                    raise
                finally:
                    self._done = True
                    self._targets = {}  # a finished round keeps no tensor alive
            elif self._error is not None:
                raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether ``wait()`` has finished (successfully or not)."""
        return self._done

    def wait_for_upload(self, timeout: float | None = None) -> None:
        """Block until this rank's own contribution is in the store (re-raising the upload's error), not for
        the mean: what a caller about to stop needs to know (its peers can then finish the round)."""
        self._uploaded.result(timeout=timeout)

    @property
    def _upload(self) -> Future[None]:
        """The upload's future under its former name (tests/replica/test_rejoin.py waits on it; prefer
        ``wait_for_upload``)."""
        return self._uploaded

    def is_ready(self) -> bool:
        """Whether the mean is already local (``wait()`` would only copy it): the overlap worked."""
        return self._result.done()


class RoundDriver(Generic[S, P]):
    """Mean all-reduce of named tensors among ``world_size`` ranks that share only the store at ``uri``, with
    ``exchange`` deciding what goes over the wire. Implements ``diloco.collectives.Collective``."""

    def __init__(self, uri: str, rank: int, world_size: int, *, exchange: Exchange[S, P], timeout_s: float = 1800,
                 poll_interval_s: float = 1.0, run_id: str | None = None, spread: int = 1,
                 store: ObjectStore | None = None, elastic: bool = False) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        if elastic and rank < 0:
            raise ConfigError(f"rank must be >= 0, got {rank}")
        if not elastic and not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, {world_size - 1}] for world_size {world_size}, got {rank}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
        if not poll_interval_s > 0:
            raise ConfigError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.uri = uri
        self.rank = rank
        #: The ranks of the run's first round; in an elastic run later rounds' members are data
        #: (``diloco.collectives.membership``), and this rank may be one added since (``rank >= world_size``).
        self.world_size = world_size
        self.elastic = elastic
        self.timeout_s = float(timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self.run_id = run_id
        self.spread = check_spread(spread)
        self.store = store if store is not None else ObjectStore(uri)
        self._exchange = exchange
        self._round = 0
        self._pending: AllReduceWork | None = None
        self._failed: BaseException | None = None
        self._closed = False
        self._stats = AllReduceStats()
        self._stats_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # the latest round's thread
        self._training_since = time.monotonic()  # since the last round completed here (or this rank started)
        self._trained_s = 0.0  # how long this rank trained before its latest round started

    # ---------------------------------------------------------------- public API
    def wire_state(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residuals (``diloco.collectives.wire.PayloadCodec.state_dict``): part of
        its own state, kept with the inner optimizer's after each committed round; empty without compression."""
        codec = getattr(self._exchange, "codec", None)
        return codec.state_dict() if codec is not None else {}

    def error_feedback_active(self) -> bool:
        """Whether this rank sends a lossy format and keeps what it drops for later rounds."""
        codec = getattr(self._exchange, "codec", None)
        return codec is not None and codec.compressed and codec.error_feedback

    def load_wire_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore residuals ``wire_state`` returned (a rejoining rank, before its next round)."""
        codec = getattr(self._exchange, "codec", None)
        if codec is not None:
            codec.load_state_dict(state)

    @property
    def next_round(self) -> int:
        """The round the next ``allreduce``/``allreduce_async`` call will use (starts at 0, +1 per call)."""
        return self._round

    def resume_at(self, round_: int) -> None:
        """Start counting at ``round_`` (zero-based) instead of 0: a restarted rank rejoining its peers.

        Only before this instance ran any round (the counter is the only state, so this is the whole rejoin);
        ``diloco.replica.manager.ObjectStoreManager.rejoin`` decides which round that is from the committed rounds.
        """
        if self._pending is not None or self._round != 0:
            raise RuntimeError(f"resume_at({round_}) after round {number(self._round - 1)} already started here")
        if round_ < 0:
            raise ValueError(f"round index must be >= 0, got {round_}")
        self._round = round_

    def announce_rejoin(self, round_: int) -> None:
        """Tell the peers this rank rejoined the run and will contribute to the round of zero-based index ``round_``
        (``rejoin/rank_RRRR.json``): past their deadline they wait for it as long as they trained for that round,
        plus ``timeout_s`` (``RoundIO.rejoin_deadline``). Best effort: without it the rank is only owed what the
        launcher recorded for its relaunch."""
        from diloco.store.layout import REJOIN_KEY

        record = {"rank": self.rank, "round": round_, "at": time.time(), "run_id": self.run_id or ""}
        try:
            self.store.put(REJOIN_KEY.format(rank=self.rank), json.dumps(record).encode())
        except (StoreError, OSError) as exc:
            logger.warning("could not tell the peers that rank %d rejoins at round %d: %s", self.rank,
                           number(round_), exc)
        self._training_since = time.monotonic()

    def members_after(self, round_: int) -> list[int] | None:
        """Elastic: the members of the round after ``round_``, as that round's manifest names them (None when the
        run is not elastic or ``round_`` was not reduced here)."""
        return self._exchange.members_after(round_)

    def has_own_contribution(self, round_: int) -> bool:
        """Whether this rank's contribution for ``round_`` is already in the store (written before a restart)."""
        return self.store.exists(contribution_key(round_, self.rank, self.spread))

    def relaunch_deadline(self, peer: int) -> float | None:
        """The wall-clock time until which the launcher said ``peer`` is being relaunched, if it said so."""
        return self._io().relaunch_deadline(peer)

    @property
    def stats(self) -> AllReduceStats:
        """A consistent snapshot of the cumulative counters."""
        with self._stats_lock:
            return replace(self._stats)

    def allreduce(self, tensors: Tensors) -> None:
        """Replace ``tensors`` in place by their mean over all ranks (blocking)."""
        self.allreduce_async(tensors).wait()

    def allreduce_async(self, tensors: Tensors) -> AllReduceWork:
        """Snapshot ``tensors`` now and run the round on a background thread; return the round's ``Work``.

        The caller may keep training (and even modify ``tensors``: the snapshot was taken); ``Work.wait()``
        writes the mean into ``tensors``. The previous round's ``Work`` must have been waited for first: that
        ordering is what makes deleting old rounds safe.
        """
        self._check_usable()
        if self._pending is not None and not self._pending.is_completed():
            raise RuntimeError(
                f"all-reduce round {number(self._pending.round)} was never waited for; call wait() on its Work "
                f"before starting round {number(self._round)}"
            )
        targets = as_named(tensors)
        self._trained_s = time.monotonic() - self._training_since
        snapshot = self._exchange.snapshot(targets)  # a CPU copy now (a device sync on accelerators)
        round_ = self._round
        self._round += 1
        uploaded: Future[None] = Future()
        result: Future[dict[str, torch.Tensor]] = Future()
        # The snapshot travels in a box the round thread empties once it is uploaded: a Thread keeps its args
        # alive until it ends, and the snapshot is the size of the payload.
        thread = threading.Thread(target=self._run_round, args=(round_, [snapshot], uploaded, result),
                                  name=f"diloco-allreduce-r{self.rank}-round{number(round_)}", daemon=True)
        thread.start()
        self._thread = thread
        work = AllReduceWork(self, round_, targets, uploaded, result)
        self._pending = work
        return work

    def close(self, wait: bool = True) -> None:
        """Stop the round thread. Idempotent.

        ``wait=True`` first lets an upload in progress finish (bounded by ``timeout_s``), so a contribution the
        caller started is not lost, then stops the round thread and joins it (it ends within ``poll_interval_s``
        plus a read in progress), so no thread of ours is still in torch or the store when the process exits.
        ``wait=False`` only tells the thread to stop and returns at once (for a replica that is failing anyway;
        the thread is a daemon, so it never holds the process open)."""
        self._closed = True
        pending = self._pending
        if wait and pending is not None and not pending.is_completed():
            try:
                pending._uploaded.result(timeout=self.timeout_s)
            except BaseException:  # noqa: BLE001 - the round's error belongs to wait(), not to close()
                pass
        self._stop.set()
        thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(self.timeout_s)
        close = getattr(self._exchange, "close", None)  # a ReusingExchange's hook
        if close is not None:
            close()

    def __enter__(self) -> RoundDriver[S, P]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- the round
    def _io(self) -> RoundIO:
        return RoundIO(self.store, self.rank, self.world_size, timeout_s=self.timeout_s,
                       poll_interval_s=self.poll_interval_s, run_id=self.run_id, spread=self.spread,
                       stats=self._stats, stats_lock=self._stats_lock, stop=self._stop, trained_s=self._trained_s)

    def _run_round(self, round_: int, snapshot_box: list[S], uploaded: Future[None],
                   result: Future[dict[str, torch.Tensor]]) -> None:
        """The round thread: publish, then reduce, then delete our objects of the previous round.

        Deleting round k-1 is safe once every peer's contribution to round k exists (``reduce`` waited for all of
        them): a peer only starts round k after its ``wait()`` of round k-1 returned, and that ``wait()`` only
        returns once its round thread had read every object of round k-1 it needed, ours included."""
        io = self._io()
        try:
            published = self._exchange.publish(io, round_, snapshot_box.pop())
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            uploaded.set_exception(exc)
            result.set_exception(exc)
            return
        uploaded.set_result(None)
        try:
            mean = self._exchange.reduce(io, round_, published)
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            result.set_exception(exc)
            return
        result.set_result(mean)
        if round_ >= 1:
            for key in self._exchange.own_keys(round_ - 1, self.rank):
                io.delete(key)

    def complete(self, work: AllReduceWork) -> None:
        """Body of ``Work.wait()``: our own upload (bounded by ``timeout_s``), then the round thread's mean,
        copied into the caller's tensors. The time spent here is ``seconds_blocked``."""
        import torch

        started = time.monotonic()
        try:
            try:
                work._uploaded.result(timeout=self.timeout_s)  # re-raises the upload's error, if any
            except FutureTimeout:
                raise StoreError(
                    f"all-reduce round {number(work.round)}: rank {self.rank}'s own upload to "
                    f"{self.store.url(contribution_key(work.round, self.rank, self.spread))} did not finish in "
                    f"{self.timeout_s:g}s",
                    hint="check the store's reachability and bandwidth from this replica",
                ) from None
            mean = work._result.result()  # the round thread's polling is bounded by timeout_s per phase
            with torch.no_grad():
                for name, target in work._targets.items():
                    target.copy_(mean[name].to(target.dtype))  # cast on the CPU: same bits on every device
            del mean
            release = getattr(self._exchange, "release", None)  # a ReusingExchange's hook
            if release is not None:
                release(work.round)
        finally:
            with self._stats_lock:
                self._stats.seconds_blocked += time.monotonic() - started
        with self._stats_lock:
            self._stats.rounds += 1
        self._training_since = time.monotonic()

    # ---------------------------------------------------------------- failure latch
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} was closed")
        if self._failed is not None:
            raise DilocoError(
                f"rank {self.rank}'s all-reduce already failed in an earlier round and cannot resume: "
                f"{type(self._failed).__name__}: {self._failed}",
                hint="restart the replica; see the first error above",
            )

    def mark_failed(self, exc: BaseException) -> None:
        """Latch the first failure: peers count rounds in lockstep, so no later round may pair up with theirs."""
        if self._failed is None:
            self._failed = exc
