"""A run's lifecycle as the launcher judges it, through the real CLI on the local backend (real replica processes,
real kills): ``watch`` honours the run's own ``--max-restarts`` and never relaunches into a run that has ended;
a run whose replica died but can still finish reads as running (with the replica awaiting a relaunch) until
nothing can help; a run whose launcher died is finished by ``watch``, whose webhook hears of what it did, while a
``logs -f`` follows the relaunched replica to the end; Ctrl-C says what state the run is in (on
that finished run: each real run asserts everything that can be seen on it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

from support.commands import run_cli, start_cli
from support.polling import wait_for_file as wait_for
from support.run_processes import processes_of
from support.webhook import WebhookReceiver

from diloco.executors.local_supervisor import parse_combined_line

TESTS_DIR = Path(__file__).resolve().parents[1]

#: A two-replica run long enough to kill a replica in (paced steps; a round every 5 of them).
PACED = ["--replicas", "2", "--backend", "local", "--trainer", "support.paced_trainer:train", "--sync-every", "5",
         "-k", "step_s=0.05", "--set", "store.poll_interval_s=0.05"]


#: Any committed round's marker. Not round 1's: the store keeps the last 3 committed rounds, and paced rounds of a
#: quarter second delete round 1's marker within a second, which a test started late on a loaded machine can miss.
COMMITTED_ROUND = "runs/*/store/committed/round_*/COMMITTED"

#: The CLI from tests/ (so ``support.paced_trainer:train`` imports), relaunching without a backoff.
cli = partial(run_cli, restart_backoff_s=0, timeout=180)
background = partial(start_cli, restart_backoff_s=0)


def kill_replica(home: Path, rank: int) -> None:
    """SIGKILL the replica process of ``rank`` (not its supervisor), once the run has committed a round."""
    wait_for(COMMITTED_ROUND, home)
    child = json.loads(wait_for(f"runs/*/logs/rank_{rank}/child.json", home).read_text())
    os.kill(int(child["pid"]), signal.SIGKILL)


def status_once_dead(home: Path, run_id: str, rank: int) -> dict:
    """``diloco status -o json`` once it shows the killed ``rank`` as ended: its supervisor has recorded how, and
    has exited (a replica is terminal only then), usually at the first call."""
    wait_for(f"runs/{run_id}/logs/rank_{rank}/exit.json", home)
    deadline = time.monotonic() + 60
    while True:
        report = json.loads(cli("status", run_id, "-o", "json", home=home).stdout)
        if report["ranks"][rank]["state"] == "failed" or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


@contextmanager
def cleaned_up(home: Path, *procs: subprocess.Popen[str]) -> Iterator[None]:
    """Whatever the test asserts, no launcher, watcher or replica of the runs under ``home`` outlives it."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=60)
        for record in (home / "runs").glob("*.json"):
            if processes_of(record.stem):
                cli("cancel", record.stem, home=home)


def test_watch_honours_the_runs_max_restarts_and_on_the_run_it_ended_relaunches_nothing(tmp_path: Path) -> None:
    """A detached run launched with ``--max-restarts 0`` loses replica 1 to a SIGKILL: it reads as failed at once
    (no relaunch can help) though replica 0 still runs; ``watch`` stops replica 0 and relaunches nothing (``watch``
    waits as ``launch`` does: one waiting code); a second ``watch`` on the run that has now ended (failed, replica 0
    cancelled) only says so, still with the kill as replica 1's reason."""
    home = tmp_path / "home"
    launch = cli("launch", *PACED, "--steps", "400", "--max-restarts", "0", "--set", "store.timeout_s=60",
                 "--detach", "-o", "json", home=home)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    with cleaned_up(home):
        kill_replica(home, 1)
        status = status_once_dead(home, run_id, 1)
        # No relaunch can help (the run said 0): the run is failed although replica 0 still runs.
        assert status["state"] == "failed" and status["ranks"][0]["state"] == "running", status

        watch = cli("watch", run_id, "-o", "json", home=home)
        assert watch.returncode == 1, watch.stderr[-3000:]
        assert "relaunching" not in watch.stderr, watch.stderr[-3000:]
        assert re.search(r"replica 1 failed \(.+\); stopping replica\(s\) 0", watch.stderr), watch.stderr[-3000:]
        watched = json.loads(watch.stdout)
        assert [r["restarts"] for r in watched["ranks"]] == [0, 0]
        assert [r["state"] for r in watched["ranks"]] == ["cancelled", "failed"], watched["ranks"]
        assert status["awaiting_relaunch"] == [] and "diloco watch" not in cli("status", run_id, home=home).stderr
        assert not processes_of(run_id)

        again = cli("watch", run_id, "-o", "json", home=home)
        assert again.returncode == 1, again.stderr[-3000:]
        assert f"run {run_id} has already ended (failed)" in again.stderr
        assert "relaunching" not in again.stderr, again.stderr[-3000:]
        report = json.loads(again.stdout)
        assert report["state"] == "failed" and [r["restarts"] for r in report["ranks"]] == [0, 0], report
        assert report["ranks"][1]["reason"] == watched["ranks"][1]["reason"]  # still the kill, not a timeout
        assert not list(home.glob("runs/*/logs/rank_1.try*")), "a replica was relaunched into the run"
        assert not processes_of(run_id)


