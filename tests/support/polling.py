"""The bounded waits tests poll with, in one place: ``until`` returns the value (or the last falsy one at the limit,
so the test's own assertion says what was missing); ``wait_for`` fails naming what it waited for. A limit only
bounds a hang: tests never measure speed with it, so it is generous and derived from the work where it matters."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def until(check: Callable[[], T], limit_s: float, *, interval_s: float = 0.05) -> T:
    """Poll ``check`` every ``interval_s`` until it returns something truthy or ``limit_s`` has passed."""
    deadline = time.monotonic() + limit_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def wait_for(check: Callable[[], T], what: str, limit_s: float = 60.0, *, interval_s: float = 0.05,
             alive: Callable[[], bool] | None = None) -> T:
    """``check()``'s first truthy value; ``AssertionError`` naming ``what`` past ``limit_s``, or as soon as
    ``alive()`` says the process being waited on has ended (it will never come true then)."""
    deadline = time.monotonic() + limit_s
    while True:
        value = check()
        if value:
            return value
        if alive is not None and not alive():
            raise AssertionError(f"the process ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s:g}s waiting for {what}")
        time.sleep(interval_s)


def wait_for_file(path_glob: str, root: Path, limit_s: float = 120) -> Path:
    """The first file under ``root`` matching ``path_glob`` once one exists; ``AssertionError`` naming it past
    ``limit_s``."""
    return wait_for(lambda: next(iter(root.glob(path_glob)), None), f"{path_glob} under {root}", limit_s)
