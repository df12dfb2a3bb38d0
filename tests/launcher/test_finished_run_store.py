"""A finished run's store, through the real CLI: what compaction keeps (exactly what ``status``, ``plot``,
``watch``, ``logs``, ``collect`` and ``rm`` still read), and read commands that reuse the recorded weights verdict
instead of importing torch to check the kept copy again (asserted with ``python -X importtime``, never a timing:
the timing is ``bench/read_commands.py``'s)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.store_cli import launch_small_run, run_cli, store_dir

from diloco.launcher.compaction import COMPACTED_KEY
from diloco.store.layout import FINAL_KEY, METRICS_KEY, PROGRESS_KEY, RUN_INFO_KEY, SPEC_KEY

#: One worker runs this module: its module-scoped run (or server) is then started once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_finished_run_store")

REPLICAS = 2


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """One run of the README's own trainer, 2 replicas, 3 rounds, finished under ``launch`` (whose summary checks
    the weights and compacts the store), shared by the tests here: ``(DILOCO_HOME, run_id)``."""
    home = tmp_path_factory.mktemp("finished") / "home"
    run_id = launch_small_run(home, replicas=REPLICAS, steps=6, sync_every=2)
    yield home, run_id
    run_cli("rm", run_id, home=home)


def imported_modules(stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reported importing (its lines: ``import time: self | cumulative |
    module``, the module indented by its nesting)."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_compaction_keeps_exactly_what_a_finished_run_is_still_read_for(finished_run: tuple[Path, str]) -> None:
    home, run_id = finished_run
    root = store_dir(home, run_id)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    expected = [COMPACTED_KEY, FINAL_KEY.format(rank=0), *[METRICS_KEY.format(rank=r) for r in range(REPLICAS)],
                *[PROGRESS_KEY.format(rank=r) for r in range(REPLICAS)], RUN_INFO_KEY, SPEC_KEY]
    assert files == sorted(expected)  # no committed rounds, contributions, relaunch notes or extra copies
    assert [str(d.relative_to(root)) for d in root.rglob("*") if d.is_dir() and not any(d.iterdir())] == []

    status = run_cli("status", run_id, "-o", "json", home=home)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["state"] == "succeeded" and all(r["step"] == 6 for r in report["ranks"])
    plot = run_cli("plot", run_id, "--output", str(home.parent / "curves.png"), "-o", "json", home=home)
    assert plot.returncode == 0, plot.stderr
    assert json.loads(plot.stdout)["rounds"] == 3


def test_watch_and_collect_on_a_finished_run_reuse_the_recorded_verdict_without_torch(
        finished_run: tuple[Path, str]) -> None:
    home, run_id = finished_run
    watched = run_cli("watch", run_id, home=home, python_flags="-X importtime")
    assert watched.returncode == 0, watched.stderr
    assert "final weights: identical: 2 replica(s) hold identical final weights" in watched.stdout
    assert "torch" not in imported_modules(watched.stderr)

    model = home.parent / "model.safetensors"
    collected = run_cli("collect", run_id, "--output", str(model), "--force", "-o", "json", home=home,
                        python_flags="-X importtime")
    assert collected.returncode == 0, collected.stderr
    assert json.loads(collected.stdout)["weights_identical"] is True
    assert "torch" not in imported_modules(collected.stderr) and "safetensors" not in imported_modules(
        collected.stderr)

    from diloco.store.codec import (
        decode,  # the model file, read back here: rank 0's tensors, the run's metadata
    )

    kept, kept_meta = decode((store_dir(home, run_id) / FINAL_KEY.format(rank=0)).read_bytes())
    tensors, meta = decode(model.read_bytes())
    assert sorted(tensors) == sorted(kept) and all(tensors[k].equal(kept[k]) for k in kept)
    assert meta["run_id"] == run_id and "rank" not in meta
    assert {k: v for k, v in meta.items() if k != "run_id"} == {k: v for k, v in kept_meta.items() if k != "rank"}


def test_a_changed_kept_copy_is_checked_again(finished_run: tuple[Path, str]) -> None:
    """The fingerprint no longer matches: the same bytes (only touched) still give "identical" (and the marker is
    refreshed); other bytes are caught, the verdict is not reused."""
    home, run_id = finished_run
    kept = store_dir(home, run_id) / FINAL_KEY.format(rank=0)
    marker = store_dir(home, run_id) / COMPACTED_KEY
    original = kept.read_bytes()
    try:
        recorded = json.loads(marker.read_text())["fingerprint"]
        os.utime(kept, ns=(1_000_000_000, 1_000_000_000))  # touched: same content, another mtime
        touched = run_cli("watch", run_id, home=home)
        assert touched.returncode == 0, touched.stderr
        assert "hold identical final weights" in touched.stdout
        refreshed = json.loads(marker.read_text())["fingerprint"]
        assert refreshed != recorded and refreshed["mtime"] == "1.0"

        changed = bytearray(original)
        changed[-1] ^= 0xFF  # one bit pattern in the last tensor's data
        kept.write_bytes(bytes(changed))
        caught = run_cli("watch", run_id, home=home)
        assert caught.returncode == 1, caught.stderr
        assert "changed after the replicas' copies were checked" in caught.stdout + caught.stderr
    finally:
        kept.write_bytes(original)
