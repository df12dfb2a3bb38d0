"""``--mlflow URI`` and ``--wandb PROJECT``: each replica also logs its metrics rows to an experiment tracker.

Why it looks the way it does:

* **One tracker run per DiLoCo run.** The launcher creates it before any replica starts
  (``diloco.launcher.tracking``) and puts its id in every replica's settings (``mlflow_run_id``,
  ``wandb_run_id``), so a replica that is relaunched or rejoins logs into the same run instead of starting a
  new one. Each replica writes its own series, keyed by its rank (``r0/train_loss``, ``r1/train_loss``, ...),
  with the inner step as the step, so the replicas' curves sit side by side in one run.
* **The same rows as the store's metrics.** A sink is a listener of the replica's
  ``diloco.replica.metrics.MetricsWriter``, like the TensorBoard writer: it logs the history rows (``init``,
  every ``round``, ``final``) once their losses are final: train and eval loss, tokens/s, the committed round,
  the seconds blocked in sync so far (``sync_s``) and in this round (``round_sync_s``: the round's latency as
  this replica saw it), the bytes written and read so far, the replicas the round averaged (``participants``),
  and whatever the trainer reported under another name
  (``extra/<name>``, e.g. a compression error). Progress snapshots between rounds are not logged: their losses
  are repeats, and a tracker call per snapshot would cost more than it tells.
* **Each step once, none missing.** A series never gets a step twice, not even across a relaunch: at start a
  sink reads back the last step its series holds (MLflow: ``get_metric_history``; W&B: the step this rank last
  logged, kept in the run's store, since an offline W&B run cannot be read back), and logs only later steps.
  Each time a row closes it logs every history row up to it that the tracker lacks, so a rejoining replica,
  whose writer got its predecessor's rows up to the committed round back from the store, fills in what its
  predecessor had no time to send before it was killed.
* **Never in training's way.** Rows go to a background thread; the training thread only enqueues. A tracker
  that cannot be reached, or refuses, costs one warning line in the replica's log and the sink is off for the
  rest of the attempt: training and the store's metrics go on. ``close`` waits a bounded time for the rows
  still queued.
* **Optional packages.** ``mlflow`` and ``wandb`` are imported only by a replica that logs to them.
  Credentials come from the tracker's own environment (``MLFLOW_TRACKING_TOKEN``, ``WANDB_API_KEY``: the run's
  ``env`` settings), never from the settings object, and are never printed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from diloco.replica.metric_rows import HISTORY_KINDS

log = logging.getLogger("diloco.replica.tracking")

#: Metrics row field -> metric name (after the replica's prefix).
FIELDS = {
    "train_loss": "train_loss", "eval_loss": "eval_loss", "tokens_per_s": "tokens_per_s", "round": "round",
    "sync_s": "sync_s", "bytes_written": "bytes_written", "bytes_read": "bytes_read",
}
#: The metric whose series says which steps a replica has logged (every logged row has a round).
STEP_MARK = "round"
#: MLflow's HTTP client retries a refused connection for minutes by default; a sink would rather warn and go on.
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                        "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
#: Seconds ``close`` waits for the rows still queued (a tracker that stopped answering must not hold the exit).
CLOSE_WAIT_S = 60.0
#: Where a replica keeps the last step it logged to W&B, in the run's store.
WANDB_MARK_KEY = "tracking/wandb/rank_{rank:04d}.json"


def prefix(rank: int) -> str:
    """The replica's series prefix: ``r0/``, ``r1/``, ..."""
    return f"r{rank}/"


