"""The master's outer state: its fp32 global copy, the Nesterov outer optimizer, which deltas it applied, and how
that state is committed to the run's store so that a relaunched master finds it.

**Commit before publish.** Every version the master publishes is first committed (``MasterStateCommits``) as one
committed "round" numbered by the version, with the ``RoundCheckpoints`` protocol the synchronous mode uses for its
rounds: data first, then a marker created exactly once that names the data's SHA-256, both verified on read (run
id, version, digest, safetensors checksum). The data holds the global weights (``global/<name>``), the outer
momentum (``momentum/<name>``) and, as JSON, the keys of the deltas applied so far (the last 1000) and the
per-node stats. The master deletes a delta only after the version that applied it is committed. So whenever the
master dies, its relaunch resumes from the newest committed version with its momentum: a delta whose application
was committed is in its ``processed`` list (deleted, never applied twice), any other is still in the store (applied
once, now); and no version number is ever published twice with different weights.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from diloco.replica.async_diloco.config import AsyncDiLoCoConfig
from diloco.replica.async_diloco.record import WorkerRecord
from diloco.replica.async_diloco.tensors import tensors_with_prefix

if TYPE_CHECKING:
    import torch

    from diloco.replica.checkpoint import CommittedRound
    from diloco.store.objects import ObjectStore

log = logging.getLogger("diloco.async")

#: How many applied delta keys a committed state remembers: far more than can wait between two commits.
PROCESSED_KEPT = 1000


@dataclass
class WorkerStat:
    """The master's running tally of one node's deltas (published in ``latest.json`` as a ``WorkerRecord``)."""

    applied: int = 0
    rejected: int = 0
    last_upload_time: float | None = None
    last_base_version: int | None = None
    last_staleness: int | None = None
    last_weight: float | None = None

    def record(self) -> WorkerRecord:
        return WorkerRecord(**asdict(self), staleness=self.last_staleness)


class MasterOuterLoop:
    """The master's fp32 global copy, its Nesterov outer optimizer and the bookkeeping of processed deltas.

    Thread-safe: the outer thread applies deltas, the training thread reads snapshots, both under ``lock``."""

    def __init__(self, config: AsyncDiLoCoConfig, template: Mapping[str, torch.Tensor]) -> None:
        self.config = config
        self.lock = threading.RLock()
        self.outer_step = 0
        self.workers: dict[str, WorkerStat] = {}
        self.processed: list[str] = []  # delta keys applied (or rejected) but perhaps not yet deleted
        self._set_global(template, momentum=None)

    # ---- state
    def _set_global(self, tensors: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor] | None) -> None:
        import torch

        self.global_state = {k: v.detach().to("cpu").clone() for k, v in tensors.items()}
        self.params = {k: v for k, v in self.global_state.items() if v.is_floating_point()}
        for v in self.params.values():
            v.requires_grad_(False)
        c = self.config
        self.optimizer = torch.optim.SGD(list(self.params.values()), lr=c.outer_lr, momentum=c.outer_momentum,
                                         nesterov=c.nesterov and c.outer_momentum > 0)
        if momentum:
            for name, p in self.params.items():
                if name in momentum:
                    self.optimizer.state[p]["momentum_buffer"] = momentum[name].clone()

    def adopt(self, tensors: Mapping[str, torch.Tensor], outer_step: int,
              momentum: Mapping[str, torch.Tensor] | None = None) -> None:
        """Take ``tensors`` as the global state at ``outer_step``; momentum restarts unless given."""
        with self.lock:
            self._set_global(tensors, momentum)
            self.outer_step = outer_step

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        with self.lock:
            return self.outer_step, {k: v.clone() for k, v in self.global_state.items()}

    def momentum(self) -> dict[str, torch.Tensor]:
        with self.lock:
            return {name: self.optimizer.state[p]["momentum_buffer"].clone() for name, p in self.params.items()
                    if "momentum_buffer" in self.optimizer.state.get(p, {})}

    # ---- the committed form
    def committed_form(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        """``(version, tensors, metadata)`` of the state as it is now, taken under the lock in one piece: what
        ``MasterStateCommits.commit`` writes and ``restore`` reads back."""
        with self.lock:
            tensors = {f"global/{k}": v.clone() for k, v in self.global_state.items()}
            tensors.update({f"momentum/{k}": v for k, v in self.momentum().items()})
            meta = {"processed": self.processed[-PROCESSED_KEPT:],
                    "workers": {k: asdict(v) for k, v in self.workers.items()}}
            return self.outer_step, tensors, meta

    def restore(self, committed: CommittedRound) -> None:
        """Resume from a committed state: global weights, momentum, version, processed deltas, per-node stats."""
        with self.lock:
            self.adopt(tensors_with_prefix(committed.tensors, "global/"), committed.round,
                       momentum=tensors_with_prefix(committed.tensors, "momentum/"))
            self.processed = [str(k) for k in committed.metadata.get("processed", [])]
            self.workers = {k: WorkerStat(**v) for k, v in committed.metadata.get("workers", {}).items()}

    # ---- the outer step
    def staleness_weight(self, base_version: int) -> float | None:
        """The documented rule (``diloco.replica.async_diloco``): ``None`` rejects, else the delta's weight."""
        staleness = max(0, self.outer_step - base_version)
        if staleness > self.config.max_staleness:
            return None
        if self.config.staleness_policy == "accept":
            return 1.0
        return 1.0 / (1 + max(0, staleness - self.config.staleness_grace))

    def apply(self, key: str, node: str, delta: Mapping[str, torch.Tensor], base_version: int) -> bool:
        """One Nesterov outer step with ``weight * delta`` as the gradient; ``False`` when rejected or mismatched."""
        with self.lock:
            stat = self.workers.setdefault(node, WorkerStat())
            stat.last_upload_time, stat.last_base_version = time.time(), base_version
            stat.last_staleness = max(0, self.outer_step - base_version)
            weight = self.staleness_weight(base_version)
            self.processed.append(key)
            if weight is None:
                stat.rejected += 1
                stat.last_weight = 0.0
                log.warning("delta %s from %s rejected: staleness %d > max_staleness %d", key, node,
                            stat.last_staleness, self.config.max_staleness)
                return False
            bad = [k for k, p in self.params.items() if k not in delta or delta[k].shape != p.shape]
            if bad:
                stat.rejected += 1
                log.error("delta %s from %s does not match the global state (first: %r); ignored", key, node, bad[0])
                return False
            for name, p in self.params.items():
                p.grad = delta[name].to(p.dtype) * weight
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.outer_step += 1
            stat.applied += 1
            stat.last_weight = weight
            return True

    def status(self) -> dict[str, WorkerRecord]:
        with self.lock:
            return {k: v.record() for k, v in self.workers.items()}


