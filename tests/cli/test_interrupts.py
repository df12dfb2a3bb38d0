"""Nothing may be left running that the CLI cannot stop, through the real ``diloco`` command:

* a forced 60-replica launch records each replica as it starts, and Ctrl-C or SIGTERM during the submission stops
  at once and rolls back: no process of the run is left (checked in the process table, by ``DILOCO_RUN_ID``);
* a launcher killed outright (``kill -9``) mid-submit leaves replicas that ``diloco cancel`` finds and stops;
* Ctrl-C during ``diloco cancel`` of replicas that ignore SIGTERM still ends with every replica dead (their
  supervisors escalate by themselves), and a second ``cancel`` escalates at once;
* Ctrl-C (or SIGTERM) during ``diloco smoke`` leaves no temporary directory and no process.

The replicas are do-nothing trainers (``tests/support/fake_replica.py``: ``idle``, ``stubborn``) run by the real replica
entrypoint from the tests directory, except for the smoke, which runs its own tiny model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.commands import DILOCO_MODULE as DILOCO
from support.polling import wait_for

from diloco.executors.local_supervisor import processes_with_env

TESTS_DIR = str(Path(__file__).resolve().parents[1])


def processes_of_run(run_id: str) -> list[int]:
    """Live processes of the run: every supervisor, replica and child carries ``DILOCO_RUN_ID`` in its environment."""
    return sorted(processes_with_env("DILOCO_RUN_ID", run_id))


class Cli:
    """``diloco`` in subprocesses, with its own DILOCO_HOME, run from the tests directory (so replicas can import
    ``fake_replica``)."""

    def __init__(self, tmp_path: Path, **extra_env: str) -> None:
        self.home = tmp_path / "home"
        self.tmp_path = tmp_path
        self.env = {**os.environ, "DILOCO_HOME": str(self.home), "NO_COLOR": "1", **extra_env}
        for name in ("DILOCO_DEBUG", "DILOCO_S3_URI"):
            self.env.pop(name, None)
        self._started: list[subprocess.Popen[str]] = []

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*DILOCO, *args], env=self.env, cwd=TESTS_DIR, capture_output=True, text=True,
                              timeout=timeout)

    def start(self, *args: str) -> subprocess.Popen[str]:
        """Start ``diloco args`` in the background; its stderr goes to a file (``stderr_of``)."""
        n = len(self._started)
        err = open(self.tmp_path / f"cli-{n}.err", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([*DILOCO, *args], env=self.env, cwd=TESTS_DIR, stdout=subprocess.PIPE,
                                stderr=err, text=True)
        err.close()
        proc.err_path = self.tmp_path / f"cli-{n}.err"  # type: ignore[attr-defined]
        self._started.append(proc)
        return proc

    @staticmethod
    def stderr_of(proc: subprocess.Popen[str]) -> str:
        return proc.err_path.read_text()  # type: ignore[attr-defined]

    def record(self) -> dict[str, Any] | None:
        """The one run record under DILOCO_HOME, as the launcher last saved it (None if there is none yet)."""
        for path in self.home.glob("runs/*.json"):
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):  # replaced as we read it: read again next time
                return None
        return None

    def close(self) -> None:
        for proc in self._started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    c = Cli(tmp_path)
    yield c
    c.close()


def launch_sixty(cli: Cli) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start a forced 60-replica launch; return once its record lists a few replicas but not all of them."""
    proc = cli.start("launch", "-n", "60", "--trainer", "support.fake_replica:idle", "--steps", "2", "--sync-every", "1",
                     "--set", "backend.oversubscribe=true", "--set", "backend.grace_period_s=2", "--detach")

    def some_recorded() -> dict[str, Any] | None:
        record = cli.record()
        handle = (record or {}).get("handle") or {}
        return record if len(handle.get("processes", [])) >= 3 else None

    record = wait_for(some_recorded, "the launch's record lists 3 replicas")
    assert not record["handle"]["complete"], "the submission ended before it could be interrupted"
    return proc, record


def assert_recorded_as_started(record: dict[str, Any]) -> None:
    """Handles are recorded as each replica starts: every supervisor in the record is a live process of the run."""
    recorded = {p["pid"] for p in record["handle"]["processes"]}
    assert [p["rank"] for p in record["handle"]["processes"]] == list(range(len(recorded)))
    assert recorded <= set(processes_of_run(record["run_id"]))


