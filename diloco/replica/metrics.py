"""Per-replica progress, the replica's half: ``report()`` for trainers and the writer the outer loop drives.

**For trainers.** The DiLoCo outer loop records on its own what it knows: the inner step, the total steps (when the
launcher passed ``total_steps``), the outer round, the seconds blocked in sync and the bytes written and read.
What only the trainer knows comes through one call, anywhere in the training code::

    import diloco
    diloco.report(train_loss=loss.item(), tokens=x.numel())   # eval_loss=..., or any other name=number

It is a no-op outside a replica (a notebook, a unit test), so a trainer never needs a guard. ``tokens`` adds to a
running count (tokens processed since the previous call), from which tokens/s is derived; ``train_loss`` and
``eval_loss`` are the latest values; any other name is kept under ``extra`` in the rows. A value that is not a
number is dropped with one warning in the replica's log; a NaN or infinite loss is recorded as ``null`` with
``diverged: true`` (JSON has no NaN) and stays flagged. ``step``, ``round`` and the other fields the loop records
are refused (``ValueError``), so a trainer cannot contradict the loop.

**Listeners** (``MetricsWriter.add_listener``): each history row is also handed, once its values are final, to
the listeners, and so is each progress snapshot; ``diloco.replica.tensorboard`` writes them as TensorBoard events.

The rows and where they live are the record the writer and its reader share (``diloco.replica.metric_rows``);
the launcher reads them back (``diloco.launcher.progress``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from diloco.defaults import DEFAULT_PROGRESS_INTERVAL_S
from diloco.replica.metric_rows import (
    LOSS_FIELDS,
    RECORDED_BY_THE_LOOP,
    describe_row,
    read_history,
    show_value,
)
from diloco.store.layout import METRICS_KEY, PROGRESS_KEY

if TYPE_CHECKING:
    from diloco.collectives.allreduce import AllReduceStats
    from diloco.store.objects import ObjectStore

log = logging.getLogger("diloco.replica.metrics")

#: The shortest window tokens/s is measured over (shorter ones are noise: a row right after another).
MIN_RATE_WINDOW_S = 1.0


# ================================================================================================ report()
#: Writers made active by ``reporting_to``: per thread (so ranks run as threads in one process, as in tests, each
#: report to their own), and process-wide (so a trainer's helper threads reach the replica's writer too).
_local = threading.local()
_process: list[MetricsWriter] = []
_process_lock = threading.Lock()


def report(**values: Any) -> None:
    """Record trainer metrics for this replica (see the module docstring); a no-op outside a replica.

    ``train_loss`` and ``eval_loss`` (latest values), ``tokens`` (processed since the previous call),
    ``total_steps``, or any other ``name=number`` (kept under ``extra``). Raises ``ValueError`` for a field the
    outer loop records itself (``step``, ``round``, ...)."""
    refused = sorted(set(values) & RECORDED_BY_THE_LOOP)
    if refused:
        raise ValueError(f"diloco.report: {', '.join(refused)} is recorded by the DiLoCo outer loop itself; "
                         f"report only what the trainer knows (train_loss, eval_loss, tokens, or other names)")
    writer = current_writer()
    if writer is not None:
        writer.report(values)


def current_writer() -> MetricsWriter | None:
    """The writer ``report()`` goes to: this thread's innermost active one, else the process's, else none."""
    mine: list[MetricsWriter] = getattr(_local, "stack", [])
    if mine:
        return mine[-1]
    with _process_lock:
        return _process[-1] if _process else None


@contextmanager
def reporting_to(writer: MetricsWriter) -> Iterator[MetricsWriter]:
    """Make ``writer`` the target of ``report()`` for the duration (the replica entrypoint does this around the
    trainer call, and the outer loop while its context is open). Nests; always restores the previous target."""
    if not hasattr(_local, "stack"):
        _local.stack = []
    _local.stack.append(writer)
    with _process_lock:
        _process.append(writer)
    try:
        yield writer
    finally:
        _remove_last(_local.stack, writer)
        with _process_lock:
            _remove_last(_process, writer)


def _remove_last(stack: list[MetricsWriter], writer: MetricsWriter) -> None:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is writer:
            del stack[i]
            return


# ================================================================================================ writer
class MetricsWriter:
    """One replica's metrics: the history and progress objects described in the module docstring.

    Driven by the outer loop (``begin`` on entering, ``on_step`` after each inner step, ``on_round`` after each
    outer round, ``finish`` on leaving after training) and by ``report()``. Thread-safe. A failed store write is
    logged once and retried at the next write: metrics never fail a training run.
    """

    def __init__(
        self,
        store: ObjectStore,
        rank: int,
        *,
        total_steps: int | None = None,
        stats: Callable[[], AllReduceStats] | None = None,
        rounds: Callable[[], int] | None = None,
        progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
    ) -> None:
        if not progress_interval_s > 0:
            raise ValueError(f"progress_interval_s must be > 0, got {progress_interval_s}")
        self.store = store
        self.rank = rank
        self.total_steps = total_steps
        self.progress_interval_s = float(progress_interval_s)
        self._stats = stats
        self._rounds = rounds
        self._lock = threading.RLock()
        self._history: list[dict[str, Any]] = []
        self._amendable = False  # the last history row still takes report()s (until the next inner step)
        self._logged = 0  # history rows logged so far
        self._history_dirty = False
        self._step = 0
        self._losses: dict[str, float | None] = dict.fromkeys(LOSS_FIELDS)
        self._extra: dict[str, float | None] = {}
        self._tokens: int | None = None
        self._tokens_per_s: float | None = None
        self._rate_mark: tuple[float, int] = (time.monotonic(), 0)
        self._started: float | None = None
        self._diverged = False
        self._last_flush: float | None = None
        self._warned: set[str] = set()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Also give every row to ``listener`` (e.g. ``diloco.replica.tensorboard.TensorBoardWriter.on_row``): each history
        row once, when it is closed (its losses final), and each progress snapshot when it is written. A listener
        that raises is logged once and kept: metrics never fail a training run."""
        with self._lock:
            self._listeners.append(listener)

    def _tell_listeners(self, row: Mapping[str, Any]) -> None:
        for listener in self._listeners:
            try:
                listener(dict(row))
            except Exception as exc:  # noqa: BLE001 - metrics must never fail a training run
                self._warn_once(f"listener:{id(listener)}", f"rank {self.rank}: a metrics listener failed "
                                f"({type(exc).__name__}: {exc}); training goes on")

    # ------------------------------------------------------------------------------------------ state
    @property
    def started(self) -> bool:
        """Whether anything was recorded (the outer loop was entered, or the trainer reported)."""
        return self._started is not None

    @property
    def finished(self) -> bool:
        """Whether the last history row is ``final``."""
        return bool(self._history) and self._history[-1]["kind"] == "final"

    @property
    def history(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(row) for row in self._history]

    def resume(self, round_: int, *, step: int | None = None) -> None:
        """A replica rejoining after committed round ``round_`` keeps its history: the rows it wrote before it died,
        up to that round, are read back from the store, so the first write after the restart does not replace
        them with an empty history. Rows past ``round_`` (work the restart threw away) are dropped, and so are
        rows past ``step`` when it is given (asynchronous mode, whose rows all have round 0: a node resumes at a
        step of its own)."""
        rows, _ = read_history(self.store, self.rank)
        kept = [row.model_dump() for row in rows
                if row.kind == "init" or (row.kind == "round" and row.round is not None and row.round <= round_
                                          and (step is None or (row.step or 0) <= step))]
        with self._lock:
            self._history = kept
            self._logged = len(kept)
            self._amendable = False
            self._history_dirty = bool(kept)
            if kept and kept[-1].get("eval_loss") is not None:
                self._losses["eval_loss"] = kept[-1]["eval_loss"]

    # ------------------------------------------------------------------------------------------ the loop's calls
    def begin(self, step: int) -> None:
        """The outer loop was entered: start the clock and, on the first entry, open the ``init`` row."""
        with self._lock:
            self._start()
            self._step = step
            if not self._history:
                self._append("init")
                self._flush()

    def on_step(self, step: int) -> None:
        """After an inner step without an outer round: close a row opened by the last round, or write a
        progress row when ``progress_interval_s`` has passed since the last write."""
        with self._lock:
            self._start()
            self._step = step
            if self._amendable:
                self._close_row()
                self._flush()
            else:
                self._flush_if_due()

    def on_round(self, step: int) -> None:
        """After an outer round (its number is the manager's committed count): add its row and write at once."""
        with self._lock:
            self._start()
            self._close_row()
            self._step = step
            self._append("round")
            self._flush()

    def finish(self, step: int | None = None) -> None:
        """Training ended: add the ``final`` row (later reports amend it) and write at once."""
        with self._lock:
            self._start()
            self._close_row()
            if step is not None:
                self._step = step
            self._append("final")
            self._close_row()  # logged now: nothing else closes it
            self._amendable = True
            self._flush()

    def close(self) -> None:
        """The trainer returned: finish if it recorded anything but never finished, else write what is pending."""
        with self._lock:
            if self.started and not self.finished:
                self.finish()
            elif self._history_dirty:
                self._flush()

    # ------------------------------------------------------------------------------------------ report()
    def report(self, values: Mapping[str, Any]) -> None:
        """Take the trainer's values (see ``report``); amend an open row; write when due."""
        with self._lock:
            self._start()
            for name, value in values.items():
                self._take(name, value)
            if self._amendable and self._history:
                self._amend_last()
                if self.finished:  # no inner step will come to write it
                    self._flush()
                    return
            self._flush_if_due()

    def _take(self, name: str, value: Any) -> None:
        if name == "tokens":
            count = _as_count(value)
            if count is None:
                self._warn_once(f"bad:{name}", f"diloco.report: tokens must be a whole number >= 0, got "
                                               f"{show_value(value)}; ignored")
            else:
                self._tokens = (self._tokens or 0) + count
            return
        if name == "total_steps":
            count = _as_count(value)
            if count is None or count < 1:
                self._warn_once(f"bad:{name}", f"diloco.report: total_steps must be a whole number >= 1, got "
                                               f"{show_value(value)}; ignored")
            else:
                self.total_steps = count
            return
        number = _as_number(value)
        if number is None:
            self._warn_once(f"bad:{name}", f"diloco.report: {name} must be a number, got {show_value(value)}; ignored")
            return
        finite = number if math.isfinite(number) else None
        if name in LOSS_FIELDS:
            if finite is None:
                self._diverged = True
                self._warn_once("diverged", f"rank {self.rank}: {name} is {number} at step {self._step}: training "
                                            f"diverged (recorded as null with diverged: true)")
            self._losses[name] = finite
        else:
            self._extra[name] = finite

    # ------------------------------------------------------------------------------------------ rows
    def _start(self) -> None:
        if self._started is None:
            self._started = time.monotonic()
            self._rate_mark = (self._started, self._tokens or 0)

    def _snapshot(self, kind: str) -> dict[str, Any]:
        now = time.monotonic()
        stats = self._stats() if self._stats is not None else None
        return {
            "kind": kind, "time": time.time(), "step": self._step, "total_steps": self.total_steps,
            "round": self._rounds() if self._rounds is not None else None,
            "train_loss": self._losses["train_loss"], "eval_loss": self._losses["eval_loss"],
            "tokens": self._tokens, "tokens_per_s": self._rate(now, whole_run=kind == "final"),
            "sync_s": round(float(stats.seconds_blocked), 6) if stats is not None else None,
            "bytes_written": int(stats.bytes_written) if stats is not None else None,
            "bytes_read": int(stats.bytes_read) if stats is not None else None,
            "diverged": self._diverged, "extra": dict(self._extra),
        }

    def _rate(self, now: float, *, whole_run: bool) -> float | None:
        """Tokens/s since the previous row (at least ``MIN_RATE_WINDOW_S``), or over the whole run."""
        if self._tokens is None:
            return None
        if whole_run and self._started is not None and now > self._started:
            return self._tokens / (now - self._started)
        mark_time, mark_tokens = self._rate_mark
        if now - mark_time >= MIN_RATE_WINDOW_S:
            self._tokens_per_s = (self._tokens - mark_tokens) / (now - mark_time)
            self._rate_mark = (now, self._tokens)
        return self._tokens_per_s

    def _append(self, kind: str) -> None:
        self._history.append(self._snapshot(kind))
        self._amendable = True
        self._history_dirty = True

    def _amend_last(self) -> None:
        """Put the latest trainer values into the open row (its step, round, time and counters stay)."""
        row = self._history[-1]
        row.update(train_loss=self._losses["train_loss"], eval_loss=self._losses["eval_loss"],
                   diverged=self._diverged, extra=dict(self._extra), total_steps=self.total_steps)
        self._history_dirty = True

    def _close_row(self) -> None:
        """No more amendments to the last row; log every history row not logged yet (one line each)."""
        self._amendable = False
        while self._logged < len(self._history):
            log.info("%s", describe_row(self._history[self._logged]))
            self._tell_listeners(self._history[self._logged])
            self._logged += 1

    # ------------------------------------------------------------------------------------------ writes
    def _flush_if_due(self) -> None:
        if self._last_flush is None or time.monotonic() - self._last_flush >= self.progress_interval_s:
            self._flush()

    def _flush(self) -> None:
        """Write the history if it changed, then the progress row (a copy of ``final`` once training ended)."""
        self._last_flush = time.monotonic()
        if self._history_dirty:
            text = "".join(json.dumps(row, allow_nan=False) + "\n" for row in self._history)
            if self._put(METRICS_KEY.format(rank=self.rank), text.encode()):
                self._history_dirty = False
        progress = dict(self._history[-1]) if self.finished else self._snapshot("progress")
        self._put(PROGRESS_KEY.format(rank=self.rank), json.dumps(progress, allow_nan=False).encode())
        if not self.finished:
            self._tell_listeners(progress)

    def _put(self, key: str, data: bytes) -> bool:
        try:
            self.store.put(key, data)
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a training run
            self._warn_once(f"put:{key}", f"rank {self.rank}: could not write {self.store.url(key)} "
                                          f"({type(exc).__name__}: {exc}); training goes on, retrying later")
            return False
        return True

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)


def _as_number(value: Any) -> float | None:
    """A float from a Python or numpy number or a one-element tensor; ``None`` for anything else (text, bools)."""
    if isinstance(value, (bool, str, bytes)) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None


def _as_count(value: Any) -> int | None:
    number = _as_number(value)
    if number is None or not math.isfinite(number) or number < 0 or number != int(number):
        return None
    return int(number)
