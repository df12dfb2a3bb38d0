"""What the SageMaker end-to-end tests share: the emulator's role and a job's CloudWatch lines. One copy, so the
tests that run jobs on the emulator cannot drift apart (the CLI and the bounded waits are ``support.commands`` and
``support.polling``)."""

from __future__ import annotations

import functools
import os
from typing import Any

#: Where SageMaker writes every training job's log streams.
LOG_GROUP = "/aws/sagemaker/TrainingJobs"


def role(emulator: Any) -> str:
    """An execution role ARN in the emulator's account."""
    return f"arn:aws:iam::{emulator.account_id}:role/diloco-e2e"


def aws_client(service: str) -> Any:
    """A boto3 client of ``service`` for the AWS settings of the environment now (the emulator's endpoints), one
    per settings: a test that polls asks through one client, not a new one (10-20 ms of CPU) per poll."""
    return _client(service, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))


@functools.lru_cache(maxsize=16)
def _client(service: str, settings: tuple[tuple[str, str], ...]) -> Any:
    import boto3

    return boto3.client(service)


def describe(job_name: str) -> dict[str, Any]:
    """``DescribeTrainingJob`` of ``job_name``."""
    return dict(aws_client("sagemaker").describe_training_job(TrainingJobName=job_name))


def log_lines(job_name: str) -> list[str]:
    """Every CloudWatch line of a training job so far (none while its log group or stream does not exist)."""
    logs = aws_client("logs")
    try:
        streams = logs.describe_log_streams(logGroupName=LOG_GROUP, logStreamNamePrefix=f"{job_name}/")["logStreams"]
    except logs.exceptions.ResourceNotFoundException:
        return []
    return [e["message"] for s in streams for e in logs.get_log_events(
        logGroupName=LOG_GROUP, logStreamName=s["logStreamName"], startFromHead=True)["events"]]
