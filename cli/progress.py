"""Progress while a command waits on a run, always on stderr.

On a terminal: a live Rich table (per replica: state, step/total, round, train/eval loss, tokens/s). Anywhere
else (CI logs, pipes): one plain line per replica whenever its state or step changes, so the log stays short
and greppable.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING

from diloco.cli.render import stderr_console
from diloco.cli.views import fmt_duration, fmt_loss, fmt_num, fmt_step, replica_table

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.live import Live

    from diloco.launcher.reports import RunReport


class RunProgress:
    """``with RunProgress(run_id) as p: p.update(report)``; ``note(text)`` prints narration above the table."""

    def __init__(self, run_id: str, *, interactive: bool | None = None) -> None:
        self.run_id = run_id
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.console = stderr_console()
        self._live: Live | None = None
        self._last: RenderableType | None = None
        self._seen: dict[int, tuple[str, int | None]] = {}

    def __enter__(self) -> RunProgress:
        if self.interactive:
            from rich.live import Live

            # Transient: the summary printed after the wait replaces the live table instead of repeating it.
            self._live = Live(console=self.console, refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)
            self._live = None
            if exc_type is not None and self._last is not None:
                self.console.print(self._last)  # interrupted: leave the last view on screen (no summary follows)

    def note(self, text: str) -> None:
        self.console.print(text)

    def update(self, report: RunReport) -> None:
        if self._live is not None:
            elapsed = fmt_duration(time.time() - report.created_at)
            size = self.console.size
            # the rows, plus a title, the header, its rule and up to two notes (replicas not shown, columns hidden)
            self._last = replica_table(report, title=f"{report.run_id}: {report.state.value}, {elapsed} since launch",
                                       width=size.width, max_rows=max(2, size.height - 5))
            self._live.update(self._last)
            return
        for rep in report.ranks:
            key = (rep.state.value, rep.step)
            if self._seen.get(rep.rank) == key:
                continue
            self._seen[rep.rank] = key
            parts = [f"[r{rep.rank}] {rep.state.value}"]
            if rep.step is not None:
                parts.append(f"step {fmt_step(rep)}")
                parts.append(f"round {rep.round}")
                parts.append(f"train {fmt_loss(rep.train_loss)}")
                parts.append(f"eval {fmt_loss(rep.eval_loss)}")
                if rep.tokens_per_s:
                    parts.append(f"{fmt_num(rep.tokens_per_s)} tok/s")
            self.console.print("  ".join(parts))
