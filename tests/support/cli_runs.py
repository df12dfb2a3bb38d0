"""Real local runs made through the installed ``diloco`` script, for tests of what the read commands print.

``RealRuns`` launches small runs of the ``cli_trainers`` functions (real replica processes, no torch) in their own
``DILOCO_HOME`` and cancels whatever is still going when it is closed, so a test module can share them and leave no
process behind.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from support import commands

TESTS_DIR = str(Path(__file__).resolve().parents[1])


def run_cli(*args: str, home: Path, columns: int | None = None, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
    """``diloco ARGS`` as a user types it (the console script), piped (not a terminal), optionally with ``COLUMNS``."""
    return commands.run_cli(*args, home=home, columns=columns, timeout=timeout, script=True)


class RealRuns:
    """Runs launched through the CLI into ``home``; ``close()`` cancels the ones still going."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self._detached: list[str] = []

    def finished(self, *extra: str) -> str:
        """A run that succeeded (two replicas of ``support.cli_trainers:slow``, two steps), waited for by ``launch``."""
        result = run_cli("launch", "-n", "2", "--trainer", "support.cli_trainers:slow", "--steps", "2", "--sync-every", "1",
                         "-o", "json", *extra, home=self.home)
        assert result.stdout, result.stderr[-2000:]  # exit 1: it writes no final weights to check; it succeeded
        report = json.loads(result.stdout)
        assert report["state"] == "succeeded", result.stderr[-2000:]
        return str(report["run_id"])

    def detached(self, trainer: str, *extra: str) -> str:
        """A run launched with ``--detach`` (still going when this returns); ``close()`` cancels it."""
        result = run_cli("launch", "-n", "2", "--trainer", f"support.cli_trainers:{trainer}", "--steps", "2000",
                         "--sync-every", "1", "--detach", "-o", "json", *extra, home=self.home)
        assert result.returncode == 0, result.stderr[-2000:]
        run_id = str(json.loads(result.stdout)["run_id"])
        self._detached.append(run_id)
        return run_id

    def wait_for_replica_state(self, run_id: str, rank: int, state: str, timeout_s: float = 60.0) -> None:
        """Until ``diloco status`` shows replica ``rank`` in ``state`` (a replica's start takes a moment)."""
        deadline = time.monotonic() + timeout_s
        seen = None
        while time.monotonic() < deadline:
            report = json.loads(run_cli("status", run_id, "-o", "json", home=self.home).stdout)
            seen = report["ranks"][rank]["state"]
            if seen == state:
                return
            time.sleep(0.2)
        raise AssertionError(f"replica {rank} of {run_id} is {seen}, not {state}, after {timeout_s:g}s")

    def close(self) -> None:
        for run_id in self._detached:
            run_cli("cancel", run_id, home=self.home)
