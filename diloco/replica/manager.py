"""The manager surface the DiLoCo outer loop talks to, modelled on torchft's ``Manager``, over the store all-reduce.

torchft's Manager runs quorums, heals joiners and swallows collective errors into ``report_error`` so a failed
step is discarded and retried by a smaller quorum. Here the replica set is fixed for the whole run, and a round that
some rank skipped can never be repaired (the ranks' round counters would drift apart). A replica that *dies*, or
is dropped from a ``min_replicas`` round it was late for (it exits 75), is different: the launcher relaunches it
and it rejoins (``rejoin``: the latest committed round, ``diloco.replica.checkpoint``,
loaded by the outer loop; its peers just wait a little longer). So the one rule that differs from torchft is:

* **Errors are loud.** A failed all-reduce re-raises from ``Work.wait()`` and the replica fails (the orchestrator
  relaunches or aborts the run). The error is also latched, so ``should_commit()`` returns ``False`` if a caller
  caught it and carried on: the outer step is never applied with a partial or local-only pseudo-gradient (Prime's
  fallback to the unreduced pseudo-gradient was silent divergence).

Step semantics (identical to torchft, and what the fragment schedule relies on): ``current_step()`` counts
committed rounds. It starts at 0 and advances by exactly one per round, inside ``should_commit()`` when that
returns ``True``, never twice per round (``start_quorum()`` opens a round; repeated ``should_commit()`` calls in
one round return the same answer). So between ``start_quorum()`` and ``should_commit()`` of round k it reads k: the
first sync picks fragment ``0 % F``, the next ``1 % F`` and so on, the same on every rank.

Round numbering (the one used in every log line, error, metric and table): rounds are numbered from 1, round N
being the N-th outer sync; during round N ``current_step()`` reads N - 1, and after it commits, N. Metrics'
``round`` is ``current_step()``: the number of the last completed round, 0 before the first.

Sharded models (FSDP2): the outer loop exchanges, commits and restores a sharded model by rows
(``allreduce_shards``, ``commit_round_shards``, ``rejoin_shards``, ``gather_shards``); here, in a one-process
replica, the rows are whole tensors, exchanged through the parts collective (``diloco.collectives.parts``) that
``parts`` builds, so the replica meets sharded peers. A multi-process replica's processes do the same through
``diloco.replica.local_group.LocalGroupManager``.

The manager also owns the replica's ``MetricsWriter`` (``manager.metrics``): the outer loop drives it, so every
trainer's progress and final weights are recorded whether or not the trainer reports anything itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from diloco.collectives.allreduce import AllReduceStats, AllReduceWork, Collective, Tensors
from diloco.defaults import DEFAULT_PROGRESS_INTERVAL_S
from diloco.errors import DilocoError
from diloco.replica.metrics import MetricsWriter

if TYPE_CHECKING:
    import torch

    from diloco.collectives.part_layout import ShardSpec
    from diloco.collectives.parts import PartsAllReduce
    from diloco.replica.checkpoint import CommittedRound, RoundCheckpoints
    from diloco.replica.parts_setup import PartsSetup
    from diloco.store.objects import ObjectStore

logger = logging.getLogger(__name__)


class ManagedWork:
    """A round's ``Work`` whose failure is latched in the manager before it is re-raised."""

    def __init__(self, manager: ObjectStoreManager, work: AllReduceWork) -> None:
        self._manager = manager
        self._work = work

    def wait(self, timeout: object = None) -> bool:
        """Block until the mean is written back into the tensors; re-raise (after latching) any error."""
        try:
            return self._work.wait(timeout)
        except Exception as exc:
            self._manager.report_error(exc)
            raise

    def is_completed(self) -> bool:
        return self._work.is_completed()


