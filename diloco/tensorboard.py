"""``--tensorboard DIR`` (``metrics.tensorboard``): each replica also writes its metrics as TensorBoard events.

Why it looks the way it does:

* **Not a core dependency.** ``tensorboard`` is imported only when the flag is given; ``check_tensorboard`` runs
  at launch (before anything starts) and again in each replica, so a missing package is one line naming the flag
  and ``pip install tensorboard`` instead of a traceback after the first round.
* **The same rows as the store's metrics.** A ``TensorBoardWriter`` is a listener of the replica's
  ``diloco.metrics.MetricsWriter``: it sees each history row (``init``, every ``round``, ``final``) once its losses
  are final, and writes its numbers as scalars against the inner step: train and eval loss, the round, the
  seconds blocked in sync, the bytes written and read (cumulative), tokens/s and anything the trainer reported
  under another name (``extra/<name>``). Progress snapshots between rounds add only tokens/s: their losses are
  the last ones measured, not new points.
* **One run per rank.** Events go to ``DIR/rank_RRRR/``, so ``tensorboard --logdir DIR`` shows every replica as its
  own run, side by side.
* **Local or S3.** A local directory is written by torch's ``SummaryWriter`` directly. An ``s3://`` prefix is
  written through diloco's own store layer (the run's S3 settings, endpoint and credentials apply): the events
  are written to a local temporary directory and each event file is uploaded whole after every history row, so
  the prefix is at most one round behind (TensorBoard reads ``s3://`` log directories itself). Other URI schemes
  are refused.

Tensors never go through here: only numbers.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from diloco.errors import ConfigError

log = logging.getLogger("diloco.tensorboard")

#: Metrics row field -> TensorBoard tag.
SCALARS = {
    "train_loss": "loss/train", "eval_loss": "loss/eval", "round": "diloco/round", "sync_s": "diloco/sync_s",
    "bytes_written": "diloco/bytes_written", "bytes_read": "diloco/bytes_read",
    "tokens_per_s": "throughput/tokens_per_s",
}
#: Rows after which the event files are flushed (and uploaded to S3).
_FLUSHING_KINDS = ("init", "round", "final")
_INSTALL_HINT = "pip install tensorboard (or the diloco[hf] extra), or drop --tensorboard"


def check_tensorboard(directory: str, *, on_this_machine: bool = True) -> None:
    """Whether ``--tensorboard DIR`` can work: a local directory or an ``s3://`` prefix, and the ``tensorboard``
    package importable here (found, not imported). ``ConfigError`` naming the flag otherwise.

    ``on_this_machine=False`` (a backend that runs the replicas on machines of its own: SageMaker, EKS): the
    package is the image's business (each replica checks it at start), and a local directory would stay on those
    machines, so only an ``s3://`` prefix is accepted."""
    if not isinstance(directory, str) or not directory.strip():
        raise ConfigError("metrics.tensorboard (--tensorboard): empty directory",
                          hint="pass a local directory or an s3:// prefix, e.g. --tensorboard ./tb")
    scheme = directory.split("://", 1)[0].lower() if "://" in directory else ""
    if scheme not in ("", "file", "s3"):
        raise ConfigError(f"metrics.tensorboard (--tensorboard): {directory} is a {scheme}:// URI; events are "
                          f"written to a local directory or an s3:// prefix",
                          hint="pass a local directory or an s3:// prefix")
    if not on_this_machine:
        if scheme != "s3":
            raise ConfigError(f"metrics.tensorboard (--tensorboard): {directory} would be written on the replicas' "
                              f"own machines, which this backend does not keep",
                              hint="pass an s3:// prefix, e.g. --tensorboard s3://<bucket>/tb/")
        return
    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError("metrics.tensorboard (--tensorboard): the tensorboard package is not installed here",
                          hint=_INSTALL_HINT)


def rank_dir(rank: int) -> str:
    """Each rank's run directory under DIR."""
    return f"rank_{rank:04d}"


class TensorBoardWriter:
    """One replica's TensorBoard events under ``DIR/rank_RRRR/`` (see the module docstring)."""

    def __init__(self, directory: str, rank: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        check_tensorboard(directory)
        self.rank = rank
        self._store: Any = None
        self._tmp: str | None = None
        if directory.startswith("s3://"):
            from diloco.store import ObjectStore

            self._store = ObjectStore(directory.rstrip("/"))
            self._tmp = tempfile.mkdtemp(prefix="diloco-tb-")
            self.local_dir = os.path.join(self._tmp, rank_dir(rank))
        else:
            self.local_dir = os.path.join(directory.removeprefix("file://"), rank_dir(rank))
        self._writer: Any = SummaryWriter(log_dir=self.local_dir)
        self._closed = False

    def on_row(self, row: Mapping[str, Any]) -> None:
        """Write one metrics row's numbers at its inner step; flush (and upload) after a history row."""
        if self._closed:
            return
        step = row.get("step") or 0
        walltime = row.get("time")
        if row.get("kind") not in _FLUSHING_KINDS:
            # A progress snapshot repeats the latest losses wherever they were measured: only its rate is new.
            self._scalar(SCALARS["tokens_per_s"], row.get("tokens_per_s"), step, walltime)
            return
        for field, tag in SCALARS.items():
            self._scalar(tag, row.get(field), step, walltime)
        for name, value in (row.get("extra") or {}).items():
            self._scalar(f"extra/{name}", value, step, walltime)
        self.flush()

    def _scalar(self, tag: str, value: Any, step: int, walltime: float | None) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        self._writer.add_scalar(tag, float(value), global_step=int(step), walltime=walltime)

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
            self.flush()
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a training run
            log.warning("rank %d: could not write the last TensorBoard events (%s: %s)", self.rank,
                        type(exc).__name__, exc)
        finally:
            self._writer.close()
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
