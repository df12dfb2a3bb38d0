"""The SageMaker emulator, driven only through real boto3 (``AWS_ENDPOINT_URL_SAGEMAKER``), against moto's S3/Logs.

Why these tests: the SageMaker backend is proven against this emulator, so the emulator itself must be shown to
behave like the service where a backend can tell: the wire errors and messages, the status machine, what the
job process gets, what lands in S3 and CloudWatch Logs, and the faults (throttling, quota, spot interruption).
Jobs are tiny ``python -c`` programs so the whole file stays quick.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.sagemaker import SageMakerEmulator

REPO = Path(__file__).resolve().parents[2]
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
TERMINAL = ("Completed", "Failed", "Stopped")


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture
def emulator(aws_env: str, s3_bucket: str, tmp_path: Path) -> Iterator[SageMakerEmulator]:
    """An emulator on the test's clean moto, with a short stop grace and quick checkpoint/log flushes."""
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=1.0,
                           checkpoint_sync_s=0.2, log_flush_s=0.1, restart_delay_s=0.1) as emu:
        yield emu


@pytest.fixture
def sm(emulator: SageMakerEmulator, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A plain boto3 SageMaker client that finds the emulator the standard way: AWS_ENDPOINT_URL_SAGEMAKER."""
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emulator.url)
    client = boto3.client("sagemaker")
    assert client.meta.endpoint_url == emulator.url
    return client


@pytest.fixture
def s3(aws_env: str) -> Any:
    import boto3

    return boto3.client("s3")


@pytest.fixture
def logs(aws_env: str) -> Any:
    import boto3

    return boto3.client("logs")


@pytest.fixture
def job(emulator: SageMakerEmulator, s3: Any, s3_bucket: str) -> Callable[..., dict[str, Any]]:
    """``job(name, code, **overrides)``: a CreateTrainingJob request running the Python program ``code``.

    The program travels as real code does: uploaded to S3 and delivered as the ``code`` input channel (each
    ContainerArguments entry is limited to 256 characters, so programs cannot ride in ``python -c``)."""

    def make(name: str, code: str, **overrides: Any) -> dict[str, Any]:
        s3.put_object(Bucket=s3_bucket, Key=f"code/{name}/job.py", Body=code.encode())
        channel = {"ChannelName": "code", "DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": f"s3://{s3_bucket}/code/{name}/"}}}
        request: dict[str, Any] = {
            "TrainingJobName": name,
            "RoleArn": f"arn:aws:iam::{emulator.account_id}:role/diloco-test",
            "AlgorithmSpecification": {"TrainingImage": "training-image:latest", "TrainingInputMode": "File",
                                       "ContainerEntrypoint": ["python"],
                                       "ContainerArguments": ["/opt/ml/input/data/code/job.py"]},
            "OutputDataConfig": {"S3OutputPath": f"s3://{s3_bucket}/output"},
            "ResourceConfig": {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 5},
            "StoppingCondition": {"MaxRuntimeInSeconds": 120},
        }
        request.update(overrides)
        request["InputDataConfig"] = [channel, *request.get("InputDataConfig", [])]
        return request

    return make


# ---------------------------------------------------------------------------------------------------- helpers
def wait_for(sm: Any, name: str, done: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        desc = sm.describe_training_job(TrainingJobName=name)
        if done(desc):
            return desc
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}: still {desc['TrainingJobStatus']}/{desc['SecondaryStatus']}")
        time.sleep(0.05)


def wait_terminal(sm: Any, name: str, timeout: float = 60) -> dict[str, Any]:
    return wait_for(sm, name, lambda d: d["TrainingJobStatus"] in TERMINAL, timeout)


def job_log_lines(logs: Any, name: str) -> list[str]:
    """Every line of every stream of the job, streams in name (= start) order; [] before the group exists."""
    try:
        streams = logs.describe_log_streams(logGroupName=LOG_GROUP, logStreamNamePrefix=f"{name}/")["logStreams"]
    except logs.exceptions.ResourceNotFoundException:
        return []
    lines: list[str] = []
    for stream in sorted(s["logStreamName"] for s in streams):
        lines += [e["message"] for e in read_stream(logs, stream)]
    return lines


def read_stream(logs: Any, stream: str) -> list[dict[str, Any]]:
    """GetLogEvents from the head until nextForwardToken repeats (the service's end-of-stream signal)."""
    events: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamName": stream, "startFromHead": True}
        if token:
            kwargs["nextToken"] = token
        page = logs.get_log_events(**kwargs)
        events += page["events"]
        if page["nextForwardToken"] == token:
            return events
        token = page["nextForwardToken"]


def wait_log_line(logs: Any, name: str, text: str, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = job_log_lines(logs, name)
        if any(text in line for line in lines):
            return lines
        time.sleep(0.05)
    raise AssertionError(f"{name}: no log line containing {text!r}")


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (reaped, or a zombie that will never run again)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def transitions(desc: dict[str, Any]) -> list[str]:
    return [t["Status"] for t in desc["SecondaryStatusTransitions"]]


def error_of(call: Callable[[], Any]) -> tuple[str, str]:
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as info:
        call()
    return info.value.response["Error"]["Code"], info.value.response["Error"]["Message"]


# ---------------------------------------------------------------------------------------------------- tests
WRITE_MODEL = """
import json, os, sys
opt_ml = os.environ["OPT_ML"]
data = open(os.path.join(opt_ml, "input/data/train/sub/a.txt")).read()
print("read:", data)
print("env:", json.dumps(sorted(os.environ)))
print("cwd-is-root:", os.getcwd() == os.path.dirname(os.path.dirname(opt_ml)))
print("to stderr", file=sys.stderr)
open(os.path.join(opt_ml, "model", "weights.txt"), "w").write("trained on " + data)
"""


def test_completed_job_reads_its_channel_writes_logs_and_uploads_the_model(
    sm: Any, s3: Any, logs: Any, s3_bucket: str, job: Callable[..., dict[str, Any]]
) -> None:
    s3.put_object(Bucket=s3_bucket, Key="inputs/train/sub/a.txt", Body=b"hello")
    request = job("completes-1", WRITE_MODEL, Environment={"OPT_ML": "/opt/ml", "RUN": "r1"},
                  InputDataConfig=[{"ChannelName": "train", "DataSource": {"S3DataSource": {
                      "S3DataType": "S3Prefix", "S3Uri": f"s3://{s3_bucket}/inputs/train"}}}],
                  Tags=[{"Key": "diloco:run", "Value": "r1"}])
    arn = sm.create_training_job(**request)["TrainingJobArn"]
    assert arn.endswith(":training-job/completes-1") and arn.startswith("arn:aws:sagemaker:us-east-1:")

    desc = wait_terminal(sm, "completes-1")
    assert (desc["TrainingJobStatus"], desc["SecondaryStatus"]) == ("Completed", "Completed"), desc.get("FailureReason")
    assert transitions(desc) == ["Starting", "Downloading", "Training", "Uploading", "Completed"]
    assert desc["Environment"] == {"OPT_ML": "/opt/ml", "RUN": "r1"}  # the request as given, unmapped
    assert desc["TrainingEndTime"] >= desc["TrainingStartTime"] >= desc["CreationTime"]
    assert desc["BillableTimeInSeconds"] == desc["TrainingTimeInSeconds"] >= 1
    assert "FailureReason" not in desc

    uri = desc["ModelArtifacts"]["S3ModelArtifacts"]
    assert uri == f"s3://{s3_bucket}/output/completes-1/output/model.tar.gz"
    blob = s3.get_object(Bucket=s3_bucket, Key="output/completes-1/output/model.tar.gz")["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        assert tar.getnames() == ["weights.txt"]
        assert tar.extractfile("weights.txt").read() == b"trained on hello"  # type: ignore[union-attr]

    lines = job_log_lines(logs, "completes-1")
    assert "read: hello" in lines and "to stderr" in lines and "cwd-is-root: True" in lines
    env_line = next(line for line in lines if line.startswith("env: "))
    names = set(json.loads(env_line[5:]))
    assert {"TRAINING_JOB_NAME", "TRAINING_JOB_ARN", "OPT_ML", "RUN", "AWS_ENDPOINT_URL", "AWS_REGION"} <= names
    assert not [n for n in names if n.startswith("SM_")], "SM_* variables come from the toolkit, never the platform"
    assert "AWS_ENDPOINT_URL_SAGEMAKER" not in names and "PWD" not in names  # nothing leaks from the test process

    summaries = sm.list_training_jobs()["TrainingJobSummaries"]
    assert [(s["TrainingJobName"], s["TrainingJobStatus"]) for s in summaries] == [("completes-1", "Completed")]
    assert sm.list_tags(ResourceArn=arn)["Tags"] == [{"Key": "diloco:run", "Value": "r1"}]


INVALID_REQUESTS: list[tuple[dict[str, Any], str]] = [
    ({"TrainingJobName": "under_score"},
     "1 validation error detected: Value 'under_score' at 'trainingJobName' failed to satisfy constraint: "
     "Member must satisfy regular expression pattern: ^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}"),
    ({"TrainingJobName": "a" * 64}, "at 'trainingJobName' failed to satisfy constraint: Member must have length "
                                    "less than or equal to 63"),
    ({"Environment": {f"K{i}": "v" for i in range(101)}},
     "at 'environment' failed to satisfy constraint: Member must have length less than or equal to 100"),
    ({"Environment": {"OK": "v" * 513}}, "at 'environment' failed to satisfy constraint: Map value must satisfy "
                                         "constraint: [Member must have length less than or equal to 512]"),
    ({"Environment": {"1BAD": "v"}}, "at 'environment' failed to satisfy constraint: Map keys must satisfy "
                                     "constraint: [Member must satisfy regular expression pattern"),
    ({"AlgorithmSpecification": {"TrainingImage": "i", "TrainingInputMode": "File",
                                 "ContainerEntrypoint": ["python"], "ContainerArguments": ["x" * 257]}},
     "at 'algorithmSpecification.containerArguments' failed to satisfy constraint: Member must satisfy "
     "constraint: [Member must have length less than or equal to 256]"),
    ({"ResourceConfig": {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 5,
                         "KeepAlivePeriodInSeconds": 21601}},
     "at 'resourceConfig.keepAlivePeriodInSeconds' failed to satisfy constraint: Member must have value less "
     "than or equal to 21600"),
    ({"EnableManagedSpotTraining": True},
     "Invalid MaxWaitTimeInSeconds. It must be present and be greater than or equal to MaxRuntimeInSeconds"),
    ({"EnableManagedSpotTraining": True, "StoppingCondition": {"MaxRuntimeInSeconds": 60, "MaxWaitTimeInSeconds": 30}},
     "Invalid MaxWaitTimeInSeconds. It must be present and be greater than or equal to MaxRuntimeInSeconds"),
    ({"StoppingCondition": {"MaxRuntimeInSeconds": 60, "MaxWaitTimeInSeconds": 60}},
     "Invalid MaxWaitTimeInSeconds. It is only supported when EnableManagedSpotTraining is set to true"),
    ({"RoleArn": "arn:aws:iam::12:role/short-account"}, "at 'roleArn' failed to satisfy constraint: Member must "
                                                         "satisfy regular expression pattern"),
]


def test_invalid_requests_get_the_services_validation_errors_and_create_nothing(
    sm: Any, job: Callable[..., dict[str, Any]]
) -> None:
    for overrides, expected in INVALID_REQUESTS:  # one emulator for all cases: each is one quick call
        request = job("valid-name", "pass", **overrides)
        code, message = error_of(lambda r=request: sm.create_training_job(**r))
        assert code == "ValidationException", overrides
        assert expected in message, (overrides, message)
    assert sm.list_training_jobs()["TrainingJobSummaries"] == []


def test_names_are_unique_for_ever_and_unknown_jobs_are_not_found(
    sm: Any, job: Callable[..., dict[str, Any]]
) -> None:
    sm.create_training_job(**job("once", "pass"))
    assert wait_terminal(sm, "once")["TrainingJobStatus"] == "Completed"
    code, message = error_of(lambda: sm.create_training_job(**job("once", "pass")))
    assert code == "ResourceInUse"
    assert message.startswith("Training job names must be unique within an AWS account and region")
    assert "training-job/once)" in message
    assert error_of(lambda: sm.describe_training_job(TrainingJobName="never-made")) == (
        "ValidationException", "Requested resource not found.")
    assert error_of(lambda: sm.stop_training_job(TrainingJobName="once")) == (
        "ValidationException", "The request was rejected because the training job is in status Completed.")


FAILS = """
import os, sys
if os.environ.get("WRITE_FAILURE"):
    open("/opt/ml/output/failure".replace("/opt/ml", os.environ["OPT_ML"]), "w").write("ValueError: loss is nan")
sys.exit(int(os.environ["CODE"]))
"""


def test_failed_jobs_report_the_failure_file_or_the_exit_code(sm: Any, job: Callable[..., dict[str, Any]]) -> None:
    sm.create_training_job(**job("fails-with-file", FAILS,
                                 Environment={"CODE": "3", "WRITE_FAILURE": "1", "OPT_ML": "/opt/ml"}))
    sm.create_training_job(**job("fails-bare", FAILS, Environment={"CODE": "2"}))
    with_file, bare = wait_terminal(sm, "fails-with-file"), wait_terminal(sm, "fails-bare")
    assert (with_file["TrainingJobStatus"], with_file["SecondaryStatus"]) == ("Failed", "Failed")
    assert with_file["FailureReason"] == "AlgorithmError: ValueError: loss is nan"
    assert bare["FailureReason"] == "AlgorithmError: , exit code: 2"
    assert transitions(bare)[-2:] == ["Uploading", "Failed"]


STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *a: print("got SIGTERM, ignoring it", flush=True))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print("pids", child.pid, flush=True)
time.sleep(300)
"""


def test_stop_sends_sigterm_then_sigkill_and_leaves_no_process(
    sm: Any, logs: Any, emulator: SageMakerEmulator, job: Callable[..., dict[str, Any]]
) -> None:
    sm.create_training_job(**job("stubborn", STUBBORN))
    lines = wait_log_line(logs, "stubborn", "pids ")
    child = int(next(line for line in lines if line.startswith("pids ")).split()[1])
    main = emulator.job("stubborn").pid()
    assert main is not None

    sm.stop_training_job(TrainingJobName="stubborn")
    now = sm.describe_training_job(TrainingJobName="stubborn")
    assert (now["TrainingJobStatus"], now["SecondaryStatus"]) == ("Stopping", "Stopping")
    desc = wait_terminal(sm, "stubborn")
    assert (desc["TrainingJobStatus"], desc["SecondaryStatus"]) == ("Stopped", "Stopped")
    assert "got SIGTERM, ignoring it" in job_log_lines(logs, "stubborn")
    assert process_gone(main) and process_gone(child)
    assert emulator.running_pids() == []
    assert error_of(lambda: sm.stop_training_job(TrainingJobName="stubborn"))[1] == (
        "The request was rejected because the training job is in status Stopped.")


def test_max_runtime_stops_the_job_as_max_runtime_exceeded(sm: Any, job: Callable[..., dict[str, Any]]) -> None:
    sm.create_training_job(**job("too-long", "import time; time.sleep(300)",
                                 StoppingCondition={"MaxRuntimeInSeconds": 1}))
    desc = wait_terminal(sm, "too-long")
    assert (desc["TrainingJobStatus"], desc["SecondaryStatus"]) == ("Stopped", "MaxRuntimeExceeded")
    assert transitions(desc)[-2:] == ["Stopping", "MaxRuntimeExceeded"]


def test_throttling_knob_is_retried_by_boto3_until_the_retries_run_out(
    sm: Any, emulator: SageMakerEmulator, job: Callable[..., dict[str, Any]]
) -> None:
    import boto3
    from botocore.config import Config

    emulator.throttle(2, operations=["CreateTrainingJob"])
    response = sm.create_training_job(**job("after-throttling", "pass"))
    assert response["ResponseMetadata"]["RetryAttempts"] == 2
    assert [c.error for c in emulator.operation_calls("CreateTrainingJob")] == [
        "ThrottlingException", "ThrottlingException", None]

    impatient = boto3.client("sagemaker", config=Config(retries={"mode": "legacy", "max_attempts": 1}))
    emulator.throttle(2)
    assert error_of(lambda: impatient.describe_training_job(TrainingJobName="after-throttling")) == (
        "ThrottlingException", "Rate exceeded")
    assert sm.describe_training_job(TrainingJobName="after-throttling")["TrainingJobName"] == "after-throttling"


def test_quota_knobs_refuse_creation_with_resource_limit_exceeded(
    sm: Any, emulator: SageMakerEmulator, job: Callable[..., dict[str, Any]]
) -> None:
    sleeper = "import time; time.sleep(300)"
    emulator.refuse_create(nth=2)
    sm.create_training_job(**job("quota-0", sleeper))
    code, message = error_of(lambda: sm.create_training_job(**job("quota-1", sleeper)))
    assert code == "ResourceLimitExceeded"
    assert message == ("The account-level service limit 'ml.m5.xlarge for training job usage' is 1 Instances, with "
                       "current utilization of 1 Instances and a request delta of 1 Instances. Please contact AWS "
                       "support to request an increase for this limit.")
    sm.create_training_job(**job("quota-2", sleeper))  # the knob refuses one job only
    emulator.set_instance_limit("ml.m5.xlarge", 2)
    assert error_of(lambda: sm.create_training_job(**job("quota-3", sleeper)))[0] == "ResourceLimitExceeded"
    names = [s["TrainingJobName"] for s in sm.list_training_jobs()["TrainingJobSummaries"]]
    assert sorted(names) == ["quota-0", "quota-2"]  # a refused job does not exist, and its name stays free
    for name in names:
        sm.stop_training_job(TrainingJobName=name)


CHECKPOINTED = """
import os, sys, time
ckpt = os.environ["CKPT"]
state = os.path.join(ckpt, "state.txt")
if os.path.exists(state):
    print("restored", open(state).read(), flush=True)
    time.sleep(1.5)
    open(os.path.join(os.environ["OPT_ML"], "model", "done"), "w").write("ok")
    sys.exit(0)
open(state, "w").write("round-7")
print("first run", flush=True)
time.sleep(300)
"""


def test_spot_interruption_restarts_the_job_with_its_checkpoints_restored(
    sm: Any, s3: Any, logs: Any, emulator: SageMakerEmulator, s3_bucket: str, job: Callable[..., dict[str, Any]]
) -> None:
    request = job("spot-1", CHECKPOINTED, EnableManagedSpotTraining=True,
                  StoppingCondition={"MaxRuntimeInSeconds": 120, "MaxWaitTimeInSeconds": 240},
                  CheckpointConfig={"S3Uri": f"s3://{s3_bucket}/ckpt/spot-1"},
                  Environment={"CKPT": "/opt/ml/checkpoints", "OPT_ML": "/opt/ml"})
    sm.create_training_job(**request)
    sm.create_training_job(**job("on-demand", "import time; time.sleep(300)"))
    wait_log_line(logs, "spot-1", "first run")
    deadline = time.monotonic() + 30
    while s3.list_objects_v2(Bucket=s3_bucket, Prefix="ckpt/spot-1/").get("KeyCount", 0) == 0:
        assert time.monotonic() < deadline, "the checkpoint directory was never synced to S3"
        time.sleep(0.05)
    wait_for(sm, "on-demand", lambda d: d["SecondaryStatus"] == "Training")
    with pytest.raises(ValueError, match="not a managed spot job"):
        emulator.interrupt("on-demand")

    emulator.interrupt("spot-1", hold=True)
    held = wait_for(sm, "spot-1", lambda d: d["SecondaryStatus"] == "Interrupted")
    assert held["TrainingJobStatus"] == "InProgress"
    time.sleep(0.3)  # longer than restart_delay_s: held, it does not come back on its own
    assert sm.describe_training_job(TrainingJobName="spot-1")["SecondaryStatus"] == "Interrupted"
    emulator.resume("spot-1")
    desc = wait_terminal(sm, "spot-1")
    assert desc["TrainingJobStatus"] == "Completed", desc.get("FailureReason")
    assert transitions(desc) == ["Starting", "Downloading", "Training", "Interrupted", "Restarting",
                                 "Downloading", "Training", "Uploading", "Completed"]
    assert "restored round-7" in job_log_lines(logs, "spot-1")
    streams = logs.describe_log_streams(logGroupName=LOG_GROUP, logStreamNamePrefix="spot-1/")["logStreams"]
    assert len(streams) == 2  # a new instance, a new stream
    assert desc["BillableTimeInSeconds"] < desc["TrainingTimeInSeconds"]  # managed spot's savings
    assert s3.get_object(Bucket=s3_bucket, Key="ckpt/spot-1/state.txt")["Body"].read() == b"round-7"
    sm.stop_training_job(TrainingJobName="on-demand")


def test_log_events_land_in_the_job_stream_and_paginate_past_one_page(
    sm: Any, logs: Any, job: Callable[..., dict[str, Any]]
) -> None:
    count = 10_050  # GetLogEvents returns at most 10,000 events per page
    sm.create_training_job(**job("chatty", f"for i in range({count}): print('line', i)"))
    assert wait_terminal(sm, "chatty")["TrainingJobStatus"] == "Completed"
    streams = logs.describe_log_streams(logGroupName=LOG_GROUP, logStreamNamePrefix="chatty/")["logStreams"]
    assert len(streams) == 1 and re.fullmatch(r"chatty/algo-1-\d{10}", streams[0]["logStreamName"])
    first = logs.get_log_events(logGroupName=LOG_GROUP, logStreamName=streams[0]["logStreamName"],
                                startFromHead=True)
    assert len(first["events"]) < count
    events = read_stream(logs, streams[0]["logStreamName"])
    assert [e["message"] for e in events] == [f"line {i}" for i in range(count)]
    stamps = [e["timestamp"] for e in events]
    assert stamps == sorted(stamps)


def test_list_filters_sorts_and_paginates(sm: Any, job: Callable[..., dict[str, Any]]) -> None:
    for name in ("list-b", "list-a", "other-c"):
        sm.create_training_job(**job(name, "pass"))
    for name in ("list-b", "list-a", "other-c"):
        wait_terminal(sm, name)
    page = sm.list_training_jobs(MaxResults=2, SortOrder="Ascending")
    assert [s["TrainingJobName"] for s in page["TrainingJobSummaries"]] == ["list-b", "list-a"]
    rest = sm.list_training_jobs(MaxResults=2, SortOrder="Ascending", NextToken=page["NextToken"])
    assert [s["TrainingJobName"] for s in rest["TrainingJobSummaries"]] == ["other-c"] and "NextToken" not in rest
    newest_first = sm.list_training_jobs()["TrainingJobSummaries"]  # the default: most current to oldest
    assert [s["TrainingJobName"] for s in newest_first] == ["other-c", "list-a", "list-b"]
    by_name = sm.list_training_jobs(NameContains="list", SortBy="Name", SortOrder="Descending")
    assert [s["TrainingJobName"] for s in by_name["TrainingJobSummaries"]] == ["list-b", "list-a"]
    assert sm.list_training_jobs(StatusEquals="Failed")["TrainingJobSummaries"] == []
    pages = sm.get_paginator("list_training_jobs").paginate(PaginationConfig={"PageSize": 1})
    assert sum(len(p["TrainingJobSummaries"]) for p in pages) == 3


def test_network_isolation_gives_the_job_no_way_to_aws(
    sm: Any, logs: Any, job: Callable[..., dict[str, Any]]
) -> None:
    code = "import os; print('endpoint', os.environ['AWS_ENDPOINT_URL'], 'AWS_ACCESS_KEY_ID' in os.environ)"
    sm.create_training_job(**job("isolated", code, EnableNetworkIsolation=True))
    assert wait_terminal(sm, "isolated")["EnableNetworkIsolation"] is True
    assert "endpoint http://127.0.0.1:9 False" in job_log_lines(logs, "isolated")


def test_runs_on_its_own_with_an_embedded_s3_and_stops_its_jobs_on_ctrl_c(tmp_path: Path) -> None:
    import boto3

    proc = subprocess.Popen([sys.executable, "-m", "tests.emulators.sagemaker", "--port", "0",
                             "--root", str(tmp_path), "--stop-grace", "1"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
    try:
        exports: dict[str, str] = {}
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("export "):
                key, _, value = line[len("export "):].strip().partition("=")
                exports[key] = value
            if line.startswith("# Ctrl-C"):
                break
        assert {"AWS_ENDPOINT_URL_SAGEMAKER", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID"} <= set(exports)
        session = boto3.session.Session(aws_access_key_id=exports["AWS_ACCESS_KEY_ID"],
                                        aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"],
                                        region_name=exports["AWS_REGION"])
        session.client("s3", endpoint_url=exports["AWS_ENDPOINT_URL"]).create_bucket(Bucket="standalone-bucket")
        sm = session.client("sagemaker", endpoint_url=exports["AWS_ENDPOINT_URL_SAGEMAKER"])
        request = dict(
            TrainingJobName="standalone",
            AlgorithmSpecification={"TrainingImage": "i", "TrainingInputMode": "File",
                                    "ContainerEntrypoint": ["python", "-c"],
                                    "ContainerArguments": ["import os, time; print(os.getpid(), flush=True); "
                                                           "open(os.environ['HOME'] + '/pid', 'w').write(str(os.getpid())); "
                                                           "time.sleep(300)"]},
            OutputDataConfig={"S3OutputPath": "s3://standalone-bucket/out"},
            ResourceConfig={"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 1})
        # On its own it checks roles as the service does: only the role it provisioned (it trusts SageMaker) works.
        code, _ = error_of(lambda: sm.create_training_job(RoleArn="arn:aws:iam::000000000000:role/r", **request))
        assert code == "ValidationException"
        sm.create_training_job(RoleArn="arn:aws:iam::000000000000:role/any", **request)
        pid_file = tmp_path / "jobs" / "standalone" / "home" / "pid"
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert process_gone(pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_caller_policy_refuses_every_action_outside_it_the_way_aws_does(
    sm: Any, emulator: SageMakerEmulator, job: Callable[..., dict[str, Any]]
) -> None:
    """IAM as the services evaluate it (``aws_iam``): an action outside the caller's policy is AccessDeniedException
    in AWS's words, naming the action and the resource; CreateTrainingJob needs iam:PassRole on its role and
    sagemaker:AddTags for its tags as well; every action evaluated is recorded."""
    import boto3
    from emulators.aws_iam import CallerPolicy

    principal = f"arn:aws:iam::{emulator.account_id}:user/emulator-caller"
    emulator.set_caller_policy(CallerPolicy(["sagemaker:CreateTrainingJob", "sagemaker:Describe*"],
                                            principal=principal))
    request = job("iam-0", "print('hi')", Tags=[{"Key": "k", "Value": "v"}])
    code, message = error_of(lambda: sm.create_training_job(**request))
    assert code == "AccessDeniedException"
    assert message == (f"User: {principal} is not authorized to perform: iam:PassRole on resource: "
                       f"{request['RoleArn']} because no identity-based policy allows the iam:PassRole action")
    emulator.set_caller_policy(CallerPolicy(["sagemaker:CreateTrainingJob", "sagemaker:Describe*", "iam:PassRole"],
                                            principal=principal))
    assert "sagemaker:AddTags action" in error_of(lambda: sm.create_training_job(**request))[1]
    assert emulator.jobs() == []  # a refused create creates nothing
    sm.create_training_job(**job("iam-1", "print('hi')"))  # no tags: AddTags is not needed
    arn = sm.describe_training_job(TrainingJobName="iam-1")["TrainingJobArn"]
    code, message = error_of(lambda: sm.list_tags(ResourceArn=arn))
    assert (code, message) == ("AccessDeniedException", f"User: {principal} is not authorized to perform: "
                               f"sagemaker:ListTags on resource: {arn} because no identity-based policy allows "
                               "the sagemaker:ListTags action")
    assert "sagemaker:ListTrainingJobs because no identity-based policy" in error_of(sm.list_training_jobs)[1]
    logs = boto3.client("logs", endpoint_url=emulator.logs_url)
    assert error_of(lambda: logs.describe_log_streams(logGroupName=LOG_GROUP))[0] == "AccessDeniedException"
    assert emulator.iam_actions.actions() == {
        "sagemaker:CreateTrainingJob", "iam:PassRole", "sagemaker:AddTags", "sagemaker:DescribeTrainingJob",
        "sagemaker:ListTags", "sagemaker:ListTrainingJobs", "logs:DescribeLogStreams"}
    emulator.set_caller_policy(CallerPolicy(["sagemaker:*"], deny=["sagemaker:ListTags"], principal=principal))
    assert error_of(lambda: sm.list_tags(ResourceArn=arn))[1].endswith(
        "with an explicit deny in an identity-based policy")
    assert sm.list_training_jobs()["TrainingJobSummaries"]


def test_check_roles_refuses_a_role_that_is_missing_or_does_not_trust_sagemaker(
    aws_env: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3: Any
) -> None:
    """CreateTrainingJob's role check, in the service's words: the role must exist (under the ARN's own path) and
    trust sagemaker.amazonaws.com; a refused job does not exist."""
    import boto3

    iam = boto3.client("iam")

    def trust(service: str) -> str:
        return json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}]})

    good = iam.create_role(RoleName="trusts-sagemaker", AssumeRolePolicyDocument=trust("sagemaker.amazonaws.com"),
                           Path="/service-role/")["Role"]["Arn"]
    ec2 = iam.create_role(RoleName="trusts-ec2", AssumeRolePolicyDocument=trust("ec2.amazonaws.com"))["Role"]["Arn"]
    account = good.split(":")[4]
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sm", stop_grace_s=1.0, account_id=account,
                           check_roles=True) as emu:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emu.url)
        sm = boto3.client("sagemaker")
        base = {"AlgorithmSpecification": {"TrainingImage": "training-image:latest", "TrainingInputMode": "File",
                                           "ContainerEntrypoint": ["python"], "ContainerArguments": ["-c", "pass"]},
                "OutputDataConfig": {"S3OutputPath": f"s3://{s3_bucket}/output"},
                "ResourceConfig": {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 5},
                "StoppingCondition": {"MaxRuntimeInSeconds": 60}}
        for role_arn in (f"arn:aws:iam::{account}:role/no-such-role", ec2,
                         f"arn:aws:iam::{account}:role/trusts-sagemaker"):  # without its path: another ARN
            code, message = error_of(lambda r=role_arn: sm.create_training_job(
                TrainingJobName="role-refused", RoleArn=r, **base))
            assert (code, message) == ("ValidationException", f"Could not assume role {role_arn}. Please ensure "
                                       "that the role exists and allows principal 'sagemaker.amazonaws.com' to "
                                       "assume the role.")
        assert emu.jobs() == []
        sm.create_training_job(TrainingJobName="role-taken", RoleArn=good, **base)
        assert [j.name for j in emu.jobs()] == ["role-taken"]
