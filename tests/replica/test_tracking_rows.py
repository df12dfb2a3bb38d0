"""The tracker-neutral half of ``diloco.replica.tracking``: which rows a sink logs, at which step, and what it never
does (a step twice, a progress snapshot, a credential in a message). The trackers themselves are exercised for real in
``test_tracking.py``; here a sink whose tracker is a list shows the bookkeeping alone."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diloco.replica.tracking import TrackingSink, row_metrics, safe_uri


class ListSink(TrackingSink):
    """A sink whose tracker is a list of ``(step, metrics)``, holding ``already`` as its series' last step."""

    tracker = "list"

    def __init__(self, rank: int, history: Any = None, already: int | None = None, fail: bool = False) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self._already = already
        self._fail_connect = fail
        super().__init__(rank, history)

    def connect(self) -> None:
        if self._fail_connect:
            raise ConnectionRefusedError("[Errno 111] Connection refused")

    def last_logged_step(self) -> int | None:
        return self._already

    def log_step(self, metrics: dict[str, float], step: int, *, timestamp: float | None) -> None:
        self.logged.append((step, metrics))


def row(kind: str, step: int, round_: int, sync_s: float = 0.0, **more: Any) -> dict[str, Any]:
    return {"kind": kind, "step": step, "round": round_, "sync_s": sync_s, "bytes_written": 10 * step,
            "bytes_read": 20 * step, "train_loss": 1.0 / (step + 1), "time": 1000.0 + step, **more}


def test_a_row_becomes_prefixed_metrics_with_the_rounds_own_sync_seconds() -> None:
    sink = ListSink(2)
    sink.on_row(row("init", 0, 0))
    sink.on_row({"kind": "progress", "step": 2, "tokens_per_s": 5.0})  # a snapshot: not logged
    sink.on_row(row("round", 4, 1, sync_s=1.5, extra={"compression_error": 0.25, "nan": float("nan")}))
    sink.on_row(row("round", 8, 2, sync_s=4.0))
    sink.on_row(row("final", 8, 2, sync_s=4.0))  # the last round's step again
    sink.close()
    assert [step for step, _ in sink.logged] == [0, 4, 8]
    step4 = sink.logged[1][1]
    assert step4["r2/round"] == 1 and step4["r2/bytes_read"] == 80 and step4["r2/extra/compression_error"] == 0.25
    assert "r2/extra/nan" not in step4
    assert step4["r2/round_sync_s"] == 1.5 and sink.logged[2][1]["r2/round_sync_s"] == 2.5


def test_a_relaunched_replica_skips_what_its_series_holds_and_sends_what_its_predecessor_did_not() -> None:
    # its predecessor logged up to step 4 and died; the store's history (what the writer resumed) runs to step 12
    history = [row("init", 0, 0), row("round", 4, 1), row("round", 8, 2), row("round", 12, 3)]
    sink = ListSink(0, history=lambda: history, already=4)
    sink.on_row(row("init", 12, 3))  # the relaunched replica's own first row
    history.append(row("round", 16, 4))
    sink.on_row(history[-1])
    sink.close()
    assert [step for step, _ in sink.logged] == [8, 12, 16]


def test_an_unreachable_tracker_is_one_warning_without_the_password_and_training_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="diloco.replica.tracking")
    sink = ListSink(1, fail=True)
    for step in range(0, 12, 4):
        sink.on_row(row("round", step, step // 4))
    sink.close()
    assert sink.logged == []
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "training goes on" in warnings[0], warnings
    assert safe_uri("https://user:s3cret@mlflow.example:8443/x") == "https://mlflow.example:8443/x"


def test_a_counter_that_restarted_gives_no_round_latency() -> None:
    assert "round_sync_s" not in row_metrics(row("round", 4, 1, sync_s=0.5), previous_sync_s=3.0)


def test_the_cli_and_the_launch_path_import_no_tracker() -> None:
    code = ("import sys, diloco.cli.main, diloco.launcher.launch, diloco.launcher.run, diloco.replica.entrypoint\n"
            "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_a_job_without_the_tracker_installs_its_extra() -> None:
    """A SageMaker or Kubernetes job's bootstrap installs a tracker's extra only for a run that logs to it."""
    from diloco.defaults import DEFAULT_TRAINER
    from diloco.executors.replica_requirements import diloco_extras, replica_requirements

    common = {"trainer": DEFAULT_TRAINER, "rendezvous_uri": "file:///tmp/r", "tensorboard": False,
              "source_dir": None, "ships_requirements_txt": False}
    assert replica_requirements(**common) == []
    wanted = replica_requirements(**common, trackers=("mlflow", "wandb"))
    assert wanted == [*diloco_extras()["mlflow"], *diloco_extras()["wandb"]] and wanted


def test_participants_are_the_world_or_what_a_partial_rounds_manifest_names(tmp_path: Path) -> None:
    from diloco.replica.settings import ReplicaSettings
    from diloco.replica.tracking import participants_reader
    from diloco.store.layout import ROUND_MANIFEST_KEY
    from diloco.store.objects import ObjectStore

    store = ObjectStore(tmp_path.as_uri())
    full = ReplicaSettings(rendezvous_uri=tmp_path.as_uri(), world_size=4)
    assert participants_reader(full, store)(3) == 4 and participants_reader(full, store)(0) is None
    partial = ReplicaSettings(rendezvous_uri=tmp_path.as_uri(), world_size=4, min_replicas=2, allreduce="gather")
    store.put(ROUND_MANIFEST_KEY.format(round=2), json.dumps({"round": 2, "members": [0, 2, 3]}).encode())
    assert participants_reader(partial, store)(3) == 3  # round 3 is round_000002
    assert participants_reader(partial, store)(5) is None  # its manifest is gone: no number rather than a wrong one
