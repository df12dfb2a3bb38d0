"""Per-replica progress: ``report()`` for trainers, the writer the outer loop drives, and the reader the CLI uses.

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

**In the store** (``diloco.store.layout``), per rank:

* ``metrics/rank_RRRR.jsonl``: the history, one JSON row per line: ``init`` (when the outer loop is entered),
  ``round`` (after every outer round), ``final`` (when the loop is left after training). A ``report()`` made
  after a round and before the next inner step (typically an evaluation) amends that round's row, so each row
  carries the losses of the model it describes. Object stores cannot append, so the object is rewritten whole,
  but only when a row is added or amended: once or twice per round, a few hundred bytes per round.
* ``progress/rank_RRRR.json``: one row, the latest snapshot, overwritten at most every ``progress_interval_s``
  (5 s by default) between rounds. It is a separate object so that the frequent write stays one small PUT of
  constant size however long the run is, and the table moves before the first round.

Every row is a full snapshot: ``kind, time, step, total_steps, round, train_loss, eval_loss, tokens,
tokens_per_s, sync_s, bytes_written, bytes_read, diverged, extra``. ``round`` counts completed outer rounds (0
before the first; see "round numbering" in ``diloco.replica.outer``). ``tokens_per_s`` is measured over the window since
the previous row (sync included), and over the whole run in the ``final`` row.

**Listeners** (``MetricsWriter.add_listener``): each history row is also handed, once its values are final, to
the listeners, and so is each progress snapshot; ``diloco.replica.tensorboard`` writes them as TensorBoard events.

**For readers** (``read_progress``): every row is validated field by field. A bad field (``"train_loss": "abc"``)
or an unreadable line is skipped, and each (rank, field) problem becomes exactly one warning string, returned to
the caller so the CLI can print it once. Non-finite losses are reported as divergence (``diverged: true``, value
``None``), never as NaN.
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

from pydantic import BaseModel, Field

from diloco.errors import ObjectNotFound
from diloco.store.layout import METRICS_KEY, PROGRESS_KEY

if TYPE_CHECKING:
    from diloco.collectives.allreduce import AllReduceStats
    from diloco.store.objects import ObjectStore

log = logging.getLogger("diloco.replica.metrics")

DEFAULT_PROGRESS_INTERVAL_S = 5.0
#: The shortest window tokens/s is measured over (shorter ones are noise: a row right after another).
MIN_RATE_WINDOW_S = 1.0
#: Fields the outer loop records itself; ``report()`` refuses them.
RECORDED_BY_THE_LOOP = frozenset({"kind", "time", "step", "round", "tokens_per_s", "sync_s", "bytes_written",
                                  "bytes_read", "diverged", "extra"})
LOSS_FIELDS = ("train_loss", "eval_loss")
HISTORY_KINDS = ("init", "round", "final")


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
                                               f"{_show(value)}; ignored")
            else:
                self._tokens = (self._tokens or 0) + count
            return
        if name == "total_steps":
            count = _as_count(value)
            if count is None or count < 1:
                self._warn_once(f"bad:{name}", f"diloco.report: total_steps must be a whole number >= 1, got "
                                               f"{_show(value)}; ignored")
            else:
                self.total_steps = count
            return
        number = _as_number(value)
        if number is None:
            self._warn_once(f"bad:{name}", f"diloco.report: {name} must be a number, got {_show(value)}; ignored")
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


def describe_row(row: Mapping[str, Any]) -> str:
    """The one log line of a history row: ``round 3 step 60/60 train_loss 2.1 eval_loss 2.3 tok/s 9,000 ...``."""
    total = row.get("total_steps")
    step = f"{row.get('step')}/{total}" if total else f"{row.get('step')}"

    def num(key: str, spec: str) -> str:
        value = row.get(key)
        return "-" if value is None else format(value, spec)

    prefix = "final: " if row.get("kind") == "final" else ""
    text = (f"{prefix}round {row.get('round')} step {step} train_loss {num('train_loss', '.4f')} "
            f"eval_loss {num('eval_loss', '.4f')} tok/s {num('tokens_per_s', ',.0f')} sync_s {num('sync_s', '.2f')}")
    return text + (" DIVERGED" if row.get("diverged") else "")


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


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ================================================================================================ reader
class MetricRow(BaseModel):
    """One validated metrics row (history or progress). ``None`` means "not recorded" (or dropped as invalid)."""

    kind: str = "progress"
    time: float | None = None
    step: int | None = None
    total_steps: int | None = None
    round: int | None = None
    train_loss: float | None = None
    eval_loss: float | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    sync_s: float | None = None
    bytes_written: int | None = None
    bytes_read: int | None = None
    diverged: bool = False  # a loss was NaN or infinite (then recorded as None)
    extra: dict[str, float | None] = Field(default_factory=dict)


class ReplicaProgress(BaseModel):
    """One replica's progress as the CLI shows it: the newest row's values, plus what the history adds."""

    rank: int
    step: int | None = None
    total_steps: int | None = None
    round: int | None = None
    train_loss: float | None = None
    eval_loss: float | None = None
    initial_eval_loss: float | None = None  # the eval loss before the first outer round
    tokens: int | None = None
    tokens_per_s: float | None = None
    sync_s: float | None = None
    bytes_written: int | None = None
    bytes_read: int | None = None
    diverged: bool = False  # some recorded loss was NaN or infinite
    finished_training: bool = False  # the newest row is the ``final`` one
    updated_at: float | None = None  # time of the newest row (seconds since the epoch)
    extra: dict[str, float | None] = Field(default_factory=dict)


class MetricsReadout(BaseModel):
    """Every rank's progress, in rank order, and one warning per (rank, field) that had to be skipped."""

    replicas: list[ReplicaProgress]
    warnings: list[str] = Field(default_factory=list)

    def by_rank(self) -> dict[int, ReplicaProgress]:
        return {r.rank: r for r in self.replicas}


