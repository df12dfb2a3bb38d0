"""A census of the real processes the suite starts: how many tests start a replica process on each backend
(local processes, emulated SageMaker jobs, emulated Kubernetes pods) and how many see one replaced (a kill or a
preemption that the run survives by a relaunch). Shrinking the suite must not lose a kind: ``make test`` prints
the census at the end and writes it to ``build/test-process-census.json``, so two runs can be compared.

How it counts: while a test runs, a thread of the pytest process that runs it looks in ``/proc`` a few times a
second for processes descending from it whose command line is diloco's replica entrypoint or its bootstrap
(``diloco_bootstrap.py`` execs the entrypoint in the same process). The backend is read from the process's
environment, as the platforms set it: ``TRAINING_JOB_NAME`` (SageMaker, set by the emulator as the service does),
``KUBERNETES_SERVICE_HOST`` (a pod), else a local process. A replica is keyed by its run, rank and local rank
(``DILOCO_RUN_ID``, ``REPLICA_RANK``/``JOB_COMPLETION_INDEX``, ``LOCAL_RANK``): a second process under one key is a
relaunch. A process living less than a sampling interval can be missed; a replica lives far longer.

Linux only (``/proc``); elsewhere the census is empty and says so.
"""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

CENSUS_FILE = Path(__file__).resolve().parents[2] / "build" / "test-process-census.json"
SAMPLE_S = 0.25
BACKENDS = ("local", "sagemaker", "kubernetes")
_MARKERS = ("diloco.replica.entrypoint", "diloco_bootstrap.py")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _parent_and_start(pid: int) -> tuple[int, str] | None:
    """``(ppid, start time)`` from ``/proc/PID/stat`` (the fields after the command name's closing paren)."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat[stat.rfind(b")") + 2:].split()
    if len(fields) < 20:
        return None
    return int(fields[1]), fields[19].decode()


def _replica_key(pid: int) -> tuple[str, str, str, str] | None:
    """``(backend, run, rank, local rank)`` of a replica process, or None when ``pid`` is not one."""
    cmdline = _read(f"/proc/{pid}/cmdline").split(b"\0")
    if not _runs_a_replica([part.decode(errors="replace") for part in cmdline if part]):
        return None
    env = dict(item.decode(errors="replace").partition("=")[::2]
               for item in _read(f"/proc/{pid}/environ").split(b"\0") if b"=" in item)
    backend = ("sagemaker" if "TRAINING_JOB_NAME" in env
               else "kubernetes" if "KUBERNETES_SERVICE_HOST" in env else "local")
    args = [part.decode(errors="replace") for part in cmdline]
    rank = env.get("REPLICA_RANK") or env.get("JOB_COMPLETION_INDEX") or (
        args[args.index("--rank") + 1] if "--rank" in args[:-1] else "?")
    run = env.get("DILOCO_RUN_ID") or env.get("TRAINING_JOB_NAME", "").rsplit("-r", 1)[0] or "?"
    return backend, run, rank, env.get("LOCAL_RANK", "")


def _runs_a_replica(args: list[str]) -> bool:
    """Whether an interpreter's command line runs the replica entrypoint (``-m diloco.replica.entrypoint``) or the
    bootstrap script, as its program: a supervisor that names them after its own module (``local_supervisor
    ... -- python -m diloco.replica.entrypoint``) is not a replica."""
    rest = args[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        rest = rest[1:]  # the interpreter's own flags (-u, -X ...)
    if len(rest) >= 2 and rest[0] == "-m":
        return rest[1] == _MARKERS[0]
    return bool(rest) and os.path.basename(rest[0]) == _MARKERS[1]


class _Sampler:
    """The thread that watches ``/proc`` for the test now running in this process."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.lock = threading.Lock()
        self.seen: dict[tuple[int, str], tuple[str, str, str, str]] = {}
        self.known: dict[int, tuple[int, str]] = {}  # every process seen so far: its parent and start time
        self.mine: set[int] = set()  # those descending from this worker
        self.scanning = threading.Lock()
        self.current: str | None = None
        self.found: dict[str, list[tuple[str, str, str, str]]] = defaultdict(list)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="process-census", daemon=True)
        self.thread.start()

    def _descends_from_me(self, pid: int) -> bool:
        for _ in range(64):
            if pid == self.me or pid in self.mine:
                return True
            if pid <= 1 or pid not in self.known:
                return False
            pid = self.known[pid][0]
        return False

    def scan(self) -> None:
        """Note the replica processes this worker's test has started since the last scan.

        A process is read once when it first appears (its parent and start time), so a scan of a busy machine
        costs a directory listing, not a read of every process; only this worker's descendants are read again
        each scan (a child forked by the test becomes a replica when it execs, which changes its command line)."""
        test = self.current
        if test is None:
            return
        with self.scanning:  # the sampler thread and take() share what was seen
            self._scan(test)

    def _scan(self, test: str) -> None:
        current = {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}
        for pid in self.known.keys() - current:
            del self.known[pid]
            self.mine.discard(pid)
        fresh = sorted(current - self.known.keys() - {self.me})  # parents before their children, mostly
        for pid in fresh:
            info = _parent_and_start(pid)
            if info is not None:
                self.known[pid] = info
        self.mine.update(pid for pid in fresh if pid in self.known and self._descends_from_me(pid))
        for pid in list(self.mine):
            start = self.known[pid][1]
            if (pid, start) in self.seen:
                continue
            key = _replica_key(pid)
            if key is None:
                continue
            with self.lock:
                self.seen[(pid, start)] = key
                self.found[test].append(key)

    def _loop(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - a census must never break a test run
                pass

    def take(self, test: str) -> list[tuple[str, str, str, str]]:
        self.scan()  # the processes of a test's last moments
        with self.lock:
            return self.found.pop(test, [])


def summarize(per_test: dict[str, list[list[str]]]) -> dict[str, Any]:
    """Per backend: the tests that started a replica process, the processes, and the tests that saw a relaunch."""
    out: dict[str, Any] = {}
    for backend in BACKENDS:
        tests = processes = relaunching = 0
        for keys in per_test.values():
            mine = [tuple(k) for k in keys if k[0] == backend]
            if mine:
                tests += 1
                processes += len(mine)
                relaunching += any(n > 1 for n in _counts(mine).values())
        out[backend] = {"tests_starting_replicas": tests, "replica_processes": processes,
                        "tests_with_a_relaunch": relaunching}
    return out


def _counts(keys: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], int]:
    counts: dict[tuple[Any, ...], int] = defaultdict(int)
    for key in keys:
        counts[key] += 1
    return counts


