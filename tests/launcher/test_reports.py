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