class _Problems:
    """Collects invalid fields per name, so each becomes one warning with a count and an example."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.fields: dict[str, tuple[str, int, Any]] = {}  # field -> (expected, count, first bad value)
        self.bad_lines = 0
        self.first_bad_line: str | None = None

    def field(self, name: str, expected: str, value: Any) -> None:
        what, n, example = self.fields.get(name, (expected, 0, value))
        self.fields[name] = (what, n + 1, example)

    def line(self, text: str) -> None:
        self.bad_lines += 1
        if self.first_bad_line is None:
            self.first_bad_line = text

    def warnings(self) -> list[str]:
        out = []
        if self.bad_lines:
            out.append(f"rank {self.rank}: {self.bad_lines} metrics line(s) are not JSON objects "
                       f"(e.g. {_show(self.first_bad_line)}); skipped")
        for name, (expected, n, example) in self.fields.items():
            out.append(f"rank {self.rank}: metrics field {name!r} is not {expected} (e.g. {_show(example)}) in "
                       f"{n} row(s); ignored")
        return out


_COUNT_FIELDS = ("step", "total_steps", "round", "tokens", "bytes_written", "bytes_read")
_RATE_FIELDS = ("time", "tokens_per_s", "sync_s")


def parse_row(raw: Mapping[str, Any], problems: _Problems) -> MetricRow:
    """Validate ``raw`` field by field: keep what is valid, report the rest, map non-finite losses to divergence.
    Unknown top-level keys are ignored (newer writers may add keys)."""
    values: dict[str, Any] = {}
    kind = raw.get("kind", "progress")
    if isinstance(kind, str):
        values["kind"] = kind
    else:
        problems.field("kind", "a string", kind)
    for name in _COUNT_FIELDS:
        if raw.get(name) is not None:
            count = _json_count(raw[name])
            if count is None:
                problems.field(name, "a whole number >= 0", raw[name])
            values[name] = count
    for name in _RATE_FIELDS:
        if raw.get(name) is not None:
            number = _json_number(raw[name])
            if number is None or not math.isfinite(number) or number < 0:
                problems.field(name, "a finite number >= 0", raw[name])
                number = None
            values[name] = number
    diverged = raw.get("diverged", False)
    if not isinstance(diverged, bool):
        problems.field("diverged", "true or false", diverged)
        diverged = False
    for name in LOSS_FIELDS:
        if raw.get(name) is not None:
            number = _json_number(raw[name])
            if number is None:
                problems.field(name, "a number", raw[name])
            elif not math.isfinite(number):
                diverged, number = True, None
            values[name] = number
    values["diverged"] = diverged
    values["extra"] = _parse_extra(raw.get("extra"), problems)
    return MetricRow(**values)


def _parse_extra(extra: Any, problems: _Problems) -> dict[str, float | None]:
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        problems.field("extra", "an object of numbers", extra)
        return {}
    out: dict[str, float | None] = {}
    for name, value in extra.items():
        number = _json_number(value) if value is not None else None
        if value is not None and number is None:
            problems.field(f"extra.{name}", "a number", value)
            continue
        out[str(name)] = number if number is not None and math.isfinite(number) else None
    return out


def _json_number(value: Any) -> float | None:
    """A JSON number (int or float, NaN/Infinity included as Python parses them); never a string or a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _json_count(value: Any) -> int | None:
    number = _json_number(value)
    if number is None or not math.isfinite(number) or number < 0 or number != int(number):
        return None
    return int(number)


