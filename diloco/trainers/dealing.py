"""Training data dealt by each round's membership, for elastic runs: no block seen twice in an epoch, none skipped,
whatever the count of replicas does between rounds.

A fixed set of replicas can each own a shard (rank ``r`` of ``N``). When replicas join and leave, shards would have
to be re-cut, and blocks the leavers had not reached would be skipped. Here every round ``r`` consumes the next
``steps_per_round * |members(r)| * per_step`` positions of one global sequence instead; inside the round, step ``s``
takes the next ``|members(r)| * per_step`` positions, and the member in slot ``k`` (its index among the round's
members, sorted) takes ``per_step`` of them, the ``k``-th chunk. So the positions the members of all rounds take are
consecutive, with no gap and no overlap, and position ``p`` is block ``perm_e[p mod total]`` of epoch
``e = p // total``, ``perm_e`` a permutation seeded by ``seed`` and ``e``, identical on every machine.

Every member computes this alone from the rounds' memberships (``members_of(round)``: the manager's
``members_of``, read from the round manifests), so a replica that joins, rejoins or is relaunched needs no
position of its own: the step it is at says where it reads. Torch-free.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from diloco.errors import ConfigError


class MembershipDealer:
    """Which blocks (of ``total`` per epoch) each member takes at each inner step (see the module docstring).

    ``procs``: local processes per replica, each a slot of its own (member slot ``k``, process ``l``: slot
    ``k * procs + l``)."""

    def __init__(self, members_of: Callable[[int], Sequence[int]], *, steps_per_round: int, per_step: int,
                 total: int, seed: int = 0, procs: int = 1) -> None:
        for name, value in (("steps_per_round", steps_per_round), ("per_step", per_step), ("total", total),
                            ("procs", procs)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1 (got {value})")
        self.members_of = members_of
        self.steps_per_round, self.per_step, self.total, self.seed, self.procs = (
            steps_per_round, per_step, total, seed, procs)
        self._starts = [0]  # _starts[r]: the first position of round r
        self._perms: dict[int, list[int]] = {}

    def round_start(self, round_: int) -> int:
        """The first global position of round ``round_`` (zero-based): the positions of every round before it."""
        while len(self._starts) <= round_:
            r = len(self._starts) - 1
            width = len(self.members_of(r)) * self.procs * self.per_step
            self._starts.append(self._starts[r] + self.steps_per_round * width)
        return self._starts[round_]

    def positions(self, step: int, rank: int, proc: int = 0) -> list[int]:
        """The global positions member ``rank`` (its process ``proc``) trains on at inner step ``step`` (zero-based
        over the run). ``ConfigError`` when the round of that step does not name ``rank``."""
        round_, within = divmod(step, self.steps_per_round)
        members = sorted(self.members_of(round_))
        if rank not in members:
            raise ConfigError(f"rank {rank} is not a member of round {round_ + 1} ({members}); it has no data there")
        width = len(members) * self.procs * self.per_step
        slot = members.index(rank) * self.procs + proc
        first = self.round_start(round_) + within * width + slot * self.per_step
        return list(range(first, first + self.per_step))

    def block(self, position: int) -> int:
        """The block at global ``position``: its epoch's permutation, read at ``position mod total``."""
        epoch, index = divmod(position, self.total)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(self.total))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            self._perms = {epoch: perm}  # one epoch at a time: a round reads at most into the next one
        return perm[index]

    def blocks(self, step: int, rank: int, proc: int = 0) -> list[int]:
        """The blocks member ``rank`` trains on at inner step ``step`` (zero-based)."""
        return [self.block(p) for p in self.positions(step, rank, proc)]


class DealtFeed:
    """In-memory training blocks dealt by membership, as the Hugging Face trainer's ``Feed``
    (``diloco.trainers.hf_feed``): the ``k``-th block this process takes is the ``k mod per_step``-th of what the
    dealer gives it at inner step ``k // per_step`` (``per_step``: blocks per process per inner step). Its position
    is only the count taken, since the step says the rest: a relaunch's ``advance`` by the rounds done puts it
    exactly where the run is."""

    def __init__(self, train: Any, eval_blocks: Any, dealer: MembershipDealer, *, rank: int, proc: int,
                 per_step: int, describe: str) -> None:
        self.train, self.eval, self.dealer, self.describe = train, eval_blocks, dealer, describe
        self.rank, self.proc, self.per_step = rank, proc, per_step
        self.taken = 0

    def take(self, count: int) -> Any:
        rows = []
        for k in range(self.taken, self.taken + count):
            step, i = divmod(k, self.per_step)
            rows.append(self.dealer.block(self.dealer.positions(step, self.rank, self.proc)[i]))
        self.taken += count
        return self.train[rows]

    def advance(self, count: int) -> None:
        self.taken += count

    def state_dict(self) -> dict[str, Any]:
        return {"format": "diloco.dealt-blocks/1", "taken": self.taken}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != "diloco.dealt-blocks/1":
            raise ValueError(f"not a position of blocks dealt by membership: {dict(state)}")
        self.taken = int(state["taken"])
