"""Run one function per rank in threads: the multi-rank harness of the all-reduce and outer-loop tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_ranks(world_size: int, fn: Callable[[int], Any], timeout: float = 30) -> list[Any]:
    """Run ``fn(rank)`` for every rank in its own thread; return results in rank order, re-raising the first error."""
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank hung"
    for exc in errors:
        if exc is not None:
            raise exc
    return results
