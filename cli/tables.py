"""Tables that fit the terminal by dropping their least important columns, never by cutting values.

Left to itself, Rich fits a table that is too wide by shortening every column with an ellipsis, so the run id and
the state, the two things a reader looks for, become ``diloco-20261201-1…`` and ``runn…``. A table built here knows
which of its columns matter most: when the whole table does not fit the console's width (a narrow terminal, or
``COLUMNS`` on a pipe) it drops the least important columns until it does, and a footer names what it dropped.
Essential columns are never dropped; free-text columns wrap onto more lines instead of being dropped first; a
column with nothing in it is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rich import box
from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult

Cell = str | Text
Justify = Literal["left", "right", "center"]

#: The narrowest a wrapping (free-text) column is squeezed to before it is dropped instead.
WRAP_MIN_WIDTH = 16
#: Between two columns: one space of padding and one of the (blank) divider.
GAP = 2


@dataclass(frozen=True)
class Column:
    """One column: its header, alignment, whether it may ever be dropped, and whether its text may wrap."""

    name: str
    justify: Justify = "left"
    essential: bool = False  # never dropped (the run id, the state): the row means nothing without it
    wrap: bool = False  # free text (a reason): wraps onto more lines rather than widening the table


def hidden_note(names: Sequence[str]) -> str:
    """The footer under a table that dropped columns to fit."""
    return f"columns hidden: {', '.join(names)}; widen the terminal or use -o json"


def _plain(cell: Cell) -> str:
    return cell.plain if isinstance(cell, Text) else cell


def _width_needed(column: Column, rows: Sequence[dict[str, Cell]]) -> int:
    """The width ``column`` takes: its widest value (or header); a wrapping column settles for less."""
    natural = max([cell_len(column.name)] + [max((cell_len(line) for line in _plain(r[column.name]).splitlines()),
                                                 default=0) for r in rows])
    return min(natural, max(WRAP_MIN_WIDTH, cell_len(column.name))) if column.wrap else natural


def fit_columns(columns: Sequence[Column], rows: Sequence[dict[str, Cell]], width: int | None,
                priority: Sequence[str]) -> tuple[list[Column], list[str]]:
    """``(shown, hidden)``: the columns that fit ``width`` in reading order, and the names of those dropped.

    ``priority`` lists the column names most important first: the last ones are dropped first, one at a time, until
    the rest fits (essential columns are never dropped). A column whose every cell is empty is left out and not
    counted as hidden."""
    present = [c for c in columns if any(_plain(r[c.name]).strip() for r in rows) or not rows]
    if width is None:
        return present, []
    rank = {name: i for i, name in enumerate(priority)}
    shown = list(present)
    hidden: list[Column] = []
    droppable = sorted((c for c in present if not c.essential), key=lambda c: rank.get(c.name, len(rank)))

    def total(cols: list[Column]) -> int:
        return sum(_width_needed(c, rows) for c in cols) + GAP * max(0, len(cols) - 1)

    while total(shown) > width and droppable:
        dropped = droppable.pop()
        shown.remove(dropped)
        hidden.append(dropped)
    return shown, [c.name for c in present if c in hidden]


@dataclass
class FittedTable:
    """A table fitted to a width, with the lines that go with it: a title above (at full width, so a long run id
    in it never wraps inside a narrow table), and notes below (replicas not shown, columns hidden)."""

    table: Table
    hidden: list[str] = field(default_factory=list)
    title: Cell | None = None
    notes: list[str] = field(default_factory=list)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.title is not None:
            yield self.title if isinstance(self.title, Text) else Text(self.title)
        yield self.table
        for note in self.notes + ([hidden_note(self.hidden)] if self.hidden else []):
            yield Text(note, no_wrap=False, overflow="fold")  # within the width, even where output soft-wraps


def fitted_table(columns: Sequence[Column], rows: Sequence[dict[str, Cell]], *, width: int | None,
                 priority: Sequence[str] | None = None, title: Cell | None = None) -> FittedTable:
    """The CLI's one table style (a rule under the header, no borders: easy to read, grep and paste) holding the
    columns of ``columns`` that fit ``width`` (None: all of them); see ``fit_columns`` for ``priority`` (default:
    the order of ``columns``)."""
    shown, hidden = fit_columns(columns, rows, width, [c.name for c in columns] if priority is None else priority)
    too_narrow = width is not None and sum(_width_needed(c, rows) for c in shown) + GAP * (len(shown) - 1) > width
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for column in shown:
        # Only when even the essential columns are wider than the terminal may a value fold onto a second line,
        # whole; otherwise no column but free text ever wraps, so Rich never has a reason to cut one.
        fold = column.wrap or (too_narrow and column.essential)
        table.add_column(column.name, justify=column.justify, no_wrap=not fold, overflow="fold" if fold else "ellipsis")
    for row in rows:
        table.add_row(*(row[c.name] for c in shown))
    return FittedTable(table=table, hidden=hidden, title=title)
