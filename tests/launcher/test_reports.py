"""A replica's row in a run's report is its backend status and its progress, each field declared once: every field
of either is in the row, with its value, and a row is built without naming any of them."""

from __future__ import annotations

from diloco.executors.base import ReplicaState, ReplicaStatus
from diloco.executors.failures import FailureClass, FailureVerdict
from diloco.launcher.progress import ProgressMetrics, ReplicaProgress
from diloco.launcher.reports import ReplicaReport


def test_a_row_carries_every_status_and_progress_field_with_its_value() -> None:
    status = ReplicaStatus(rank=2, state=ReplicaState.FAILED, job_id="job-2", backend="local", part=1,
                           reason="killed", detail="pid 7", exit_code=137, restarts=1, timed_out=False,
                           started_at=10.0, ended_at=20.0, artifacts={"model": "file:///m"}, billable_s=10.0,
                           cost_usd=0.5, cost_source="table",
                           failure=FailureVerdict(failure_class=FailureClass.KILLED, relaunch=True, why="oom"))
    progress = ReplicaProgress(rank=2, step=40, total_steps=80, round=2, train_loss=3.5, eval_loss=3.25,
                               initial_eval_loss=4.0, tokens=1000, tokens_per_s=50.0, sync_s=0.25,
                               bytes_written=11, bytes_read=22, diverged=True, finished_training=False,
                               updated_at=19.0, extra={"lr": 0.1})
    row = ReplicaReport.of(status, progress)
    for name in ReplicaStatus.model_fields:
        assert getattr(row, name) == getattr(status, name), name
    for name in ProgressMetrics.model_fields:
        assert getattr(row, name) == getattr(progress, name), name
    assert "extra" not in ReplicaReport.model_fields  # the trainer's own values stay out of the report
    assert set(ReplicaReport.model_fields) - set(ReplicaStatus.model_fields) - set(ProgressMetrics.model_fields) \
        == {"eval_trend", "async_last_upload_at", "async_staleness", "stderr_tail"}


def test_a_replica_that_reported_nothing_has_empty_metrics() -> None:
    row = ReplicaReport.of(ReplicaStatus(rank=0, state=ReplicaState.PENDING), None)
    assert row.step is None and row.eval_loss is None and not row.diverged and row.state == ReplicaState.PENDING


def _row(rank: int, state: ReplicaState, *, round_: int, eval_loss: float, exit_code: int | None = None
         ) -> ReplicaReport:
    return ReplicaReport.of(ReplicaStatus(rank=rank, state=state, exit_code=exit_code),
                            ReplicaProgress(rank=rank, step=5 * round_, total_steps=15, round=round_,
                                            eval_loss=eval_loss))


def test_the_models_eval_loss_is_never_a_mean_with_a_replica_left_at_an_earlier_round() -> None:
    """A ``--min-replicas`` run that succeeded without a replica dropped more often than ``--max-restarts``
    allowed: that replica failed (exit 75, dropped) holding round 2's model, so the run's latest and final eval
    losses are those of the replicas at round 3, not a mean with its stale one. While it was still being
    relaunched (not failed), its earlier round kept it out all the same."""
    from diloco.launcher.reports import model_eval_loss

    on_time = _row(0, ReplicaState.SUCCEEDED, round_=3, eval_loss=4.0)
    left_behind = _row(1, ReplicaState.FAILED, round_=2, eval_loss=4.5, exit_code=75)
    assert model_eval_loss([on_time, left_behind]) == 4.0
    assert model_eval_loss([on_time, left_behind], final=True) == 4.0
    relaunching = _row(1, ReplicaState.PENDING, round_=2, eval_loss=4.5)
    assert model_eval_loss([_row(0, ReplicaState.RUNNING, round_=3, eval_loss=4.0), relaunching]) == 4.0
    # replicas of one round hold one model: their mean; replicas whose rounds do not line up (async) all count
    peers = [on_time, _row(1, ReplicaState.SUCCEEDED, round_=3, eval_loss=4.5)]
    assert model_eval_loss(peers) == 4.25
    assert model_eval_loss([on_time, relaunching], by_round=False) == 4.25
