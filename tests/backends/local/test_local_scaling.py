"""Growing a live local run (``add_ranks``): what the conformance suite cannot see from outside the local backend.

The replicas are ``fake_replica`` processes (torch-free); every check is on real processes, files and signals."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from diloco.errors import BackendError, ConfigError
from diloco.executors.base import ReplicaState, RunState
from diloco.executors.local import REQUESTS_FILE, LocalBackend, LocalBackendConfig
from diloco.executors.local_supervisor import processes_with_env
from diloco.executors.testing import BackendCase, wait_for_output, wait_until


def processes_of_run(run_id: str) -> list[int]:
    """Live processes whose environment carries the run's id (replicas, supervisors' children)."""
    return sorted(processes_with_env("DILOCO_RUN_ID", run_id))


def _backend(root: Path) -> LocalBackend:
    return LocalBackend(LocalBackendConfig(log_root=str(root / "runs"), grace_period_s=1.0))


def _run_id(name: str) -> str:
    return f"{name}-{os.getpid()}-{int(time.time() * 1000) % 10**6}"


def _spec(run_id: str, **behaviour: Any) -> Any:
    return BackendCase().spec(run_id, replicas=2, **behaviour)


def _gone(run_id: str, patience_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + patience_s
    while processes_of_run(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    return processes_of_run(run_id)


def test_added_ranks_are_seen_cancelled_and_removed_through_a_stale_handle(tmp_path: Path) -> None:
    """Another process (``diloco scale``) grows the run; the launcher's and the registry's copy of the handle, taken
    at submit, still sees the new replicas (describe, logs), stops them (cancel) and deletes their files (remove)."""
    backend = _backend(tmp_path)
    run_id = _run_id("grow-stale")
    spec = _spec(run_id, sleep=120, announce_world=True, lines=1, env_out=str(tmp_path))
    stale = backend.submit(backend.plan(spec))
    wait_until(backend, stale, {ReplicaState.RUNNING}, 30)
    grown = _backend(tmp_path).add_ranks(stale, [2, 3], spec)  # a fresh backend object, as another CLI has
    assert grown.ranks is None and grown.own_ranks == [0, 1, 2, 3]
    requests = json.loads((Path(stale.run_dir) / REQUESTS_FILE).read_text())["requests"]
    assert [r["rank"] for r in requests] == [0, 1, 2, 3]
    assert [r["env"]["WORLD_SIZE"] for r in requests] == ["2", "2", "4", "4"]
    assert {r["env"]["DILOCO_CHECKPOINT_DIR"] for r in requests} == {os.path.join(stale.run_dir, "checkpoints")}
    status = wait_until(backend, stale, {ReplicaState.RUNNING}, 30)
    assert [r.rank for r in status.replicas] == [0, 1, 2, 3], status
    wait_for_output(backend, grown, "line 0", 30)  # each replica wrote what it saw before that line
    assert "rank 3 of world size 4" in [r.text for r in backend.logs(stale, [3])]
    for rank in (2, 3):
        seen = json.loads((tmp_path / f"rank_{rank}.json").read_text())["env"]
        assert (seen["REPLICA_RANK"], seen["WORLD_SIZE"], seen["DILOCO_RUN_ID"]) == (str(rank), "4", run_id)
    assert len(processes_of_run(run_id)) >= 4
    backend.cancel(stale)
    final = backend.wait(stale, timeout_s=30, poll_interval_s=0.2)
    assert final.state == RunState.CANCELLED and len(final.replicas) == 4, final
    assert _gone(run_id) == [], "no added replica may outlive the cancel"
    with pytest.raises(ConfigError, match="cancelled"):
        backend.add_ranks(stale, [4], spec)
    assert backend.remove(stale) and not Path(stale.run_dir).exists()


def test_an_added_rank_that_fails_is_relaunched_with_its_own_request(tmp_path: Path) -> None:
    """Rank 2, added, is killed (as the OOM killer would): ``relaunch`` starts it again from the request
    ``add_ranks`` recorded, with the same rank and rank space, and describe counts the restart."""
    backend = _backend(tmp_path)
    run_id = _run_id("grow-relaunch")
    spec = _spec(run_id, sleep=60, env_out=str(tmp_path))
    handle = backend.add_ranks(backend.submit(backend.plan(spec)), [2], spec)
    try:
        wait_for_output(backend, handle, "line 0", 30)
        os.kill(json.loads((tmp_path / "rank_2.json").read_text())["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (status := backend.describe(handle)).replica(2).state != ReplicaState.FAILED:
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        assert [r.state for r in status.replicas[:2]] == [ReplicaState.RUNNING] * 2
        (tmp_path / "rank_2.json").unlink()
        handle = backend.relaunch(handle, 2)
        again = wait_until(backend, handle, {ReplicaState.RUNNING}, 30)
        assert again.replica(2).restarts == 1, again
        wait_for_output(backend, handle, "line 0", 30)
        seen = json.loads((tmp_path / "rank_2.json").read_text())["env"]
        assert (seen["REPLICA_RANK"], seen["WORLD_SIZE"]) == ("2", "3")
    finally:
        backend.cancel(handle)
    assert backend.wait(handle, timeout_s=30, poll_interval_s=0.2).terminal
    assert _gone(run_id) == []


def test_an_add_cut_short_stops_only_what_it_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 3 cannot be started (its spawn fails as a missing working directory makes it fail): rank 2, started by
    the same call, is stopped and forgotten, and ranks 0-1 run on, the handle and requests as before the call."""
    backend = _backend(tmp_path)
    run_id = _run_id("grow-cut")
    spec = _spec(run_id, sleep=120)
    handle = backend.submit(backend.plan(spec))
    wait_until(backend, handle, {ReplicaState.RUNNING}, 30)
    before = (Path(handle.run_dir) / REQUESTS_FILE).read_text()
    real = backend._requests

    def third_cannot_start(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        requests = real(*args, **kwargs)
        requests[-1]["cwd"] = str(tmp_path / "no-such-directory")
        return requests

    monkeypatch.setattr(backend, "_requests", third_cannot_start)
    try:
        with pytest.raises(BackendError, match="could not start local replica 3"):
            backend.add_ranks(handle, [2, 3], spec)
        assert (Path(handle.run_dir) / REQUESTS_FILE).read_text() == before
        status = backend.describe(handle)
        assert [r.rank for r in status.replicas] == [0, 1]
        assert all(r.state == ReplicaState.RUNNING for r in status.replicas), status
        ranks = {int(env.get("REPLICA_RANK", -1)) for env in processes_with_env("DILOCO_RUN_ID", run_id).values()}
        assert ranks == {0, 1}, f"only ranks 0 and 1 may be left: {ranks}"
    finally:
        backend.cancel(handle)
    backend.wait(handle, timeout_s=30, poll_interval_s=0.2)
    assert _gone(run_id) == []
