"""Request-rate quotas as AWS enforces them: one token bucket per operation and account, shared by every client.

Why: the SageMaker and CloudWatch Logs APIs a launcher polls are throttled per account and region, whatever
machine or process the calls come from; a backend that polls too often works against a lenient emulator and
fails against the service. AWS documents its throttling as a token bucket (a bucket of ``burst`` tokens refilled
at ``rate_per_s``; a call that finds it empty is refused: the EC2 API reference, "Request throttling"), and
refuses with ``ThrottlingException`` "Rate exceeded" at HTTP 400 (SageMaker: aws/sagemaker-python-sdk#645,
the developer guide's CommonErrors; CloudWatch Logs: dbhowell/pino-cloudwatch#4, turbot/steampipe-mod-aws-thrifty
#130 "StatusCode: 400 ... ThrottlingException: Rate exceeded").

The quotas below are the documented or commonly reported ones, each with its source; where no number is
published the entry says so and holds a conservative choice (lower than the service is likely to allow, so a
backend that passes here passes there).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LOGS_QUOTAS", "SAGEMAKER_QUOTAS", "Call", "Quota", "RateLimits", "TokenBucket"]

THROTTLING_CODE = "ThrottlingException"
THROTTLING_MESSAGE = "Rate exceeded"


@dataclass(frozen=True)
class Quota:
    """A sustained rate, the burst a full bucket allows, and where the numbers come from."""

    rate_per_s: float
    burst: float
    source: str


@dataclass(frozen=True)
class Call:
    """One API call an emulator answered: the operation, the error code it returned (None = success), when, and
    (where the emulator keeps it) the request's parameters."""

    operation: str
    error: str | None
    at: float
    request: dict[str, Any] | None = None


#: SageMaker's per-account, per-region request rates for the operations diloco uses.
SAGEMAKER_QUOTAS: dict[str, Quota] = {
    "ListTrainingJobs": Quota(2.0, 2.0, "2 requests/s per account, not adjustable (aws-solutions/deepracer-on-aws"
                                        "#87, from the Service Quotas console); throttling reported in "
                                        "syne-tune/syne-tune#634 and apache/airflow#16299"),
    "DescribeTrainingJob": Quota(10.0, 10.0, "not published; 10/s, the rate of comparable non-adjustable AWS "
                                             "describe quotas (CloudTrail DescribeTrails 10 TPS: awslabs/mcp#1377; "
                                             "ECS DescribeTasks about 20 TPS). The SageMaker SDK itself describes a "
                                             "job only every 30 s while it streams logs (aws/sagemaker-python-sdk#10)"),
    "CreateTrainingJob": Quota(2.0, 4.0, "not published; throttled with 5 parallel creators "
                                         "(aws/sagemaker-python-sdk#645, aws/deep-learning-containers#1018): 2/s"),
    "StopTrainingJob": Quota(5.0, 5.0, "not published; a conservative 5/s"),
}
#: Operations the table does not name (ListTags, AddTags, ...): no published number either.
SAGEMAKER_DEFAULT_QUOTA = Quota(5.0, 5.0, "not published; a conservative 5/s")

#: CloudWatch Logs' per-account, per-region request rates for reading logs.
LOGS_QUOTAS: dict[str, Quota] = {
    "GetLogEvents": Quota(10.0, 10.0, "10 requests/s per account per Region, changed only in special "
                                      "circumstances (awsdocs/amazon-cloudwatch-logs-user-guide "
                                      "cloudwatch_limits_cwl.md); not adjustable (PrefectHQ/prefect#17780)"),
    "DescribeLogStreams": Quota(25.0, 25.0, "25 transactions/s (botocore's logs model, DescribeLogStreams); "
                                            "older revisions of cloudwatch_limits_cwl.md said 5"),
    "FilterLogEvents": Quota(5.0, 5.0, "5 transactions/s per account/Region (cloudwatch_limits_cwl.md)"),
}


class TokenBucket:
    """``burst`` tokens, refilled continuously at ``rate_per_s``; each admitted call takes one."""

    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()

    def take(self) -> bool:
        """Admit one call (True) or refuse it (False: the bucket is empty)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class RateLimits:
    """One account's buckets: ``admit(operation)`` for every call, from whichever client it comes."""

    def __init__(self, quotas: Mapping[str, Quota], default: Quota | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.quotas = dict(quotas)
        self.default = default
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def quota(self, operation: str) -> Quota | None:
        """The quota that applies to ``operation`` (None: unlimited)."""
        return self.quotas.get(operation, self.default)

    def admit(self, operation: str) -> bool:
        quota = self.quota(operation)
        if quota is None:
            return True
        with self._lock:
            bucket = self._buckets.get(operation)
            if bucket is None:
                bucket = self._buckets[operation] = TokenBucket(quota.rate_per_s, quota.burst, self._clock)
            return bucket.take()
