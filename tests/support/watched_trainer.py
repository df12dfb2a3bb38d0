"""A trainer that only talks: one line every ``every_s`` seconds until the replica is stopped.

For runs that are watched and cancelled (tests/sagemaker_scenario.py): it costs no model and no torch, keeps its
job in ``Training`` and its log stream growing, and stops promptly on SIGTERM (the replica entrypoint's handler).
"""

from __future__ import annotations

import time
from typing import Any


def train(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int, every_s: float = 0.5,
          seconds: float = 600.0, **_: Any) -> None:
    began = time.monotonic()
    tick = 0
    while time.monotonic() - began < seconds:
        print(f"rank {rank} tick {tick}", flush=True)
        tick += 1
        time.sleep(every_s)
