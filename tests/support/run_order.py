"""The order tests go out in: the longest units of work first, by what each test took in the last whole run.

Why: pytest-xdist hands units of work (a test, or a whole ``xdist_group``: ``support.xdist_groups``) to the workers in
collection order, a worker taking its next one as it runs low. A 35-second scenario handed out last keeps one
worker busy after the others have finished, and on a 2-core machine with four workers half of the CPU is then
idle. Handing out the longest first (the classic longest-processing-time rule) leaves the short tests to fill the
gaps at the end. Markers alone are a poor guide: a test marked ``slow`` may take 4 seconds or 40, and an unmarked one
35.

What a test is expected to take: its seconds in ``tests/test_durations.json`` (setup, call and teardown, from a whole
``make test``; every test of a second or more), else a default by marker for a test not measured yet (``long`` 60 s,
``slow`` 5 s, others 0.3 s). A unit costs the sum of its tests. Units keep their tests together, in collection
order, so a module-scoped fixture is set up once per unit; units of equal cost keep their collection order.

Each run writes what it measured to ``build/test-durations.json`` (the controller's reports, so also under xdist);
after a whole ``make test``, copying it over ``tests/test_durations.json`` refreshes the order. A stale file only
makes the order less good, never a test wrong.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import pytest

DURATIONS_FILE = Path(__file__).resolve().parents[1] / "test_durations.json"
MEASURED_FILE = Path(__file__).resolve().parents[2] / "build" / "test-durations.json"
#: Tests shorter than this are left out of the durations file: the default for an unmeasured test stands for them.
KEPT_FROM_S = 1.0
#: Expected seconds of a test the durations file does not name, by its marker.
DEFAULT_S = {"long": 60.0, "slow": 5.0}
UNMARKED_S = 0.3


def load_durations(path: Path = DURATIONS_FILE) -> dict[str, float]:
    """Node id -> seconds; empty when the file is missing or unreadable (the markers' defaults then decide)."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def expected_seconds(item: pytest.Item, durations: Mapping[str, float]) -> float:
    if item.nodeid in durations:
        return durations[item.nodeid]
    for marker, seconds in DEFAULT_S.items():
        if item.get_closest_marker(marker) is not None:
            return seconds
    return UNMARKED_S


def unit_of(item: pytest.Item) -> str:
    """The unit of work the scheduler hands out whole: the module's ``xdist_group`` name, else the test."""
    group = item.get_closest_marker("xdist_group")
    if group is not None and group.args:
        return f"xdist_group:{group.args[0]}"
    return item.nodeid


def longest_first(items: list[pytest.Item], durations: Mapping[str, float]) -> None:
    """Reorder ``items`` in place: units by expected seconds, longest first, each unit's tests together."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(unit_of(item), []).append(item)
    cost = {unit: sum(expected_seconds(i, durations) for i in members) for unit, members in units.items()}
    ranked = sorted(units, key=lambda unit: -cost[unit])  # stable: equal costs keep their collection order
    items[:] = [item for unit in ranked for item in units[unit]]


class DurationRecorder:
    """The plugin that writes what this run's tests took (``MEASURED_FILE``), on the controller only."""

    def __init__(self, measured_file: Path = MEASURED_FILE) -> None:
        self.measured_file = measured_file
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput") or not self.seconds:
            return
        kept = {nodeid: round(s, 1) for nodeid, s in sorted(self.seconds.items()) if s >= KEPT_FROM_S}
        self.measured_file.parent.mkdir(parents=True, exist_ok=True)
        self.measured_file.write_text(json.dumps(kept, indent=0) + "\n")


__all__ = ["DURATIONS_FILE", "DurationRecorder", "expected_seconds", "load_durations", "longest_first", "unit_of"]
