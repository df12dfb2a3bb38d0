"""Metrics: the writer the outer loop drives, ``report()``, and a reader that no trainer's rows can crash.

Real stores (``memory://``, ``file://``), real threads; the writer's stats come from a real ``AllReduceStats``.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from diloco.collectives.allreduce import AllReduceStats
from diloco.launcher.progress import read_progress, read_replica
from diloco.replica.metric_rows import read_history
from diloco.replica.metrics import MetricsWriter, report, reporting_to
from diloco.store.objects import ObjectStore


def new_store() -> ObjectStore:
    return ObjectStore(f"memory://metrics-{uuid.uuid4().hex[:8]}")


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses NaN/Infinity, as every strict JSON parser (jq, JavaScript) does."""
    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def writer(store: ObjectStore, rank: int = 0, **kw: Any) -> MetricsWriter:
    stats = AllReduceStats(rounds=0, bytes_written=10, bytes_read=20, seconds_blocked=0.5)
    return MetricsWriter(store, rank, stats=lambda: stats, rounds=lambda: 0, **kw)


# ---------------------------------------------------------------------------------------------- reader
def test_bad_rows_from_a_trainer_never_crash_the_reader_and_warn_once_per_rank_and_field() -> None:
    """A trainer writing its own rows with "abc" in them must not crash launch, status or collect."""
    store = new_store()
    good = {"kind": "round", "time": 10.0, "step": 5, "total_steps": 10, "round": 1, "eval_loss": 2.0,
            "sync_s": 0.1}
    lines = [
        json.dumps({"kind": "init", "time": 1.0, "step": 0, "round": 0, "eval_loss": 5.5}),
        json.dumps({**good, "train_loss": "abc"}),
        "this is not json",
        json.dumps([1, 2, 3]),
        json.dumps({**good, "train_loss": "abc", "step": -4, "extra": {"acc": "high", "f1": 0.5}}),
        json.dumps({**good, "time": 20.0, "step": 10, "train_loss": 1.5, "tokens_per_s": "fast"}),
    ]
    store.put("metrics/rank_0001.jsonl", "\n".join(lines).encode())
    readout = read_progress(store, 2)

    assert readout.replicas[0].step is None  # rank 0 reported nothing yet: not a problem
    rep = readout.replicas[1]
    assert (rep.step, rep.round, rep.train_loss, rep.eval_loss, rep.tokens_per_s) == (10, 1, 1.5, 2.0, None)
    assert rep.initial_eval_loss == 5.5 and not rep.diverged
    warnings = readout.warnings
    assert all(w.startswith("rank 1: ") for w in warnings)
    by_field = {w.split("'")[1]: w for w in warnings if "field" in w}
    assert sorted(by_field) == ["extra.acc", "step", "tokens_per_s", "train_loss"]
    assert "in 2 row(s)" in by_field["train_loss"] and "'abc'" in by_field["train_loss"]
    assert len([w for w in warnings if "not JSON objects" in w]) == 1 and "2 metrics line(s)" in warnings[0]
    strict_json(readout.model_dump_json())


def test_non_finite_losses_are_divergence_never_nan_in_json() -> None:
    """A diverged run never prints NaN/Infinity (invalid JSON)."""
    store = new_store()
    # Python's json module writes (and reads) these tokens: a trainer writing its own rows produces them.
    rows = [{"kind": "init", "time": 1.0, "step": 0, "round": 0, "eval_loss": 5.5},
            {"kind": "round", "time": 2.0, "step": 5, "round": 1, "train_loss": float("nan"),
             "eval_loss": float("inf")}]
    store.put("metrics/rank_0000.jsonl", "\n".join(json.dumps(r) for r in rows).encode())
    readout = read_progress(store, 1)
    rep = readout.replicas[0]
    assert rep.diverged and rep.train_loss is None and rep.eval_loss is None
    assert readout.warnings == []  # divergence is a finding, not a malformed row
    parsed = strict_json(readout.model_dump_json())
    assert parsed["replicas"][0]["diverged"] is True and parsed["replicas"][0]["train_loss"] is None


def test_the_newest_of_history_and_progress_wins_and_final_means_finished() -> None:
    store = new_store()
    store.put("metrics/rank_0000.jsonl", json.dumps({"kind": "round", "time": 5.0, "step": 50, "round": 1}).encode())
    store.put("progress/rank_0000.json", json.dumps({"kind": "progress", "time": 9.0, "step": 80, "round": 1}).encode())
    rep, _ = read_replica(store, 0)
    assert (rep.step, rep.updated_at, rep.finished_training) == (80, 9.0, False)
    store.put("metrics/rank_0000.jsonl", json.dumps({"kind": "final", "time": 9.0, "step": 100, "round": 2}).encode())
    rep, _ = read_replica(store, 0)
    assert (rep.step, rep.round, rep.finished_training) == (100, 2, True)  # a tie goes to the history


# ---------------------------------------------------------------------------------------------- writer
def test_report_values_that_are_not_numbers_are_dropped_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    store = new_store()
    w = writer(store)
    caplog.set_level(logging.WARNING, logger="diloco.replica.metrics")
    with reporting_to(w):
        w.begin(0)
        for _ in range(3):
            report(train_loss="abc", eval_loss=2.0, tokens=1.5)
        w.on_step(1)
        w.finish(1)
    rows, warnings = read_history(store, 0)
    assert warnings == []
    assert rows[-1].train_loss is None and rows[-1].eval_loss == 2.0 and rows[-1].tokens is None
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "train_loss must be a number" in m]) == 1
    assert len([m for m in messages if "tokens must be a whole number" in m]) == 1


