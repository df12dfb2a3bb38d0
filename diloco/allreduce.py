"""All-reduce (mean) over an object store: the only way replicas exchange tensors.

Replicas never connect to each other. Per round, each rank writes ONE object holding every tensor it contributes,
``round_{NNNNNN}/rank_{RRRR}.safetensors`` at the root of the rendezvous URI, then polls until every peer's object
of that round exists, reads them, and averages.

Round numbering: messages (errors, logs) name rounds from 1, as the metrics and the CLI do ("round 1" is the first
outer sync); the round index inside this module, in the object keys and in each object's metadata counts from 0, so
round N lives under ``round_{N-1:06d}/``.

Round semantics (what a caller can rely on):

* **Identical results.** Contributions are accumulated in fp32 (fp64 stays fp64) strictly in rank order 0..N-1
  and divided by N on the CPU, so every rank computes the same bits; the mean is then cast to each caller tensor's
  dtype on the CPU (so the rounding is the same on every rank, whatever its device) and copied back into it,
  keeping its device.
* **Late or missing peer.** Polling is bounded by ``timeout_s``, counted from when ``wait()`` starts polling
  (after our own upload finished). Past it, ``AllReduceTimeout`` names the round, the exact ranks whose objects
  are still missing, and the last store error seen while polling (so a denied bucket is not reported as a slow
  peer). Waiting for our own upload is bounded by ``timeout_s`` too (a ``StoreError`` naming the round), so
  ``wait()`` never blocks for more than about twice ``timeout_s``.
* **Partial or wrong upload.** A peer object that does not decode (truncated, corrupted, checksum mismatch),
  claims another round, rank or world size, or holds other tensor names, shapes or dtypes than ours is re-read a
  few times (on ``file://`` and S3 an object is complete when it is visible, so a retry only helps against a
  flaky read) and then raises ``CorruptObjectError`` naming the round and the rank. It is never averaged: the
  caller's tensors are left untouched.
* **No silent skips.** Any failure is raised from ``wait()`` (upload errors included) and marks this instance
  failed: peers count rounds in lockstep, so after a failed round every later call raises instead of pairing up
  with the wrong round.
* **Bounded store.** A rank deletes its own object of round k-1 once it has seen every peer's object of round k.
  Why that is safe: a peer only starts round k (``allreduce_async`` refuses to start a round before the previous
  one was waited for) after its ``wait()`` of round k-1 returned, and that ``wait()`` read every object of round
  k-1, ours included. So once all round-k objects exist, nobody will read our round k-1 object again. Deleting
  round k itself at that point would not be safe: a slower peer may still be reading it. Hence at most two objects
  per rank exist at any time, and after the last round exactly one per rank remains (the run's owner deletes the
  rendezvous prefix).

* **Rejoining.** A restarted rank calls ``resume_at(k)`` before its first round: the counter is the only state.
  Which k, and why a contribution is never recomputed for a round that already holds one, is
  ``diloco.manager.ObjectStoreManager.rejoin``'s business.
* **Relaunch in progress.** Past ``timeout_s``, a peer the launcher is relaunching (``relaunch/rank_RRRR.json``
  with an ``until`` wall-clock time, see ``diloco.layout``) extends the wait until then instead of timing out.

Seams left for later (not implemented):

* **Sharded reduce-scatter / all-gather** (each rank reduces 1/N of every tensor and publishes it; reads drop
  from (N-1)S to 2S(N-1)/N): replace ``_gather_mean``; ``allreduce_async``/``wait`` and the deletion rule stay.
* **Compressed payloads** (int8/fp8 on the wire, fp32 accumulation on receipt): override ``_encode`` and
  ``_decode`` and tag the format in the metadata that ``_decode`` checks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from diloco.codec import decode_tensors, encode_tensors
from diloco.errors import (
    AllReduceTimeout,
    ConfigError,
    CorruptObjectError,
    DilocoError,
    ObjectNotFound,
    StoreError,
)
from diloco.store import ObjectStore

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: What callers may pass: named tensors, or a list (named ``t0``..``tN`` on the wire).
Tensors = Mapping[str, "torch.Tensor"] | Sequence["torch.Tensor"]

#: How many times a peer object that fails to decode is read before the round fails.
READ_ATTEMPTS = 3


def number(round_index: int) -> int:
    """The round's number in every message: rounds are numbered from 1 for people (round 1 is the first outer
    sync, as in the metrics and the CLI's table); ``round_index`` counts from 0 on the wire and in the keys."""
    return round_index + 1


