"""Do-nothing trainers for CLI tests, and ``python -m support.fake_replica``: the shipped stand-in replica
(``diloco.executors.testing.fake_replica``) under the short name that backend tests run from this directory.
"""

from __future__ import annotations

import signal
import time

from diloco.executors.testing.fake_replica import main, run

__all__ = ["idle", "main", "stubborn"]

# ---------------------------------------------------------------------------------------------- CLI trainers
# Trainer functions for tests that launch through the real CLI (``--trainer support.fake_replica:<fn>``, run from the
# tests directory, which a local replica's ``python -m`` puts on its path): replicas that do nothing but exist.


def idle(*, manager: object, rank: int, world_size: int, total_steps: int, sync_every: int,
         sleep_s: float = 600.0, **_: object) -> None:
    """Sleep; stops promptly on SIGTERM (the replica entrypoint's own handler)."""
    time.sleep(sleep_s)


def stubborn(*, manager: object, rank: int, world_size: int, total_steps: int, sync_every: int,
             sleep_s: float = 600.0, **_: object) -> None:
    """Ignore SIGTERM and sleep: only a SIGKILL stops it (a trainer stuck in native code, in effect)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"rank {rank} ignores SIGTERM", flush=True)
    time.sleep(sleep_s)


if __name__ == "__main__":
    run()