def safe_uri(uri: str) -> str:
    """``uri`` without a user or password (what a warning may show)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<tracking URI>"
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    return urlunsplit((parts.scheme, host + (f":{parts.port}" if parts.port else ""), parts.path, "", ""))


def row_metrics(row: Mapping[str, Any], previous_sync_s: float | None) -> dict[str, float]:
    """The finite numbers of one history row, by metric name (without the replica's prefix)."""
    out: dict[str, float] = {}

    def put(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        out[name] = float(value)

    for field, name in FIELDS.items():
        put(name, row.get(field))
    sync_s = row.get("sync_s")
    if isinstance(sync_s, (int, float)) and previous_sync_s is not None and sync_s >= previous_sync_s:
        put("round_sync_s", sync_s - previous_sync_s)  # a relaunched replica's counters restart: no delta then
    for name, value in (row.get("extra") or {}).items():
        put(f"extra/{name}", value)
    return out


class TrackingSink:
    """Logs a replica's history rows to one tracker, each step once, from a background thread (see the module
    docstring). Subclasses say how to connect, where the series stands and how to log one step."""

    tracker = "tracker"

    def __init__(self, rank: int, history: Callable[[], list[dict[str, Any]]] | None = None,
                 participants: Callable[[int], int | None] | None = None) -> None:
        self.rank = rank
        self.prefix = prefix(rank)
        self._history = history
        self._participants = participants
        self._queue: queue.Queue[Mapping[str, Any] | None] = queue.Queue()
        self._last_step: int | None = None  # the latest step of this replica's series in the tracker
        self._last_sync_s: float | None = None
        self._failed = False
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"diloco-{self.tracker}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the training thread's side
    def on_row(self, row: Mapping[str, Any]) -> None:
        """A metrics listener: queue a closed history row (progress snapshots are not logged)."""
        if row.get("kind") in HISTORY_KINDS and not self._closed and not self._failed:
            self._queue.put(dict(row))

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Log what is queued (waiting at most ``wait_s``), then let the tracker go."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(wait_s)
        if self._thread.is_alive():
            log.warning("rank %d: %s did not take the last metrics within %.0f s; they stay in the store only",
                        self.rank, self.tracker, wait_s)

    # ------------------------------------------------------------------ the background thread
    def _work(self) -> None:
        try:
            self.connect()
            self._last_step = self.last_logged_step()
        except Exception as exc:  # noqa: BLE001 - a tracker must never fail training
            self._fail(exc)
        while True:
            row = self._queue.get()
            if row is None:
                break
            if self._failed:
                continue
            try:
                for pending in self._backlog(row):
                    self._log_row(pending)
            except Exception as exc:  # noqa: BLE001 - a tracker must never fail training
                self._fail(exc)
        if not self._failed:
            try:
                self.finish()
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)

    def _backlog(self, row: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        """The history rows up to ``row``'s step that the tracker lacks, in order; just ``row`` without a
        history (the writer's rows include what a rejoining replica got back from the store)."""
        step = int(row.get("step") or 0)
        rows = self._history() if self._history is not None else [row]
        rows = [r for r in rows if r.get("kind") in HISTORY_KINDS and int(r.get("step") or 0) <= step]
        if not rows or int(rows[-1].get("step") or 0) != step:
            rows.append(row)
        return rows

    def _log_row(self, row: Mapping[str, Any]) -> None:
        step = int(row.get("step") or 0)
        sync_s = row.get("sync_s")
        if self._last_step is not None and step <= self._last_step:
            if isinstance(sync_s, (int, float)):
                self._last_sync_s = float(sync_s)
            return
        metrics = row_metrics(row, self._last_sync_s)
        if isinstance(sync_s, (int, float)):
            self._last_sync_s = float(sync_s)
        if STEP_MARK not in metrics:
            metrics[STEP_MARK] = 0.0  # a row before the first round: the series still marks its step
        if self._participants is not None and row.get("kind") == "round":
            count = self._participants(int(row.get("round") or 0))
            if count is not None:
                metrics["participants"] = float(count)
        self.log_step({self.prefix + name: value for name, value in metrics.items()}, step,
                      timestamp=row.get("time"))
        self._last_step = step

    def _fail(self, exc: BaseException) -> None:
        self._failed = True
        text = " ".join(str(exc).split())[:200]
        log.warning("rank %d: %s unreachable or refused (%s: %s); training goes on, its metrics stay in the store",
                    self.rank, self.describe(), type(exc).__name__, text)

    # ------------------------------------------------------------------ per tracker
    def describe(self) -> str:
        return self.tracker

    def connect(self) -> None:
        """Reach the tracker's run (raises when it cannot)."""

    def last_logged_step(self) -> int | None:
        """The latest step this replica's series holds (None: none yet)."""
        return None

    def log_step(self, metrics: dict[str, float], step: int, *, timestamp: float | None) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Flush and let the tracker go (the run stays open for the other replicas)."""


class MlflowSink(TrackingSink):
    """Logs into the launcher's MLflow run through ``MlflowClient`` (no active-run state, safe in a thread)."""

    tracker = "mlflow"

    def __init__(self, uri: str, run_id: str, rank: int, history: Callable[[], list[dict[str, Any]]] | None = None,
                 participants: Callable[[int], int | None] | None = None) -> None:
        self.uri = uri
        self.run_id = run_id
        self._client: Any = None
        for name, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        super().__init__(rank, history, participants)

    def describe(self) -> str:
        return f"MLflow at {safe_uri(self.uri)}"

    def connect(self) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.uri)
        self._client.get_run(self.run_id)

    def last_logged_step(self) -> int | None:
        history = self._client.get_metric_history(self.run_id, self.prefix + STEP_MARK)
        return max((m.step for m in history), default=None)

    def log_step(self, metrics: dict[str, float], step: int, *, timestamp: float | None) -> None:
        from mlflow.entities import Metric

        millis = int((timestamp if isinstance(timestamp, (int, float)) else 0) * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(key, value, millis, step)
                                                     for key, value in metrics.items()])


