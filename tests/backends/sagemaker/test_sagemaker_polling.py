"""The SageMaker backend's pacing and polling rules on a fake clock: what a watcher costs, and what throttling does.

Why: the end-to-end tests (tests/test_sagemaker_api_limits.py, tests/test_sagemaker_watched_launch.py) show the
backend within the emulator's limits; these pin the rules themselves, exactly and fast: a pacer's budget and how
it yields to throttling, and a run's poller sharing rounds, never asking an ended job again, keeping what it knew
through throttling and waiting (never failing) for a job it has not seen yet. The errors are real botocore ones.
"""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from diloco.errors import BackendError
from diloco.executors.sagemaker.pacing import Pacer, is_transient
from diloco.executors.sagemaker.polling import MIN_POLL_INTERVAL_S, RunPoller


class Clock:
    """Time that moves only when something sleeps (or the test says so)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def aws_error(code: str, status: int = 400) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "Rate exceeded" if "Throttl" in code else code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "DescribeTrainingJob")


class FakeService:
    """DescribeTrainingJob's answers: a status per job, and errors to answer first."""

    def __init__(self, statuses: dict[str, str]) -> None:
        self.statuses = statuses
        self.errors: list[BaseException] = []
        self.asked: list[str] = []

    def describe(self, name: str) -> tuple[dict[str, Any] | None, bool]:
        self.asked.append(name)
        if self.errors:
            raise self.errors.pop(0)
        return {"TrainingJobName": name, "TrainingJobStatus": self.statuses[name]}, False


def poller_for(service: FakeService, clock: Clock) -> RunPoller:
    return RunPoller(service.describe, Pacer(100.0, 100.0, clock=clock, sleep=clock.sleep), clock=clock,
                     sleep=clock.sleep)


# ---------------------------------------------------------------------------------------------------- pacer
def test_a_pacer_allows_its_burst_then_spaces_calls_at_its_rate() -> None:
    clock = Clock()
    pacer = Pacer(2.0, 4.0, clock=clock, sleep=clock.sleep)
    for _ in range(4):
        pacer.acquire()
    assert clock.slept == []
    for _ in range(4):
        pacer.acquire()
    assert clock.slept == pytest.approx([0.5, 0.5, 0.5, 0.5])


def test_a_throttled_pacer_halves_its_rate_down_to_an_eighth_and_recovers() -> None:
    clock = Clock()
    pacer = Pacer(2.0, 1.0, clock=clock, sleep=clock.sleep)
    pacer.throttled()
    assert pacer.rate_per_s == 1.0
    for _ in range(5):
        pacer.throttled()
    assert pacer.rate_per_s == 0.25
    pacer.acquire()
    assert clock.slept == [pytest.approx(4.0)]  # the bucket was emptied: one call per 4 s now
    for _ in range(20):
        pacer.succeeded()
    assert pacer.rate_per_s == 2.0


def test_throttling_5xx_and_lost_connections_are_transient_and_denials_are_not() -> None:
    assert is_transient(aws_error("ThrottlingException"))
    assert is_transient(aws_error("InternalFailure", 500))
    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:9"))
    assert not is_transient(aws_error("AccessDeniedException"))
    assert not is_transient(aws_error("ValidationException"))


# ---------------------------------------------------------------------------------------------------- poller
def test_watchers_within_one_interval_share_one_round() -> None:
    clock, service = Clock(), FakeService({"r0": "InProgress", "r1": "InProgress"})
    poller = poller_for(service, clock)
    for _ in range(10):
        poller.descriptions(["r0", "r1"])
    assert service.asked == ["r0", "r1"]
    clock.now += MIN_POLL_INTERVAL_S
    poller.descriptions(["r0", "r1"])
    assert service.asked == ["r0", "r1", "r0", "r1"]


def test_an_ended_job_is_never_asked_again() -> None:
    clock, service = Clock(), FakeService({"r0": "Completed", "r1": "InProgress"})
    poller = poller_for(service, clock)
    poller.descriptions(["r0", "r1"])
    for _ in range(3):
        clock.now += 10 * MIN_POLL_INTERVAL_S
        assert poller.descriptions(["r0", "r1"])["r0"]["TrainingJobStatus"] == "Completed"
    assert service.asked == ["r0", "r1", "r1", "r1", "r1"]
    assert poller.final("r0") is not None and poller.final("r1") is None


def test_a_new_job_name_is_described_at_once_and_expire_forces_a_round() -> None:
    clock, service = Clock(), FakeService({"r0": "InProgress", "r0-1": "InProgress"})
    poller = poller_for(service, clock)
    poller.descriptions(["r0"])
    poller.descriptions(["r0", "r0-1"])  # a relaunch added a job: not known yet, so not young
    poller.expire()
    poller.descriptions(["r0", "r0-1"])
    assert service.asked == ["r0", "r0", "r0-1", "r0", "r0-1"]


def test_throttling_keeps_the_last_description_and_doubles_the_interval() -> None:
    clock, service = Clock(), FakeService({"r0": "InProgress"})
    poller = poller_for(service, clock)
    first = poller.descriptions(["r0"])
    service.statuses["r0"] = "Stopping"
    service.errors = [aws_error("ThrottlingException")]
    clock.now += MIN_POLL_INTERVAL_S
    assert poller.descriptions(["r0"]) == first  # what was seen, not an error
    assert poller.interval_s == 2 * MIN_POLL_INTERVAL_S
    clock.now += MIN_POLL_INTERVAL_S
    assert poller.descriptions(["r0"]) == first  # the slower schedule: still young
    clock.now += MIN_POLL_INTERVAL_S
    assert poller.descriptions(["r0"])["r0"]["TrainingJobStatus"] == "Stopping"
    assert poller.interval_s < 2 * MIN_POLL_INTERVAL_S  # a clean round speeds back up


def test_a_job_never_described_is_waited_for_through_throttling_never_given_up() -> None:
    clock, service = Clock(), FakeService({"r0": "InProgress"})
    service.errors = [aws_error("ThrottlingException")] * 6 + [aws_error("ServiceUnavailable", 503)]
    poller = poller_for(service, clock)
    assert poller.descriptions(["r0"])["r0"]["TrainingJobStatus"] == "InProgress"
    assert len(service.asked) == 8 and len([s for s in clock.slept if s >= 0.25]) >= 7  # it backed off each time


def test_an_error_that_is_not_transient_is_raised() -> None:
    clock = Clock()

    def describe(name: str) -> tuple[dict[str, Any] | None, bool]:
        raise BackendError("could not describe SageMaker training job r0: AccessDeniedException: no")

    with pytest.raises(BackendError, match="AccessDenied"):
        RunPoller(describe, Pacer(10.0, 10.0, clock=clock, sleep=clock.sleep), clock=clock,
                  sleep=clock.sleep).descriptions(["r0"])
