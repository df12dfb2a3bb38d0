"""``python -m tests.emulators.sagemaker`` on its own, the way README's "Trying it without an account" uses it.

The emulator runs as a subprocess; the test reads what it prints and runs those lines in other shells exactly as
printed (only ``JOB`` in a knob template becomes a real job's name): the exports, doctor (which must pass with the
printed role, its bucket and its quotas, every row one line), a launch, and the fault knobs over its admin
endpoint (a refused CreateTrainingJob, the job list, a crash). Stopping the emulator leaves no job process.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from diloco.executors.local_supervisor import processes_with_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Printed:
    """What the emulator printed: the variables to export and the commands, in order."""

    env: dict[str, str]
    commands: list[str]

    def command(self, start: str) -> str:
        [found] = [c for c in self.commands if c.startswith(start)]
        return found


def _clean_environment(tmp_path: Path) -> dict[str, str]:
    """This process's environment without anything AWS, so only what the emulator printed can reach a service."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_", "DILOCO_"))}
    return {**env, "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"), "NO_COLOR": "1", "COLUMNS": "200",
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"), "AWS_EC2_METADATA_DISABLED": "true",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


@contextmanager
def standalone(tmp_path: Path) -> Iterator[Printed]:
    """The emulator as README starts it, until the block ends (then SIGTERM, as a Ctrl-C would be)."""
    env = _clean_environment(tmp_path)
    with open(tmp_path / "emulator.err", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tests.emulators.sagemaker", "--port", "0", "--root",
                                 str(tmp_path / "emulator"), "--stop-grace", "2"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        lines: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:  # the text ends with its Ctrl-C line; a crash ends the stream
            lines.append(line.rstrip("\n"))
            if line.startswith("# Ctrl-C"):
                break
        assert lines and lines[-1].startswith("# Ctrl-C"), (lines, (tmp_path / "emulator.err").read_text())
        exports = dict(shlex.split(line)[1].split("=", 1) for line in lines if line.startswith("export "))
        commands = [line for line in lines if line and not line.startswith(("#", "export "))]
        yield Printed(env={**env, **exports, "DILOCO_HOME": str(tmp_path / "home")}, commands=commands)
    finally:
        proc.send_signal(signal.SIGTERM)  # the emulator stops answering and kills every job
        proc.wait(timeout=60)


def shell(command: str, printed: Printed, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, shell=True, executable="/bin/bash", capture_output=True, text=True,
                          env=printed.env, cwd=cwd, timeout=240)


def job_states(printed: Printed) -> dict[str, str]:
    out = shell(printed.command("python -m tests.emulators.sagemaker knob jobs"), printed, REPO)
    assert out.returncode == 0, out.stderr
    return dict(line.split("\t") for line in out.stdout.splitlines())


def test_the_commands_the_emulator_prints_work_as_printed(tmp_path: Path) -> None:
    work = tmp_path / "work"  # a user's empty directory: the launch ships it as the source
    work.mkdir()
    with standalone(tmp_path) as printed:
        run_id = _try_every_printed_command(printed, work)
    assert not processes_with_env("DILOCO_RUN_ID", run_id)  # stopping the emulator killed every job


def _try_every_printed_command(printed: Printed, work: Path) -> str:
    assert {"AWS_ENDPOINT_URL_SAGEMAKER", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_SERVICE_QUOTAS"} <= set(printed.env)
    doctor = shell(printed.command("diloco doctor"), printed, work)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    for row in ("aws credentials", "s3 bucket", "s3 read/write", "sagemaker execution role", "role can reach bucket",
                "training quota"):
        assert re.search(rf"│ {row}\s+│ pass", doctor.stdout), doctor.stdout
    assert "000000000000" in doctor.stdout and "<html" not in doctor.stdout.lower()

    refuse = shell(printed.command("python -m tests.emulators.sagemaker knob refuse-create"), printed, REPO)
    assert refuse.returncode == 0, refuse.stderr
    refused = shell(printed.command("diloco launch"), printed, work)
    assert refused.returncode != 0 and "ResourceLimitExceeded" in refused.stderr, refused.stderr

    launched = shell(printed.command("diloco launch"), printed, work)
    assert launched.returncode == 0, launched.stderr
    run_id = launched.stdout.strip()
    assert "estimated cost:" in launched.stderr and "warning:" not in launched.stderr  # a sagemaker-named bucket
    job = f"{run_id}-r0"
    deadline = time.monotonic() + 180  # the job's bootstrap installs the shipped wheel before it trains
    while job_states(printed).get(job) != "InProgress/Training":
        assert time.monotonic() < deadline, job_states(printed)
        time.sleep(0.5)
    crash_job = printed.command("python -m tests.emulators.sagemaker knob crash JOB")
    crash = shell(crash_job.replace("JOB", job), printed, REPO)
    assert crash.returncode == 0, crash.stderr
    while not job_states(printed)[job].startswith("Failed"):
        assert time.monotonic() < deadline, job_states(printed)
        time.sleep(0.5)
    assert f"{run_id}-r1" in job_states(printed)
    missing = shell(crash_job.replace("JOB", "nope"), printed, REPO)
    assert missing.returncode == 1 and "no training job named 'nope'" in missing.stderr
    return run_id
