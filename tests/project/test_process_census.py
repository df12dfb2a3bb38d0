"""The suite's census of real processes (tests/support/process_census.py) counts what it claims: replica
processes descending from the test's process, by backend, with a second process of one replica as a relaunch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from support.process_census import _runs_a_replica, _Sampler, summarize


def replica_like(folder: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A process whose program is a ``diloco_bootstrap.py`` (this one only sleeps), as a job's first process is."""
    script = folder / "diloco_bootstrap.py"
    script.write_text("import time\ntime.sleep(30)\n")
    return subprocess.Popen([sys.executable, str(script), "-m", "diloco.replica.entrypoint"],
                            env={**os.environ, **env})


def test_a_supervisor_naming_the_entrypoint_is_not_a_replica_and_the_interpreters_flags_are_skipped() -> None:
    assert _runs_a_replica(["python", "-u", "-m", "diloco.replica.entrypoint", "--spec", "x"])
    assert _runs_a_replica(["python", "/opt/ml/input/data/code/diloco_bootstrap.py", "-m", "x"])
    assert not _runs_a_replica(["python", "-m", "diloco.executors.local_supervisor", "--", "python", "-m",
                                "diloco.replica.entrypoint"])
    assert not _runs_a_replica(["python", "-c", "pass", "diloco_bootstrap.py"])


def test_replica_processes_are_counted_by_backend_and_a_second_one_of_a_rank_is_a_relaunch(tmp_path: Path) -> None:
    sampler = _Sampler()
    sampler.current = "t"
    started = [
        replica_like(tmp_path, {"DILOCO_RUN_ID": "run-a", "REPLICA_RANK": "0"}),
        replica_like(tmp_path, {"DILOCO_RUN_ID": "run-a", "REPLICA_RANK": "1"}),
        replica_like(tmp_path, {"TRAINING_JOB_NAME": "run-b-r0", "DILOCO_RUN_ID": "run-b", "REPLICA_RANK": "0"}),
    ]
    relaunched = None
    try:
        deadline = time.monotonic() + 60
        while len(sampler.found["t"]) < 3 and time.monotonic() < deadline:
            sampler.scan()
        started[0].kill()
        started[0].wait()
        relaunched = replica_like(tmp_path, {"DILOCO_RUN_ID": "run-a", "REPLICA_RANK": "0"})
        while len(sampler.found["t"]) < 4 and time.monotonic() < deadline:
            sampler.scan()
        unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        sampler.scan()
        unrelated.kill()
        unrelated.wait()
    finally:
        sampler.stop.set()
        for proc in [*started, *([relaunched] if relaunched else [])]:
            proc.kill()
            proc.wait()
    keys = sampler.take("t")
    assert sorted(keys) == sorted([("local", "run-a", "0", ""), ("local", "run-a", "1", ""),
                                   ("local", "run-a", "0", ""), ("sagemaker", "run-b", "0", "")])
    census = summarize({"t": [list(k) for k in keys], "u": [["kubernetes", "run-c", "0", ""]]})
    assert census == {
        "local": {"tests_starting_replicas": 1, "replica_processes": 3, "tests_with_a_relaunch": 1},
        "sagemaker": {"tests_starting_replicas": 1, "replica_processes": 1, "tests_with_a_relaunch": 0},
        "kubernetes": {"tests_starting_replicas": 1, "replica_processes": 1, "tests_with_a_relaunch": 0},
    }
