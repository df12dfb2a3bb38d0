"""The local backend's own guarantees, with real processes, beyond what the conformance suite checks for every
backend (tests/backends): the environment and process-group contract, log files, exact exit codes and reasons,
escalation that does not need the canceller, exactly one SIGTERM, recycled pids, time limits, killed supervisors,
and a launch interrupted or killed half-way (nothing unrecorded, nothing left running).

The replicas run ``tests/support/fake_replica.py`` (found through PYTHONPATH), told what to do by their trainer kwargs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.polling import wait_for

from diloco.errors import BackendError, ConfigError
from diloco.executors import backend_class, create_backend
from diloco.executors.base import EntrypointArgs, LaunchSpec, ReplicaState, RunState
from diloco.executors.local import LocalBackend, LocalBackendConfig, LocalProcess, LocalRunHandle
from diloco.executors.local_supervisor import group_members, proc_stat

TESTS_DIR = str(Path(__file__).resolve().parents[2])
#: One per test process: pytest-xdist workers run these tests side by side, and processes are found by this id.
RUN_ID = f"run-test-{os.getpid()}"


def make_spec(tmp_path: Path, n: int = 2, timeout_s: float | None = None, run_id: str = RUN_ID,
              **behaviour: object) -> LaunchSpec:
    """A spec that runs tests/support/fake_replica.py with ``behaviour`` as its kwargs."""
    args = EntrypointArgs(rendezvous_uri=f"file://{tmp_path}/store", world_size=n, trainer="fake:train",
                          trainer_kwargs=dict(behaviour))
    return LaunchSpec(run_id=run_id, replicas=n, entrypoint="support.fake_replica", entrypoint_args=args,
                      timeout_s=timeout_s, env={"PYTHONPATH": TESTS_DIR})


def alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st.state != "Z"


def processes_of_run(run_id: str) -> list[int]:
    """Live processes whose environment carries ``DILOCO_RUN_ID=run_id`` (supervisors, replicas, their children)."""
    from diloco.executors.local_supervisor import processes_with_env

    return sorted(processes_with_env("DILOCO_RUN_ID", run_id))


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    return LocalBackend(LocalBackendConfig(log_root=str(tmp_path / "logs"), grace_period_s=2.0))


def log_dir(handle: LocalRunHandle, rank: int) -> Path:
    p = handle.process(rank)
    assert p is not None
    return Path(p.log_dir)


# ---------------------------------------------------------------------------------------------- registry, plan
def test_registry_builds_local_and_refuses_unknown_backends() -> None:
    assert isinstance(create_backend(LocalBackendConfig()), LocalBackend)
    assert backend_class("local") is LocalBackend and LocalBackend.unavailable_reason is None
    with pytest.raises(ConfigError, match=r"must be one of local, sagemaker, eks.* \(got 'ec2'\)"):
        backend_class("ec2")


def test_plan_is_pure_and_lists_only_added_env(tmp_path: Path, backend: LocalBackend) -> None:
    environ_before = dict(os.environ)
    plan = backend.plan(make_spec(tmp_path, n=3))
    assert os.environ == environ_before
    assert not (tmp_path / "logs").exists()  # nothing created
    assert [r["rank"] for r in plan.requests] == [0, 1, 2]
    req = plan.requests[2]
    assert req["argv"][:3] == [sys.executable, "-m", "support.fake_replica"]
    assert "--rendezvous" in req["argv"] and f"file://{tmp_path}/store" in req["argv"]
    env = req["env"]
    assert env["DILOCO_RUN_ID"] == RUN_ID
    assert env["REPLICA_RANK"] == "2"
    assert env["WORLD_SIZE"] == "3"
    assert env["RENDEZVOUS_URI"] == f"file://{tmp_path}/store"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert set(env) <= {"DILOCO_RUN_ID", "REPLICA_RANK", "WORLD_SIZE", "RENDEZVOUS_URI", "PYTHONUNBUFFERED",
                        "OMP_NUM_THREADS", "PYTHONPATH", "DILOCO_CHECKPOINT_DIR"}
    if "DILOCO_CHECKPOINT_DIR" not in os.environ:  # each rank's inner optimizer state, under the run directory
        assert env["DILOCO_CHECKPOINT_DIR"] == str(tmp_path / "logs" / RUN_ID / "checkpoints")
    assert req["cwd"] == os.getcwd()
    assert req["log_dir"] == str(tmp_path / "logs" / RUN_ID / "logs" / "rank_2")


# ---------------------------------------------------------------------------------------------- running
def test_replicas_run_in_own_groups_with_env_contract_and_logs(tmp_path: Path, backend: LocalBackend) -> None:
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    handle = backend.submit(backend.plan(make_spec(tmp_path, n=2, lines=3, env_out=str(seen_dir))))
    status = backend.wait(handle, timeout_s=30, poll_interval_s=0.05)
    assert [r.state for r in status.replicas] == [ReplicaState.SUCCEEDED, ReplicaState.SUCCEEDED]
    assert [r.exit_code for r in status.replicas] == [0, 0]

    for rank in (0, 1):
        seen = json.loads((seen_dir / f"rank_{rank}.json").read_text())
        assert seen["env"]["REPLICA_RANK"] == str(rank)
        assert seen["env"]["WORLD_SIZE"] == "2"
        assert seen["env"]["DILOCO_RUN_ID"] == RUN_ID
        assert seen["env"]["RENDEZVOUS_URI"] == f"file://{tmp_path}/store"
        assert seen["env"]["PYTHONUNBUFFERED"] == "1"
        # its own process group, led by its supervisor, not ours
        p = handle.process(rank)
        assert p is not None and seen["pgid"] == p.pid != os.getpgrp()
        assert status.replica(rank).job_id == str(p.pid)

        logs = log_dir(handle, rank)
        assert (logs / "stdout.log").read_text().splitlines() == [f"rank {rank} line {i}" for i in range(3)]
        assert "hello on stderr" in (logs / "stderr.log").read_text()
        combined = (logs / "combined.log").read_text().splitlines()
        stamps = [float(line.split(" ", 2)[0]) for line in combined]
        assert stamps == sorted(stamps) and len(combined) == 4
        assert [line.split(" ", 2)[1] for line in combined].count("err") == 1
        records = list(backend.replica_logs(handle, rank))
        assert [r.text for r in records if "line" in r.text] == [f"rank {rank} line {i}" for i in range(3)]
        assert len(records) == 4


def test_failed_replica_reports_exact_exit_code_reason_and_stderr(tmp_path: Path, backend: LocalBackend) -> None:
    handle = backend.submit(backend.plan(make_spec(tmp_path, n=2, fail_rank=1, fail_exit=3)))
    ok, bad = backend.wait(handle, timeout_s=30, poll_interval_s=0.05).replicas
    assert ok.state == ReplicaState.SUCCEEDED
    assert bad.state == ReplicaState.FAILED
    assert bad.exit_code == 3
    assert bad.reason == "exited with code 3"
    assert backend.failure_tail(handle, 1)[-1] == "rank 1: injected failure"


def test_timeout_stops_the_replica(tmp_path: Path, backend: LocalBackend) -> None:
    handle = backend.submit(backend.plan(make_spec(tmp_path, n=1, timeout_s=0.5, sleep=60)))
    (status,) = backend.wait(handle, timeout_s=30, poll_interval_s=0.05).replicas
    assert status.state == ReplicaState.FAILED
    assert "exceeded its time limit of 0.5s" in (status.reason or "")
    assert status.timed_out


def test_follow_logs_until_the_replica_ends(tmp_path: Path, backend: LocalBackend) -> None:
    handle = backend.submit(backend.plan(make_spec(tmp_path, n=1, lines=5, line_gap=0.1)))
    records = list(backend.replica_logs(handle, 0, follow=True))
    assert [r.text for r in records if r.stream == "out"] == [f"rank 0 line {i}" for i in range(5)]
    assert backend.describe(handle).replica(0).state == ReplicaState.SUCCEEDED


# ---------------------------------------------------------------------------------------------- cancel
def cancel_from_another_process(backend: LocalBackend, handle: LocalRunHandle) -> None:
    """``cancel`` in a process that exits as soon as it has asked, as a CLI interrupted by Ctrl-C would."""
    code = ("import json, sys\n"
            "from diloco.executors.local import LocalBackend, LocalBackendConfig\n"
            "config, handle = json.loads(sys.stdin.read())\n"
            "backend = LocalBackend(LocalBackendConfig.model_validate(config))\n"
            "backend.cancel(backend.load_handle(handle))\n")
    payload = json.dumps([backend.config.model_dump(mode="json"), handle.model_dump(mode="json")])
    subprocess.run([sys.executable, "-c", code], input=payload, text=True, check=True, timeout=60)


def test_cancel_kills_the_whole_group_even_if_sigterm_is_ignored_and_the_canceller_is_gone(tmp_path: Path) -> None:
    backend = LocalBackend(LocalBackendConfig(log_root=str(tmp_path / "logs"), grace_period_s=1.0))
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    handle = backend.submit(backend.plan(make_spec(tmp_path, n=2, sleep=120, spawn_child=True, ignore_term=True,
                                                   pid_out=str(pid_dir))))
    wait_for(lambda: len(list(pid_dir.iterdir())) == 2, "both replicas to record their pid")
    grandchildren = [int(p.read_text()) for p in pid_dir.iterdir()]
    assert all(alive(pid) for pid in grandchildren)
    assert all(r.state == ReplicaState.RUNNING for r in backend.describe(handle).replicas)

    cancel_from_another_process(backend, handle)  # the canceller exits at once: the supervisors escalate alone

    status = backend.wait(handle, timeout_s=30, poll_interval_s=0.1)
    assert [r.state for r in status.replicas] == [ReplicaState.CANCELLED] * 2, status
    for p in handle.processes:  # the supervisor writes the exit record, then exits itself: give it that moment
        wait_for(lambda p=p: group_members(p.pid) == [], "the group to be gone", 10)  # nothing of the group is left
    assert not any(alive(pid) for pid in grandchildren)
    backend.cancel(handle)  # idempotent
    assert backend.describe(handle).state == RunState.CANCELLED


def test_cancel_with_sigterm_records_the_exit(tmp_path: Path, backend: LocalBackend) -> None:
    handle = backend.submit(backend.plan(make_spec(tmp_path, n=1, sleep=120)))
    stdout = log_dir(handle, 0) / "stdout.log"
    wait_for(lambda: stdout.exists() and "line 2" in stdout.read_text(), "line 2 in the replica's stdout")
    backend.cancel(handle)
    (status,) = backend.wait(handle, timeout_s=30, poll_interval_s=0.05).replicas
    assert status.state == ReplicaState.CANCELLED
    assert status.exit_code == 128 + signal.SIGTERM
    assert "SIGTERM" in (status.reason or "")


def test_cancel_delivers_exactly_one_sigterm_to_the_replica(tmp_path: Path, backend: LocalBackend) -> None:
    term_log = tmp_path / "terms"
    handle = backend.submit(backend.plan(make_spec(tmp_path, n=1, sleep=120, term_log=str(term_log))))
    wait_for(term_log.exists, "the replica to catch SIGTERM (it creates the log then)")
    backend.cancel(handle)
    (status,) = backend.wait(handle, timeout_s=30, poll_interval_s=0.05).replicas
    # Only the supervisor's forwarded SIGTERM: a group-wide one would reach the replica a second time, directly
    # from the canceller, and a second SIGTERM can cut the replica's clean shutdown short.
    assert term_log.read_text().splitlines() == [f"SIGTERM from {handle.processes[0].pid}"]
    assert status.state == ReplicaState.CANCELLED and status.exit_code == 143


def test_recycled_pid_is_never_signalled_or_taken_for_the_replica(tmp_path: Path, backend: LocalBackend) -> None:
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        st = proc_stat(stranger.pid)
        assert st is not None
        logs = tmp_path / "logs" / "ghost" / "logs" / "rank_0"
        logs.mkdir(parents=True)
        handle = LocalRunHandle(run_id="ghost", replicas=1, host=socket.gethostname(),
                                run_dir=str(tmp_path / "logs" / "ghost"), launcher_pid=os.getpid(), complete=True,
                                processes=[LocalProcess(rank=0, pid=stranger.pid, start_time=st.start_time + 1,
                                                        log_dir=str(logs), launched_at=time.time())])
        status = backend.describe(handle).replica(0)
        assert status.state == ReplicaState.FAILED  # not RUNNING: that pid is someone else now
        backend.cancel(handle)
        backend.cancel(handle)  # the second cancel escalates to SIGKILL: still never to a stranger
        time.sleep(0.2)
        assert stranger.poll() is None  # and it was not killed
    finally:
        stranger.kill()
        stranger.wait()


# ---------------------------------------------------------------------------------------------- killed supervisors
def test_killed_supervisor_leaves_a_running_replica_that_cancel_still_stops(tmp_path: Path,
                                                                            backend: LocalBackend) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    go_on = tmp_path / "go-on"
    handle = backend.submit(backend.plan(make_spec(tmp_path, n=1, sleep=120, env_out=str(pid_dir),
                                                   announce_world=True, go_on_when=str(go_on))))
    supervisor = handle.processes[0].pid
    logs = log_dir(handle, 0)
    combined = logs / "combined.log"
    wait_for(lambda: combined.exists() and "world size" in combined.read_text(), "the supervisor to copy a line")
    replica_pid = json.loads((pid_dir / "rank_0.json").read_text())["pid"]
    os.kill(supervisor, signal.SIGKILL)  # the supervisor only, as `kill -9 <pid>` or the OOM killer would
    wait_for(lambda: not alive(supervisor), "the supervisor to exit")
    go_on.touch()  # the replica prints only now, with no supervisor: its output must still have somewhere to go
    wait_for(lambda: "hello on stderr" in (logs / "stderr.log").read_text(), "the replica's unsupervised output",
             alive=lambda: alive(replica_pid))
    later = [f"rank 0 line {i}" for i in range(3)]
    assert (logs / "stdout.log").read_text().splitlines() == ["rank 0 of world size 1", *later]
    assert alive(replica_pid)
    # `diloco logs` shows the copied line and then, once each, what the supervisor never copied
    shown = [(r.stream, r.text) for r in backend.replica_logs(handle, 0)]
    assert shown == [("out", "rank 0 of world size 1"), *[("out", t) for t in later],
                     ("err", "rank 0 says hello on stderr")]

    status = backend.describe(handle).replica(0)  # not "failed" while the replica still trains, nor "running"
    assert status.state == ReplicaState.RUNNING  # forever: it says why
    assert "supervisor" in (status.reason or "") and "unsupervised" in (status.reason or "")

    backend.cancel(handle)  # it is still ours to stop (no supervisor to escalate: signalled directly)
    wait_for(lambda: not alive(replica_pid), "the replica to exit")
    assert group_members(supervisor) == []
    assert backend.describe(handle).replica(0).state == ReplicaState.CANCELLED
    assert [(r.stream, r.text) for r in backend.replica_logs(handle, 0, follow=True)] == shown  # ends, and no twice


def test_killed_supervisor_whose_replica_then_ends_is_failed_with_the_reason(tmp_path: Path,
                                                                              backend: LocalBackend) -> None:
    handle = backend.submit(backend.plan(make_spec(tmp_path, n=1, sleep=120)))
    supervisor = handle.processes[0].pid
    wait_for(lambda: (log_dir(handle, 0) / "child.json").exists(), "the supervisor to start its child")
    os.killpg(supervisor, signal.SIGKILL)  # the whole group, e.g. a reboot
    wait_for(lambda: group_members(supervisor) == [], "nothing left of the supervisor's group")
    status = backend.describe(handle).replica(0)
    assert status.state == ReplicaState.FAILED
    assert "without recording an exit code" in (status.reason or "")


# ---------------------------------------------------------------------------------------------- interrupted launches
def test_submit_failure_stops_replicas_already_started(tmp_path: Path, backend: LocalBackend) -> None:
    plan = backend.plan(make_spec(tmp_path, n=3, sleep=120))
    blocker = Path(plan.requests[2]["log_dir"])
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where replica 2's log directory should go")
    handles: list[LocalRunHandle] = []
    with pytest.raises(BackendError, match="could not start local replica 2"):
        backend.submit(plan, on_progress=lambda h: handles.append(h.model_copy(deep=True)))
    assert len(handles[-1].processes) == 2
    for p in handles[-1].processes:
        assert group_members(p.pid) == []
    assert processes_of_run(RUN_ID) == []
    assert not Path(handles[-1].run_dir).exists(), "a rolled-back launch leaves no run directory"


def test_interrupt_mid_submit_stops_the_replicas_already_started(tmp_path: Path, backend: LocalBackend,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    plan = backend.plan(make_spec(tmp_path, n=3, sleep=120))
    spawn = backend._spawn
    started: list[LocalProcess] = []

    def spawn_or_interrupt(request: dict[str, Any]) -> LocalProcess:  # Ctrl-C while replica 2 is being started
        if request["rank"] == 2:
            raise KeyboardInterrupt
        started.append(spawn(request))
        return started[-1]

    monkeypatch.setattr(backend, "_spawn", spawn_or_interrupt)
    reported: list[LocalRunHandle] = []
    with pytest.raises(KeyboardInterrupt):
        backend.submit(plan, on_progress=lambda h: reported.append(h.model_copy(deep=True)))
    assert len(started) == 2
    assert [len(h.processes) for h in reported] == [0, 1, 2], \
        "the handle is reported before the first replica and after each one"
    assert [p.pid for p in reported[-1].processes] == [p.pid for p in started]
    for p in started:
        assert group_members(p.pid) == []
    assert processes_of_run(RUN_ID) == []
    assert not (tmp_path / "logs" / RUN_ID).exists(), "a rolled-back launch leaves no run directory"


LAUNCHER = """
import json, signal, sys
# A launcher in a terminal: hangups at their default even when the suite runs under nohup, which leaves SIGHUP
# ignored in every process it starts (the backend rightly keeps an ignored hangup ignored).
signal.signal(signal.SIGHUP, signal.SIG_DFL)
from diloco.executors.local import LocalBackend, LocalBackendConfig
from diloco.executors.base import LaunchSpec
config, spec = json.loads(sys.argv[1]), LaunchSpec.model_validate_json(sys.argv[2])
backend = LocalBackend(LocalBackendConfig.model_validate(config))
backend.submit(backend.plan(spec), on_progress=lambda h: print(len(h.processes), flush=True))
print("submitted", flush=True)
"""


def launcher(backend: LocalBackend, spec: LaunchSpec) -> subprocess.Popen[str]:
    """``submit`` in its own process, printing how many replicas it has started after each one."""
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, json.dumps(backend.config.model_dump(mode="json")),
                             spec.model_dump_json()], stdout=subprocess.PIPE, text=True)


def read_until(proc: subprocess.Popen[str], started: int) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == str(started):
            return
    raise AssertionError(f"the launcher ended before starting {started} replicas")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_launcher_mid_submit_rolls_back(tmp_path: Path, sig: signal.Signals) -> None:
    backend = LocalBackend(LocalBackendConfig(log_root=str(tmp_path / "logs"), grace_period_s=1.0,
                                              oversubscribe=True))
    run_id = f"sig-{sig.name.lower()}"
    proc = launcher(backend, make_spec(tmp_path, n=40, run_id=run_id, sleep=120, ignore_term=True))
    read_until(proc, 3)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert "submitted" not in out, "the signal must stop the submission, not wait for its end"
    assert proc.returncode != 0
    assert processes_of_run(run_id) == []
    assert not (tmp_path / "logs" / run_id).exists(), "a rolled-back launch leaves no run directory"


def test_a_launcher_killed_mid_submit_leaves_replicas_that_cancel_finds(tmp_path: Path) -> None:
    """``kill -9`` of the launcher: no rollback can run. The replicas it started, recorded or not, are adopted by
    a later ``describe``/``cancel`` through the run id in their environment."""
    backend = LocalBackend(LocalBackendConfig(log_root=str(tmp_path / "logs"), grace_period_s=1.0,
                                              oversubscribe=True))
    run_id = "killed-launcher"
    proc = launcher(backend, make_spec(tmp_path, n=40, run_id=run_id, sleep=120))
    read_until(proc, 3)
    proc.kill()
    proc.wait(timeout=30)
    started = processes_of_run(run_id)
    assert started, "replicas were running when the launcher died"

    handle_file = tmp_path / "logs" / run_id / "handle.json"
    recorded = LocalRunHandle.model_validate_json(handle_file.read_text())
    # As if the launcher had died right after starting its first replica: only the environment scan can find the
    # others (the record and the run directory's handle.json both name one replica).
    lost = LocalRunHandle(**{**recorded.model_dump(), "processes": recorded.processes[:1]})
    handle_file.write_text(lost.model_dump_json())
    status = backend.describe(lost)
    assert status.state != RunState.CANCELLED and not status.terminal
    seen = {r.rank for r in status.replicas if r.state in (ReplicaState.RUNNING, ReplicaState.PENDING)}
    assert seen >= {p.rank for p in recorded.processes}, "every replica the launch started is seen"
    never = [r for r in status.replicas if r.rank not in seen]
    assert never and all(r.state == ReplicaState.CANCELLED and "never started" in (r.reason or "") for r in never)

    backend.cancel(lost)
    backend.wait(lost, timeout_s=30, poll_interval_s=0.1)
    wait_for(lambda: processes_of_run(run_id) == [], "no process of the run", 30)
    assert backend.describe(lost).state == RunState.CANCELLED


def test_a_replica_started_after_its_runs_cancel_starts_nothing(tmp_path: Path) -> None:
    """A launcher killed while it starts a supervisor leaves a process that may run its first line only after a
    ``cancel`` has looked for the run's processes and found none of it. The cancel marks the run first, and a
    supervisor that finds the mark starts nothing: here a start after the cancel (a relaunch of a cancelled
    run's replica, which goes through the same start) ends at once, cancelled, with no process of the run left."""
    backend = LocalBackend(LocalBackendConfig(log_root=str(tmp_path / "logs"), grace_period_s=1.0))
    run_id = f"late-start-{os.getpid()}"
    handle = backend.submit(backend.plan(make_spec(tmp_path, n=2, run_id=run_id, sleep=120)))
    wait_for(lambda: all(r.state == ReplicaState.RUNNING for r in backend.describe(handle).replicas), "both to run")
    backend.cancel(handle)
    assert backend.wait(handle, timeout_s=30, poll_interval_s=0.1).state == RunState.CANCELLED
    wait_for(lambda: processes_of_run(run_id) == [], "the cancelled replicas to be gone", 30)

    handle = backend.relaunch(handle, 1)
    late = backend.wait(handle, timeout_s=30, poll_interval_s=0.1).replica(1)
    assert late.state == ReplicaState.CANCELLED and late.restarts == 1, late
    assert late.reason == "cancelled (not started: its run had been cancelled)", late
    assert not (log_dir(handle, 1) / "child.json").exists()  # no replica process was ever started
    assert processes_of_run(run_id) == []