def parse_history(text: str, problems: _Problems) -> list[MetricRow]:
    """The valid rows of a ``metrics/rank_RRRR.jsonl`` body, in order."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except ValueError:
            problems.line(line)
            continue
        if not isinstance(raw, dict):
            problems.line(line)
            continue
        rows.append(parse_row(raw, problems))
    return rows


def summarize(rank: int, history: list[MetricRow], progress: MetricRow | None) -> ReplicaProgress:
    """Fold one rank's rows into its progress: values from the newest row (history wins a tie), the initial
    eval loss from the history, divergence from any row."""
    rows = list(history) + ([progress] if progress is not None else [])
    out = ReplicaProgress(rank=rank)
    if not rows:
        return out
    latest = history[-1] if history else progress
    if progress is not None and history and (progress.time or 0.0) > (history[-1].time or 0.0):
        latest = progress
    assert latest is not None
    out = ReplicaProgress(
        rank=rank, step=latest.step, total_steps=latest.total_steps, round=latest.round,
        train_loss=latest.train_loss, eval_loss=latest.eval_loss, tokens=latest.tokens,
        tokens_per_s=latest.tokens_per_s, sync_s=latest.sync_s, bytes_written=latest.bytes_written,
        bytes_read=latest.bytes_read, updated_at=latest.time, extra=dict(latest.extra),
        diverged=any(r.diverged for r in rows), finished_training=latest.kind == "final",
    )
    before_training = [r for r in history if r.kind == "init" or r.round == 0]
    out.initial_eval_loss = next((r.eval_loss for r in before_training if r.eval_loss is not None), None)
    return out


def read_history(store: ObjectStore, rank: int) -> tuple[list[MetricRow], list[str]]:
    """One rank's validated history rows (none yet when the object does not exist) and its warnings."""
    problems = _Problems(rank)
    rows = parse_history(_get_text(store, METRICS_KEY.format(rank=rank)) or "", problems)
    return rows, problems.warnings()


def read_replica(store: ObjectStore, rank: int) -> tuple[ReplicaProgress, list[str]]:
    """One rank's progress (history and progress objects) and its warnings."""
    problems = _Problems(rank)
    history = parse_history(_get_text(store, METRICS_KEY.format(rank=rank)) or "", problems)
    progress = None
    text = _get_text(store, PROGRESS_KEY.format(rank=rank))
    if text is not None and text.strip():
        rows = parse_history(text.replace("\n", " "), problems)
        progress = rows[-1] if rows else None
    return summarize(rank, history, progress), problems.warnings()


def read_progress(store: ObjectStore, world_size: int) -> MetricsReadout:
    """Every rank's progress; absent objects mean "nothing reported yet". Store errors other than a missing
    object propagate (the caller decides whether a failed poll matters)."""
    replicas, warnings = [], []
    for rank in range(world_size):
        progress, problems = read_replica(store, rank)
        replicas.append(progress)
        warnings += problems
    return MetricsReadout(replicas=replicas, warnings=warnings)


def _get_text(store: ObjectStore, key: str) -> str | None:
    try:
        return store.get(key).decode(errors="replace")
    except ObjectNotFound:
        return None