def contribution_key(round_: int, rank: int) -> str:
    """Where ``rank`` publishes its contribution to the round of zero-based index ``round_`` (round
    ``round_ + 1`` in messages): ``round_000042/rank_0003.safetensors``."""
    return f"round_{round_:06d}/rank_{rank:04d}.safetensors"


@dataclass
class AllReduceStats:
    """Cumulative counters of one rank's all-reduce traffic (for metrics and the bytes-per-round budget)."""

    rounds: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    seconds_blocked: float = 0.0


# ---------------------------------------------------------------- pure math (no I/O)
def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every floating type up to 32 bits (bf16/fp16 sums lose integers past 256/2048); fp64 stays."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def average(contributions: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of ``contributions``, summed in the order given, on the CPU, in fp32 (or fp64).

    The all-reduce calls this with contributions in rank order, so every rank performs the same floating-point
    operations in the same order and gets bitwise-identical results. Inputs are not modified.
    """
    if not contributions:
        raise ValueError("average() needs at least one contribution")
    acc: dict[str, torch.Tensor] = {}
    for contribution in contributions:
        _accumulate(acc, contribution)
    return _finish_mean(acc, len(contributions))


def _accumulate(acc: dict[str, torch.Tensor], contribution: Mapping[str, torch.Tensor]) -> None:
    """``acc += contribution`` in the accumulation dtype; the first contribution is copied in."""
    for name, t in contribution.items():
        t = t.detach().to("cpu")
        if name not in acc:
            acc[name] = t.to(accumulation_dtype(t.dtype), copy=True)
        else:
            acc[name].add_(t.to(acc[name].dtype))


def _finish_mean(acc: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    for t in acc.values():
        t.div_(n)
    return acc


def as_named(tensors: Tensors) -> dict[str, torch.Tensor]:
    """Named view of the caller's tensors: a mapping as is, a sequence as ``t0``..``tN``."""
    import torch

    if isinstance(tensors, torch.Tensor):
        raise TypeError("pass a dict or a list of tensors, not a single tensor (wrap it: [t])")
    named = dict(tensors) if isinstance(tensors, Mapping) else {f"t{i}": t for i, t in enumerate(tensors)}
    if not named:
        raise ValueError("all-reduce needs at least one tensor")
    for name, t in named.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, expected a torch.Tensor")
        if not t.is_floating_point():
            raise TypeError(f"{name!r} has dtype {t.dtype}; only floating-point tensors can be averaged")
    return named


