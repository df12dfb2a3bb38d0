"""All-reduce (mean) over an object store: the only way replicas exchange tensors.

Replicas never connect to each other. Per round, each rank writes ONE object holding every tensor it contributes,
``round_{NNNNNN}/rank_{RRRR}.safetensors`` at the root of the rendezvous URI (or under ``p{K}/`` with a request
``spread``, see ``diloco.store.layout``), then reads what it needs of its peers' objects and averages. Two strategies
(``store.allreduce``), sibling implementations of one protocol (``diloco.collectives``):

=========  ==================  =====================  ==================================================
strategy   written per rank    read per rank          requests per rank per round
=========  ==================  =====================  ==================================================
gather     S                   (N-1)·S                1 PUT, (N-1)·(1 + ceil(S / 32 MiB)) GETs
sharded    S + S/N             2·S·(N-1)/N            2 PUTs, 3(N-1) GETs (header + shard range + reduced)
=========  ==================  =====================  ==================================================

(S: the payload's bytes on the wire, fp32 or ``store.compression``'s format; plus polling: one HEAD per awaited
object per ``poll_interval_s``, after up to four quicker ones at the start of each wait; plus one 64 KiB header probe per peer object read by ranges. Gather reads an
uncompressed peer in verified 32 MiB ranges it accumulates as they arrive, so a round holds the snapshot, the
accumulator and one range; sharded holds the snapshot, whose buffer later holds the gathered mean, and one shard per peer read.) Sharded reads less from N = 3 on; gather makes a third of the requests and has one
phase instead of two. ``bench/allreduce_traffic.py`` counts both at the store layer.

Round numbering: messages (errors, logs) name rounds from 1, as the metrics and the CLI do ("round 1" is the first
outer sync); the round index inside this module, in the object keys and in each object's metadata counts from 0, so
round N lives under ``round_{N-1:06d}/``.

Round semantics (what a caller can rely on, whatever the strategy):

* **Identical results.** Contributions are accumulated in fp32 (gather keeps fp64 in fp64) in a fixed order (rank
  order 0..N-1; a compressed sharded round's owner adds its own shard first) and divided by N on the CPU, so every
  rank computes the same bits (and uncompressed gather and sharded the same bits as each other); the mean is then
  cast to each caller tensor's dtype on the CPU and copied back into it, keeping its device. With
  ``store.compression``, every rank averages the *decoded* version of its own contribution, the very values its
  peers decode (``diloco.collectives.wire``).
* **Overlap.** ``allreduce_async`` snapshots the tensors and runs the whole round (upload, polling, downloads,
  reduction) on a background thread; ``Work.wait()`` only waits for it and copies the mean back. The time callers
  spend in ``wait()`` is ``AllReduceStats.seconds_blocked`` (``sync s`` in ``diloco status``).
* **Late or missing peer.** Polling is bounded by ``timeout_s`` per phase (gather has one, sharded two), counted
  from when the round thread starts polling (after our own upload finished). Past it, ``AllReduceTimeout`` names
  the round, the exact ranks whose objects are still missing, and the last store error seen while polling (so a
  denied bucket is not reported as a slow peer). Waiting for our own upload is bounded by ``timeout_s`` too (a
  ``StoreError`` naming the round).
* **Partial or wrong upload.** An object that does not decode (truncated, corrupted, checksum mismatch), claims
  another round, rank, run or world size, or holds other tensor names, shapes, dtypes or another compression
  format than ours is re-read a few times and then raises ``CorruptObjectError`` naming the round and the rank.
  It is never averaged: the caller's tensors are left untouched.
* **No silent skips.** Any failure is raised from ``wait()`` (upload errors included) and marks this instance
  failed: peers count rounds in lockstep, so after a failed round every later call raises instead of pairing up
  with the wrong round.
* **Bounded store.** A rank deletes its own objects of round k-1 once it has seen every peer's contribution of
  round k. Why that is safe: a peer only starts round k (``allreduce_async`` refuses to start a round before the
  previous one was waited for) after its ``wait()`` of round k-1 returned, and that ``wait()`` returns only after
  its round thread read everything of round k-1 it needed, ours included. Hence at most two rounds of objects per
  rank exist at any time, and after the last round one round's remain (the run's owner deletes the prefix).
* **Rejoining.** A restarted rank calls ``resume_at(k)`` before its first round: the counter is the only state.
  Which k, and why a contribution is never recomputed for a round that already holds one, is
  ``diloco.replica.manager.ObjectStoreManager.rejoin``'s business. Error-feedback residuals start empty after a rejoin.
* **Partial participation** (``min_replicas = K``, gather only, opt-in). When a round's deadline passes with at
  least K contributions, it commits with those: every rank adopts the round's manifest
  (``round_NNNNNN/manifest.json``, created exactly once), sums the members' contributions in rank order and
  divides by their number, so results stay bitwise identical. A contribution that lands after the manifest is not
  averaged; its rank raises ``DroppedFromRound`` (the replica exits 75) and rejoins at the next round once
  relaunched. A rank the launcher has left behind (failed for good: ``left/rank_RRRR.json``) is not waited for:
  once every missing rank is one, a round with K contributions commits at once (one HEAD per missing rank per
  poll while a quorum waits). Without ``min_replicas`` nothing is ever averaged over a partial set.
* **Elastic membership** (``max_replicas`` set, gather only). The members of a round are data: every round
  commits a manifest naming the ranks it averaged and the next round's members, copied from the launcher's target
  (``membership.json``, ``diloco scale``) by whoever creates it; a rank waits only for the members its previous
  round's manifest named (``diloco.collectives.membership``). A rank the next round does not name leaves the run
  after its last round (``ReplicaDrained``); a rank added since waits, as a rejoining rank does, until a manifest
  names it.
* **Relaunch in progress.** Past ``timeout_s``, a peer the launcher is relaunching (``relaunch/rank_RRRR.json``
  with an ``until`` wall-clock time, see ``diloco.store.layout``) extends the wait until then instead of timing out.
* **Rejoined peer.** A restarted rank announces the round it rejoins for (``rejoin/rank_RRRR.json``, with the
  time; a first start announces round 1); past ``timeout_s`` its peers wait for it until that time plus as long as
  they trained for the round plus ``timeout_s``, since it started that round late by its whole restart (or a slow
  start). Only for that round.
"""

