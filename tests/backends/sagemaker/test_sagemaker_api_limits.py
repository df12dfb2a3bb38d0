"""The SageMaker backend within the service's API limits, against the emulator with its rate limits on.

Why: the service throttles per account (ListTrainingJobs 2 requests/s, CloudWatch GetLogEvents 10/s, ...), lists
with filters applied after paging, and an account holds every job it ever ran. A backend that polls by listing,
describes the same jobs from several watchers, reads a log backlog twice or gives up on throttling works against
a lenient emulator and breaks on a user's first real run. Here a poll's cost is counted with and without an
account history; watchers in one process are shown to share one schedule; throttling never ends a wait, a cancel
or a log follow; and a run's log follower stays within the Logs quotas and reads each backlog once.

The counts are of calls the emulator answered; the bounds are invariants of the design (a run's unfinished jobs
are described at most once per poll interval per process), never speeds.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.sagemaker import SageMakerEmulator
from support.polling import wait_for

from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.executors.sagemaker import SageMakerBackend, SageMakerBackendConfig

TESTS_DIR = str(Path(__file__).resolve().parents[2])
#: What a run's watchers in one process may cost at most: every unfinished job described once per this many
#: seconds (the backend's shortest poll interval).
SHORTEST_POLL_S = 1.0


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture
def start_emulator(aws_env: str, s3_bucket: str, tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., SageMakerEmulator]]:
    """``start_emulator(history=N)``: an emulator with its rate limits on, found the standard way."""
    started: list[SageMakerEmulator] = []

    def start(history: int = 0) -> SageMakerEmulator:
        emu = SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / f"sagemaker-{len(started)}",
                                stop_grace_s=1.0, log_flush_s=0.1, history=history).start()
        started.append(emu)
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emu.url)
        monkeypatch.setenv("AWS_ENDPOINT_URL_CLOUDWATCH_LOGS", emu.logs_url)
        return emu

    yield start
    for emu in started:
        emu.stop()


@pytest.fixture
def emulator(start_emulator: Callable[..., SageMakerEmulator]) -> SageMakerEmulator:
    return start_emulator()


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two attempts per call, so that throttling reaches the backend instead of botocore's ten retries."""
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")


def new_backend(emulator: SageMakerEmulator) -> SageMakerBackend:
    """A backend as a fresh process has it: nothing cached."""
    return SageMakerBackend(SageMakerBackendConfig(
        role_arn=f"arn:aws:iam::{emulator.account_id}:role/diloco-limits", region="us-east-1",
        image_uri="diloco-ready-image:test", log_poll_interval_s=0.2))


def submit(backend: SageMakerBackend, bucket: str, replicas: int = 2, **behaviour: Any) -> Any:
    """A run of tests/support/fake_replica.py jobs (print ``lines`` lines, sleep ``sleep`` s, exit 0)."""
    run_id = f"lim-{uuid.uuid4().hex[:8]}"
    args = EntrypointArgs(rendezvous_uri=f"s3://{bucket}/limits/{run_id}", world_size=replicas,
                          trainer="fake:train", trainer_kwargs=dict(behaviour))
    spec = LaunchSpec(run_id=run_id, replicas=replicas, entrypoint="support.fake_replica", entrypoint_args=args,
                      env={"PYTHONPATH": TESTS_DIR})
    return backend.submit(backend.plan(spec))


def jobs_in(emulator: SageMakerEmulator, handle: Any, secondary: tuple[str, ...]) -> bool:
    """Read in-process (no API call): whether every job of the run is in one of these secondary statuses."""
    return all(emulator.job(name).secondary in secondary for name in handle.job_names)


def calls_during(emulator: SageMakerEmulator, action: Callable[[], Any]) -> Counter[str]:
    before = len(emulator.calls)
    action()
    return Counter(c.operation for c in emulator.calls[before:])


def stop_all(emulator: SageMakerEmulator, handle: Any) -> None:
    for name in handle.job_names:
        job = emulator.job(name)
        if job.running and job.status == "InProgress":
            job.request_stop()
        job.wait(30)


# ---------------------------------------------------------------------------------------------------- polling
def test_a_poll_costs_the_same_whatever_the_accounts_history(
    start_emulator: Callable[..., SageMakerEmulator], s3_bucket: str
) -> None:
    costs = {}
    for history in (0, 5000):
        emulator = start_emulator(history=history)
        handle = submit(new_backend(emulator), s3_bucket, sleep=60)
        wait_for(lambda e=emulator, h=handle: jobs_in(e, h, ("Training",)), "both jobs to train")
        backend = new_backend(emulator)
        first = calls_during(emulator, lambda b=backend, h=handle: b.describe(h))
        costs[history] = first
        stop_all(emulator, handle)
    assert costs[5000] == costs[0], costs
    assert costs[0] == Counter({"DescribeTrainingJob": 2}), costs  # one call per job: the handle knows them


def test_ended_jobs_are_not_asked_again(emulator: SageMakerEmulator, s3_bucket: str) -> None:
    handle = submit(new_backend(emulator), s3_bucket, lines=1)
    for name in handle.job_names:
        assert emulator.job(name).wait(60)
    backend = new_backend(emulator)
    status = backend.describe(handle)
    assert [r.state.value for r in status.replicas] == ["succeeded", "succeeded"]
    time.sleep(SHORTEST_POLL_S)  # past any poll interval: a live job would be described again now
    again = calls_during(emulator, lambda: backend.describe(handle))
    assert again == Counter(), again
    assert [r.state.value for r in backend.describe(handle).replicas] == ["succeeded", "succeeded"]


