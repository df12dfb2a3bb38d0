"""A waiting command's repeated reports reuse the replicas' metrics for a moment, and read them afresh as soon as a
replica's state changes: on a real store, with the metrics a replica writes."""

from __future__ import annotations

import json
from pathlib import Path

from diloco.launcher.progress import ProgressCache
from diloco.launcher.reports import run_report
from diloco.store.layout import METRICS_KEY
from diloco.store.objects import ObjectStore

RUNNING = ((0, "running", 0), (1, "running", 0))


def write_step(store: ObjectStore, rank: int, step: int) -> None:
    row = {"kind": "round", "time": 1.0 + step, "step": step, "total_steps": 100, "round": step // 10,
           "train_loss": 3.0, "eval_loss": 3.0}
    store.put(METRICS_KEY.format(rank=rank), (json.dumps(row) + "\n").encode())


def steps(readout: object) -> list[int | None]:
    return [r.step for r in readout.replicas]  # type: ignore[attr-defined]


def test_a_readout_is_reused_while_young_and_states_hold_and_read_again_when_a_state_changes(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}")
    write_step(store, 0, 10)
    write_step(store, 1, 10)
    cache = ProgressCache()
    assert steps(cache.read(store, 2, key=RUNNING, max_age_s=60)) == [10, 10]
    write_step(store, 0, 20)
    assert steps(cache.read(store, 2, key=RUNNING, max_age_s=60)) == [10, 10]  # reused: nothing read
    ended = ((0, "succeeded", 0), (1, "running", 0))
    assert steps(cache.read(store, 2, key=ended, max_age_s=60)) == [20, 10]  # a state changed: read afresh
    write_step(store, 1, 30)
    assert steps(cache.read(store, 2, key=ended, max_age_s=0)) == [20, 30]  # no reuse asked: read afresh
    assert steps(cache.read(store, 3, key=ended, max_age_s=60)) == [20, 30, None]  # the run grew: read afresh


def test_a_warning_one_report_adds_is_not_in_the_next(tmp_path: Path) -> None:
    from diloco.executors.base import ReplicaState, ReplicaStatus, RunState, RunStatus
    from diloco.launcher.runs import RunRecord

    store = ObjectStore(f"file://{tmp_path}")
    store.put(METRICS_KEY.format(rank=0), b"not json\n")
    cache = ProgressCache()
    record = RunRecord(run_id="r", backend="local", created_at=0.0, rendezvous_uri=f"file://{tmp_path}", replicas=1,
                       config={})
    status = RunStatus(run_id="r", replicas=[ReplicaStatus(rank=0, state=ReplicaState.RUNNING)])
    reports = []
    for _ in range(2):
        report = run_report(record, status, cache.read(store, 1, key=RUNNING[:1], max_age_s=60),
                            state=RunState.RUNNING, left_behind=[], awaiting_relaunch=[])
        reports.append(list(report.warnings))
        report.warnings.append("the backend could not be asked")
    assert reports[0] == reports[1] and len(reports[0]) == 1 and "not JSON" in reports[0][0]
