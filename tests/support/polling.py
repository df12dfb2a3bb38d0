"""One bounded wait for tests that poll a backend: the value once truthy, or the last (falsy) value at the limit,
so the test's own assertion says what was missing."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
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


def wait_for_file(path_glob: str, root: Path, limit_s: float = 120) -> Path:
    """The first file under ``root`` matching ``path_glob`` once one exists; ``AssertionError`` naming it past
    ``limit_s``."""
    found = until(lambda: next(iter(root.glob(path_glob)), None), limit_s)
    if found is None:
        raise AssertionError(f"timed out waiting for {path_glob} under {root}")
    return found