def test_every_watcher_in_one_process_shares_one_poll_schedule(emulator: SageMakerEmulator, s3_bucket: str) -> None:
    backend = new_backend(emulator)
    handle = submit(backend, s3_bucket, sleep=60)
    wait_for(lambda: jobs_in(emulator, handle, ("Training",)), "both jobs to train")
    before = len(emulator.calls)
    began = time.monotonic()
    stop = threading.Event()
    seen: list[str] = []

    def watch() -> None:  # the wait loop, every rank's log thread, a cancel's wait: all call describe()
        while not stop.is_set():
            seen.append(backend.describe(handle).state.value)

    watchers = [threading.Thread(target=watch) for _ in range(8)]
    for t in watchers:
        t.start()
    time.sleep(3.0)
    stop.set()
    for t in watchers:
        t.join()
    elapsed = time.monotonic() - began
    made = Counter(c.operation for c in emulator.calls[before:])
    assert set(seen) == {"running"} and len(seen) >= 8
    rounds = 1 + elapsed / SHORTEST_POLL_S
    assert sum(made.values()) <= len(handle.job_names) * rounds, (made, elapsed)
    stop_all(emulator, handle)


# ---------------------------------------------------------------------------------------------------- throttling
def run_view(backend: SageMakerBackend, handle: Any, bucket: str) -> Any:
    from diloco.launcher.run import Run
    from diloco.launcher.runs import RunRecord

    record = RunRecord(run_id=handle.run_id, backend="sagemaker", created_at=time.time(),
                       rendezvous_uri=f"s3://{bucket}/limits/{handle.run_id}", replicas=handle.replicas,
                       config={}, handle=handle.model_dump(mode="json"))
    return Run(record, executor=backend)


def test_throttling_slows_a_wait_down_and_never_ends_it(
    emulator: SageMakerEmulator, s3_bucket: str, quick_retries: None
) -> None:
    backend = new_backend(emulator)
    handle = submit(backend, s3_bucket, sleep=1)
    emulator.throttle(4, operations=["DescribeTrainingJob", "ListTrainingJobs"])  # 2 calls' worth of attempts
    report, timed_out = run_view(backend, handle, s3_bucket).wait_for_outcome(timeout_s=120, poll_interval_s=0.2)
    assert not timed_out and report.state.value == "succeeded"
    throttled = [c for c in emulator.calls if c.error == "ThrottlingException"]
    assert len(throttled) == 4


def test_throttling_never_ends_a_cancel(emulator: SageMakerEmulator, s3_bucket: str, quick_retries: None) -> None:
    backend = new_backend(emulator)
    handle = submit(backend, s3_bucket, sleep=60)
    wait_for(lambda: jobs_in(emulator, handle, ("Training",)), "both jobs to train")
    emulator.throttle(4, operations=["StopTrainingJob"])
    backend.cancel(handle)
    for name in handle.job_names:
        assert emulator.job(name).wait(30)
        assert emulator.job(name).status == "Stopped"
    assert sum(c.error == "ThrottlingException" for c in emulator.operation_calls("StopTrainingJob")) == 4


def test_throttling_never_ends_a_log_follow(emulator: SageMakerEmulator, s3_bucket: str, quick_retries: None) -> None:
    backend = new_backend(emulator)
    handle = submit(backend, s3_bucket, lines=5, line_gap=0.1)
    wait_for(lambda: jobs_in(emulator, handle, ("Training", "Uploading", "Completed")), "the jobs to train")
    emulator.throttle_logs(4, operations=["GetLogEvents", "DescribeLogStreams"])
    texts = [r.text for r in backend.logs(handle, follow=True)]
    for rank in range(2):
        assert [t for t in texts if t.startswith(f"rank {rank} line")] == [f"rank {rank} line {i}" for i in range(5)]
    assert sum(c.error == "ThrottlingException" for c in emulator.logs_calls) == 4


# ---------------------------------------------------------------------------------------------------- logs
def test_following_a_run_stays_within_the_logs_quotas_and_reads_each_backlog_once(
    emulator: SageMakerEmulator, s3_bucket: str
) -> None:
    backend = new_backend(emulator)
    handle = submit(backend, s3_bucket, replicas=4, lines=40, line_gap=0.05)
    wait_for(lambda: all(emulator.job(n).log_streams for n in handle.job_names), "every job's first log stream")
    wait_for(lambda: sum(len(emulator.job(n).log_streams) for n in handle.job_names) == 4, "the streams")
    time.sleep(0.5)  # a backlog to read first
    view = run_view(backend, handle, s3_bucket)
    texts = [r.text for r in view.logs(follow=True)]
    for rank in range(4):
        assert [t for t in texts if t.startswith(f"rank {rank} line")] == [f"rank {rank} line {i}" for i in range(40)]
    calls = emulator.logs_calls
    assert [c for c in calls if c.error] == []  # never beyond GetLogEvents' 10/s nor DescribeLogStreams' 25/s
    from_head = Counter(c.request["logStreamName"] for c in calls if c.operation == "GetLogEvents" and c.request
                        and not c.request.get("nextToken") and not c.request.get("startTime"))
    assert sorted(from_head.values()) == [1, 1, 1, 1], from_head  # each stream's backlog read once
