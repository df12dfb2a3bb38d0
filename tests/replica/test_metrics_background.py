"""A replica's metrics written off the training loop (``MetricsWriter(background=True)``): the loop's calls return
while the store is still busy, the latest bytes of each object land (history before progress), ``finish`` and
``close`` wait for them, and a failing store still never fails training."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from diloco.replica.metric_rows import read_history
from diloco.replica.metrics import MetricsWriter
from diloco.store.objects import ObjectStore


class GatedStore(ObjectStore):
    """A file store whose ``put`` waits for ``gate`` and records what it wrote, in order."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.gate = threading.Event()
        self.puts: list[str] = []
        self.fail = False

    def put(self, key: str, data: bytes) -> int:  # type: ignore[override]
        self.gate.wait(30)
        if self.fail:
            raise OSError("the store is down")
        self.puts.append(key)
        return super().put(key, data)


def test_the_loop_does_not_wait_for_the_store_and_the_latest_rows_land(tmp_path: Path) -> None:
    store = GatedStore(f"file://{tmp_path}/run")
    w = MetricsWriter(store, 0, total_steps=30, background=True)
    started = time.monotonic()
    w.begin(0)
    for step in range(1, 31):
        w.on_step(step)
        if step % 10 == 0:
            w.on_round(step)
    assert time.monotonic() - started < 20  # the gate is shut: a loop that waited for a put would take 30 s each
    assert store.puts == []
    store.gate.set()
    w.finish(30)
    rows, _ = read_history(store, 0)
    assert [r.kind for r in rows] == ["init", "round", "round", "round", "final"]
    assert set(store.puts[-2:]) == {"metrics/rank_0000.jsonl", "progress/rank_0000.json"}
    assert json.loads(store.get("progress/rank_0000.json"))["kind"] == "final"  # the latest bytes of each
    assert len(store.puts) < 2 * 8  # a newer write of a queued object replaced it: far fewer puts than flushes
    w.close()
    assert not [t for t in threading.enumerate() if t.name == "diloco-metrics" and t.is_alive()] or \
        _gone_soon("diloco-metrics")


def _gone_soon(name: str) -> bool:
    until = time.monotonic() + 10
    while time.monotonic() < until:
        if not [t for t in threading.enumerate() if t.name == name and t.is_alive()]:
            return True
        time.sleep(0.01)
    return False


def test_a_failing_store_never_fails_training_and_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = GatedStore(f"file://{tmp_path}/run")
    store.gate.set()
    store.fail = True
    w = MetricsWriter(store, 0, background=True)
    w.begin(0)
    for step in range(1, 6):
        w.on_round(step)
    w.finish(5)
    w.close()
    assert sum("could not write" in r.message for r in caplog.records) <= 2  # once per object
    store.fail = False
    w2 = MetricsWriter(store, 0, background=True)
    w2.begin(0)
    w2.close()
    assert [r.kind for r in read_history(store, 0)[0]] == ["init", "final"]
