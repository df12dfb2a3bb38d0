"""bench/suite_cpu.py, which says where the suite's CPU goes, counts what it claims: a process a test started is
found with its CPU time and credited to that test (through its own environment, or a parent that knows), and
only the suite's processes are counted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.bench_scripts import load_bench_script

suite_cpu = load_bench_script("suite_cpu")
Sampler, attribute, kind_of, report = suite_cpu.Sampler, suite_cpu.attribute, suite_cpu.kind_of, suite_cpu.report

BURN = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\ntime.sleep(30)\n"


def test_a_process_a_test_started_is_found_with_its_cpu_and_credited_to_that_test(tmp_path: Path) -> None:
    sampler = Sampler(tmp_path)
    env = {**os.environ, "DILOCO_TEST_ID": "tests/x/test_y.py::test_z"}
    burner = subprocess.Popen([sys.executable, "-c", BURN, "diloco.replica.entrypoint"], env=env)
    try:
        while True:  # until it has burned its half second: the sampler reads what /proc says
            sampler.scan()
            seen = [p for p in sampler.procs.values() if p["pid"] == burner.pid]
            if seen and seen[0]["cpu"] >= 0.5:
                break
    finally:
        burner.kill()
        burner.wait()
    procs = attribute(list(sampler.procs.values()), root=-1)  # no pytest root: only what a test started counts
    mine = [p for p in procs if p["pid"] == burner.pid]
    assert len(mine) == 1 and mine[0]["kind"] == "replica" and mine[0]["test_id"] == "tests/x/test_y.py::test_z"
    assert mine[0]["used"] >= 0.4
    assert all(p["test_id"] for p in procs)  # the machine's other processes are not the suite's
    assert "| tests/x/test_y.py |" in report(procs, top=5)


def test_kinds_and_a_child_credited_through_its_parent() -> None:
    assert kind_of("python -m diloco.executors.local_supervisor -- python -m diloco.replica.entrypoint") == "supervisor"
    assert kind_of("/venv/bin/python3 /venv/bin/diloco status") == "cli"
    assert kind_of("python -m diloco.cli.main launch") == "cli"
    assert kind_of("python -u -c import sys;exec(eval(sys.stdin.readline()))") == "worker"
    parent = {"pid": 10, "ppid": 1, "first_cpu": 0.0, "cpu": 1.0, "test": None, "parent_test": "t.py::a",
              "cmdline": "python -m diloco.cli.main launch"}
    child = {"pid": 11, "ppid": 10, "first_cpu": 0.0, "cpu": 2.0, "test": None, "parent_test": None,
             "cmdline": "python -m diloco.replica.entrypoint --spec x"}
    stranger = {"pid": 12, "ppid": 1, "first_cpu": 0.0, "cpu": 9.0, "test": None, "parent_test": None,
                "cmdline": "sshd"}
    procs = attribute([parent, child, stranger], root=-1)
    assert [(p["pid"], p["kind"], p["test_id"]) for p in procs] == [(10, "cli", "t.py::a"), (11, "replica", "t.py::a")]
