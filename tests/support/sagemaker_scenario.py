"""A watched SageMaker launch, as a user runs it in four shells: ``diloco launch`` waiting on the run, then
``diloco status``, ``diloco logs -f`` and finally ``diloco cancel`` from other shells, all real CLI processes.

Shared by tests/test_sagemaker_watched_launch.py (which asserts what the user sees) and
bench/sagemaker_api_rates.py (which prints the requests per minute each operation got, next to its quota). The
emulator is the caller's (with its history and rate limits); its jobs run ``watched_trainer`` from a "ready image"
(``image_interpreter``: this interpreter with the tests directory on its path), so no code is shipped and no
replica imports torch: eight replicas stay cheap on two cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.polling import wait_for

TESTS_DIR = Path(__file__).resolve().parents[1]
READY_IMAGE = "diloco-ready-image:test"


@dataclass
class Shell:
    """One command as a user ran it: its argv, exit status and output."""

    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str


@dataclass
class WatchedRun:
    run_id: str
    shells: dict[str, Shell] = field(default_factory=dict)
    began: float = 0.0  # unix time the launch started
    ended: float = 0.0  # unix time the last command ended
    phases: dict[str, float] = field(default_factory=dict)  # seconds from the start to each step

    @property
    def seconds(self) -> float:
        return max(1e-9, self.ended - self.began)


def image_interpreter(directory: Path) -> str:
    """An interpreter standing for a ready image that holds diloco and the tests' trainers."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "image-python"
    path.write_text(f'#!/bin/sh\nPYTHONPATH="{TESTS_DIR}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    path.chmod(0o755)
    return str(path)


def cli_env(emulator: Any, home: Path) -> dict[str, str]:
    """A shell that reaches the emulator (SageMaker, the Logs front, S3) the standard way."""
    env = {**os.environ, **emulator.environment(), "DILOCO_HOME": str(home), "NO_COLOR": "1"}
    env.pop("DILOCO_DEBUG", None)
    return env


def run_watched_launch(emulator: Any, *, bucket: str, home: Path, workdir: Path, replicas: int = 8,
                       patience_s: float = 180.0) -> WatchedRun:
    """Launch ``replicas`` jobs and wait on them (shell 1); once every job trains, ``status`` (shell 2), then
    ``logs -f`` (shell 3) until it has shown every rank, then ``cancel`` (shell 4); wait for every command to end."""
    from diloco.launcher.runs import RunRegistry

    env = cli_env(emulator, home)
    cli = [sys.executable, "-m", "diloco.cli.main"]
    role = f"arn:aws:iam::{emulator.account_id}:role/diloco-watched"
    launch_argv = [*cli, "launch", "--backend", "sagemaker", "--replicas", str(replicas), "--role", role,
                   "--region", emulator.default_region, "--image", READY_IMAGE,
                   "--rendezvous", f"s3://{bucket}/watched/{{run_id}}", "--trainer", "support.watched_trainer:train"]
    workdir.mkdir(parents=True, exist_ok=True)
    files = {name: (workdir / f"{name}.out", workdir / f"{name}.err") for name in ("launch", "logs")}
    handles = {name: (open(out, "w"), open(err, "w")) for name, (out, err) in files.items()}
    began = time.time()
    launch = subprocess.Popen(launch_argv, env=env, cwd=TESTS_DIR, stdout=handles["launch"][0],
                              stderr=handles["launch"][1], text=True)
    follow: subprocess.Popen[str] | None = None
    shells: dict[str, Shell] = {}
    phases: dict[str, float] = {}

    def reached(step: str) -> None:
        phases[step] = round(time.time() - began, 1)
    try:
        def recorded() -> Any:
            records = [r for r in RunRegistry(home).list()
                       if r.handle and len(r.handle.get("job_names", [])) == replicas]
            return records[0] if records else None

        alive = lambda: launch.poll() is None  # noqa: E731
        record = wait_for(recorded, "the launch to create every job", patience_s, alive=alive)
        reached("jobs created")
        names = record.handle["job_names"]
        wait_for(lambda: all(emulator.job(n).secondary == "Training" for n in names), "every job to train",
                 patience_s, alive=alive)
        reached("every job training")
        shells["status"] = _run([*cli, "status", record.run_id], env, patience_s)
        reached("status shown")
        follow = subprocess.Popen([*cli, "logs", record.run_id, "-f"], env=env, cwd=TESTS_DIR,
                                  stdout=handles["logs"][0], stderr=handles["logs"][1], text=True)
        every_rank = lambda: all(f"[r{r}] rank {r} tick" in files["logs"][0].read_text()  # noqa: E731
                                 for r in range(replicas))
        wait_for(every_rank, "logs -f to show every rank", patience_s, alive=alive)
        reached("logs -f showed every rank")
        shells["cancel"] = _run([*cli, "cancel", record.run_id], env, patience_s)
        reached("cancel returned")
        launch.wait(timeout=patience_s)
        reached("launch ended")
        follow.wait(timeout=patience_s)
        reached("logs -f ended")
    finally:
        for proc in (launch, follow):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for out, err in handles.values():
            out.close()
            err.close()
    shells["launch"] = Shell(launch_argv, launch.returncode, *(p.read_text() for p in files["launch"]))
    shells["logs"] = Shell([*cli, "logs", "-f"], follow.returncode if follow else None,
                           *(p.read_text() for p in files["logs"]))
    ordered = {name: shells[name] for name in ("launch", "status", "logs", "cancel") if name in shells}
    return WatchedRun(run_id=record.run_id, shells=ordered, began=began, ended=time.time(), phases=phases)


def _run(argv: list[str], env: Mapping[str, str], timeout_s: float) -> Shell:
    done = subprocess.run(argv, env=dict(env), cwd=TESTS_DIR, capture_output=True, text=True, timeout=timeout_s)
    return Shell(argv, done.returncode, done.stdout, done.stderr)


# ---------------------------------------------------------------------------------------------------- rates
def rate_rows(calls: Sequence[Any], began: float, ended: float, quota: Callable[[str], Any],
              always: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Per operation called (and each of ``always``, called or not): calls, throttled, mean requests per minute
    over the run, the busiest second, and its quota."""
    minutes = max(1e-9, ended - began) / 60.0
    by_op: dict[str, list[Any]] = {operation: [] for operation in always}
    for call in calls:
        if began <= call.at <= ended:
            by_op.setdefault(call.operation, []).append(call)
    rows = []
    for operation, made in sorted(by_op.items()):
        per_second = Counter(int(c.at) for c in made)
        q = quota(operation)
        rows.append({"operation": operation, "calls": len(made),
                     "throttled": sum(1 for c in made if c.error == "ThrottlingException"),
                     "per minute": round(len(made) / minutes, 1), "busiest second": max(per_second.values(), default=0),
                     "limit per minute": round(q.rate_per_s * 60) if q else None,
                     "limit per second": q.rate_per_s if q else None, "limit source": q.source if q else "none"})
    return rows
