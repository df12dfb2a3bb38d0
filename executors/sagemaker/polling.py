"""One describe schedule per run and process: a run's training jobs, described at a bounded, adaptive rate.

Why not ListTrainingJobs: the service applies ``NameContains`` (and its other filters) after it has picked a page
of the account's jobs, so a filtered listing walks the account's whole history, empty page after empty page
(boto/boto3#2838, #3347; aws/aws-sdk#701), at 2 requests/s per account, not adjustable. A poll's cost would grow
with every job the account ever ran. The run's handle knows its job names, so a poll is one DescribeTrainingJob
per job that has not ended (whatever the account holds), and an ended job's final description is kept: it is
never asked again.

Why shared: a launcher watches one run from several places at once (the wait loop, every rank's ``logs -f``
thread, a cancel's wait). ``RunPoller.descriptions`` returns the last round's descriptions while they are younger
than the poll interval, so all of them together cost one round per interval; one thread describes while the
others wait for its result. The calls go through the process's ``Pacer`` for DescribeTrainingJob, so a run of
many jobs is described at that rate, not in a burst.

Why adaptive: throttling (an error after botocore's own retries, or an answer that needed retries) doubles the
interval, up to ``MAX_POLL_INTERVAL_S``; clean rounds shrink it back. A job whose description cannot be had for
throttling keeps its last one; a job never described yet is tried again after a backoff, until it answers: a wait
or a cancel is slowed down by throttling, never ended by it. Errors that are not transient (access denied) are
raised.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from diloco.executors.sagemaker.pacing import Pacer, backoff_s, is_transient

#: A run's jobs are described at most once per this many seconds per process (the service has no push).
MIN_POLL_INTERVAL_S = 1.0
#: However throttled, a run is described at least this often.
MAX_POLL_INTERVAL_S = 60.0
#: This process's share of DescribeTrainingJob's account-wide rate: the service publishes no number, and other
#: watchers (another shell's ``status``, ``logs -f``, ``cancel``; other tools) share the account's.
DESCRIBE_RATE_PER_S = 2.0
DESCRIBE_BURST = 4.0
#: TrainingJobStatus values after which a job's description never changes.
FINAL_STATUSES = ("Completed", "Failed", "Stopped")

Describe = Callable[[str], tuple[dict[str, Any] | None, bool]]


class RunPoller:
    """The descriptions of one run's jobs as this process last saw them, renewed at most once per interval.

    ``describe(name)`` returns ``(description or None when the job does not exist, whether botocore retried)``
    and raises the client's exception; ``pacer`` spaces the calls."""

    def __init__(self, describe: Describe, pacer: Pacer, *, min_interval_s: float = MIN_POLL_INTERVAL_S,
                 max_interval_s: float = MAX_POLL_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._describe = describe
        self._pacer = pacer
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.interval_s = min_interval_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._latest: dict[str, dict[str, Any] | None] = {}  # every job asked about: its last description
        self._final: dict[str, dict[str, Any]] = {}  # ended jobs: never asked again
        self._final_at: dict[str, float] = {}  # when this process first saw each of them ended
        self._at: float | None = None  # when the last round ended

    def final(self, name: str) -> Mapping[str, Any] | None:
        """The job's final description, if this process has seen it end."""
        return self._final.get(name)

    def ended_at(self, name: str) -> float | None:
        """When (on this poller's clock) this process first saw the job ended; None while it has not."""
        return self._final_at.get(name)

    def expire(self) -> None:
        """The next ``descriptions`` call describes again (after this process changed the jobs, e.g. stopped
        them): what was seen before is no longer the news."""
        with self._lock:
            self._at = None

    def descriptions(self, names: Sequence[str]) -> dict[str, dict[str, Any] | None]:
        """Each job's description (None: no such job), at most ``interval_s`` old."""
        with self._lock:
            young = self._at is not None and self._clock() - self._at < self.interval_s
            if not (young and all(name in self._latest for name in names)):
                self._round(names)
            return {name: self._latest.get(name) for name in names}

    def _round(self, names: Sequence[str]) -> None:
        throttled = False
        for name in names:
            if name not in self._final:
                throttled |= self._renew(name)
        self._at = self._clock()
        if throttled:
            self.interval_s = min(self.max_interval_s, self.interval_s * 2.0)
        else:
            self.interval_s = max(self.min_interval_s, self.interval_s / 1.5)

    def _renew(self, name: str) -> bool:
        """Describe one job (waiting out throttling if it was never described); whether it was throttled."""
        throttled = False
        attempt = 0
        while True:
            self._pacer.acquire()
            try:
                desc, retried = self._describe(name)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self._pacer.throttled()
                if name in self._latest:
                    return True  # keep what was seen; the next round asks again
                self._sleep(backoff_s(attempt))
                attempt += 1
                throttled = True
                continue
            if retried:
                self._pacer.throttled()
            else:
                self._pacer.succeeded()
            self._latest[name] = desc
            if desc is not None and desc.get("TrainingJobStatus") in FINAL_STATUSES:
                self._final[name] = desc
                self._final_at[name] = self._clock()
            return throttled or retried
