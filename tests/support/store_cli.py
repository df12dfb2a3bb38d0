"""Helpers for the store-side CLI tests (collect's output, compaction, read commands on finished runs, plot): the
real ``diloco`` executable in a subprocess, as a user types it, with its own ``DILOCO_HOME``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.commands import DILOCO_SCRIPT as DILOCO

TESTS_DIR = str(Path(__file__).resolve().parents[1])


def run_cli(*args: str, home: Path, cwd: str = TESTS_DIR, python_flags: str = "",
            timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """``diloco ARGS`` in a subprocess (``python_flags``: e.g. ``-X importtime``, through ``PYTHONOPTIONS``-free
    means: the interpreter is started explicitly with them)."""
    env = {**os.environ, "DILOCO_HOME": str(home), "NO_COLOR": "1", "COLUMNS": "200"}
    env.pop("DILOCO_DEBUG", None)
    command = [sys.executable, *python_flags.split(), DILOCO, *args] if python_flags else [DILOCO, *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout_s)


def launch_small_run(home: Path, *extra: str, replicas: int = 2, steps: int = 4, sync_every: int = 2,
                     trainer: str = "support.byo_trainer:train") -> str:
    """A finished run of the README's own trainer (``support.byo_trainer:train``), or of ``trainer``: launch
    waits, prints the summary and keeps one copy of the agreed weights. Returns the run id."""
    launched = run_cli("launch", "-n", str(replicas), "-b", "local", "--trainer", trainer,
                       "--steps", str(steps), "--sync-every", str(sync_every), *extra, "-o", "json", home=home)
    assert launched.returncode == 0, launched.stderr
    return str(json.loads(launched.stdout)["run_id"])


def store_dir(home: Path, run_id: str) -> Path:
    """The default ``file://`` rendezvous of a local run."""
    return home / "runs" / run_id / "store"
