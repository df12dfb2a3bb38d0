"""Each test file's time budget, held by the suite itself: a file whose tests together take longer than its
budget fails the run, naming the file, its time and its budget, so a slow test cannot creep back in unnoticed.

What is measured: the seconds each test of a file spent in setup, call and teardown, summed over the file (on
whichever pytest-xdist worker ran it): the file's share of the suite's work, not its wall time. Only a file whose
every test ran is judged: a run that picks tests within files (``-k``, ``-m``, ``path::test``) judges none, and a
run stopped early (``-x``) judges none it left unfinished; a run of one file alone is judged (its budget holds
wherever it runs).

The budgets (``tests/time_budgets.json``) are the seconds each file took in a whole ``make test`` on an idle 2-core
machine, times 3 (rounded up to 10 s, at least the default): a margin that covers a machine running two other busy
processes (what the suite must survive: CI machines are shared); files not named there get the default (60 s). ``make test`` writes every file's measured time to
``build/test-file-times.json``, from which the budgets were made; raising one is a reviewed change to that file.
``DILOCO_TIME_BUDGETS=report`` prints the overruns without failing the run (for a machine known to be slower).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

BUDGETS_FILE = Path(__file__).resolve().parents[1] / "time_budgets.json"
TIMES_FILE = Path(__file__).resolve().parents[2] / "build" / "test-file-times.json"
MODE_ENV = "DILOCO_TIME_BUDGETS"


def _selects_within_files(config: pytest.Config) -> bool:
    """Whether the run asks for some tests of a file (``-k``, ``-m``, ``path::test``): then no file is judged."""
    return bool(config.getoption("keyword", "") or config.getoption("markexpr", "")
                or any("::" in str(arg) for arg in config.args))


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class TimeBudgets:
    """The plugin: counts what each file collected and ran, sums its seconds, judges it at the end."""

    def __init__(self, budgets_file: Path = BUDGETS_FILE, times_file: Path = TIMES_FILE) -> None:
        self.budgets_file, self.times_file = budgets_file, times_file
        self.collected: dict[str, set[str]] = defaultdict(set)
        self.finished: dict[str, set[str]] = defaultdict(set)
        self.seconds: dict[str, float] = defaultdict(float)

    # ---------------------------------------------------------------- what was collected
    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        for nodeid in ids:  # every worker collects the same tests: a set keeps one of each
            self.collected[_file_of(nodeid)].add(nodeid)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:  # empty on the controller of an xdist run (the workers collect)
            self.collected[_file_of(item.nodeid)].add(item.nodeid)

    # ---------------------------------------------------------------- what ran, and for how long
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = _file_of(report.nodeid)
        self.seconds[path] += report.duration
        if report.when == "teardown":
            self.finished[path].add(report.nodeid)

    # ---------------------------------------------------------------- the verdict
    def judged(self) -> dict[str, float]:
        """Seconds of each file whose every collected test ran."""
        return {path: seconds for path, seconds in self.seconds.items()
                if self.collected.get(path) and self.collected[path] <= self.finished[path]}

    def overruns(self, budgets: dict[str, Any]) -> list[str]:
        default = float(budgets["default_s"])
        files = budgets.get("files", {})
        return [f"{path}: {seconds:.1f} s of tests, over its budget of {float(files.get(path, default)):.1f} s"
                for path, seconds in sorted(self.judged().items())
                if seconds > float(files.get(path, default))]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if hasattr(session.config, "workerinput") or _selects_within_files(session.config):
            return  # an xdist worker (the controller judges), or a run of some of a file's tests
        judged = self.judged()
        if not judged:
            return
        if len(judged) == len(self.collected):  # a whole run: keep its times for the budgets' next review
            self.times_file.parent.mkdir(parents=True, exist_ok=True)
            self.times_file.write_text(json.dumps({path: round(s, 1) for path, s in sorted(judged.items())},
                                                  indent=1) + "\n")
        overruns = self.overruns(json.loads(self.budgets_file.read_text()))
        if not overruns:
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = ["test files over their time budget (tests/time_budgets.json; tests/support/time_budget.py):",
                 *overruns]
        if reporter is not None:
            reporter.write_sep("=", "time budgets", red=True)
            for line in lines:
                reporter.write_line(line)
        if os.environ.get(MODE_ENV) != "report" and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
