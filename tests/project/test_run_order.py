"""The suite hands out its long scenarios early and spread among the short tests (``support.run_order``), by what
each test took in the last whole run: a real pytest run of a small suite shows the order, and writes what it
measured for the next one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

CONFTEST = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(TESTS)!r})
from support.run_order import DurationRecorder, dispatch_order, load_durations

def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a slow test")
    config.addinivalue_line("markers", "xdist_group(name): one worker runs the module")
    config.pluginmanager.register(DurationRecorder(Path("measured.json")), "durations")

def pytest_collection_modifyitems(items):
    dispatch_order(items, load_durations(Path("durations.json")))
"""

SUITE = {
    "test_a.py": "import time\n\n"
                 "def test_short():\n    pass\n\n"
                 "def test_measured_long():\n    time.sleep(1.1)\n",
    "test_b.py": "import pytest\n\n"
                 "@pytest.mark.slow\ndef test_marked_slow():\n    pass\n\n"
                 "def test_unmarked():\n    pass\n",
    "test_c.py": "import pytest\n\npytestmark = pytest.mark.xdist_group('together')\n\n"
                 "def test_first_of_group():\n    pass\n\n"
                 "def test_second_of_group():\n    pass\n",
}


def test_heavy_units_go_longest_first_among_the_short_ones_a_group_stays_together_and_durations_are_kept(
        tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "durations.json").write_text(json.dumps({
        "test_a.py::test_measured_long": 8.0,
        "test_c.py::test_first_of_group": 1.5, "test_c.py::test_second_of_group": 1.5}))
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = re.findall(r"^(test_\w+\.py::\w+) PASSED", done.stdout, re.MULTILINE)
    # Heavy: the measured 8 s, then the marked 5 s; short, in collection order: 0.3 s, 0.3 s and the group's 3 s.
    assert ran == [
        "test_a.py::test_measured_long",   # the longest heavy unit first: 8 of the 13 heavy seconds out
        "test_a.py::test_short",           # then short ones until their share catches up (0.3 + 0.3 + 3 of 3.6)
        "test_b.py::test_unmarked",
        "test_c.py::test_first_of_group",  # a group is one unit: its tests together and in their order
        "test_c.py::test_second_of_group",
        "test_b.py::test_marked_slow",     # not measured, marked slow: 5 s, heavy
    ], done.stdout
    measured = json.loads((tmp_path / "measured.json").read_text())
    assert list(measured) == ["test_a.py::test_measured_long"], measured  # only tests of a second or more
    assert measured["test_a.py::test_measured_long"] >= 1.1

    # A run of part of the suite keeps what it did not run.
    again = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_b.py"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((tmp_path / "measured.json").read_text()) == measured
