"""What the SageMaker end-to-end tests share: the emulator's role and a job's CloudWatch lines. One copy, so the
tests that run jobs on the emulator cannot drift apart (the CLI and the bounded waits are ``support.commands`` and
``support.polling``)."""

from __future__ import annotations

from typing import Any

#: Where SageMaker writes every training job's log streams.
LOG_GROUP = "/aws/sagemaker/TrainingJobs"


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