class MasterStateCommits:
    """The master's committed states in the run's store: ``<prefix>/master/committed/round_NNNNNN/``, one per
    published version NNNNNN (from 1; version 0 is the initial model, which needs no commit), written and verified
    by ``diloco.replica.checkpoint.RoundCheckpoints`` with the master as its single writer."""

    def __init__(self, store: ObjectStore, *, run_id: str | None, keep: int) -> None:
        from diloco.replica.async_diloco.record import MASTER_STATE_PREFIX
        from diloco.replica.checkpoint import RoundCheckpoints

        # world_size 1: one writer, the master, whatever the number of nodes (which may change between lives)
        self.rounds = RoundCheckpoints(store.child(MASTER_STATE_PREFIX), run_id=run_id, world_size=1, keep=keep)

    def commit(self, outer: MasterOuterLoop) -> int:
        """Commit ``outer`` as it is now (a no-op at version 0, or when that version is committed already);
        returns the version. A store error propagates: the caller must not publish an uncommitted version."""
        version, tensors, meta = outer.committed_form()
        if version > 0:
            self.rounds.commit(version, tensors, metadata=meta, single_writer=True)
        return version

    def latest(self) -> CommittedRound | None:
        """The newest committed state, verified (``CorruptObjectError`` when it is damaged: the master must not
        silently start over); ``None`` when the master never committed one."""
        return self.rounds.latest()