class WandbSink(TrackingSink):
    """Resumes the launcher's W&B run (``resume="allow"`` with its stable id) and logs this replica's series
    against its own step metric (``r0/step``), so the replicas' steps need not interleave."""

    tracker = "wandb"

    def __init__(self, project: str, run_id: str, rank: int, store: Any = None,
                 history: Callable[[], list[dict[str, Any]]] | None = None,
                 participants: Callable[[int], int | None] | None = None) -> None:
        self.project = project
        self.run_id = run_id
        self._store = store
        self._run: Any = None
        super().__init__(rank, history, participants)

    def describe(self) -> str:
        return f"W&B project {self.project}"

    def connect(self) -> None:
        import wandb

        # A WANDB_SERVICE inherited from the launcher names the launcher's own wandb-core process, not ours.
        os.environ.pop("WANDB_SERVICE", None)
        # Each attempt its own local run directory: wandb names it by the second and the run id, which the
        # replicas share, and two writers of one offline ``.wandb`` file would interleave their records.
        base = os.environ.get("WANDB_DIR") or os.getcwd()
        local = os.path.join(base, "diloco", f"rank_{self.rank:04d}-{os.getpid()}")
        os.makedirs(local, exist_ok=True)
        self._run = wandb.init(project=self.project, id=self.run_id, resume="allow", reinit="create_new", dir=local,
                               settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                                       x_disable_machine_info=True))
        step = self.prefix + "step"
        self._run.define_metric(step, hidden=True)
        self._run.define_metric(self.prefix + "*", step_metric=step)

    def last_logged_step(self) -> int | None:
        if self._store is None:
            return None
        from diloco.errors import ObjectNotFound

        try:
            return int(json.loads(self._store.get(WANDB_MARK_KEY.format(rank=self.rank)))["step"])
        except ObjectNotFound:
            return None

    def log_step(self, metrics: dict[str, float], step: int, *, timestamp: float | None) -> None:
        self._run.log({**metrics, self.prefix + "step": step})
        if self._store is not None:
            self._store.put(WANDB_MARK_KEY.format(rank=self.rank), json.dumps({"step": step}).encode())

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()


def participants_reader(settings: Any, store: Any) -> Callable[[int], int | None]:
    """How many replicas a committed round averaged: every replica of the run, unless ``min_replicas`` lets a
    round go without some, when its manifest (``round_NNNNNN/manifest.json``, NNNNNN = round - 1) names them.
    None when the manifest is gone or unreadable (old rounds are deleted as the run goes)."""
    from diloco.store.layout import ROUND_MANIFEST_KEY

    def participants(round_: int) -> int | None:
        if round_ < 1:
            return None
        if settings.min_replicas is None or store is None:
            return int(settings.world_size)
        try:
            manifest = json.loads(store.get(ROUND_MANIFEST_KEY.format(round=round_ - 1)))
            return len(manifest.get("members") or [])
        except Exception:  # noqa: BLE001 - a count for a chart, never worth a failure
            return None

    return participants


def open_sinks(settings: Any, rank: int, metrics: Any) -> list[TrackingSink]:
    """The sinks this replica's settings ask for, each a listener of ``metrics`` (its ``MetricsWriter``)."""
    sinks: list[TrackingSink] = []
    history = (lambda: metrics.history) if metrics is not None else None
    store = getattr(metrics, "store", None)
    participants = participants_reader(settings, store)
    if settings.mlflow and settings.mlflow_run_id:
        sinks.append(MlflowSink(settings.mlflow, settings.mlflow_run_id, rank, history, participants))
    if settings.wandb and settings.wandb_run_id:
        sinks.append(WandbSink(settings.wandb, settings.wandb_run_id, rank, store=store, history=history,
                               participants=participants))
    if metrics is not None:
        for sink in sinks:
            metrics.add_listener(sink.on_row)
    return sinks
