"""Elastic membership: which ranks a round averages is data in the store, not the world size a replica started with.

An elastic run (``store.max_replicas`` set) commits a manifest for every round (``round_NNNNNN/manifest.json``,
created exactly once, as ``min_replicas`` rounds do). Besides the ranks the round averaged (``members``) it names
the members of the *next* round (``next``): whoever creates round k's manifest copies the target membership it
reads at that moment (``membership.json`` at the rendezvous root, written by the launcher's ``diloco scale``) into
it. So every replica learns round k+1's members from round k's manifest, deterministically, whatever the order in
which the launcher's write and the round's commit happened: a target written after round k's manifest takes effect
one round later, never half-way.

Round 1 (index 0) has the ``world_size`` ranks the run was launched with (the spec's ``world_size``); a round whose
previous manifest says nothing (a run launched before it was elastic) keeps the members of the round before.

The arithmetic stays that of every round: the members' contributions summed in rank order and divided by their
number, so each member of a round computes the same bits, whatever the count was in earlier rounds.

This module is replica-side (the launcher writes the target through ``write_target``): no launcher, no backend.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diloco.errors import DilocoError, ObjectNotFound, StoreError
from diloco.store.layout import MEMBERSHIP_KEY, ROUND_MANIFEST_KEY

if TYPE_CHECKING:
    from diloco.store.objects import ObjectStore

#: The format tag of the target membership object.
MEMBERSHIP_FORMAT = "diloco.membership/1"


class ReplicaDrained(DilocoError):
    """This rank is not a member of the run's next round: it contributed to its last round and leaves the run,
    drained, not failed (the replica exits 0 and is not relaunched)."""

    def __init__(self, rank: int, after_round: int) -> None:
        super().__init__(f"rank {rank} leaves the run after round {after_round}: the run was scaled down and this "
                         "rank is not a member of the next round (drained, not failed)")
        self.rank = rank
        self.after_round = after_round  # numbered from 1, as in the logs


@dataclass(frozen=True)
class Target:
    """The membership the launcher asks for: the ranks of every round from the next manifest on."""

    members: tuple[int, ...]
    epoch: int
    at: float

    def to_bytes(self, run_id: str) -> bytes:
        return json.dumps({"format": MEMBERSHIP_FORMAT, "run_id": run_id, "members": list(self.members),
                           "epoch": self.epoch, "at": self.at}, indent=2).encode()


def read_target(store: ObjectStore) -> Target | None:
    """The target membership at the rendezvous root, or None when the run was never scaled (or it is unreadable:
    then the members stay as they are, which is always safe)."""
    try:
        body = json.loads(store.get(MEMBERSHIP_KEY))
    except (ObjectNotFound, StoreError, OSError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("format") != MEMBERSHIP_FORMAT:
        return None
    members = body.get("members")
    if not isinstance(members, list) or not members or not all(isinstance(r, int) and r >= 0 for r in members):
        return None
    return Target(members=tuple(sorted(set(members))), epoch=int(body.get("epoch", 0)), at=float(body.get("at", 0)))


def write_target(store: ObjectStore, run_id: str, members: Iterable[int]) -> Target:
    """Ask for ``members`` from the next manifest on (the launcher's half of a scale); the epoch counts scales."""
    previous = read_target(store)
    target = Target(members=tuple(sorted(set(members))), epoch=(previous.epoch + 1) if previous else 1,
                    at=time.time())
    store.put(MEMBERSHIP_KEY, target.to_bytes(run_id))
    return target


def read_manifest(store: ObjectStore, round_: int) -> dict[str, Any] | None:
    """Round ``round_``'s (zero-based) manifest, or None when it is not committed (or unreadable)."""
    try:
        body = json.loads(store.get(ROUND_MANIFEST_KEY.format(round=round_)))
    except (ObjectNotFound, StoreError, OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def next_of(manifest: dict[str, Any]) -> list[int] | None:
    """The members a manifest names for the round after it (None: it names none)."""
    nxt = manifest.get("next")
    return sorted(int(r) for r in nxt) if isinstance(nxt, list) else None


def round_members(store: ObjectStore, round_: int, initial: int) -> list[int] | None:
    """The ranks expected in the round of zero-based index ``round_``: ``range(initial)`` for the first, else what
    the previous round's manifest names (its own members when it names no next); None while that manifest is not
    committed yet."""
    if round_ == 0:
        return list(range(initial))
    manifest = read_manifest(store, round_ - 1)
    if manifest is None:
        return None
    named = next_of(manifest)
    return named if named is not None else sorted(int(r) for r in manifest.get("members", []))


def members_for_next(store: ObjectStore, current: Sequence[int]) -> list[int]:
    """What a round's manifest names as the next round's members: the target when there is one, else ``current``."""
    target = read_target(store)
    return list(target.members) if target is not None else sorted(current)


def member_history(store: ObjectStore, rounds: int, initial: int) -> list[list[int]]:
    """The members of each of the first ``rounds`` committed rounds, from their manifests (what ``status`` shows
    and the data dealing counts); a round without a manifest is taken to have had its expected members."""
    history: list[list[int]] = []
    expected = list(range(initial))
    for round_ in range(rounds):
        manifest = read_manifest(store, round_)
        if manifest is None:
            history.append(expected)
            continue
        members = sorted(int(r) for r in manifest.get("members", expected))
        history.append(members)
        expected = next_of(manifest) or members
    return history