def test_a_run_whose_launcher_died_reads_as_running_with_the_killed_replica_and_watch_finishes_it(
        tmp_path: Path) -> None:
    """The launcher dies, then replica 1 is SIGKILLed: the run reads as running with replica 1 awaiting a relaunch;
    ``watch --max-restarts 2`` relaunches it (nothing else would), it rejoins and the run succeeds with
    bitwise-identical weights; ``watch`` prints launch's summary, and its webhook hears of the replica it found
    failed and relaunched. A ``logs -f`` started before the kill waits through it and follows the relaunched
    replica to the run's end. On that succeeded run, Ctrl-C in a later ``watch`` (caught while it still reads the
    summary) says the run has ended, not that it keeps running."""
    home = tmp_path / "home"
    launch = background("launch", *PACED, "--steps", "60", "--set", "store.timeout_s=120", "-o", "json", home=home)
    with cleaned_up(home, launch), ExitStack() as stack:  # the logs follower goes too, whatever happens
        run_id = wait_for("runs/*.json", home).stem
        logs = background("logs", run_id, "-f", "-r", "1", home=home)
        stack.callback(lambda: logs.poll() is None and logs.kill())
        wait_for(COMMITTED_ROUND, home)
        launch.kill()  # the launcher's terminal went away: nobody relaunches anything now
        launch.communicate(timeout=60)
        kill_replica(home, 1)

        status = status_once_dead(home, run_id, 1)
        assert status["state"] == "running" and status["awaiting_relaunch"] == [1], status
        assert status["ranks"][0]["state"] == "running"
        table = cli("status", run_id, home=home)
        assert table.returncode == 0 and f"run {run_id}: running" in table.stdout, table.stdout
        assert f"if none is waiting, run: diloco watch {run_id}" in table.stderr, table.stderr
        runs = json.loads(cli("runs", "-o", "json", home=home).stdout)["runs"]
        assert [r["state"] for r in runs] == ["running"]

        with WebhookReceiver() as hook:  # the replica this watch found failed and relaunched is news to its webhook
            watch = cli("watch", run_id, "--max-restarts", "2", "-o", "json", "--notify", hook.url, home=home)
        assert watch.returncode == 0, watch.stderr[-3000:]
        assert "replica 1 failed" in watch.stderr and "relaunching it (restart 1 of 2)" in watch.stderr, \
            watch.stderr[-3000:]
        events = [(b["diloco"]["event"], b["diloco"].get("rank")) for b in hook.bodies]
        assert events == [("replica_failed", 1), ("replica_relaunched", 1), ("run_ended", None)], hook.bodies
        report = json.loads(watch.stdout)
        assert report["state"] == "succeeded" and report["weights_identical"] is True, report
        assert [r["restarts"] for r in report["ranks"]] == [0, 1] and report["awaiting_relaunch"] == []
        victim_log = "".join(p.read_text() for p in home.glob("runs/*/logs/rank_1/combined.log"))
        assert "rank 1 rejoined at step" in victim_log, victim_log[-2000:]

        followed, _ = logs.communicate(timeout=60)  # it ends with the run: the relaunched replica's end is the run's
        assert logs.returncode == 0
        lines = followed.splitlines()
        assert lines and all(line.startswith("[r1] ") for line in lines), lines[:5]
        attempts = [home.glob("runs/*/logs/rank_1.try1/combined.log"), home.glob("runs/*/logs/rank_1/combined.log")]
        written = [f"[r1] {parsed[2]}" for found in attempts for path in found
                   for parsed in map(parse_combined_line, path.read_text().splitlines()) if parsed is not None]
        assert any("rank 1 rejoined at step" in line for line in written), written[-10:]
        assert lines == written, "every line of both attempts, in order, each once"
        assert json.loads((home / "runs" / f"{run_id}.json").read_text())["policy"]["max_restarts"] == 2
        runs = json.loads(cli("runs", "-o", "json", home=home).stdout)["runs"]
        assert [r["state"] for r in runs] == ["succeeded"]
        assert not processes_of(run_id)

    assert_ctrl_c_in_watch_says_the_succeeded_run_has_ended(home, run_id)


def assert_ctrl_c_in_watch_says_the_succeeded_run_has_ended(home: Path, run_id: str) -> None:
    """Ctrl-C in ``watch`` of a succeeded run says it has ended (succeeded), not that it keeps running."""
    # A store read that does not return until interrupted (a slow store): rank 0's metrics become a FIFO that
    # nobody writes, so `watch` is still reading the summary of the succeeded run when Ctrl-C comes.
    metrics = next(home.glob("runs/*/store/metrics/rank_0000.jsonl"))
    kept = metrics.with_name("kept.jsonl")
    metrics.rename(kept)
    os.mkfifo(metrics)
    watch = background("watch", run_id, home=home)
    try:
        assert watch.stderr is not None
        first = watch.stderr.readline()
        assert first.startswith(f"run {run_id} has already ended (succeeded)"), first
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate(timeout=60)
        metrics.unlink()
        kept.rename(metrics)
    assert watch.returncode == 130, err
    assert "keeps running" not in err, err
    assert f"stopped waiting; run {run_id} has ended (succeeded)" in err
    assert f"diloco collect {run_id}" in err
