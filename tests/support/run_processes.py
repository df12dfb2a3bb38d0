"""The live processes of a run, for tests that prove nothing of it is left behind."""

from __future__ import annotations

from diloco.executors.local_supervisor import processes_with_env


def processes_of(run_id: str) -> list[int]:
    """Pids whose environment names the run: every local replica, supervisor and emulated job's process tree
    carries ``DILOCO_RUN_ID``."""
    return sorted(processes_with_env("DILOCO_RUN_ID", run_id))