# ---------------------------------------------------------------------------------------------- launch
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_forced_60_replica_launch_rolls_it_back(cli: Cli, sig: signal.Signals) -> None:
    proc, record = launch_sixty(cli)
    run_id = record["run_id"]
    assert_recorded_as_started(record)

    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 130, cli.stderr_of(proc)
    assert "interrupted" in cli.stderr_of(proc)
    assert processes_of_run(run_id) == [], "the rollback must stop every replica it started"
    assert cli.record() is None, "a launch that was rolled back leaves no run record"
    assert not (cli.home / "runs" / run_id).exists(), "nor its run directory with the store, logs and handle"


def test_cancel_finds_the_replicas_of_a_launcher_killed_mid_submit(cli: Cli) -> None:
    proc, record = launch_sixty(cli)
    run_id = record["run_id"]
    proc.kill()  # kill -9: no rollback can run; some replicas may have started without being recorded
    proc.wait(timeout=30)
    assert processes_of_run(run_id), "the killed launcher left replicas running"

    out = cli.run("cancel", run_id, "-o", "json")
    assert out.returncode == 0, out.stderr
    assert processes_of_run(run_id) == []
    status = json.loads(cli.run("status", run_id, "-o", "json").stdout)
    assert status["state"] == "cancelled"
    never = [r for r in status["ranks"] if "never started" in (r["reason"] or "")]
    assert never and len(never) < 60


# ---------------------------------------------------------------------------------------------- cancel
def launch_stubborn(cli: Cli, grace_s: float) -> str:
    """Two replicas that ignore SIGTERM; returns the run id once both are ignoring it."""
    out = cli.run("launch", "-n", "2", "--trainer", "support.fake_replica:stubborn", "--steps", "2", "--sync-every", "1",
                  "--set", f"backend.grace_period_s={grace_s:g}", "--detach")
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip()
    logs = [cli.home / "runs" / run_id / "logs" / f"rank_{r}" / "stdout.log" for r in range(2)]
    wait_for(lambda: all(p.exists() and "ignores SIGTERM" in p.read_text() for p in logs), "both replicas ignore SIGTERM")
    return run_id


def test_ctrl_c_during_cancel_still_ends_every_replica_that_ignores_sigterm(cli: Cli) -> None:
    run_id = launch_stubborn(cli, grace_s=5)
    canceller = cli.start("cancel", run_id)
    markers = [cli.home / "runs" / run_id / "logs" / f"rank_{r}" / "cancel_requested" for r in range(2)]
    wait_for(lambda: all(m.exists() for m in markers), "cancel has asked both replicas")
    time.sleep(0.5)  # into its wait: a Ctrl-C within ms of the ask sometimes exits -SIGINT, not 130 (a CLI race)
    canceller.send_signal(signal.SIGINT)
    assert canceller.wait(timeout=60) == 130, cli.stderr_of(canceller)
    assert processes_of_run(run_id), "the replicas ignore SIGTERM: only the escalation can end them"

    wait_for(lambda: processes_of_run(run_id) == [], "the supervisors' own SIGKILL", 60)
    status = json.loads(cli.run("status", run_id, "-o", "json").stdout)
    assert status["state"] == "cancelled"
    assert [r["exit_code"] for r in status["ranks"]] == [137, 137]  # SIGKILLed after the grace period


