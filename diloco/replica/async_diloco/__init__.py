"""Asynchronous DiLoCo: a master applies outer steps to deltas that workers upload at their own pace.

Synchronous rounds wait for the slowest replica. Here nobody waits: every node (the master included) trains on its
own, and at each inner boundary (``step % inner_steps == 0``) uploads its pseudo-gradient ``baseline - current``
to the run's object store. The master's background *outer thread* picks deltas up, applies one Nesterov outer
step per delta to its fp32 global copy (torch ``SGD(momentum, nesterov)``, as ``diloco.replica.outer`` does for the
synchronous loop), commits its outer state and publishes each new global version. Workers poll for new versions
and install them.

The modules, one job each: ``record`` (the store's keys and the JSON records the launcher reads too), ``config``
(the settings and the node's identity), ``tensors`` (state dicts and pseudo-gradients), ``master`` (the outer
state and its commits), ``coordinator`` (one node), ``builtin`` (the built-in trainer's asynchronous mode).

**Publication.** A version is committed first (the master's state: ``master.MasterStateCommits``), then its data
is written, then ``global/latest.json`` (the commit of the publication, naming the data's SHA-256). ``put`` is
atomic, so a reader that sees version N in the metadata can always read N's data (the master keeps the last
``keep_versions`` of them), and checks those bytes against the SHA-256 whether it downloads them or finds them in
its cache.

**Staleness rule.** A delta computed against version ``b`` and applied when the master is at version ``v`` has
staleness ``s = v - b``. With ``staleness_policy = "weight"`` (the default) it is applied with weight
``1 / (1 + max(0, s - staleness_grace))`` (``staleness_grace`` defaults to 0; with N nodes taking turns a delta is
typically N - 1 versions old; a grace of N - 1 treats that lag as fresh); with ``"accept"`` with weight 1. Either
way a delta with ``s > max_staleness`` is rejected (counted, logged, deleted): the bound keeps a worker that was
offline for a long time from dragging the model back to where it was.

**A node that dies.** The master's outer state lives in the store, not on its disk: a relaunched master resumes
from its newest committed version with its momentum, never applies a delta twice and never loses one it accepted
(``master``). Every node records, before each delta it uploads, the step it reached (``nodes/<node>.json``); a
relaunched node resumes after that step on the newest global (``builtin``), instead of training from step 1.

**Lifecycle and the seed's defects, fixed.**

* ``after_optimizer_step`` returns ``SyncResult(pushed, loaded_global, outer_step)``; ``bool(result)`` is
  ``pushed or loaded_global`` (the seed's bool), but a trainer should reset its inner optimizer only on
  ``result.loaded_global``.
* Upload then advance the baseline: a failed upload leaves the baseline, so the next boundary sends the cumulative
  delta. With ``async_delta_upload`` a one-slot queue carries the delta to an uploader thread; a boundary that finds
  the slot busy emits ``delta_upload_skipped``. Installing a global bumps the *baseline generation*, so an upload
  begun before the installation never moves the baseline back when it completes.
* Polling threads never touch the live model: a fetched global waits until the training thread's next callback.
* Resume from a trainer's own checkpoint: ``load_state_dict`` may come before or after ``start()``. When
  ``start()`` installed a global newer than the checkpoint's, the fresh global stays the baseline (the model is put
  back onto it), and the checkpoint's unsent progress (``pending_delta``: ``baseline - model`` at checkpoint time,
  against ``pending_delta_step``) is uploaded as one delta against its old version, so the master weighs it by its
  staleness. When no newer global exists, the checkpoint's baseline is restored and the next boundary sends that
  progress as part of its delta.
* ``load_state_dict`` refuses another role's or another node's checkpoint.

Everything that crosses the store is safetensors (``diloco.store.codec``), never pickle; so is the local cache.
"""

from __future__ import annotations

from diloco.replica.async_diloco.builtin import run_builtin_async
from diloco.replica.async_diloco.config import AsyncDiLoCoConfig, coordinator_config, resolve_node_id
from diloco.replica.async_diloco.coordinator import AsyncDiLoCoCoordinator, SyncResult
from diloco.replica.async_diloco.master import MasterOuterLoop, MasterStateCommits
from diloco.replica.async_diloco.record import GlobalRecord, NodePosition, WorkerRecord
from diloco.replica.async_diloco.tensors import compute_pseudo_gradient, cpu_state, delta_norm

# The seed's names.
DumbDiLoCoCoordinator = AsyncDiLoCoCoordinator
DumbDiLoCo = AsyncDiLoCoCoordinator

__all__ = ["AsyncDiLoCoConfig", "AsyncDiLoCoCoordinator", "DumbDiLoCo", "DumbDiLoCoCoordinator", "GlobalRecord",
           "MasterOuterLoop", "MasterStateCommits", "NodePosition", "SyncResult", "WorkerRecord",
           "compute_pseudo_gradient", "coordinator_config", "cpu_state", "delta_norm", "resolve_node_id",
           "run_builtin_async"]
