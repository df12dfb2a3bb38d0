"""The suite's census of real processes (tests/support/process_census.py) counts what it claims: replica
processes descending from the test's process, by backend, with a second process of one replica as a relaunch."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from support.process_census import _Sampler, summarize


def replica_like(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A process whose command line names the replica entrypoint (as an argument: it only sleeps)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m", "diloco.replica.entrypoint"],
                            env={**os.environ, **env})


def test_replica_processes_are_counted_by_backend_and_a_second_one_of_a_rank_is_a_relaunch() -> None:
    sampler = _Sampler()
    sampler.current = "t"
    started = [
        replica_like({"DILOCO_RUN_ID": "run-a", "REPLICA_RANK": "0"}),
        replica_like({"DILOCO_RUN_ID": "run-a", "REPLICA_RANK": "1"}),
        replica_like({"TRAINING_JOB_NAME": "run-b-r0", "DILOCO_RUN_ID": "run-b", "REPLICA_RANK": "0"}),
    ]
    relaunched = None
    try:
        deadline = time.monotonic() + 60
        while len(sampler.found["t"]) < 3 and time.monotonic() < deadline:
            sampler.scan()
        started[0].kill()
        started[0].wait()
        relaunched = replica_like({"DILOCO_RUN_ID": "run-a", "REPLICA_RANK": "0"})
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
