"""Deadlines for tests, derived from what this machine measures now rather than fixed few-second constants.

A test that gives real processes a deadline (a round's ``store.timeout_s``, a wait for a replica) must not fail
because the machine is busy: on two shared cores a replica's start-up, which dominates how far apart peers reach
their first round, stretches several times over. ``replica_start_s`` measures that start-up here, under whatever
load there is, so a deadline scaled by it stretches with the load and stays short on an idle machine.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time

#: What a replica process imports before it can contribute to a round (the entrypoint, the outer loop, torch).
_REPLICA_IMPORTS = "import torch, diloco.replica.entrypoint, diloco.outer"


@functools.lru_cache(maxsize=1)
def replica_start_s() -> float:
    """Seconds a fresh interpreter takes, here and now, to import what a replica imports: the measured cost that
    peers' start-up skew is made of. Measured once per test process (the load a suite puts on the machine is
    steady over its run; the first measurement is taken under it)."""
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", _REPLICA_IMPORTS], check=True, capture_output=True, timeout=600)
    return time.monotonic() - began


def round_deadline_s(floor_s: float, *, starts: float = 4.0) -> float:
    """A round deadline no live replica misses through load alone: ``starts`` times the measured replica start-up
    (the spread between the first and the last peer reaching a round is at most a start-up or so, and a busy
    machine slows the replicas' steps in the same proportion), never below ``floor_s``, the deadline the test
    was written for on an idle machine."""
    return max(floor_s, starts * replica_start_s())