from __future__ import annotations

from typing import Any

from diloco.collectives import STRATEGIES, Collective, ObjectStoreAllReduce, ShardedAllReduce
from diloco.collectives.driver import READ_ATTEMPTS, AllReduceStats, AllReduceWork, RoundDriver
from diloco.collectives.reduce import Tensors, accumulation_dtype, as_named, average, number
from diloco.errors import ConfigError
from diloco.store.layout import contribution_key as _spread_contribution_key
from diloco.store.settings import StoreSettings


def contribution_key(round_: int, rank: int) -> str:
    """Where ``rank`` publishes its contribution to the round of zero-based index ``round_`` (round
    ``round_ + 1`` in messages), in the default layout (no spread): ``round_000042/rank_0003.safetensors``."""
    return _spread_contribution_key(round_, rank)


def create_allreduce(uri: str, rank: int, world_size: int, settings: StoreSettings | None = None, *,
                     run_id: str | None = None, **fields: Any) -> RoundDriver:  # type: ignore[type-arg]
    """The collective a replica's manager talks to, as the store settings ask for it
    (``diloco.store.settings.StoreSettings``: the strategy, the wire format and its parameters, ``spread``,
    ``min_replicas``, ``timeout_s``, ``poll_interval_s``). ``fields`` set some of them by name over ``settings``
    (``create_allreduce(uri, 0, 4, allreduce="sharded")``); ``settings`` may be a replica's whole settings.

    ``ConfigError`` naming the setting when the settings break one of their rules."""
    from pydantic import ValidationError

    from diloco.errors import validation_line
    from diloco.store.settings import min_replicas_problem

    base = settings.model_dump(include=set(StoreSettings.model_fields)) if settings is not None else {}
    try:
        s = StoreSettings.model_validate({**base, **fields})
    except ValidationError as exc:
        raise ConfigError(f"store.{validation_line(exc)}", hint="see docs/reference/configuration.md") from None
    problem = min_replicas_problem(s.min_replicas, world_size) if s.max_replicas is None else None
    if problem:
        raise ConfigError(f"store.min_replicas: {problem}", hint="lower --min-replicas")
    from diloco.collectives.wire import PayloadCodec

    common = dict(timeout_s=s.timeout_s, poll_interval_s=s.poll_interval_s, run_id=run_id, spread=s.spread,
                  codec=PayloadCodec.from_settings(s))
    if s.allreduce == "sharded":
        return ShardedAllReduce(uri, rank, world_size, **common)
    return ObjectStoreAllReduce(uri, rank, world_size, min_replicas=s.min_replicas, elastic=s.max_replicas is not None,
                                **common)


__all__ = ["READ_ATTEMPTS", "STRATEGIES", "AllReduceStats", "AllReduceWork", "Collective", "ObjectStoreAllReduce",
           "RoundDriver", "ShardedAllReduce", "Tensors", "accumulation_dtype", "as_named", "average",
           "contribution_key", "create_allreduce", "number"]