class ProcessCensus:
    """The plugin: samples in the processes that run tests, gathers and reports in the one that reports."""

    def __init__(self, census_file: Path = CENSUS_FILE) -> None:
        self.census_file = census_file
        self.sampler: _Sampler | None = _Sampler() if os.path.isdir("/proc") else None
        self.per_test: dict[str, list[list[str]]] = {}

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if self.sampler is not None:
            self.sampler.current = item.nodeid

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
        outcome = yield
        if call.when == "teardown" and self.sampler is not None:
            keys = self.sampler.take(item.nodeid)
            self.sampler.current = None
            outcome.get_result().user_properties.append(("replica_processes", [list(k) for k in keys]))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == "replica_processes" and value:
                self.per_test[report.nodeid] = value

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if hasattr(terminalreporter.config, "workerinput"):
            return  # an xdist worker: the controller reports
        if self.sampler is None:
            terminalreporter.write_line("process census: no /proc on this machine, nothing counted")
            return
        if not self.per_test:
            return  # no test started a replica: nothing to say (a unit-test run)
        census = summarize(self.per_test)
        self.census_file.parent.mkdir(parents=True, exist_ok=True)
        self.census_file.write_text(json.dumps({"summary": census, "tests": self.per_test}, indent=1,
                                               sort_keys=True) + "\n")
        terminalreporter.section("process census")
        for backend, row in census.items():
            terminalreporter.write_line(
                f"{backend}: {row['tests_starting_replicas']} tests started {row['replica_processes']} replica "
                f"processes; {row['tests_with_a_relaunch']} of them saw a replica relaunched (a kill or preemption)")
