"""A run's state rules (``diloco.launcher.lifecycle``) as pure functions: hand-built statuses in, a verdict out; no
process, no store, no backend. And the run record's typed policy, written by an older diloco as a plain config and
read back migrated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco.executors.base import ReplicaState, ReplicaStatus, RunState, RunStatus
from diloco.executors.failures import EXIT_DROPPED, FailureClass, FailureVerdict
from diloco.launcher import lifecycle
from diloco.launcher.lifecycle import Relaunches, RunPolicy
from diloco.launcher.runs import RECORD_VERSION, RunRecord, RunRegistry
from diloco.store.settings import StoreSettings

S, F, R = ReplicaState.SUCCEEDED, ReplicaState.FAILED, ReplicaState.RUNNING
KILLED, OWN_ERROR = 137, 1


def run(*replicas: ReplicaStatus) -> RunStatus:
    return RunStatus(run_id="r", replicas=list(replicas))


def rep(rank: int, state: ReplicaState, exit_code: int | None = None, **kw: object) -> ReplicaStatus:
    return ReplicaStatus(rank=rank, state=state, exit_code=exit_code, **kw)  # type: ignore[arg-type]


EVERY_RANK = frozenset(range(4))
CAN_RELAUNCH = Relaunches(ranks=EVERY_RANK, limit=3)
NO_RELAUNCH = Relaunches()


@pytest.mark.parametrize(("replica", "curable"), [
    (rep(0, F, KILLED), True),  # SIGKILL, the OOM killer
    (rep(0, F, None), True),  # lost without an exit code
    (rep(0, F, EXIT_DROPPED), True),  # dropped from a min_replicas round: rejoins at the next
    (rep(0, F, OWN_ERROR), False),  # the trainer raised: it would again
    (rep(0, F, KILLED, timed_out=True), False),  # the run's time limit is no accident
    (rep(0, S, 0), False),
    (rep(0, F, OWN_ERROR, failure=FailureVerdict(failure_class=FailureClass.CAPACITY, relaunch=True, why="no gpu")),
     True),  # the service's own report outranks the exit code
    (rep(0, F, KILLED, failure=FailureVerdict(failure_class=FailureClass.USER_ERROR, relaunch=False, why="bad")),
     False),
])
def test_relaunchable_by_the_failure_report_else_the_exit_code(replica: ReplicaStatus, curable: bool) -> None:
    assert lifecycle.relaunchable(replica) is curable


def test_a_killed_replica_with_restarts_left_keeps_the_run_running() -> None:
    status = run(rep(0, F, KILLED, restarts=1), rep(1, S, 0))
    assert lifecycle.awaiting_relaunch(status, CAN_RELAUNCH) == [0]
    assert lifecycle.lost(status, CAN_RELAUNCH) == []
    assert lifecycle.verdict(status, RunPolicy(), CAN_RELAUNCH) == RunState.RUNNING


def test_without_restarts_left_or_a_backend_that_relaunches_the_same_replica_is_lost() -> None:
    status = run(rep(0, F, KILLED, restarts=3), rep(1, S, 0))
    assert lifecycle.lost(status, CAN_RELAUNCH) == [0]  # 3 of 3 restarts used
    assert lifecycle.lost(run(rep(0, F, KILLED), rep(1, S, 0)), NO_RELAUNCH) == [0]
    assert lifecycle.verdict(status, RunPolicy(), CAN_RELAUNCH) == RunState.FAILED
    # Only ranks whose backend relaunches (a run split over backends): rank 1's part cannot.
    split = Relaunches(ranks=frozenset({0}), limit=3)
    assert lifecycle.lost(run(rep(0, F, KILLED), rep(1, F, KILLED)), split) == [1]


def test_a_relaunch_a_wait_scheduled_is_awaited_whatever_the_replica_says() -> None:
    status = run(rep(0, F, OWN_ERROR), rep(1, R))
    waiting = Relaunches(ranks=EVERY_RANK, limit=3, pending=frozenset({0}))
    assert lifecycle.awaits_relaunch(status.replica(0), waiting)
    assert not lifecycle.awaits_relaunch(status.replica(0), CAN_RELAUNCH)


def test_min_replicas_goes_on_without_a_lost_replica_and_succeeds_leaving_it_behind() -> None:
    policy = RunPolicy(min_replicas=2)
    going = run(rep(0, F, OWN_ERROR), rep(1, R), rep(2, R))
    assert lifecycle.can_go_on_without(going, policy, CAN_RELAUNCH)
    assert lifecycle.can_finish(going, policy, CAN_RELAUNCH)
    assert lifecycle.verdict(going, policy, CAN_RELAUNCH) == RunState.RUNNING
    done = run(rep(0, F, OWN_ERROR), rep(1, S, 0), rep(2, S, 0))
    assert lifecycle.verdict(done, policy, CAN_RELAUNCH) == RunState.SUCCEEDED
    assert lifecycle.left_behind(done, policy, CAN_RELAUNCH) == [0]
    # Below min_replicas the run cannot finish; without min_replicas one lost replica fails it.
    too_few = run(rep(0, F, OWN_ERROR), rep(1, F, OWN_ERROR), rep(2, R))
    assert not lifecycle.can_finish(too_few, policy, CAN_RELAUNCH)
    assert lifecycle.verdict(too_few, policy, CAN_RELAUNCH) == RunState.FAILED
    assert lifecycle.verdict(going, RunPolicy(), CAN_RELAUNCH) == RunState.FAILED
    assert lifecycle.left_behind(done, RunPolicy(), CAN_RELAUNCH) == []


def test_a_run_cancelled_while_a_replica_awaited_its_relaunch_is_cancelled_not_failed() -> None:
    status = run(rep(0, F, KILLED), rep(1, ReplicaState.CANCELLED))
    assert not lifecycle.can_finish(status, RunPolicy(), CAN_RELAUNCH)
    assert lifecycle.verdict(status, RunPolicy(), CAN_RELAUNCH) == RunState.CANCELLED
    assert lifecycle.to_relaunch(status, RunPolicy(), CAN_RELAUNCH, max_restarts=3) == []  # never into it


def test_to_relaunch_takes_curable_unscheduled_replicas_with_restarts_left_and_backs_off_exponentially() -> None:
    status = run(rep(0, F, KILLED, restarts=0), rep(1, F, KILLED, restarts=2), rep(2, R), rep(3, F, KILLED))
    pending = Relaunches(ranks=EVERY_RANK, limit=3, pending=frozenset({3}))
    assert [s.rank for s in lifecycle.to_relaunch(status, RunPolicy(), pending, max_restarts=2)] == [0]
    assert [lifecycle.relaunch_delay(2.0, n) for n in range(4)] == [2.0, 4.0, 8.0, 16.0]


def test_the_policy_defaults_are_the_run_configs_own() -> None:
    policy = RunPolicy()
    assert policy.round_timeout_s == StoreSettings().timeout_s
    assert policy.poll_interval_s == StoreSettings().poll_interval_s
    assert RunPolicy(poll_interval_s=30).watch_interval_s == 2.0
    assert RunPolicy(poll_interval_s=0.01).watch_interval_s == 0.2


def test_an_older_record_is_read_with_the_policy_its_config_says(tmp_path: Path) -> None:
    """A version-2 record, as an older diloco wrote it: ``max_restarts`` at the top, the settings only in the
    config (``min_replicas`` at the config's top level, as records older still kept it)."""
    registry = RunRegistry(tmp_path)
    registry.prepare()
    old = {"version": 2, "run_id": "diloco-20240101-000000-abcdefgh", "backend": "local", "created_at": 1.0,
           "rendezvous_uri": "file:///x", "replicas": 3, "handle": None, "final_state": None,
           "max_restarts": 5, "left_behind": [], "weights_disagree": None,
           "config": {"replicas": 3, "max_restarts": 1, "min_replicas": 2, "train": {"mode": "async"},
                      "store": {"timeout_s": 60.0, "poll_interval_s": 0.5}}}
    registry.path(old["run_id"]).write_text(json.dumps(old))  # type: ignore[arg-type]
    record = registry.load(old["run_id"])  # type: ignore[arg-type]
    assert record.version == RECORD_VERSION
    assert record.policy == RunPolicy(min_replicas=2, max_restarts=5, round_timeout_s=60.0, poll_interval_s=0.5,
                                      mode="async")
    registry.save(record)  # written back in the new form, and read the same
    assert "max_restarts" not in json.loads(registry.path(record.run_id).read_text())
    assert registry.load(record.run_id).policy == record.policy
    # An older record still without max_restarts of its own falls back to its config's.
    del old["max_restarts"]
    assert RunRecord.model_validate(old).policy.max_restarts == 1
