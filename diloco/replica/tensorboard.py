"""``--tensorboard DIR`` (``metrics.tensorboard``): each replica also writes its metrics as TensorBoard events.

Why it looks the way it does:

* **Not a core dependency.** ``tensorboard`` is imported only when the flag is given; ``check_tensorboard`` runs
  at launch (before anything starts) and again in each replica, so a missing package is one line naming the flag
  and ``pip install tensorboard`` instead of a traceback after the first round. A local DIR is checked the same
  way: one that cannot be created or written (a read-only mount, a path under a regular file) is refused at
  launch, in one line, before any replica starts (``diloco.local_dirs``).
* **The same rows as the store's metrics.** A ``TensorBoardWriter`` is a listener of the replica's
  ``diloco.replica.metrics.MetricsWriter``: it sees each history row (``init``, every ``round``, ``final``) once its losses
  are final, and writes its numbers as scalars against the inner step: train and eval loss, the round, the
  seconds blocked in sync, the bytes written and read (cumulative), tokens/s and anything the trainer reported
  under another name (``extra/<name>``). Progress snapshots between rounds add only tokens/s: their losses are
  the last ones measured, not new points.
* **One event per step.** Each tag gets at most one event per inner step, the first row's that reaches it: the
  ``final`` row repeats the last round's step, so it adds only what no row wrote there; a progress snapshot is
  held until a later step shows that no history row claims its step (each round's own row carries the round's
  rate), so a live board's rate is one snapshot behind. A curve never doubles back on itself.
* **One run per launch, one per rank.** The launcher gives each run its own directory under DIR
  (``diloco.replica.tensorboard_dirs.run_directory``: ``DIR/<run_id>``), and each rank writes ``rank_RRRR/`` under it, so ``tensorboard --logdir
  DIR`` lists every run's replicas side by side (``<run_id>/rank_0000``, ...) and two runs into one DIR stay two
  curves. A replica started by hand (``python -m diloco.replica.entrypoint --tensorboard DIR``) writes
  ``DIR/rank_RRRR/``.
* **Local or S3.** A local directory is written by torch's ``SummaryWriter`` directly. An ``s3://`` prefix is
  written through diloco's own store layer (the run's S3 settings, endpoint and credentials apply): the events
  are written to a local temporary directory and each event file is uploaded whole after every history row, so
  the prefix is at most one round behind (TensorBoard reads ``s3://`` log directories itself). Other URI schemes
  are refused.

Tensors never go through here: only numbers.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from diloco.replica.tensorboard_dirs import check_tensorboard, local_directory, rank_dir

log = logging.getLogger("diloco.replica.tensorboard")

#: Metrics row field -> TensorBoard tag.
SCALARS = {
    "train_loss": "loss/train", "eval_loss": "loss/eval", "round": "diloco/round", "sync_s": "diloco/sync_s",
    "bytes_written": "diloco/bytes_written", "bytes_read": "diloco/bytes_read",
    "tokens_per_s": "throughput/tokens_per_s",
}
#: Rows after which the event files are flushed (and uploaded to S3).
_FLUSHING_KINDS = ("init", "round", "final")


class TensorBoardWriter:
    """One replica's TensorBoard events under ``DIR/rank_RRRR/`` (see the module docstring)."""

    def __init__(self, directory: str, rank: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        check_tensorboard(directory)
        self.rank = rank
        self._store: Any = None
        self._tmp: str | None = None
        if directory.startswith("s3://"):
            from diloco.store.objects import ObjectStore

            self._store = ObjectStore(directory.rstrip("/"))
            self._tmp = tempfile.mkdtemp(prefix="diloco-tb-")
            self.local_dir = os.path.join(self._tmp, rank_dir(rank))
        else:
            self.local_dir = os.path.join(local_directory(directory), rank_dir(rank))
        self._writer: Any = SummaryWriter(log_dir=self.local_dir)
        self._closed = False
        self._last_step: dict[str, int] = {}  # tag -> the step of its latest event
        self._held_rate: tuple[int, Any, float | None] | None = None  # a progress snapshot's (step, rate, time)

    def on_row(self, row: Mapping[str, Any]) -> None:
        """Write one metrics row's numbers at its inner step; flush (and upload) after a history row."""
        if self._closed:
            return
        step = int(row.get("step") or 0)
        walltime = row.get("time")
        if row.get("kind") not in _FLUSHING_KINDS:
            # A progress snapshot repeats the latest losses wherever they were measured: only its rate is new, and
            # it is held until a later row shows that no history row claims its step.
            self._release_held_rate(before=step)
            self._held_rate = (step, row.get("tokens_per_s"), walltime)
            return
        self._release_held_rate(before=step)
        self._held_rate = None  # at this step the history row's own rate counts
        for field, tag in SCALARS.items():
            self._scalar(tag, row.get(field), step, walltime)
        for name, value in (row.get("extra") or {}).items():
            self._scalar(f"extra/{name}", value, step, walltime)
        self.flush()

    def _release_held_rate(self, *, before: int | None = None) -> None:
        """Write the held progress rate if its step comes before ``before`` (always, when None)."""
        if self._held_rate is not None and (before is None or self._held_rate[0] < before):
            step, value, walltime = self._held_rate
            self._held_rate = None
            self._scalar(SCALARS["tokens_per_s"], value, step, walltime)

    def _scalar(self, tag: str, value: Any, step: int, walltime: float | None) -> None:
        """One event, unless ``tag`` already has one at this step or a later one (see "One event per step")."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        if step <= self._last_step.get(tag, -1):
            return
        self._last_step[tag] = step
        self._writer.add_scalar(tag, float(value), global_step=step, walltime=walltime)

    def flush(self) -> None:
        """Events to disk, and to the S3 prefix when DIR is one."""
        self._writer.flush()
        if self._store is not None:
            for name in sorted(os.listdir(self.local_dir)):
                with open(os.path.join(self.local_dir, name), "rb") as f:
                    self._store.put(f"{rank_dir(self.rank)}/{name}", f.read())

    def close(self) -> None:
        """Flush, upload and close (idempotent, never raises: a failed write is a warning); the temporary
        directory of an S3 prefix is removed."""
        if self._closed:
            return
        self._closed = True
        try:
            self._release_held_rate()
            self.flush()
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a training run
            log.warning("rank %d: could not write the last TensorBoard events (%s: %s)", self.rank,
                        type(exc).__name__, exc)
        finally:
            self._writer.close()
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
