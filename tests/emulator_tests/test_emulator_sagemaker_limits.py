"""The SageMaker emulator's account-level behaviour, through real boto3: a job history that a filtered listing
must walk, and the request-rate quotas of SageMaker and CloudWatch Logs.

Why: the backend's polling and log following are proven against these, so they must behave as the service does
where a client can tell (sources in tests/emulators/sagemaker.py and tests/emulators/rate_limits.py). Rate
assertions are invariants of a token bucket (never more admitted than ``burst + rate * elapsed``), not speeds.
No job process is started here: the history alone is enough.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.rate_limits import LOGS_QUOTAS, SAGEMAKER_QUOTAS, TokenBucket
from emulators.sagemaker import SageMakerEmulator

HISTORY = 250
LOG_GROUP = "/aws/sagemaker/TrainingJobs"


@pytest.fixture
def emulator(aws_env: str, s3_bucket: str, tmp_path: Path) -> Iterator[SageMakerEmulator]:
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", history=HISTORY) as emu:
        yield emu


def client(service: str, endpoint: str, *, attempts: int) -> Any:
    """A boto3 client of its own session (a separate client, as another process would have)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(service, endpoint_url=endpoint,
                                          config=Config(retries={"mode": "standard", "total_max_attempts": attempts}))


def burst_of_calls(calls: list[Any], count: int) -> tuple[int, list[tuple[str, str, int]], float]:
    """Make ``count`` calls as fast as they go, cycling through ``calls``; (admitted, refusals, seconds taken)."""
    from botocore.exceptions import ClientError

    admitted, refused = 0, []
    start = time.monotonic()
    for i in range(count):
        try:
            calls[i % len(calls)]()
            admitted += 1
        except ClientError as exc:
            err, meta = exc.response["Error"], exc.response["ResponseMetadata"]
            refused.append((err["Code"], err["Message"], meta["HTTPStatusCode"]))
    return admitted, refused, time.monotonic() - start


# ---------------------------------------------------------------------------------------------------- listing
def test_name_contains_is_applied_after_the_page_is_chosen(emulator: SageMakerEmulator) -> None:
    sm = client("sagemaker", emulator.url, attempts=20)
    oldest = sm.list_training_jobs(SortOrder="Ascending", MaxResults=1)["TrainingJobSummaries"][0]
    assert oldest["TrainingJobStatus"] in ("Completed", "Failed", "Stopped")
    pages = list(sm.get_paginator("list_training_jobs").paginate(
        NameContains=oldest["TrainingJobName"], PaginationConfig={"PageSize": 100}))
    # newest first: the account's oldest job is on the last of ceil(250/100) pages, the others come back empty
    assert [len(p["TrainingJobSummaries"]) for p in pages] == [0, 0, 1]
    assert ["NextToken" in p for p in pages] == [True, True, False]
    assert pages[2]["TrainingJobSummaries"][0]["TrainingJobName"] == oldest["TrainingJobName"]

    first = sm.list_training_jobs(StatusEquals="Failed", MaxResults=10)
    newest_ten = sm.list_training_jobs(MaxResults=10)["TrainingJobSummaries"]
    assert first["TrainingJobSummaries"] == [s for s in newest_ten if s["TrainingJobStatus"] == "Failed"]
    assert "NextToken" in first  # filtered within the first 10, the 240 others still to walk


def test_older_jobs_are_described_and_cannot_be_stopped(emulator: SageMakerEmulator) -> None:
    from botocore.exceptions import ClientError

    sm = client("sagemaker", emulator.url, attempts=20)
    newest = sm.list_training_jobs(MaxResults=1)["TrainingJobSummaries"][0]
    desc = sm.describe_training_job(TrainingJobName=newest["TrainingJobName"])
    assert desc["TrainingJobArn"] == newest["TrainingJobArn"] and desc["CreationTime"] == newest["CreationTime"]
    assert desc["TrainingJobStatus"] == newest["TrainingJobStatus"] and desc["CreationTime"].timestamp() < time.time()
    with pytest.raises(ClientError) as info:
        sm.stop_training_job(TrainingJobName=newest["TrainingJobName"])
    assert info.value.response["Error"]["Code"] == "ValidationException"
    assert f"in status {newest['TrainingJobStatus']}" in info.value.response["Error"]["Message"]


