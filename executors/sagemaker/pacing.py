"""Calling AWS APIs within their account-wide rate quotas: a waiting token bucket per operation, and which errors
mean "slow down and try again" rather than "this failed".

Why: SageMaker and CloudWatch Logs throttle per account and region, whatever process the calls come from
(ListTrainingJobs 2 requests/s, not adjustable; GetLogEvents 10/s, hard; DescribeLogStreams 25/s, 5/s in older
documentation). A launcher has several watchers of one run in one process (the wait loop, every rank's log
thread, a cancel's wait) and the user may run ``status`` or ``logs -f`` in other shells at the same time, so each
process spends only a share of each quota (``Pacer``), slows down further when the service throttles anyway, and
treats throttling as a reason to wait, never as a failure of the command (``is_transient``).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

#: The error codes botocore's standard retry mode treats as throttling (``retries/standard.py``
#: ``ThrottlingErrorDetector``), whichever service answers.
THROTTLING_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "ProvisionedThroughputExceededException", "TransactionInProgressException",
    "RequestLimitExceeded", "BandwidthLimitExceeded", "LimitExceededException", "RequestThrottled",
    "SlowDown", "PriorRequestNotComplete", "EC2ThrottledException",
})
#: Codes of service-side trouble that goes away by itself (the service's 5xx answers).
_SERVICE_TROUBLE = frozenset({"InternalFailure", "InternalServerError", "InternalError", "ServiceUnavailable",
                              "ServiceUnavailableException", "RequestTimeout", "RequestTimeoutException"})
#: The longest pause between two tries of one call that keeps being throttled.
MAX_BACKOFF_S = 30.0


def error_code(exc: BaseException) -> str | None:
    """The AWS error code of a botocore ``ClientError`` (None for anything else)."""
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        code = (response.get("Error") or {}).get("Code")
        return str(code) if code else None
    return None


def is_throttling(exc: BaseException) -> bool:
    return error_code(exc) in THROTTLING_CODES


def is_transient(exc: BaseException) -> bool:
    """Throttling, a 5xx answer, or no answer at all (a connection refused, reset or timed out): worth waiting
    for. Anything else (access denied, a malformed request) is the caller's to report."""
    code = error_code(exc)
    if code is not None:
        status = (getattr(exc, "response", {}).get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
        return code in THROTTLING_CODES or code in _SERVICE_TROUBLE or int(status) >= 500
    try:
        from botocore.exceptions import ConnectionError as BotocoreConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # pragma: no cover - botocore is there whenever a client exists
        return False
    return isinstance(exc, (BotocoreConnectionError, HTTPClientError))


def was_retried(response: Mapping[str, Any]) -> bool:
    """Whether botocore had to retry to get this answer (throttled or refused on the way): a hint to slow down."""
    return int((response.get("ResponseMetadata") or {}).get("RetryAttempts") or 0) > 0


def backoff_s(attempt: int) -> float:
    """Full-jitter exponential backoff (0.5 s doubling, at most ``MAX_BACKOFF_S``) before try ``attempt`` + 1."""
    return random.uniform(0.5, 1.0) * min(MAX_BACKOFF_S, 0.5 * 2 ** min(attempt, 10))


class Pacer:
    """At most ``rate_per_s`` calls per second on average and ``burst`` at once, for every thread that shares it.

    ``acquire()`` waits for a token (it never refuses). ``throttled()`` halves the rate (down to an eighth of it),
    as the service said this process is too fast for the account's other users; ``succeeded()`` brings it back
    a quarter at a time. Tokens are reserved under the lock and waited for outside it, so waiting threads are served in
    order.
    """

    def __init__(self, rate_per_s: float, burst: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.nominal_rate_per_s = rate_per_s
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._tokens = burst
        self._at = clock()
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_per_s)
            self._at = now
            self._tokens -= 1.0
            wait = -self._tokens / self.rate_per_s if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)

    def throttled(self) -> None:
        with self._lock:
            self.rate_per_s = max(self.nominal_rate_per_s / 8.0, self.rate_per_s / 2.0)
            self._tokens = min(self._tokens, 0.0)

    def succeeded(self) -> None:
        with self._lock:
            self.rate_per_s = min(self.nominal_rate_per_s, self.rate_per_s * 1.25)