# ---------------------------------------------------------------- the all-reduce
class AllReduceWork:
    """One round in flight. The upload already started; ``wait()`` polls, averages and copies the mean back.

    ``wait()`` is idempotent: a second call returns at once, or re-raises the round's error.
    """

    def __init__(
        self,
        owner: ObjectStoreAllReduce,
        round_: int,
        targets: dict[str, torch.Tensor],
        snapshot: dict[str, torch.Tensor],
        upload: Future[None],
    ) -> None:
        self.round = round_
        self._owner = owner
        self._targets = targets
        self._snapshot = snapshot
        self._upload = upload
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def wait(self, timeout: object = None) -> bool:
        """Block until the round's mean is in the caller's tensors; raise the round's error if it failed.

        ``timeout`` is accepted for signature compatibility with ``torch.distributed.Work`` and ignored: the
        bound is the all-reduce's ``timeout_s``.
        """
        with self._lock:
            if not self._done:
                try:
                    self._owner._complete(self)
                except BaseException as exc:
                    self._error = exc
                    self._owner._mark_failed(exc)
                    raise
                finally:
                    self._done = True
                    self._snapshot = self._targets = {}  # a finished round keeps no tensor alive
            elif self._error is not None:
                raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether ``wait()`` has finished (successfully or not)."""
        return self._done


class ObjectStoreAllReduce:
    """Mean all-reduce of named tensors among ``world_size`` ranks that share only the store at ``uri``.

    See the module docstring for the round semantics (ordering, timeout, corrupt peers, deletion).
    """

    def __init__(
        self,
        uri: str,
        rank: int,
        world_size: int,
        timeout_s: float = 1800,
        poll_interval_s: float = 1.0,
        run_id: str | None = None,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, {world_size - 1}] for world_size {world_size}, got {rank}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
        if not poll_interval_s > 0:
            raise ConfigError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.uri = uri
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        # Tagged into every contribution and checked on every peer's: leftovers of another run in a reused
        # prefix are rejected as corrupt instead of being averaged into this one.
        self.run_id = run_id
        self.store = ObjectStore(uri)
        self._round = 0
        self._pending: AllReduceWork | None = None
        self._failed: BaseException | None = None
        self._closed = False
        self._stats = AllReduceStats()
        self._stats_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- public API
    @property
    def next_round(self) -> int:
        """The round the next ``allreduce``/``allreduce_async`` call will use (starts at 0, +1 per call)."""
        return self._round

    def resume_at(self, round_: int) -> None:
        """Start counting at ``round_`` (zero-based) instead of 0: a restarted rank rejoining its peers.

        Only before this instance ran any round (the counter is the only state, so this is the whole rejoin);
        ``diloco.manager.ObjectStoreManager.rejoin`` decides which round that is from the committed rounds.
        """
        if self._pending is not None or self._round != 0:
            raise RuntimeError(f"resume_at({round_}) after round {number(self._round - 1)} already started here")
        if round_ < 0:
            raise ValueError(f"round index must be >= 0, got {round_}")
        self._round = round_

    def has_own_contribution(self, round_: int) -> bool:
        """Whether this rank's object for ``round_`` is already in the store (written before a restart)."""
        return self.store.exists(contribution_key(round_, self.rank))

    def relaunch_deadline(self, peer: int) -> float | None:
        """The wall-clock time until which the launcher said ``peer`` is being relaunched, if it said so.

        Written by the launcher (``diloco.orchestrate``) at ``relaunch/rank_RRRR.json``; while it lies in the
        future a missing contribution of ``peer`` is not a timeout yet."""
        import json

        from diloco.layout import RELAUNCH_KEY

        try:
            record = json.loads(self.store.get(RELAUNCH_KEY.format(rank=peer)))
        except (StoreError, OSError, ValueError):
            return None
        until = record.get("until") if isinstance(record, dict) else None
        return float(until) if isinstance(until, (int, float)) else None

    @property
    def stats(self) -> AllReduceStats:
        """A consistent snapshot of the cumulative counters."""
        with self._stats_lock:
            return replace(self._stats)

    def allreduce(self, tensors: Tensors) -> None:
        """Replace ``tensors`` in place by their mean over all ranks (blocking)."""
        self.allreduce_async(tensors).wait()

    def allreduce_async(self, tensors: Tensors) -> AllReduceWork:
        """Snapshot ``tensors`` now, upload them in the background, and return the round's ``Work``.

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
        # A CPU copy now (a device sync on accelerators), so the caller may keep updating its tensors.
        snapshot = {name: t.detach().to("cpu", copy=True) for name, t in targets.items()}
        round_ = self._round
        self._round += 1
        upload = self._uploader().submit(self._upload, round_, snapshot)
        work = AllReduceWork(self, round_, targets, snapshot, upload)
        self._pending = work
        return work

    def close(self, wait: bool = True) -> None:
        """Stop the background upload thread. Idempotent.

        ``wait=True`` lets an upload in progress finish first (bounded by the store's retries); ``wait=False``
        returns at once and the thread ends by itself after that upload (for a replica that is failing anyway).
        """
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> ObjectStoreAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- seams
    def _encode(self, round_: int, tensors: Mapping[str, torch.Tensor]) -> bytes:
        """The wire format of one contribution (override for compressed payloads)."""
        return encode_tensors(tensors, self._identity(round_, self.rank))

    def _identity(self, round_: int, rank: int) -> dict[str, str | int]:
        """The metadata that says whose contribution an object is: written by us, expected of peers."""
        identity: dict[str, str | int] = {"round": round_, "rank": rank, "world_size": self.world_size}
        if self.run_id:
            identity["run_id"] = self.run_id
        return identity

    def _decode(self, data: bytes, round_: int, rank: int) -> dict[str, torch.Tensor]:
        """Parse and verify a peer's contribution; ``CorruptObjectError`` if it is not exactly what we expect."""
        tensors, _ = decode_tensors(
            data,
            expect=self._identity(round_, rank),
            source=self.store.url(contribution_key(round_, rank)),
        )
        return tensors

    def _gather_mean(self, round_: int, own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Poll for, read and accumulate every rank's contribution in rank order (replace for reduce-scatter)."""
        deadline = time.monotonic() + self.timeout_s
        last_error: BaseException | None = None
        acc: dict[str, torch.Tensor] = {}
        for peer in range(self.world_size):
            if peer == self.rank:  # our own bytes round-trip exactly, so the local snapshot is what peers read
                _accumulate(acc, own)
                continue
            key = contribution_key(round_, peer)
            while True:
                try:
                    if self.store.exists(key):
                        break
                except (StoreError, OSError) as exc:  # e.g. a 403: keep polling, but report it on timeout
                    last_error = exc
                    logger.debug("polling %s: %s", self.store.url(key), exc)
                remaining = deadline - time.monotonic()
                if remaining <= 0 and (extension := self._relaunch_extension(peer)) > 0:
                    logger.info("round %d: rank %d is being relaunched; waiting %.0fs more", number(round_), peer,
                                extension)
                    deadline = time.monotonic() + extension
                    remaining = extension
                if remaining <= 0:
                    raise AllReduceTimeout(
                        round_=number(round_),
                        missing_ranks=self._missing(round_, range(peer, self.world_size)),
                        timeout_s=self.timeout_s,
                        last_error=last_error,
                    )
                time.sleep(min(self.poll_interval_s, remaining))
            _accumulate(acc, self._read_peer(round_, peer, own))
        return _finish_mean(acc, self.world_size)

    def _relaunch_extension(self, peer: int) -> float:
        """Seconds until the relaunch of ``peer`` the launcher recorded runs out (0 when none is recorded)."""
        until = self.relaunch_deadline(peer)
        return max(0.0, until - time.time()) if until is not None else 0.0

    # ---------------------------------------------------------------- internals
    def _uploader(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"diloco-allreduce-r{self.rank}")
        return self._executor

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this ObjectStoreAllReduce was closed")
        if self._failed is not None:
            raise DilocoError(
                f"rank {self.rank}'s all-reduce already failed in an earlier round and cannot resume: "
                f"{type(self._failed).__name__}: {self._failed}",
                hint="restart the replica; see the first error above",
            )

    def _mark_failed(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = exc

    def _upload(self, round_: int, snapshot: Mapping[str, torch.Tensor]) -> None:
        """Runs on the upload thread: encode and PUT our contribution (atomic on every store)."""
        data = self._encode(round_, snapshot)
        self.store.put(contribution_key(round_, self.rank), data)
        with self._stats_lock:
            self._stats.bytes_written += len(data)
        logger.debug("rank %d published round %d (%d bytes)", self.rank, number(round_), len(data))

    def _complete(self, work: AllReduceWork) -> None:
        """Body of ``Work.wait()``: finish the upload, gather the mean, copy it back, clean up round k-1."""
        import torch

        started = time.monotonic()
        try:
            try:
                work._upload.result(timeout=self.timeout_s)  # re-raises the upload's error, if any
            except FutureTimeout:
                raise StoreError(
                    f"all-reduce round {number(work.round)}: rank {self.rank}'s own upload to "
                    f"{self.store.url(contribution_key(work.round, self.rank))} did not finish in {self.timeout_s:g}s",
                    hint="check the store's reachability and bandwidth from this replica",
                ) from None
            mean = self._gather_mean(work.round, work._snapshot)
            with torch.no_grad():
                for name, target in work._targets.items():
                    target.copy_(mean[name].to(target.dtype))  # cast on the CPU: same bits on every device
        finally:
            with self._stats_lock:
                self._stats.seconds_blocked += time.monotonic() - started
        with self._stats_lock:
            self._stats.rounds += 1
        if work.round >= 1:
            self._delete_own(work.round - 1)

    def _read_peer(
        self, round_: int, peer: int, reference: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Read and verify ``peer``'s contribution, retrying a corrupt read a few times before failing."""
        key = contribution_key(round_, peer)
        problem: BaseException | None = None
        for attempt in range(READ_ATTEMPTS):
            if attempt:
                time.sleep(min(self.poll_interval_s, 1.0))
            try:
                data = self.store.get(key)
                with self._stats_lock:
                    self._stats.bytes_read += len(data)
                tensors = self._decode(data, round_, peer)
                _check_same_layout(tensors, reference, round_, peer)
                return tensors
            except (CorruptObjectError, ObjectNotFound) as exc:
                problem = exc
                logger.warning("round %d: rank %d's contribution is unreadable (attempt %d): %s",
                               number(round_), peer, attempt + 1, exc)
        raise CorruptObjectError(
            f"all-reduce round {number(round_)}: the contribution of rank {peer} at {self.store.url(key)} is unusable "
            f"after {READ_ATTEMPTS} reads, so it was not averaged: {problem}",
            hint=f"check rank {peer}'s logs; a replica of another run or version may share this rendezvous URI",
        ) from problem

    def _missing(self, round_: int, candidates: range) -> list[int]:
        """The ranks among ``candidates`` whose object for ``round_`` does not exist (unknown counts as missing)."""
        missing = []
        for peer in candidates:
            if peer == self.rank:
                continue
            try:
                present = self.store.exists(contribution_key(round_, peer))
            except (StoreError, OSError):
                present = False
            if not present:
                missing.append(peer)
        return missing

    def _delete_own(self, round_: int) -> None:
        """Best effort: a failed delete costs storage, not correctness, so it is logged, not raised."""
        key = contribution_key(round_, self.rank)
        try:
            self.store.delete(key)
        except (StoreError, OSError) as exc:
            logger.warning("could not delete %s (the store keeps growing): %s", self.store.url(key), exc)


def create_allreduce(
    uri: str,
    rank: int,
    world_size: int,
    *,
    strategy: str = "gather",
    compression: str = "none",
    error_feedback: bool = True,
    min_replicas: int | None = None,
    timeout_s: float = 1800,
    poll_interval_s: float = 1.0,
    run_id: str | None = None,
) -> ObjectStoreAllReduce:
    """The collective a replica's manager talks to, as the run config asks for it (``store.allreduce``,
    ``store.compression``, ``store.error_feedback``, ``min_replicas``).

    ``ConfigError`` naming the setting when this build cannot do what was asked."""
    if strategy != "gather":
        raise ConfigError(f"store.allreduce: {strategy!r} is not available in this build", hint="use gather")
    if compression != "none":
        raise ConfigError(f"store.compression: {compression!r} is not available in this build", hint="use none")
    if min_replicas is not None and min_replicas != world_size:
        raise ConfigError("min_replicas: partial participation is not available in this build",
                          hint="leave min_replicas unset")
    return ObjectStoreAllReduce(uri, rank, world_size, timeout_s=timeout_s, poll_interval_s=poll_interval_s,
                                run_id=run_id)


def _check_same_layout(
    tensors: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], round_: int, peer: int
) -> None:
    """A peer must contribute the same tensor names, shapes and dtypes as we do, or averaging is meaningless."""
    if set(tensors) != set(reference):
        extra = sorted(set(tensors) - set(reference))
        lacking = sorted(set(reference) - set(tensors))
        raise CorruptObjectError(
            f"round {number(round_)}: rank {peer} contributed different tensors (extra {extra}, missing {lacking})"
        )
    for name, t in reference.items():
        got = tensors[name]
        if got.shape != t.shape or got.dtype != t.dtype:
            raise CorruptObjectError(
                f"round {number(round_)}: rank {peer}'s {name!r} is {got.dtype} {tuple(got.shape)}, "
                f"expected {t.dtype} {tuple(t.shape)}"
            )
