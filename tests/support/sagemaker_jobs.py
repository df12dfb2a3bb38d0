"""What the SageMaker end-to-end tests share: the CLI as a user runs it, the emulator's role, a job's CloudWatch
lines and a bounded wait. One copy, so the tests that run jobs on the emulator cannot drift apart."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.commands import DILOCO_MODULE as DILOCO

#: The CLI as a user runs it, from this interpreter's environment.
LOG_GROUP = "/aws/sagemaker/TrainingJobs"


def cli(*args: str, home: Path, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``diloco ARGS`` in a subprocess with its own ``DILOCO_HOME``, plain output and no debug tracebacks."""
    env = {**os.environ, "DILOCO_HOME": str(home), "NO_COLOR": "1"}
    env.pop("DILOCO_DEBUG", None)
    return subprocess.run([*DILOCO, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def role(emulator: Any) -> str:
    """An execution role ARN in the emulator's account."""
    return f"arn:aws:iam::{emulator.account_id}:role/diloco-e2e"


def log_lines(job_name: str) -> list[str]:
    """Every CloudWatch line of a training job so far (none while its log group or stream does not exist)."""
    import boto3

    logs = boto3.client("logs")
    try:
        streams = logs.describe_log_streams(logGroupName=LOG_GROUP, logStreamNamePrefix=f"{job_name}/")["logStreams"]
    except logs.exceptions.ResourceNotFoundException:
        return []
    return [e["message"] for s in streams for e in logs.get_log_events(
        logGroupName=LOG_GROUP, logStreamName=s["logStreamName"], startFromHead=True)["events"]]


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 90, interval: float = 0.2) -> Any:
    """``predicate()``'s first truthy value, polled until ``timeout``; ``AssertionError`` naming ``what`` after."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")