class ObjectStoreManager:
    """torchft-style ``Manager`` for a fixed set of replicas meeting through a store collective
    (``diloco.collectives.Collective``: gather or sharded, as ``diloco.collectives.allreduce.create_allreduce`` built it)."""

    def __init__(
        self,
        allreduce: Collective,
        *,
        total_steps: int | None = None,
        progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
        rounds: RoundCheckpoints | None = None,
        parts: PartsSetup | None = None,
    ) -> None:
        """``total_steps`` (when known) and ``progress_interval_s`` configure the replica's metrics; ``rounds``
        (a ``diloco.replica.checkpoint.RoundCheckpoints``) turns on committing each round and rejoining from them;
        ``parts`` (a ``diloco.replica.parts_setup.PartsSetup``) lets a sharded model be exchanged by rows."""
        self._allreduce = allreduce
        self.rounds = rounds
        self._parts = parts
        self._parts_collective: PartsAllReduce | None = None
        #: Bytes (written, read) the replica's other local processes moved in their parts rounds, so far.
        self.sibling_bytes = (0, 0)
        self.metrics = MetricsWriter(allreduce.store, allreduce.rank, total_steps=total_steps,
                                     stats=lambda: self.stats, rounds=self.current_step,
                                     progress_interval_s=progress_interval_s)
        self._step = 0
        self._error: BaseException | None = None
        self._round_open = False
        self._commit_decision: bool | None = None
        self._pending: ManagedWork | None = None  # the round in flight (the all-reduce allows one at a time)
        self._members: dict[int, list[int]] = {}  # elastic: round index -> its members (``members_of``)

    # ---------------------------------------------------------------- identity
    @property
    def rank(self) -> int:
        return self._allreduce.rank

    @property
    def world_size(self) -> int:
        return self._allreduce.world_size

    @property
    def store(self) -> ObjectStore:
        """The store at the rendezvous root (metrics and final weights go here too)."""
        return self._allreduce.store

    @property
    def stats(self) -> AllReduceStats:
        """The replica's collective counters: its whole-tensor collective's, plus its parts collective's and the
        bytes its other local processes moved (a sharded replica's traffic is the sum of its processes')."""
        stats = self._allreduce.stats
        if self._parts_collective is not None:
            own = self._parts_collective.stats
            stats = AllReduceStats(rounds=stats.rounds + own.rounds,
                                   bytes_written=stats.bytes_written + own.bytes_written + self.sibling_bytes[0],
                                   bytes_read=stats.bytes_read + own.bytes_read + self.sibling_bytes[1],
                                   seconds_blocked=stats.seconds_blocked + own.seconds_blocked)
        return stats

    def wire_state(self) -> dict[str, Any]:
        """The collective's per-rank wire state (error-feedback residuals), for the outer loop to keep."""
        return self._allreduce.wire_state() if hasattr(self._allreduce, "wire_state") else {}

    def error_feedback_active(self) -> bool:
        """Whether the collective sends a lossy format with error feedback (what SparseLoCo's outer rule needs)."""
        active = getattr(self._allreduce, "error_feedback_active", None)
        return bool(active()) if callable(active) else False

    def load_wire_state(self, state: Mapping[str, Any]) -> None:
        if hasattr(self._allreduce, "load_wire_state"):
            self._allreduce.load_wire_state(state)

    def inner_state_place(self, shards: bool) -> tuple[str | None, tuple[int, int] | None] | None:
        """Where the outer loop keeps the inner optimizer's state: beside committed rounds (the run's id), or None
        when this replica commits none. A one-process replica keeps its state whole, shards or not."""
        return (self.rounds.run_id, None) if self.rounds is not None else None

    def num_participants(self) -> int:
        """The replicas of the run, ``world_size`` (with ``min_replicas`` a round may average fewer; its manifest,
        ``round_NNNNNN/manifest.json``, names them)."""
        return self._allreduce.world_size

    def current_step(self) -> int:
        """Committed rounds so far; see the module docstring for exactly when it advances."""
        return self._step

    # ---------------------------------------------------------------- round lifecycle
    def start_quorum(self) -> None:
        """Open a round: clear the error latch (as torchft does) and allow ``should_commit`` to advance the step.

        The quorum is trivially everyone, so this does no I/O.
        """
        if self._error is not None:
            logger.warning("starting a new round after an error was latched: %s", self._error)
        self._error = None
        self._round_open = True
        self._commit_decision = None

    def allreduce(self, tensor_or_tensors: torch.Tensor | Tensors) -> ManagedWork:
        """Start averaging (AVG) ``tensor_or_tensors`` in place across all replicas; returns the round's Work.

        One call is one store round, however many tensors it carries, so pass a fragment's tensors together.
        """
        import torch

        tensors: Tensors = [tensor_or_tensors] if isinstance(tensor_or_tensors, torch.Tensor) else tensor_or_tensors
        try:
            work = ManagedWork(self, self._allreduce.allreduce_async(tensors))
        except Exception as exc:
            self.report_error(exc)
            raise
        self._pending = work
        return work

    def report_error(self, exc: BaseException) -> None:
        """Latch ``exc`` for this round (the first one wins); ``should_commit()`` will return ``False``."""
        if self._error is None:
            from diloco.collectives.gather import DroppedFromRound

            self._error = exc
            log = logger.warning if isinstance(exc, DroppedFromRound) else logger.error  # it is relaunched
            log("rank %d: outer round %d failed: %s", self.rank, self._step + 1, exc)

    def errored(self) -> BaseException | None:
        """The error latched in the current round, if any."""
        return self._error

    def should_commit(self) -> bool:
        """Whether this round's outer step may be applied; advances ``current_step()`` when it is.

        Waits for any all-reduce of the round that was not waited for yet (its error, if any, is raised: a
        failure is never turned into a quiet ``False``). Returns ``False`` only when an error was latched earlier
        in the round. Must follow ``start_quorum()``.
        """
        pending, self._pending = self._pending, None
        if pending is not None and not pending.is_completed():  # a completed one already raised to its waiter
            pending.wait()
        if self._commit_decision is not None:
            return self._commit_decision
        if not self._round_open:
            raise RuntimeError("should_commit() called without start_quorum() for this round")
        decision = self._error is None
        if decision:
            self._step += 1
        self._round_open = False
        self._commit_decision = decision
        return decision

    # ---------------------------------------------------------------- committed rounds and rejoining
    def commit_round(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Commit the global state after the round that just committed (no-op without ``rounds``)."""
        if self.rounds is not None:
            self.rounds.commit(self._step, tensors)

    def rejoin(self, poll_s: float | None = None) -> CommittedRound | None:
        """Find where this rank's peers are and set the round counters there; the state to load, or ``None``
        (``rejoin_round``, then the committed round's whole state)."""
        latest = self.rejoin_round(poll_s)
        if latest == 0:
            return None
        assert self.rounds is not None
        return self.rounds.read(latest)

    def rejoin_round(self, poll_s: float | None = None, *,
                     contributed: Callable[[int], bool] | None = None) -> int:
        """Find where this rank's peers are and set the round counters there; the committed round to load (0:
        none, start from the common initial weights). ``contributed(round index)`` says whether this replica's
        contribution to a round is in the store (default: its collective's object; a sharded replica's parts).

        0 means the run has no committed round yet: a first start (or a restart before round 1), from the
        common initial weights. Otherwise the latest committed round c: the manager's step becomes c and
        the all-reduce's next round index c (round c + 1), so this rank contributes to the round its peers
        wait for. One exception makes it wait first: when this rank's contribution to round c + 1 is already in
        the store (it died after uploading it), its peers may have read those bytes, so recomputing it would
        give them different means. It waits for round c + 1 to commit instead (it has all contributions, so it
        will, within the all-reduce timeout; with ``min_replicas`` it may have committed without them: this rank
        was dropped from it) and looks again. So a rejoined rank never contributes twice to one round, and what it
        contributes is computed from exactly that round's global weights.

        A rank that rejoins tells its peers the round it will contribute to (``announce_rejoin``): it starts that
        round late by its whole restart, so past their deadline they wait for it as long as they trained for the
        round, plus the all-reduce timeout, before they fail or (with ``min_replicas``) drop it again. A first
        start announces round 1 the same way, so a replica whose machine took longer to start it (importing
        torch on a busy host) is not timed out or dropped for that alone. When c is
        the run's last round (the rank was dropped from it, or died after its peers finished), the trainer has
        no step left: it leaves the loop at once with the final committed model, the one its peers exported.
        """
        if self.rounds is None:
            return 0
        if self._step or self._allreduce.next_round:
            raise RuntimeError("rejoin() must come before the first round")
        own = contributed or self._allreduce.has_own_contribution
        poll = self._allreduce.poll_interval_s if poll_s is None else poll_s
        if self._allreduce.elastic:
            self._wait_until_named(poll)
        deadline = time.monotonic() + self._allreduce.timeout_s
        while True:
            latest = self.rounds.latest_round()
            if not own(latest):
                break
            if time.monotonic() > deadline:
                raise DilocoError(
                    f"rank {self.rank} could not rejoin: round {latest + 1} holds its contribution but did not "
                    f"commit within {self._allreduce.timeout_s:g}s",
                    hint="a peer is missing too; check every replica's log (diloco logs RUN)")
            logger.info("rank %d: my contribution to round %d is already in the store; waiting for that round to "
                        "commit before rejoining", self.rank, latest + 1)
            time.sleep(poll)
        announce = getattr(self._allreduce, "announce_rejoin", None)
        if callable(announce):
            announce(latest)
        if latest == 0:
            return 0
        self._step = latest
        self._allreduce.resume_at(latest)
        logger.info("rank %d rejoins the run after committed round %d (its next round is %d)", self.rank, latest,
                    latest + 1)
        return latest

    def members_of(self, round_index: int) -> list[int] | None:
        """Elastic: the members of the round of zero-based index ``round_index`` (what the trainers deal data by,
        ``diloco.trainers.dealing``): the ranks the run started with for the first round, else what the previous
        round's manifest names; manifests never change, so each is read once. None for a run of fixed replicas."""
        if not self._allreduce.elastic:
            return None
        known = self._members.get(round_index)
        if known is not None:
            return known
        from diloco.collectives.membership import round_members

        after = self._allreduce.members_after(round_index - 1) if round_index else None
        members = after if after is not None else round_members(self.store, round_index, self.world_size)
        if members is None:
            raise DilocoError(f"the members of round {round_index + 1} are not known yet: round {round_index}'s "
                              "manifest is not committed", hint="a trainer asks only for rounds this replica reached")
        self._members[round_index] = list(members)
        return self._members[round_index]

    def leaving(self) -> bool:
        """Whether the round that just committed was this rank's last: in an elastic run, its manifest does not
        name this rank among the next round's members (the run was scaled down). The rank's contribution to that
        round was averaged; the outer loop then ends it as drained (``ReplicaDrained``), exit 0."""
        done = self._allreduce.next_round
        if done == 0:
            return False
        after = self._allreduce.members_after(done - 1)
        return after is not None and self.rank not in after

    def _wait_until_named(self, poll: float) -> None:
        """Elastic: wait until the round this rank would join (the one after the latest committed) names it, as
        it does a rank ``diloco scale`` added once the next manifest was committed; a rank neither that round nor
        the launcher's target names is not part of the run (a drained rank started again) and leaves at once
        (``ReplicaDrained``). A run that ended meanwhile (a member's final weights exist) is joined at its end."""
        from diloco.collectives.membership import ReplicaDrained, read_target, round_members
        from diloco.store.layout import FINAL_KEY

        assert self.rounds is not None
        store = self._allreduce.store
        patience = 4 * self._allreduce.timeout_s
        latest, since, told = self.rounds.latest_round(), time.monotonic(), False
        while True:
            members = round_members(store, latest, self._allreduce.world_size)
            if members is not None and self.rank in members:
                if told:
                    logger.info("rank %d: round %d names it; joining the run", self.rank, latest + 1)
                return
            target = read_target(store)
            if members is not None and (target is None or self.rank not in target.members):
                raise ReplicaDrained(self.rank, latest)
            if members and any(store.exists(FINAL_KEY.format(rank=m)) for m in members):
                logger.info("rank %d: the run ended before a round named it; it adopts the final model", self.rank)
                return
            if not told:
                logger.info("rank %d joins the run: waiting for a committed round to name it (after round %d)",
                            self.rank, latest)
                told = True
            if time.monotonic() - since > patience:
                raise DilocoError(f"rank {self.rank} could not join the run: no round named it, and no round "
                                  f"committed for {patience:g}s", hint="check the run's other replicas "
                                                                     "(diloco status RUN)")
            time.sleep(poll)
            now = self.rounds.latest_round()
            if now != latest:
                latest, since = now, time.monotonic()

    # ---------------------------------------------------------------- a model exchanged by rows
    def parts_collective(self, part: int = 0, parts: int = 1) -> PartsAllReduce:
        """This process's parts collective (built on first use); ``DilocoError`` without a parts setup."""
        if self._parts_collective is None:
            if self._parts is None:
                raise DilocoError("this replica's manager was built without a parts setup, so it cannot exchange a "
                                  "sharded model by rows", hint="run the trainer through the replica entrypoint")
            self._parts_collective = self._parts.collective(part, parts)
        return self._parts_collective

    def allreduce_shards(self, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec]) -> ManagedWork:
        """``allreduce`` of the rows ``specs`` name (here: whole tensors), through the parts collective."""
        try:
            work = ManagedWork(self, self.parts_collective().allreduce_shards_async(tensors, specs))
        except Exception as exc:
            self.report_error(exc)
            raise
        self._pending = work
        return work

    def commit_round_shards(self, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec]) -> None:
        """``commit_round`` by rows (one part: this process holds every row); no-op without ``rounds``."""
        if self.rounds is None:
            return
        from diloco.replica.checkpoint_parts import PartCheckpoints

        checkpoints = PartCheckpoints.like(self.rounds)
        digest = checkpoints.write_part(self._step, 1, 0, tensors, specs)
        if digest is not None:
            checkpoints.mark(self._step, 1, [digest])

    def rejoin_shards(self, specs: Mapping[str, ShardSpec]) -> CommittedRound | None:
        """``rejoin`` by rows: the committed round's rows ``specs`` name, whatever partition committed it."""
        if self.rounds is None:
            return None
        from diloco.replica.checkpoint_parts import PartCheckpoints

        collective = self.parts_collective()
        latest = self.rejoin_round(contributed=collective.replica_contributed)
        if latest == 0:
            return None
        collective.resume_at(latest)
        return PartCheckpoints.like(self.rounds).read(latest, specs)

    def gather_shards(self, tensors: Mapping[str, torch.Tensor],
                      specs: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor] | None:
        """The whole tensors from every process's rows: here the process holds them all."""
        return dict(tensors)

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._step = step
