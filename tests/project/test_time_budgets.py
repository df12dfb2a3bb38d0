"""The suite holds each test file to its time budget (``support.time_budget``): a real pytest run, in and out of
pytest-xdist, fails naming the file that took longer than its budget, and judges no file it ran only in part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

CONFTEST = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(TESTS)!r})
from support.time_budget import TimeBudgets

def pytest_configure(config):
    config.pluginmanager.register(TimeBudgets(Path("budgets.json"), Path("times.json")), "budgets")
"""


def _suite(tmp_path: Path, slow_budget_s: float) -> Path:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_fast.py").write_text("def test_fast():\n    assert True\n")
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_slow_a():\n    time.sleep(0.4)\n\ndef test_slow_b():\n    time.sleep(0.4)\n")
    (tmp_path / "budgets.json").write_text(json.dumps({"default_s": 60, "files": {"test_slow.py": slow_budget_s}}))
    return tmp_path


def _pytest(where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=where,
                          capture_output=True, text=True, timeout=120)


def test_a_file_over_its_budget_fails_the_run_and_is_named(tmp_path: Path) -> None:
    done = _pytest(_suite(tmp_path, slow_budget_s=0.5))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    assert "test_slow.py: 0.8 s of tests, over its budget of 0.5 s" in done.stdout
    assert "test_fast.py" not in done.stdout.split("time budgets")[-1]
    times = json.loads((tmp_path / "times.json").read_text())
    assert set(times) == {"test_fast.py", "test_slow.py"} and times["test_slow.py"] >= 0.8


def test_the_budget_holds_under_xdist_too(tmp_path: Path) -> None:
    done = _pytest(_suite(tmp_path, slow_budget_s=0.5), "-n", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "test_slow.py: 0.8 s of tests, over its budget of 0.5 s" in done.stdout


def test_a_file_within_its_budget_or_run_in_part_passes(tmp_path: Path) -> None:
    suite = _suite(tmp_path, slow_budget_s=5)
    assert _pytest(suite).returncode == 0
    (suite / "budgets.json").write_text(json.dumps({"default_s": 60, "files": {"test_slow.py": 0.1}}))
    part = _pytest(suite, "test_slow.py::test_slow_a", "test_fast.py")  # test_slow.py only in part: not judged
    assert part.returncode == 0, part.stdout + part.stderr
    assert "over its budget" not in part.stdout