# ---------------------------------------------------------------------------------------------------- rates
def test_a_token_bucket_admits_its_burst_then_its_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(2.0, 2.0, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    now[0] += 0.5  # one token back
    assert [bucket.take(), bucket.take()] == [True, False]
    now[0] += 60.0  # never more than the burst
    assert [bucket.take() for _ in range(3)] == [True, True, False]


def test_list_training_jobs_is_limited_per_account_across_clients(emulator: SageMakerEmulator) -> None:
    one, other = (client("sagemaker", emulator.url, attempts=1) for _ in range(2))
    quota = SAGEMAKER_QUOTAS["ListTrainingJobs"]
    admitted, refused, took = burst_of_calls([lambda: one.list_training_jobs(MaxResults=1),
                                              lambda: other.list_training_jobs(MaxResults=1)], 12)
    assert admitted <= quota.burst + quota.rate_per_s * took
    assert admitted + len(refused) == 12
    assert set(refused) <= {("ThrottlingException", "Rate exceeded", 400)}
    calls = emulator.operation_calls("ListTrainingJobs")
    assert len(calls) == 12 and sum(c.error == "ThrottlingException" for c in calls) == len(refused)


def test_describe_training_job_has_its_own_bucket(emulator: SageMakerEmulator) -> None:
    sm = client("sagemaker", emulator.url, attempts=1)
    name = sm.list_training_jobs(MaxResults=1)["TrainingJobSummaries"][0]["TrainingJobName"]
    quota = SAGEMAKER_QUOTAS["DescribeTrainingJob"]
    admitted, refused, took = burst_of_calls([lambda: sm.describe_training_job(TrainingJobName=name)], 40)
    assert admitted <= quota.burst + quota.rate_per_s * took and admitted >= 1
    assert set(refused) <= {("ThrottlingException", "Rate exceeded", 400)}


def test_cloudwatch_logs_reads_go_through_a_front_with_the_services_quotas(
    emulator: SageMakerEmulator, aws_env: str
) -> None:
    writer = client("logs", aws_env, attempts=1)  # the jobs' side: moto itself
    writer.create_log_group(logGroupName=LOG_GROUP)
    writer.create_log_stream(logGroupName=LOG_GROUP, logStreamName="job/algo-1-1")
    writer.put_log_events(logGroupName=LOG_GROUP, logStreamName="job/algo-1-1",
                          logEvents=[{"timestamp": int(time.time() * 1000), "message": "hello"}])
    assert emulator.environment()["AWS_ENDPOINT_URL_CLOUDWATCH_LOGS"] == emulator.logs_url

    reader = client("logs", emulator.logs_url, attempts=1)
    began = time.monotonic()
    events = reader.get_log_events(logGroupName=LOG_GROUP, logStreamName="job/algo-1-1", startFromHead=True)
    assert [e["message"] for e in events["events"]] == ["hello"]  # forwarded to moto and back

    quota = LOGS_QUOTAS["GetLogEvents"]
    admitted, refused, _ = burst_of_calls([lambda: reader.get_log_events(
        logGroupName=LOG_GROUP, logStreamName="job/algo-1-1", startFromHead=True)], 20)
    assert admitted + 1 <= quota.burst + quota.rate_per_s * (time.monotonic() - began)  # with the read above
    assert set(refused) <= {("ThrottlingException", "Rate exceeded", 400)}
    gets = [c for c in emulator.logs_calls if c.operation == "GetLogEvents"]
    assert len(gets) == 21 and sum(c.error == "ThrottlingException" for c in gets) == len(refused)

    streams = LOGS_QUOTAS["DescribeLogStreams"]
    admitted, refused, took = burst_of_calls([lambda: reader.describe_log_streams(
        logGroupName=LOG_GROUP, logStreamNamePrefix="job/")], 30)
    assert admitted <= streams.burst + streams.rate_per_s * took
    assert set(refused) <= {("ThrottlingException", "Rate exceeded", 400)}


def test_without_rate_limits_every_call_is_answered(aws_env: str, s3_bucket: str, tmp_path: Path) -> None:
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sm", history=3, rate_limits=False) as emu:
        sm = client("sagemaker", emu.url, attempts=1)
        admitted, refused, _ = burst_of_calls([lambda: sm.list_training_jobs(MaxResults=1)], 12)
        assert (admitted, refused) == (12, [])
