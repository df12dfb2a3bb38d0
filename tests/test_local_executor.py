"""The local backend with real processes: env contract, logs, exit codes seen from another process, cancel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.errors import BackendError, ConfigError
from diloco.executors import create_executor
from diloco.executors.base import EntrypointArgs, LaunchSpec, ReplicaHandle, RunState, collect
from diloco.executors.local import LocalProcessExecutor
from diloco.executors.local_supervisor import group_members, proc_stat

TESTS_DIR = str(Path(__file__).parent)


def make_spec(tmp_path: Path, n: int = 2, timeout_s: float | None = None, **behaviour: object) -> LaunchSpec:
    """A spec that runs tests/fake_replica.py (found through PYTHONPATH) with ``behaviour`` as its kwargs."""
    args = EntrypointArgs(rendezvous_uri=f"file://{tmp_path}/store", world_size=n, trainer="fake:train",
                          trainer_kwargs=dict(behaviour))
    return LaunchSpec(run_id="run-test", n_replicas=n, entrypoint="fake_replica", entrypoint_args=args,
                      timeout_s=timeout_s, env={"PYTHONPATH": TESTS_DIR})


def alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st.state != "Z"


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@pytest.fixture
def executor(tmp_path: Path) -> LocalProcessExecutor:
    return LocalProcessExecutor(log_root=str(tmp_path / "logs"), grace_period_s=2.0)


def test_registry_builds_local_and_refuses_backends_not_shipped() -> None:
    assert isinstance(create_executor("local"), LocalProcessExecutor)
    for name in ("sagemaker", "eks"):
        with pytest.raises(ConfigError, match=f"'{name}' is not available in this version yet"):
            create_executor(name)
    with pytest.raises(ConfigError, match=r"must be one of local, sagemaker, eks \(got 'ec2'\)"):
        create_executor("ec2")


def test_plan_is_pure_and_lists_only_added_env(tmp_path: Path, executor: LocalProcessExecutor) -> None:
    environ_before = dict(os.environ)
    plan = executor.plan(make_spec(tmp_path, n=3))
    assert os.environ == environ_before
    assert not (tmp_path / "logs").exists()  # nothing created
    assert [r.rank for r in plan.replicas] == [0, 1, 2]
    req = plan.replicas[2].request
    assert req["argv"][:3] == [sys.executable, "-m", "fake_replica"]
    assert "--rendezvous" in req["argv"] and f"file://{tmp_path}/store" in req["argv"]
    env = req["env"]
    assert env["DILOCO_RUN_ID"] == "run-test"
    assert env["REPLICA_RANK"] == "2"
    assert env["WORLD_SIZE"] == "3"
    assert env["RENDEZVOUS_URI"] == f"file://{tmp_path}/store"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert set(env) <= {"DILOCO_RUN_ID", "REPLICA_RANK", "WORLD_SIZE", "RENDEZVOUS_URI", "PYTHONUNBUFFERED",
                        "OMP_NUM_THREADS", "PYTHONPATH"}
    assert req["cwd"] == os.getcwd()
    assert req["log_dir"] == str(tmp_path / "logs" / "run-test" / "logs" / "rank_2")


def test_replicas_run_in_own_groups_with_env_contract_and_logs(tmp_path: Path,
                                                               executor: LocalProcessExecutor) -> None:
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    handles = executor.submit(executor.plan(make_spec(tmp_path, n=2, lines=3, env_out=str(seen_dir))))
    results = collect(executor, handles, timeout=30, poll_interval_s=0.05)
    assert [r.status.state for r in results] == [RunState.SUCCEEDED, RunState.SUCCEEDED]
    assert [r.status.exit_code for r in results] == [0, 0]

    for rank, handle in enumerate(handles):
        seen = json.loads((seen_dir / f"rank_{rank}.json").read_text())
        assert seen["env"]["REPLICA_RANK"] == str(rank)
        assert seen["env"]["WORLD_SIZE"] == "2"
        assert seen["env"]["DILOCO_RUN_ID"] == "run-test"
        assert seen["env"]["RENDEZVOUS_URI"] == f"file://{tmp_path}/store"
        assert seen["env"]["PYTHONUNBUFFERED"] == "1"
        # its own process group, led by its supervisor, not ours
        assert seen["pgid"] == handle.data["pid"] != os.getpgrp()

        log_dir = Path(handle.data["log_dir"])
        assert (log_dir / "stdout.log").read_text().splitlines() == [f"rank {rank} line {i}" for i in range(3)]
        assert "hello on stderr" in (log_dir / "stderr.log").read_text()
        combined = (log_dir / "combined.log").read_text().splitlines()
        stamps = [float(line.split(" ", 2)[0]) for line in combined]
        assert stamps == sorted(stamps) and len(combined) == 4
        assert [line.split(" ", 2)[1] for line in combined].count("err") == 1
        texts = list(executor.stream_logs(handle))
        assert [t for t in texts if "line" in t] == [f"rank {rank} line {i}" for i in range(3)]
        assert len(texts) == 4


def test_failed_replica_reports_exit_code_and_stderr(tmp_path: Path, executor: LocalProcessExecutor) -> None:
    handles = executor.submit(executor.plan(make_spec(tmp_path, n=2, fail_rank=1, fail_exit=3)))
    results = collect(executor, handles, timeout=30, poll_interval_s=0.05)
    ok, bad = (r.status for r in results)
    assert ok.state == RunState.SUCCEEDED
    assert bad.state == RunState.FAILED
    assert bad.exit_code == 3
    assert bad.reason == "exited with code 3"
    assert executor.stderr_tail(handles[1])[-1] == "rank 1: injected failure"


def test_exit_codes_are_readable_from_another_process(tmp_path: Path, executor: LocalProcessExecutor) -> None:
    handles = executor.submit(executor.plan(make_spec(tmp_path, n=2, fail_rank=0, fail_exit=5)))
    collect(executor, handles, timeout=30, poll_interval_s=0.05)
    script = (
        "import json, sys\n"
        "from diloco.executors.base import ReplicaHandle\n"
        "from diloco.executors.local import LocalProcessExecutor\n"
        "ex = LocalProcessExecutor()\n"
        "for raw in json.loads(sys.stdin.read()):\n"
        "    s = ex.poll(ReplicaHandle.model_validate(raw))\n"
        "    print(s.rank, s.state.value, s.exit_code)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], input=json.dumps([h.model_dump() for h in handles]),
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.splitlines() == ["0 failed 5", "1 succeeded 0"]


def test_cancel_kills_the_whole_group_even_if_sigterm_is_ignored(tmp_path: Path) -> None:
    executor = LocalProcessExecutor(log_root=str(tmp_path / "logs"), grace_period_s=1.0)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    handles = executor.submit(executor.plan(make_spec(tmp_path, n=2, sleep=120, spawn_child=True,
                                                      ignore_term=True, pid_out=str(pid_dir))))
    wait_for(lambda: len(list(pid_dir.iterdir())) == 2)
    grandchildren = [int(p.read_text()) for p in pid_dir.iterdir()]
    assert all(alive(pid) for pid in grandchildren)
    assert all(executor.poll(h).state == RunState.RUNNING for h in handles)

    executor.cancel_many(handles)

    for h in handles:
        assert group_members(h.data["pid"]) == []  # nothing of the group is left
        status = executor.poll(h)
        assert status.state == RunState.CANCELLED
    assert not any(alive(pid) for pid in grandchildren)
    executor.cancel(handles[0])  # idempotent
    assert executor.poll(handles[0]).state == RunState.CANCELLED


def test_cancel_with_sigterm_records_the_exit(tmp_path: Path, executor: LocalProcessExecutor) -> None:
    handles = executor.submit(executor.plan(make_spec(tmp_path, n=1, sleep=120)))
    wait_for(lambda: "line 2" in (Path(handles[0].data["log_dir"]) / "stdout.log").read_text()
             if (Path(handles[0].data["log_dir"]) / "stdout.log").exists() else False)
    executor.cancel(handles[0])
    status = executor.poll(handles[0])
    assert status.state == RunState.CANCELLED
    assert status.exit_code == 128 + signal.SIGTERM
    assert "SIGTERM" in (status.reason or "")


def test_submit_failure_stops_replicas_already_started(tmp_path: Path, executor: LocalProcessExecutor) -> None:
    spec = make_spec(tmp_path, n=3, sleep=120)
    plan = executor.plan(spec)
    blocker = Path(plan.replicas[2].request["log_dir"])
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where replica 2's log directory should go")
    with pytest.raises(BackendError, match="could not start local replica 2"):
        executor.submit(plan)
    for rank in (0, 1):
        log_dir = Path(plan.replicas[rank].request["log_dir"])
        assert (log_dir / "cancel_requested").exists()
    pids = [int(json.loads((Path(plan.replicas[r].request["log_dir"]) / "child.json").read_text())["pid"])
            for r in (0, 1) if (Path(plan.replicas[r].request["log_dir"]) / "child.json").exists()]
    assert not any(alive(pid) for pid in pids)


def test_recycled_pid_is_never_signalled_or_taken_for_the_replica(tmp_path: Path,
                                                                 executor: LocalProcessExecutor) -> None:
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        st = proc_stat(stranger.pid)
        assert st is not None
        log_dir = tmp_path / "logs" / "ghost"
        log_dir.mkdir(parents=True)
        handle = ReplicaHandle(backend="local", run_id="ghost", rank=0, job_id=str(stranger.pid),
                               data={"pid": stranger.pid, "start_time": st.start_time + 1, "log_dir": str(log_dir)})
        status = executor.poll(handle)
        assert status.state == RunState.FAILED  # not RUNNING: that pid is someone else now
        executor.cancel(handle)
        assert stranger.poll() is None  # and it was not killed
    finally:
        stranger.kill()
        stranger.wait()


def test_timeout_stops_the_replica(tmp_path: Path, executor: LocalProcessExecutor) -> None:
    handles = executor.submit(executor.plan(make_spec(tmp_path, n=1, timeout_s=0.5, sleep=60)))
    (result,) = collect(executor, handles, timeout=30, poll_interval_s=0.05)
    assert result.status.state == RunState.FAILED
    assert "exceeded its time limit of 0.5s" in (result.status.reason or "")
    assert result.status.timed_out


def test_follow_logs_until_the_replica_ends(tmp_path: Path, executor: LocalProcessExecutor) -> None:
    handles = executor.submit(executor.plan(make_spec(tmp_path, n=1, lines=5, line_gap=0.1)))
    records = list(executor.log_records(handles[0], follow=True))
    assert [r.text for r in records if r.stream == "out"] == [f"rank 0 line {i}" for i in range(5)]
    assert executor.poll(handles[0]).state == RunState.SUCCEEDED


def test_killed_supervisor_leaves_a_running_replica_that_cancel_still_stops(tmp_path: Path,
                                                                            executor: LocalProcessExecutor) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    handles = executor.submit(executor.plan(make_spec(tmp_path, n=1, sleep=120, env_out=str(pid_dir))))
    (handle,) = handles
    wait_for(lambda: (pid_dir / "rank_0.json").exists())
    replica_pid = json.loads((pid_dir / "rank_0.json").read_text())["pid"]
    os.kill(handle.data["pid"], signal.SIGKILL)  # the supervisor only, as `kill -9 <pid>` or the OOM killer would
    wait_for(lambda: not alive(handle.data["pid"]))
    assert alive(replica_pid)

    status = executor.poll(handle)  # not "failed" while the replica still trains, and not "running" forever:
    assert status.state == RunState.RUNNING
    assert "supervisor" in (status.reason or "") and "unsupervised" in (status.reason or "")

    executor.cancel(handle)  # it is still ours to stop
    assert not alive(replica_pid)
    assert group_members(handle.data["pid"]) == []
    assert executor.poll(handle).state == RunState.CANCELLED


def test_killed_supervisor_whose_replica_then_ends_is_failed_with_the_reason(tmp_path: Path,
                                                                              executor: LocalProcessExecutor) -> None:
    handles = executor.submit(executor.plan(make_spec(tmp_path, n=1, sleep=120)))
    (handle,) = handles
    wait_for(lambda: (Path(handle.data["log_dir"]) / "child.json").exists())
    os.killpg(handle.data["pid"], signal.SIGKILL)  # the whole group, e.g. a reboot
    wait_for(lambda: group_members(handle.data["pid"]) == [])
    status = executor.poll(handle)
    assert status.state == RunState.FAILED
    assert "without recording an exit code" in (status.reason or "")


def test_interrupt_mid_submit_stops_the_replicas_already_started(tmp_path: Path, executor: LocalProcessExecutor,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    plan = executor.plan(make_spec(tmp_path, n=3, sleep=120))
    spawn = executor._spawn
    started = []

    def spawn_or_interrupt(run_id, replica):  # Ctrl-C arrives while replica 2 is being started
        if replica.rank == 2:
            raise KeyboardInterrupt
        started.append(spawn(run_id, replica))
        return started[-1]

    monkeypatch.setattr(executor, "_spawn", spawn_or_interrupt)
    with pytest.raises(KeyboardInterrupt):
        executor.submit(plan)
    assert len(started) == 2
    for h in started:
        assert group_members(h.data["pid"]) == []
        assert executor.poll(h).state == RunState.CANCELLED


def test_cancel_delivers_exactly_one_sigterm_to_the_replica(tmp_path: Path, executor: LocalProcessExecutor) -> None:
    term_log = tmp_path / "terms"
    handles = executor.submit(executor.plan(make_spec(tmp_path, n=1, sleep=120, term_log=str(term_log))))
    wait_for(lambda: (Path(handles[0].data["log_dir"]) / "child.json").exists())
    time.sleep(0.5)  # the replica has installed its handler
    executor.cancel(handles[0])
    # Only the supervisor's forwarded SIGTERM: a group-wide one would reach the replica a second time, directly
    # from the canceller, and a second SIGTERM can cut the replica's clean shutdown short.
    assert term_log.read_text().splitlines() == [f"SIGTERM from {handles[0].data['pid']}"]
    status = executor.poll(handles[0])
    assert status.state == RunState.CANCELLED and status.exit_code == 143
