"""One bounded wait for tests that poll a backend: the value once truthy, or the last (falsy) value at the limit,
so the test's own assertion says what was missing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(check: Callable[[], T], limit_s: float) -> T:
    """Poll ``check`` every 50 ms until it returns something truthy or ``limit_s`` has passed."""
    deadline = time.monotonic() + limit_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)
