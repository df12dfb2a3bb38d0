"""The metrics record a replica writes and the launcher reads: what a row holds and where it lives, defined once.

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

Rows are read back field by field (``parse_history``, ``read_history``): by the writer of a rejoining replica,
which keeps its history, and by the launcher (``diloco.launcher.progress``), which folds them into what
``diloco status`` shows. The writer is ``diloco.replica.metrics``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from diloco.errors import ObjectNotFound
from diloco.store.layout import METRICS_KEY

if TYPE_CHECKING:
    from diloco.store.objects import ObjectStore

#: Fields the outer loop records itself; ``report()`` refuses them.
RECORDED_BY_THE_LOOP = frozenset({"kind", "time", "step", "round", "tokens_per_s", "sync_s", "bytes_written",
                                  "bytes_read", "diverged", "extra"})
LOSS_FIELDS = ("train_loss", "eval_loss")
#: The kinds of row the history holds; anything else is a progress snapshot.
HISTORY_KINDS = ("init", "round", "final")


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


def show_value(value: Any) -> str:
    """A value as a warning quotes it: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------------------------- reading rows
class RowProblems:
    """What a reader had to skip in one rank's rows: collects invalid fields per name, so each becomes one warning with a count and an example."""

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
                       f"(e.g. {show_value(self.first_bad_line)}); skipped")
        for name, (expected, n, example) in self.fields.items():
            out.append(f"rank {self.rank}: metrics field {name!r} is not {expected} (e.g. {show_value(example)}) in "
                       f"{n} row(s); ignored")
        return out


_COUNT_FIELDS = ("step", "total_steps", "round", "tokens", "bytes_written", "bytes_read")
_RATE_FIELDS = ("time", "tokens_per_s", "sync_s")


def parse_row(raw: Mapping[str, Any], problems: RowProblems) -> MetricRow:
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


def _parse_extra(extra: Any, problems: RowProblems) -> dict[str, float | None]:
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


def parse_history(text: str, problems: RowProblems) -> list[MetricRow]:
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


def read_history(store: ObjectStore, rank: int) -> tuple[list[MetricRow], list[str]]:
    """One rank's validated history rows (none yet when the object does not exist) and its warnings."""
    problems = RowProblems(rank)
    rows = parse_history(get_text(store, METRICS_KEY.format(rank=rank)) or "", problems)
    return rows, problems.warnings()


def get_text(store: ObjectStore, key: str) -> str | None:
    try:
        return store.get(key).decode(errors="replace")
    except ObjectNotFound:
        return None
