"""The order tests go out in: the long scenarios early and spread among the short tests, by what each test took in
the last whole run.

Why: pytest-xdist hands units of work (a test, or a whole ``xdist_group``: ``support.xdist_groups``) to the workers in
the order given, a worker taking its next one as it runs low. Two things waste a 2-core machine with four workers:

* **A long unit handed out late** keeps one worker busy after the others have finished. So the units of
  ``HEAVY_S`` or more go out longest first.
* **Short tests alone** (a CLI refusal, a store round trip) mostly wait on a subprocess or a poll: four workers of
  them keep the CPU a fifth idle. Handed out all at the end, as a plain longest-first order does, they leave the last
  minutes of a run part idle. So the heavy units are interleaved with the short ones in proportion to their
  expected seconds, the heavy ones running out when ``HEAVY_DONE_AT`` of the short seconds have gone out: the
  CPU-hungry scenarios fill the short tests' waits all along, and the last short tests even out the workers' ends.

Markers alone are a poor guide: a test marked ``slow`` may take 4 seconds or 40, and an unmarked one 35.

What a test is expected to take: its seconds in ``tests/test_durations.json`` (setup, call and teardown, from a whole
``make test``; every test of a second or more), else a default by marker for a test not measured yet (``long`` 60 s,
``slow`` 5 s, others 0.3 s). A unit costs the sum of its tests. Units keep their tests together, in collection
order, so a module-scoped fixture is set up once per unit; the short units keep their collection order.

Each run records what it measured in ``build/test-durations.json`` (the controller's reports, so also under xdist;
a run of part of the suite updates only the tests it ran); after a whole ``make test``, copying it over
``tests/test_durations.json`` refreshes the order. A stale file only
makes the order less good, never a test wrong.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import pytest

from .xdist_groups import scope_of

DURATIONS_FILE = Path(__file__).resolve().parents[1] / "test_durations.json"
MEASURED_FILE = Path(__file__).resolve().parents[2] / "build" / "test-durations.json"
#: Tests shorter than this are left out of the durations file: the default for an unmeasured test stands for them.
KEPT_FROM_S = 1.0
#: Expected seconds of a test the durations file does not name, by its marker.
DEFAULT_S = {"long": 60.0, "slow": 5.0}
UNMARKED_S = 0.3
#: A unit this long or longer is heavy: it goes out longest first, interleaved with the short ones.
HEAVY_S = 5.0
#: The share of the short units' seconds handed out when the last heavy unit goes.
HEAVY_DONE_AT = 0.85


def load_durations(path: Path = DURATIONS_FILE) -> dict[str, float]:
    """Node id -> seconds; empty when the file is missing or unreadable (the markers' defaults then decide)."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def expected_seconds(item: pytest.Item, durations: Mapping[str, float]) -> float:
    """What ``item`` is expected to take: its measured seconds, else its marker's default."""
    if item.nodeid in durations:
        return durations[item.nodeid]
    for marker, seconds in DEFAULT_S.items():
        if item.get_closest_marker(marker) is not None:
            return seconds
    return UNMARKED_S


def unit_of(item: pytest.Item) -> str:
    """The unit of work the scheduler hands out whole: the module's ``xdist_group`` (as ``support.xdist_groups``
    finds it), else the test."""
    return scope_of(str(item.config.rootpath), item.nodeid)


def dispatch_order(items: list[pytest.Item], durations: Mapping[str, float]) -> None:
    """Reorder ``items`` in place (see the module docstring): heavy units longest first, interleaved with the short
    ones by expected seconds; each unit's tests together."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(unit_of(item), []).append(item)
    cost = {unit: sum(expected_seconds(i, durations) for i in members) for unit, members in units.items()}
    heavy = sorted((u for u in units if cost[u] >= HEAVY_S), key=lambda u: -cost[u])  # stable for equal costs
    short = [u for u in units if cost[u] < HEAVY_S]
    heavy_total = sum(cost[u] for u in heavy) or 1.0
    short_total = HEAVY_DONE_AT * sum(cost[u] for u in short) or 1.0
    ordered: list[str] = []
    heavy_out = short_out = 0.0
    while heavy or short:
        if heavy and (not short or heavy_out / heavy_total <= short_out / short_total):
            unit = heavy.pop(0)
            heavy_out += cost[unit]
        else:
            unit = short.pop(0)
            short_out += cost[unit]
        ordered.append(unit)
    items[:] = [item for unit in ordered for item in units[unit]]


class DurationRecorder:
    """The plugin that records what this run's tests took in ``MEASURED_FILE``, on the controller only. A run of
    part of the suite updates the tests it ran and keeps the others' seconds, so running one file after a whole
    ``make test`` does not lose the whole run's measure."""

    def __init__(self, measured_file: Path = MEASURED_FILE) -> None:
        self.measured_file = measured_file
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput") or not self.seconds:
            return
        kept = load_durations(self.measured_file)
        for nodeid, seconds in self.seconds.items():
            if seconds >= KEPT_FROM_S:
                kept[nodeid] = round(seconds, 1)
            else:
                kept.pop(nodeid, None)
        self.measured_file.parent.mkdir(parents=True, exist_ok=True)
        self.measured_file.write_text(json.dumps(dict(sorted(kept.items())), indent=0) + "\n")


__all__ = ["DURATIONS_FILE", "DurationRecorder", "dispatch_order", "expected_seconds", "load_durations", "unit_of"]
