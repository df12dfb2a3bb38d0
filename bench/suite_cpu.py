"""Where the test suite's CPU goes: every process's CPU time, by kind and by test file.

Why: on a 2-core machine the suite is bound by CPU, not by waiting (four workers keep both cores busy), so a
faster suite must do less work, and the work is spread over processes pytest never sees: replicas, CLI
invocations, pip, the emulators and moto's server inside the workers. This runs pytest and, beside it, samples
``/proc`` five times a second: each process's CPU time (user + system) at its last sighting, its command line, and
the test it belongs to (the ``DILOCO_TEST_ID`` it inherited from the test that started it, else the test its
parent worker was running). A process living under 0.2 s can be missed, and up to 0.2 s of each process's end is;
the same test's processes vary by about 20% between runs on a shared machine.

    python bench/suite_cpu.py -- -n 4 --dist loadgroup --no-loadscope-reorder   # the whole suite, as make test
    python bench/suite_cpu.py -- tests/backends/kubernetes                      # one directory

The table goes to stdout and everything to ``build/suite-cpu.json``. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "suite-cpu.json"
CURRENT_DIR_ENV = "DILOCO_SUITE_CPU_DIR"
TEST_ID_ENV = "DILOCO_TEST_ID"
SAMPLE_S = 0.2
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ---------------------------------------------------------------------------------------------- the pytest plugin
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Loaded into every worker with ``-p suite_cpu``: the processes a test starts inherit its id, and the
    sampler can read which test each worker is running."""
    os.environ[TEST_ID_ENV] = item.nodeid
    folder = os.environ.get(CURRENT_DIR_ENV)
    if folder:
        Path(folder, str(os.getpid())).write_text(item.nodeid)


# ---------------------------------------------------------------------------------------------- the sampler
def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def kind_of(cmdline: str) -> str:
    """What a process is, from its command line."""
    if "local_supervisor" in cmdline:  # before the replica: a supervisor names the entrypoint it runs
        return "supervisor"
    if "diloco.replica.entrypoint" in cmdline or "diloco_bootstrap" in cmdline:
        return "replica"
    if "diloco.cli" in cmdline or "/bin/diloco " in cmdline:
        return "cli"
    if " -m pip" in cmdline or "/pip " in cmdline:
        return "pip"
    if "python -u -c import sys" in cmdline or " -m pytest" in cmdline:
        return "worker"  # an xdist worker, or pytest without one: the tests, the emulators and moto run in it
    return "other"


class Sampler:
    """Reads every process in ``/proc`` each ``SAMPLE_S`` seconds until stopped."""

    def __init__(self, current_dir: Path) -> None:
        self.current_dir = current_dir
        self.procs: dict[tuple[int, str], dict[str, Any]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.scan()

    def scan(self) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            stat = _read(f"/proc/{entry}/stat")
            fields = stat[stat.rfind(b")") + 2:].split()
            if len(fields) < 20:
                continue
            key = (int(entry), fields[19].decode())
            cpu = (int(fields[11]) + int(fields[12])) / TICK
            seen = self.procs.get(key)
            if seen is None:
                env = _read(f"/proc/{entry}/environ").split(b"\0")
                test = next((item.split(b"=", 1)[1].decode(errors="replace") for item in env
                             if item.startswith(TEST_ID_ENV.encode() + b"=")), None)
                parent = int(fields[1])
                seen = self.procs[key] = {
                    "pid": key[0], "ppid": parent, "first_cpu": cpu, "test": test,
                    "parent_test": _read(str(self.current_dir / str(parent))).decode() or None,
                    "cmdline": _read(f"/proc/{entry}/cmdline").replace(b"\0", b" ").decode(errors="replace")[:300]}
            seen["cpu"] = cpu


def attribute(procs: list[dict[str, Any]], root: int) -> list[dict[str, Any]]:
    """The suite's processes (descending from ``root``, pytest, or started by a test and since re-parented), each
    with its ``kind``, the CPU it used while sampled (``used``) and its test (walking up its parents for one that
    knows)."""
    by_pid = {p["pid"]: p for p in procs}

    def descends(p: dict[str, Any] | None) -> bool:
        for _ in range(32):
            if p is None:
                return False
            if p["pid"] == root:
                return True
            p = by_pid.get(p["ppid"])
        return False

    for p in procs:
        p["kind"] = kind_of(p["cmdline"])
        p["used"] = p["cpu"] if p["first_cpu"] < 0.5 else p["cpu"] - p["first_cpu"]  # older ones: since first seen
        test, up = p["test"] or p["parent_test"], p
        for _ in range(16):
            if test or up is None:
                break
            up = by_pid.get(up["ppid"])
            test = up and (up["test"] or up["parent_test"])
        p["test_id"] = test
    return [p for p in procs if p["test_id"] or descends(p)]


def report(procs: list[dict[str, Any]], top: int) -> str:
    kinds = ("replica", "cli", "worker", "pip", "supervisor", "other")
    total: Counter[str] = Counter()
    count: Counter[str] = Counter()
    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    for p in procs:
        total[p["kind"]] += p["used"]
        count[p["kind"]] += 1
        if p["test_id"]:
            per_file[p["test_id"].split("::")[0]][p["kind"]] += p["used"]
    lines = ["| what | processes | CPU-seconds |", "|---|---|---|"]
    lines += [f"| {k} | {count[k]} | {total[k]:.0f} |" for k in kinds]
    lines += [f"| all | {sum(count.values())} | {sum(total.values()):.0f} |", "",
              f"The {top} test files using the most CPU in the processes they started (the workers' own CPU is "
              "not split by test):", "", "| file | replica | cli | other | total |", "|---|---|---|---|---|"]
    ranked = sorted(per_file.items(), key=lambda kv: -sum(v for k, v in kv[1].items() if k != "worker"))
    for name, used in ranked[:top]:
        rest = sum(v for k, v in used.items() if k not in ("replica", "cli", "worker"))
        lines.append(f"| {name} | {used['replica']:.1f} | {used['cli']:.1f} | {rest:.1f} | "
                     f"{used['replica'] + used['cli'] + rest:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25, help="test files to list")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    args = parser.parse_args(argv)
    pytest_args = [a for a in args.pytest_args if a != "--"] if args.pytest_args[:1] == ["--"] else args.pytest_args
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as current:
        # As `make test` runs it: compiled modules kept (the Makefile clears PYTHONDONTWRITEBYTECODE for the same
        # reason: otherwise every process compiles what it imports from the checkout again).
        env = {**os.environ, CURRENT_DIR_ENV: current, "PYTHONDONTWRITEBYTECODE": "",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), *filter(None, [os.environ.get("PYTHONPATH")])])}
        sampler = Sampler(Path(current))
        sampler.thread.start()
        started = time.monotonic()
        pytest_run = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "suite_cpu", *pytest_args], cwd=ROOT,
                                      env=env)
        code = pytest_run.wait()
        sampler.stop.set()
        sampler.thread.join()
    procs = attribute(list(sampler.procs.values()), pytest_run.pid)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"wall_s": time.monotonic() - started, "pytest_exit": code, "processes": procs}) + "\n")
    print(f"\npytest exited {code} after {time.monotonic() - started:.0f} s; every process's CPU ({OUT}):\n")
    print(report(procs, args.top))
    return code


if __name__ == "__main__":
    sys.exit(main())
