"""A relaunch on the local backend moves the ended attempt's files aside (``rank_R.tryN``) and gives the rank's log
directory to the next attempt. Whoever reads the rank meanwhile, or later through a handle taken before the relaunch
(a record another process has not rewritten yet, a ``logs -f`` following the attempt it started with), must still
see the attempt it knew as it ended: its exit and reason, and its own output, never the next attempt's files nor,
between the move and the next start, nothing at all.

The replicas are ``fake_replica`` processes (torch-free): real processes, files and signals."""

from __future__ import annotations

import os
import time
from pathlib import Path

from diloco.executors.base import ReplicaState
from diloco.executors.local import LocalBackend, LocalBackendConfig
from diloco.executors.testing import BackendCase, wait_until


def _texts(records: list) -> list[tuple[str, str]]:
    return [(r.stream, r.text) for r in records]


def test_an_ended_attempt_reads_as_it_ended_while_and_after_a_relaunch_moves_its_files(tmp_path: Path) -> None:
    backend = LocalBackend(LocalBackendConfig(log_root=str(tmp_path / "runs"), grace_period_s=1.0))
    run_id = f"relaunch-window-{os.getpid()}-{int(time.time() * 1000) % 10**6}"
    spec = BackendCase().spec(run_id, replicas=1, lines=2, fail_rank=0, fail_exit=3)
    handle = backend.submit(backend.plan(spec))
    ended = wait_until(backend, handle, {ReplicaState.FAILED}, 30).replica(0)
    assert ended.state == ReplicaState.FAILED and ended.exit_code == 3, ended
    first = list(backend.logs(handle, [0]))
    assert ("out", "rank 0 line 1") in _texts(first), first

    # What relaunch does first: the attempt's files move aside; the next attempt has not started yet.
    p = handle.process(0)
    assert p is not None
    os.replace(p.log_dir, p.moved_dir)
    between = backend.describe(handle).replica(0)
    assert (between.state, between.exit_code, between.reason) == (ended.state, 3, ended.reason), between
    assert list(backend.logs(handle, [0])) == first

    stale, handle = handle, backend.relaunch(handle, 0)
    again = wait_until(backend, handle, {ReplicaState.FAILED}, 30).replica(0)
    assert again.restarts == 1 and again.exit_code == 3, again
    second = list(backend.logs(handle, [0]))
    assert _texts(second) == _texts(first) and min(r.ts for r in second) > max(r.ts for r in first)
    assert list(backend.logs(stale, [0])) == first  # the handle taken before the relaunch: its own attempt
    assert backend.failure_tail(stale, 0) == backend.failure_tail(handle, 0)  # each attempt's own stderr
    assert os.path.isdir(p.moved_dir) and os.path.isdir(p.log_dir)
    assert backend.remove(handle) and not os.path.exists(p.moved_dir)