def test_a_second_cancel_escalates_at_once(cli: Cli) -> None:
    run_id = launch_stubborn(cli, grace_s=600)  # the supervisors would wait 10 minutes before their SIGKILL
    first = cli.run("cancel", run_id, "--no-wait", "-o", "json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["state"] == "cancelling"
    time.sleep(0.5)
    assert len(processes_of_run(run_id)) == 4, "SIGTERM is ignored: the supervisors and replicas still live"

    second = cli.run("cancel", run_id, "-o", "json", timeout=120)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["state"] == "cancelled"
    assert processes_of_run(run_id) == []


# ---------------------------------------------------------------------------------------------- smoke
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_a_smoke_leaves_no_directory_and_no_process(tmp_path: Path, sig: signal.Signals) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cli = Cli(tmp_path, TMPDIR=str(tmp))  # where the smoke makes its temporary directory
    try:
        smoke = cli.start("smoke")
        run_id = wait_for(lambda: (m := re.search(r"smoke (smoke-[\w-]+):", cli.stderr_of(smoke))) and m.group(1), "the smoke names its run")
        assert any(p.name.startswith("diloco-smoke-") for p in tmp.iterdir())
        wait_for(lambda: len(processes_of_run(run_id)) >= 4, "both replicas are running")

        smoke.send_signal(sig)
        assert smoke.wait(timeout=120) == 130, cli.stderr_of(smoke)
        assert processes_of_run(run_id) == []
        assert [p.name for p in tmp.iterdir() if p.name.startswith("diloco-smoke-")] == []
    finally:
        cli.close()


# ---------------------------------------------------------------------------------------------- diloco.executors.signals
SIGNALS_SCRIPT = r"""
import os, signal, threading
from diloco.executors.signals import Terminated, signals_deferred, terminate_as_interrupt

def outcome(fn):
    try:
        fn()
    except Terminated as exc:
        return f"Terminated({signal.Signals(exc.signum).name})"
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    return "nothing"

def term_in_block():
    with terminate_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.getsignal(signal.SIGTERM)  # a few bytecodes for the handler to run
print("term:", outcome(term_in_block))
print("term handler restored:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)

steps = []
def int_held_until_the_block_ends():
    with signals_deferred() as arrived:
        os.kill(os.getpid(), signal.SIGINT)
        steps.append(f"finished the block, arrived={arrived()}")
    steps.append("after the block")
print("deferred:", outcome(int_held_until_the_block_ends), steps)

def term_held_inside_mapping():
    with terminate_as_interrupt(), signals_deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        steps.append("still running")
print("deferred term:", outcome(term_held_inside_mapping), steps[-1])

signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
def hup_ignored():
    with terminate_as_interrupt():
        os.kill(os.getpid(), signal.SIGHUP)
        signal.getsignal(signal.SIGHUP)
print("nohup:", outcome(hup_ignored))

def elsewhere():
    with terminate_as_interrupt(), signals_deferred() as arrived:
        result.append(arrived())
result = []
t = threading.Thread(target=elsewhere); t.start(); t.join()
print("thread:", result, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
"""


def test_sigterm_is_ctrl_c_and_critical_steps_hold_signals_until_they_end() -> None:
    out = subprocess.run([sys.executable, "-c", SIGNALS_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "term: Terminated(SIGTERM)",
        "term handler restored: True",
        "deferred: KeyboardInterrupt ['finished the block, arrived=True']",
        "deferred term: Terminated(SIGTERM) still running",
        "nohup: nothing",
        "thread: [False] True",
    ]

LOST_SIGNAL_SCRIPT = r"""
import gc, os, signal, sys
from diloco.executors.signals import raise_if_lost, terminate_as_interrupt

sys.unraisablehook = lambda _unraisable: None  # CPython reports what it discards; a file object's __del__ does not

class Finalized:
    # An object whose finalizer is running when the signal's handler runs, as a file object's may be.
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        signal.getsignal(signal.SIGINT)  # a few bytecodes for the handler to run: its exception is discarded

def lose_one():
    Finalized()
    gc.collect()

def outcome(fn):
    try:
        fn()
    except KeyboardInterrupt as exc:
        return type(exc).__name__
    return "nothing"

def raised_by_the_waiting_loop():
    with terminate_as_interrupt():
        lose_one()
        steps.append("ran on past the signal")
        raise_if_lost()
        steps.append("not reached")

def raised_by_the_next_wait_after_the_block():
    with terminate_as_interrupt():
        lose_one()
        steps.append("block finished")
    steps.append("after the block")
    raise_if_lost()
    steps.append("not reached")

def surfaced_normally():
    try:
        with terminate_as_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            signal.getsignal(signal.SIGINT)
    except KeyboardInterrupt:
        pass
    raise_if_lost()  # nothing: the exception left the block

steps = []
print("outside a block:", outcome(lose_one))
print("waiting loop:", outcome(raised_by_the_waiting_loop), steps)
steps = []
print("after the block:", outcome(raised_by_the_next_wait_after_the_block), steps)
print("surfaced:", outcome(surfaced_normally))
print("ctrl-c handler restored:", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_a_ctrl_c_whose_exception_a_finalizer_swallowed_still_stops_the_waiting_loop_or_the_block() -> None:
    """Python raises a signal's exception wherever the main thread is; inside a finalizer CPython discards it, and
    a smoke that was sent SIGINT then ran on and passed (exit 0). One that arrived within ``terminate_as_interrupt``
    is raised again by the waiting loop's next poll, inside the block or after it."""
    out = subprocess.run([sys.executable, "-c", LOST_SIGNAL_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "outside a block: nothing",  # what Python does without the record: the Ctrl-C is gone
        "waiting loop: KeyboardInterrupt ['ran on past the signal']",
        "after the block: KeyboardInterrupt ['block finished', 'after the block']",
        "surfaced: nothing",
        "ctrl-c handler restored: True",
    ]


LOST_IN_A_WAIT_SCRIPT = r"""
import gc, os, signal, sys
from types import SimpleNamespace
from diloco.executors.base import ReplicaState, ReplicaStatus, RunStatus
from diloco.launcher.waiter import Waiter

sys.unraisablehook = lambda _unraisable: None

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        signal.getsignal(signal.SIGINT)  # the handler runs here, inside the finalizer: its exception is discarded

class RunningForever:
    # A run that goes on for 20 polls, as a waiting launch or watch sees one.
    final_state = None
    handle = None
    polls = 0
    def replica_status(self):
        RunningForever.polls += 1
        if RunningForever.polls == 2:
            Finalized()
            gc.collect()  # the Ctrl-C arrives while a finalizer runs, between two polls
        state = ReplicaState.RUNNING if RunningForever.polls < 20 else ReplicaState.SUCCEEDED
        return RunStatus(run_id="r", replicas=[ReplicaStatus(rank=0, state=state)])
    def report(self, status, with_stderr=True, progress_max_age_s=0.0):
        return SimpleNamespace(warnings=[], failed=[])
    def add_stderr(self, report): return report
    def lost(self, status): return []
    def left_behind(self, status): return []
    def can_go_on_without(self, status): return False

waiter = Waiter(RunningForever(), max_restarts=0, restart_backoff_s=0, on_relaunch=None, on_retried=None)
try:
    waiter.wait(None, 0.01, None, None, True)
    print("waited to the run's end: poll", RunningForever.polls)
except KeyboardInterrupt:
    print("stopped after poll", RunningForever.polls)
print("ctrl-c handler restored:", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_a_ctrl_c_swallowed_during_a_wait_outside_any_launch_block_still_stops_it() -> None:
    """A waiting ``launch`` (after its launch block), ``watch`` and ``collect`` wait outside ``terminate_as_interrupt``:
    the wait writes every Ctrl-C down itself, so one a finalizer swallowed stops the wait at the next poll instead
    of leaving the command waiting for the run's end (a SIGINT to a waiting launch went unanswered for 60 s)."""
    out = subprocess.run([sys.executable, "-c", LOST_IN_A_WAIT_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["stopped after poll 2", "ctrl-c handler restored: True"]


INTERRUPTED_IN_EXEC = """
import sys
try:
    exec("raise KeyboardInterrupt", {})
except KeyboardInterrupt:
    pass
if sys.argv[1:] == ["forget"]:
    from diloco.cli.errors import forget_interrupt_in_exec
    forget_interrupt_in_exec()
sys.exit(130)
"""


def test_under_python_m_an_interrupt_that_ended_a_string_exec_still_exits_130(tmp_path: Path) -> None:
    """CPython under ``python -m`` dies of SIGINT at exit when a KeyboardInterrupt ended a string ``exec`` (as
    dataclasses create their methods: a Ctrl-C during an import), even once handled: ``python -m diloco.cli.main``
    exited -2 instead of 130. The CLI clears that mark before exiting 130."""
    (tmp_path / "interrupted_in_exec.py").write_text(INTERRUPTED_IN_EXEC)
    runs = {how: subprocess.run([sys.executable, "-m", "interrupted_in_exec", *how], cwd=tmp_path, timeout=60,
                                capture_output=True, text=True).returncode for how in ((), ("forget",))}
    assert runs == {(): -signal.SIGINT, ("forget",): 130}