def test_a_nan_loss_is_written_as_null_with_diverged_true_and_stays_flagged() -> None:
    store = new_store()
    w = writer(store)
    with reporting_to(w):
        w.begin(0)
        report(train_loss=float("nan"))
        w.on_round(1)
        report(train_loss=1.0)  # a finite value later does not un-diverge the run
        w.finish(1)
    text = store.get("metrics/rank_0000.jsonl").decode()
    rows = [strict_json(line) for line in text.splitlines()]
    assert [r["diverged"] for r in rows] == [True, True, True]
    assert rows[0]["train_loss"] is None and rows[-1]["train_loss"] == 1.0
    assert strict_json(store.get("progress/rank_0000.json").decode())["diverged"] is True
    assert read_replica(store, 0)[0].diverged


def test_progress_is_one_small_object_rewritten_only_when_due(tmp_path: Path) -> None:
    """Object stores cannot append: the frequent write is a separate, constant-size object; the history is
    rewritten only when a row is added or amended."""
    store = ObjectStore(f"file://{tmp_path}")
    w = writer(store, progress_interval_s=3600)
    w.begin(0)
    w.on_step(1)  # closes the init row: written at once
    for step in range(2, 200):
        w.on_step(step)
    assert strict_json(store.get("progress/rank_0000.json").decode())["step"] == 1  # not due again yet
    sizes = []
    for round_ in range(1, 6):
        w.on_round(200 * round_)
        sizes.append(len(store.get("progress/rank_0000.json")))
    assert max(sizes) - min(sizes) < 10  # constant size: the same row, other numbers
    history = store.get("metrics/rank_0000.jsonl").decode().splitlines()
    assert [strict_json(line)["kind"] for line in history] == ["init"] + ["round"] * 5
    assert strict_json(store.get("progress/rank_0000.json").decode())["step"] == 1000


def test_a_failing_store_never_fails_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    store = ObjectStore(f"file://{tmp_path}/a-file/store", retries=0)
    w = writer(store, progress_interval_s=0.001)
    caplog.set_level(logging.WARNING, logger="diloco.replica.metrics")
    w.begin(0)
    for step in range(1, 5):
        w.on_step(step)
    w.on_round(5)
    w.finish(5)
    warned = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(warned) == 2  # once per object (history and progress), not once per write


def test_each_thread_reports_to_its_own_writer_and_helper_threads_reach_the_replicas() -> None:
    store = new_store()
    writers = [writer(store, rank=r) for r in range(2)]
    barrier = threading.Barrier(2)

    def rank(r: int) -> None:
        with reporting_to(writers[r]):
            writers[r].begin(0)
            barrier.wait()  # both writers active at once
            report(eval_loss=float(r))
            writers[r].finish(0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [read_replica(store, r)[0].eval_loss for r in range(2)] == [0.0, 1.0]

    w = writer(store, rank=5)
    with reporting_to(w):  # a trainer's helper thread (a data loader) has no writer of its own
        helper = threading.Thread(target=lambda: report(tokens=7))
        helper.start()
        helper.join(30)
        w.finish(0)
    assert read_replica(store, 5)[0].tokens == 7


def test_reserved_names_are_refused_and_report_is_a_no_op_outside_a_replica() -> None:
    report(train_loss=1.0, anything=2)  # nothing active: nothing happens
    for name in ("step", "round", "sync_s", "bytes_written"):
        with pytest.raises(ValueError, match=f"{name} is recorded by the DiLoCo outer loop"):
            report(**{name: 1})


def test_the_final_row_takes_later_reports_and_has_the_whole_run_rate() -> None:
    store = new_store()
    w = writer(store, total_steps=4)
    with reporting_to(w):
        w.begin(0)
        for step in range(1, 5):
            report(tokens=100)
            w.on_step(step)
        w.finish(4)
        report(eval_loss=1.25)  # e.g. an evaluation after the loop was left
    w.close()  # the entrypoint's call after the trainer returns: nothing more to add
    rows, _ = read_history(store, 0)
    assert [r.kind for r in rows] == ["init", "final"]
    assert rows[-1].eval_loss == 1.25 and rows[-1].tokens == 400 and (rows[-1].tokens_per_s or 0) > 0
    assert rows[-1].total_steps == 4 and rows[-1].bytes_read == 20 and rows[-1].sync_s == 0.5
    rep, _ = read_replica(store, 0)
    assert rep.finished_training and rep.eval_loss == 1.25


def test_a_rejoining_replica_keeps_its_history_up_to_the_committed_round() -> None:
    """A relaunched replica's writer starts empty; without resume() its first write would replace the
    rounds it recorded before it died. Rows past the committed round (work thrown away) are dropped."""
    store = new_store()
    rows = [{"kind": "init", "time": 1.0, "step": 0, "round": 0, "eval_loss": 5.5}] + [
        {"kind": "round", "time": 1.0 + r, "step": 10 * r, "round": r, "eval_loss": 5.0 - r} for r in (1, 2, 3)]
    store.put("metrics/rank_0000.jsonl", "\n".join(json.dumps(r) for r in rows).encode())
    resumed = writer(store)
    resumed.resume(2)
    resumed.begin(20)  # what the outer loop does next: no second init row
    assert [(r["kind"], r["round"]) for r in resumed.history] == [("init", 0), ("round", 1), ("round", 2)]
    resumed.on_round(30)
    history, _ = read_history(store, 0)
    assert [r.kind for r in history] == ["init", "round", "round", "round"] and history[1].eval_loss == 4.0
