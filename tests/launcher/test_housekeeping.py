"""`diloco rm` / `diloco prune` through the real CLI, on runs of real local processes (``fake_replica``, no torch)
whose stores are file:// folders or prefixes on moto's S3 server; and the compaction of a finished run's store
(``compact_store``), end to end with the README's own trainer.

What must hold: a run that has not ended is never removed; removing one takes its record, its run directory and
its objects under its own rendezvous prefix, and nothing else (a neighbouring prefix survives); ``--dry-run``
removes nothing; ``collect`` keeps one copy of the agreed weights and still says "identical" when run again.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.polling import wait_for
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.executors.local import LocalBackend, LocalBackendConfig, LocalRunHandle
from diloco.executors.local_supervisor import EXIT_FILE
from diloco.launcher.compaction import COMPACTED_KEY, compact_store, compacted_verdict
from diloco.launcher.housekeeping import parse_duration
from diloco.launcher.runs import RunRecord, RunRegistry
from diloco.store.layout import FINAL_KEY, METRICS_KEY, RUN_INFO_KEY
from diloco.store.objects import ObjectStore

TESTS_DIR = str(Path(__file__).resolve().parents[1])
runner = CliRunner()
DAY = 86400.0


# ---------------------------------------------------------------------------------------------- helpers
def start_run(home: Path, rendezvous: str, *, n: int = 2, suffix: str = "0001", age_s: float = 0.0,
              **behaviour: Any) -> RunRecord:
    """``fake_replica`` processes through the local backend, recorded as ``diloco launch`` records a run, with the
    store's ``run.json`` written as launch writes it. ``age_s`` back-dates the record (a run launched days ago)."""
    run_id = f"diloco-20240101-000000-{suffix}"
    uri = rendezvous.replace("{run_id}", run_id)
    backend = LocalBackend(LocalBackendConfig(grace_period_s=2.0))
    args = EntrypointArgs(rendezvous_uri=uri, world_size=n, trainer="fake:train", trainer_kwargs=dict(behaviour))
    spec = LaunchSpec(run_id=run_id, replicas=n, entrypoint="support.fake_replica", entrypoint_args=args,
                      env={"PYTHONPATH": TESTS_DIR})
    config = {"store": {"poll_interval_s": 0.1}, "backend": backend.config.model_dump(mode="json")}
    ObjectStore(uri).put(RUN_INFO_KEY, json.dumps({"run_id": run_id, "config": config}).encode())
    handle = backend.submit(backend.plan(spec))
    record = RunRecord(run_id=run_id, backend="local", created_at=time.time() - age_s, rendezvous_uri=uri,
                       replicas=n, config=config, handle=handle.model_dump(mode="json"))
    RunRegistry().save(record)
    return record


def finish(record: RunRecord) -> None:
    """Wait for the run's end, then leave in its store what a finished run leaves: metrics, final weights, the last
    round's contributions (opaque bytes: removal never reads them)."""
    handle = LocalRunHandle.model_validate(record.handle)
    assert LocalBackend().wait(handle, timeout_s=60, poll_interval_s=0.05).terminal
    store = ObjectStore(record.rendezvous_uri)
    for rank in range(record.replicas):
        store.put(METRICS_KEY.format(rank=rank), b'{"kind": "final"}\n')
        store.put(FINAL_KEY.format(rank=rank), b"w" * 1000)
        store.put(f"round_000001/rank_{rank:04d}.safetensors", b"g" * 1000)


def backdate_end(record: RunRecord, age_s: float) -> None:
    """Make a finished local run look as if it had ended ``age_s`` ago (its replicas' exit records say when)."""
    for p in LocalRunHandle.model_validate(record.handle).processes:
        path = Path(p.log_dir, EXIT_FILE)
        data = json.loads(path.read_text())
        data["started_at"] = data["ended_at"] = time.time() - age_s
        path.write_text(json.dumps(data))


def run_dir(home: Path, record: RunRecord) -> Path:
    return home / "runs" / record.run_id


def record_exists(home: Path, record: RunRecord) -> bool:
    return (home / "runs" / f"{record.run_id}.json").exists()


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args))


# ---------------------------------------------------------------------------------------------- rm
def test_rm_removes_record_run_directory_and_only_its_own_store_prefix(home: Path, tmp_path: Path) -> None:
    stores = tmp_path / "stores"
    record = start_run(home, f"file://{stores}/{{run_id}}", lines=1)
    finish(record)
    own = stores / record.run_id
    (own / "notes.txt").write_text("written under the run's prefix after it was launched")
    neighbours = [stores / f"{record.run_id}-2" / "run.json", stores / f"{record.run_id}x", stores / "keep.txt"]
    for path in neighbours:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("another run's")
    assert run_dir(home, record).is_dir()

    result = invoke("rm", record.run_id[-4:], "-o", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["schema_version"] == 1 and report["dry_run"] is False
    assert (report["removed"], report["kept"]) == (1, 0)
    (run,) = report["runs"]
    assert run["run_id"] == record.run_id and run["state"] == "succeeded" and run["replicas"] == 2
    assert run["removed"] is True and run["files"] == [str(run_dir(home, record))]
    assert run["store_objects"] == 1 + 2 * 3 + 1  # run.json, metrics/final/round per rank, notes.txt
    assert run["store_bytes"] == report["store_bytes"] > 2 * 2000
    assert "removed 1 run(s)" in result.stderr

    assert not record_exists(home, record) and not run_dir(home, record).exists() and not own.exists()
    assert all(path.read_text() == "another run's" for path in neighbours)
    gone = invoke("status", record.run_id)
    assert gone.exit_code == 2 and "no run" in gone.stderr
    assert json.loads(invoke("runs", "-o", "json").stdout)["runs"] == []
    again = invoke("rm", record.run_id)
    assert again.exit_code == 2 and again.stderr.startswith("diloco: error: no run ")


def test_rm_dry_run_removes_nothing_and_says_what_would_go(home: Path, tmp_path: Path) -> None:
    record = start_run(home, f"file://{tmp_path}/s/{{run_id}}", lines=1)
    finish(record)
    before = sorted(str(p) for p in (tmp_path / "s").rglob("*"))

    result = invoke("rm", record.run_id, "--dry-run")
    assert result.exit_code == 0, result.output
    assert record.run_id in result.stdout and "would remove" in result.stdout
    assert "would remove 1 run(s)" in result.stderr and "dry run: nothing removed" in result.stderr
    as_json = json.loads(invoke("rm", record.run_id, "--dry-run", "-o", "json").stdout)
    assert as_json["dry_run"] is True and as_json["runs"][0]["removed"] is True
    assert as_json["runs"][0]["store_objects"] == 7

    assert record_exists(home, record) and run_dir(home, record).is_dir()
    assert sorted(str(p) for p in (tmp_path / "s").rglob("*")) == before


def test_rm_never_removes_a_run_still_going(home: Path, tmp_path: Path) -> None:
    done = start_run(home, f"file://{tmp_path}/s/{{run_id}}", suffix="00d0", lines=1)
    finish(done)
    live = start_run(home, f"file://{tmp_path}/s/{{run_id}}", suffix="11fe", sleep=120)
    live.final_state = "failed"  # as cached when one replica fails while the others still run: not the end
    RunRegistry().save(live)
    try:
        result = invoke("rm", live.run_id, done.run_id, "-o", "json")
        assert result.exit_code == 1
        report = json.loads(result.stdout)
        by_id = {r["run_id"]: r for r in report["runs"]}
        assert by_id[done.run_id]["removed"] is True
        assert by_id[live.run_id]["removed"] is False
        assert by_id[live.run_id]["reason"].startswith("replica(s) 0, 1 have not ended")
        assert f"diloco cancel {live.run_id}" in result.stderr
        assert record_exists(home, live) and run_dir(home, live).is_dir()
        assert (tmp_path / "s" / live.run_id / RUN_INFO_KEY).exists()
        assert not record_exists(home, done)
    finally:
        assert invoke("cancel", live.run_id).exit_code == 0
    # A cancel asks and returns; the replicas end within the backend's grace period (SIGTERM, then SIGKILL). The
    # run's state says "failed" all along (the cached end), so what is waited on is every replica having ended.
    grace_s = LocalBackendConfig().grace_period_s
    wait_for(lambda: all(r["state"] in ("cancelled", "failed", "succeeded") for r in json.loads(
        invoke("status", live.run_id, "-o", "json").stdout)["ranks"]), "the cancelled replicas to end",
        limit_s=4 * grace_s + 30)
    cancelled = invoke("rm", live.run_id)  # once it has ended it can go
    assert cancelled.exit_code == 0, cancelled.output
    assert not record_exists(home, live) and not run_dir(home, live).exists()


def test_rm_of_a_run_whose_directory_was_deleted_by_hand(home: Path, tmp_path: Path) -> None:
    record = start_run(home, f"file://{tmp_path}/s/{{run_id}}", lines=1)
    finish(record)
    assert json.loads(invoke("status", record.run_id, "-o", "json").stdout)["state"] == "succeeded"
    shutil.rmtree(run_dir(home, record))
    result = invoke("rm", record.run_id, "-o", "json")
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)["runs"][0]
    assert run["removed"] is True and run["files"] == [] and run["store_objects"] == 7
    assert not record_exists(home, record) and not (tmp_path / "s" / record.run_id).exists()


def test_rm_with_an_unknown_run_removes_nothing(home: Path, tmp_path: Path) -> None:
    record = start_run(home, f"file://{tmp_path}/s/{{run_id}}", lines=1)
    finish(record)
    result = invoke("rm", record.run_id, "no-such-run")
    assert result.exit_code == 2
    assert result.stderr.startswith("diloco: error: no run 'no-such-run'") and len(result.stderr.splitlines()) == 1
    assert record_exists(home, record) and run_dir(home, record).is_dir()
    missing = invoke("rm")
    assert missing.exit_code == 2


def test_rm_leaves_a_prefix_that_another_run_now_owns(home: Path, tmp_path: Path) -> None:
    """A run whose prefix was emptied and then taken by a later run: its record and logs go, the store stays."""
    record = start_run(home, f"file://{tmp_path}/shared", lines=1)
    finish(record)
    store = ObjectStore(record.rendezvous_uri)
    store.put(RUN_INFO_KEY, json.dumps({"run_id": "diloco-20250101-000000-beef"}).encode())
    result = invoke("rm", record.run_id, "-o", "json")
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)["runs"][0]
    assert run["removed"] is True and run["store_objects"] == 0 and RUN_INFO_KEY in run["store_kept"]
    assert "now belongs to run diloco-20250101-000000-beef" in result.stderr
    assert store.exists(RUN_INFO_KEY) and store.exists(FINAL_KEY.format(rank=0))
    assert not record_exists(home, record) and not run_dir(home, record).exists()


def test_without_run_json_only_the_store_layout_is_removed(home: Path, tmp_path: Path) -> None:
    record = start_run(home, f"file://{tmp_path}/mine", lines=1)
    finish(record)
    store = ObjectStore(record.rendezvous_uri)
    store.delete(RUN_INFO_KEY)
    (tmp_path / "mine" / "data.csv").write_text("the user's own file")
    result = invoke("rm", record.run_id, "-o", "json")
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)["runs"][0]
    assert run["store_objects"] == 6 and run["store_kept"] == ["data.csv"]
    assert "data.csv" in result.stderr  # said, not silently left
    assert store.list() == ["data.csv"] and not (tmp_path / "mine" / "final").exists()


def test_rm_removes_the_objects_under_an_s3_prefix_and_nothing_beside_it(
        home: Path, s3_uri: str, s3_bucket: str, bucket_keys: Any) -> None:
    record = start_run(home, f"{s3_uri}/{{run_id}}", lines=1)
    finish(record)
    neighbours = [f"{record.run_id}-2/run.json", f"{record.run_id}x"]  # share the run prefix's first characters
    base = ObjectStore(s3_uri)
    for key in neighbours:
        base.put(key, b"another run's")
    prefix = s3_uri.split("/", 3)[3]
    assert len([k for k in bucket_keys(s3_bucket) if k.startswith(f"{prefix}/{record.run_id}/")]) == 7

    dry = invoke("rm", record.run_id, "--dry-run", "-o", "json")
    assert dry.exit_code == 0 and json.loads(dry.stdout)["runs"][0]["store_objects"] == 7
    assert len(bucket_keys(s3_bucket)) == 9

    result = invoke("rm", record.run_id, "-o", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["runs"][0]["store_objects"] == 7
    assert sorted(bucket_keys(s3_bucket)) == sorted(f"{prefix}/{key}" for key in neighbours)
    assert not record_exists(home, record) and not run_dir(home, record).exists()


# ---------------------------------------------------------------------------------------------- prune
def test_prune_removes_runs_that_ended_long_ago_and_skips_live_ones(home: Path, tmp_path: Path) -> None:
    rendezvous = f"file://{tmp_path}/s/{{run_id}}"
    old = start_run(home, rendezvous, suffix="0001", age_s=9 * DAY, lines=1)
    recent = start_run(home, rendezvous, suffix="0002", age_s=9 * DAY, lines=1)  # launched long ago, ended now
    young = start_run(home, rendezvous, suffix="0003", lines=1)
    for record in (old, recent, young):
        finish(record)
    backdate_end(old, 8 * DAY)
    live = start_run(home, rendezvous, suffix="0004", age_s=30 * DAY, sleep=120)
    try:
        dry = invoke("prune", "--older-than", "7d", "--dry-run", "-o", "json")
        assert dry.exit_code == 0, dry.output
        report = json.loads(dry.stdout)
        assert report["older_than_s"] == 7 * DAY and report["dry_run"] is True
        assert {r["run_id"]: r["removed"] for r in report["runs"]} == {old.run_id: True, live.run_id: False}
        assert all(record_exists(home, r) for r in (old, recent, young, live))

        result = invoke("prune", "--older-than", "1w")
        assert result.exit_code == 0, result.output
        assert old.run_id in result.stdout and "removed" in result.stdout
        assert f"run {live.run_id} is " in result.stderr and "not removed" in result.stderr
        assert not record_exists(home, old) and not run_dir(home, old).exists()
        assert not (tmp_path / "s" / old.run_id).exists()
        assert all(record_exists(home, r) and run_dir(home, r).is_dir() for r in (recent, young, live))
        listed = {r["run_id"] for r in json.loads(invoke("runs", "-o", "json").stdout)["runs"]}
        assert listed == {recent.run_id, young.run_id, live.run_id}
    finally:
        invoke("cancel", live.run_id)
    nothing = invoke("prune", "--older-than", "12h")
    assert nothing.exit_code == 0 and "nothing to prune: no run ended more than 12h ago" in nothing.stdout


@pytest.mark.parametrize("age", ["7", "seven days", "-1d", "7y", ""])
def test_prune_rejects_a_duration_without_a_known_unit(home: Path, age: str) -> None:
    result = invoke("prune", "--older-than", age)
    assert result.exit_code == 2
    assert result.stderr.startswith("diloco: error: --older-than: expected a duration such as 30m, 12h, 7d or 2w")
    assert len(result.stderr.splitlines()) == 1


def test_prune_needs_an_age(home: Path) -> None:
    assert invoke("prune").exit_code == 2


def test_durations() -> None:
    assert [parse_duration(t) for t in ("30m", "12h", "7d", "2w", "90s", "1.5h", " 2W ")] == [
        1800, 43200, 604800, 1209600, 90, 5400, 1209600]


# ---------------------------------------------------------------------------------------------- runs vs status
def test_runs_and_status_agree_on_finished_runs(home: Path, tmp_path: Path) -> None:
    rendezvous = f"file://{tmp_path}/s/{{run_id}}"
    ok = start_run(home, rendezvous, suffix="0001", lines=1)
    failed = start_run(home, rendezvous, suffix="0002", lines=1, fail_rank=1)
    stopped = start_run(home, rendezvous, suffix="0003", sleep=120)
    assert invoke("cancel", stopped.run_id).exit_code == 0
    for record in (ok, failed):
        finish(record)
    listed = {r["run_id"]: r["state"] for r in json.loads(invoke("runs", "-o", "json").stdout)["runs"]}
    shown = {r.run_id: json.loads(invoke("status", r.run_id, "-o", "json").stdout)["state"]
             for r in (ok, failed, stopped)}
    assert listed == shown == {ok.run_id: "succeeded", failed.run_id: "failed", stopped.run_id: "cancelled"}
    relisted = {r["run_id"]: r["state"] for r in json.loads(invoke("runs", "-o", "json").stdout)["runs"]}
    assert relisted == shown  # the state cached by `status` is the one `status` showed


# ---------------------------------------------------------------------------------------------- compaction
def _weights(seed: int = 0) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)}


def _finished_store(tmp_path: Path, replicas: int = 3, *, differ: bool = False, uri: str | None = None) -> ObjectStore:
    from diloco.store.codec import encode_tensors

    store = ObjectStore(uri or f"file://{tmp_path}/store")
    store.put(RUN_INFO_KEY, b'{"run_id": "x"}')
    for rank in range(replicas):
        weights = _weights(seed=rank if differ else 0)
        store.put(FINAL_KEY.format(rank=rank), encode_tensors(weights, {"rank": rank}))
        store.put(f"round_000003/rank_{rank:04d}.safetensors", encode_tensors(_weights(seed=10 + rank)))
        store.put(METRICS_KEY.format(rank=rank), b'{"kind": "final"}\n')
    return store


def test_compact_store_keeps_one_copy_and_stays_checkable(tmp_path: Path) -> None:
    import torch

    store = _finished_store(tmp_path)
    extra = [FINAL_KEY.format(rank=1), FINAL_KEY.format(rank=2),
             *[f"round_000003/rank_{r:04d}.safetensors" for r in range(3)]]
    extra_bytes = sum((tmp_path / "store" / key).stat().st_size for key in extra)
    first = compact_store(store, 3)
    assert first.compacted and first.kept_key == FINAL_KEY.format(rank=0)
    assert sorted(first.deleted) == sorted(extra) and first.bytes_freed == extra_bytes
    assert store.list() == [COMPACTED_KEY, FINAL_KEY.format(rank=0), *[METRICS_KEY.format(rank=r) for r in range(3)],
                            RUN_INFO_KEY]

    verdict = compacted_verdict(store, 3)
    assert verdict is not None and verdict.identical is True and "3 replica(s) hold identical" in verdict.detail
    assert verdict.tensors is not None and all(torch.equal(verdict.tensors[k], v) for k, v in _weights().items())

    again = compact_store(store, 3)  # idempotent: nothing left to delete, still compacted
    assert again.compacted and again.deleted == [] and again.bytes_freed == 0

    store.put(FINAL_KEY.format(rank=0), store.get(FINAL_KEY.format(rank=0)) + b" ")  # the kept copy changed
    tampered = compacted_verdict(store, 3)
    assert tampered is not None and tampered.identical is False and "changed after" in tampered.detail


def test_a_compacted_s3_store_reuses_its_verdict_until_the_kept_copy_changes(tmp_path: Path, s3_uri: str) -> None:
    """On S3 the verdict is reused on the kept object's HEAD (ETag, LastModified, size): only the small marker is
    read. Other bytes under the same key are caught by their SHA-256. The committed rounds and relaunch notes that
    only a running run reads are compacted away with the extra copies."""
    store = _finished_store(tmp_path, uri=s3_uri)
    store.put("committed/round_000003/state.safetensors", b"state")
    store.put("committed/round_000003/COMMITTED", b"{}")
    store.put("relaunch/rank_0001.json", b"{}")
    report = compact_store(store, 3)
    assert report.compacted and {"committed/round_000003/COMMITTED", "relaunch/rank_0001.json"} <= set(report.deleted)
    assert store.list() == [COMPACTED_KEY, FINAL_KEY.format(rank=0), *[METRICS_KEY.format(rank=r) for r in range(3)],
                            RUN_INFO_KEY]
    marker = json.loads(store.get(COMPACTED_KEY))
    assert {"ETag", "size"} <= set(marker["fingerprint"])

    before = store.traffic
    verdict = compacted_verdict(store, 3, with_tensors=False)
    spent = store.traffic - before
    assert verdict is not None and verdict.identical is True and verdict.tensors is None
    assert spent.requests == {"get": 1} and spent.bytes_read == len(store.get(COMPACTED_KEY))  # the marker only

    kept = store.get(FINAL_KEY.format(rank=0))
    store.put(FINAL_KEY.format(rank=0), kept[:-1] + bytes([kept[-1] ^ 0xFF]))
    changed = compacted_verdict(store, 3, with_tensors=False)
    assert changed is not None and changed.identical is False and "changed after" in changed.detail


def test_compact_store_deletes_nothing_when_the_copies_differ(tmp_path: Path) -> None:
    store = _finished_store(tmp_path, differ=True)
    before = store.list()
    report = compact_store(store, 3)
    assert not report.compacted and "differ" in report.detail and report.deleted == []
    assert store.list() == before and compacted_verdict(store, 3) is None


def test_collect_keeps_one_copy_and_reports_identical_when_run_again(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 torch-free replicas of the real entrypoint that export one model (what collect does with a finished run is
    under test, not training): the store keeps one copy; a second collect still checks "identical" and writes the
    same model; `rm` then removes the run and its default store. (Rounds' objects are gone from a compacted store
    of a trained run: tests/launcher/test_finished_run_store.py.)"""
    monkeypatch.chdir(TESTS_DIR)
    launched = invoke("launch", "--replicas", "2", "--backend", "local", "--trainer", "support.cli_trainers:agreed",
                      "--steps", "4", "--sync-every", "2", "-o", "json")
    assert launched.exit_code == 0, launched.output
    run_id = json.loads(launched.stdout)["run_id"]
    store = ObjectStore(f"file://{home.resolve()}/runs/{run_id}/store")

    first = invoke("collect", run_id, "--output", str(tmp_path / "a.safetensors"), "-o", "json")
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout)["weights_identical"] is True
    assert [k for k in store.list() if k.startswith("final/")] == [COMPACTED_KEY, FINAL_KEY.format(rank=0)]

    second = invoke("collect", run_id, "--output", str(tmp_path / "b.safetensors"))
    assert second.exit_code == 0, second.output
    assert "final weights: identical: 2 replica(s) hold identical final weights" in second.stdout
    from diloco.store.codec import decode

    (a, a_meta), (b, b_meta) = (decode((tmp_path / f"{n}.safetensors").read_bytes()) for n in "ab")
    assert a_meta == b_meta and sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)  # the same model

    removed = invoke("rm", run_id)
    assert removed.exit_code == 0, removed.output
    assert not (home / "runs" / run_id).exists() and not (home / "runs" / f"{run_id}.json").exists()


def test_importing_the_commands_does_not_import_heavy_modules() -> None:
    import subprocess

    code = ("import sys, diloco.cli.housekeeping, diloco.launcher.housekeeping\n"
            "print(sorted(m for m in ('torch', 'boto3', 'botocore', 'kubernetes', 'safetensors') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_a_deleted_run_directory_says_its_files_are_gone_and_runs_agrees_with_status(
        home: Path, tmp_path: Path) -> None:
    """Item 17: the run directory deleted by hand after the run ended: `status` keeps the state it saw and says the
    files are gone (not "its supervisor was killed"), and `runs` says the same."""
    record = start_run(home, f"file://{tmp_path}/s/{{run_id}}", lines=1)
    finish(record)
    assert json.loads(invoke("status", record.run_id, "-o", "json").stdout)["state"] == "succeeded"
    shutil.rmtree(run_dir(home, record))
    shown = invoke("status", record.run_id, "-o", "json")
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    assert report["state"] == "succeeded"
    assert all("run files are gone" in r["reason"] for r in report["ranks"])
    assert "supervisor" not in shown.stdout
    listed = json.loads(invoke("runs", "-o", "json").stdout)["runs"]
    assert [(r["run_id"], r["state"]) for r in listed] == [(record.run_id, "succeeded")]
    removed = invoke("rm", record.run_id)
    assert removed.exit_code == 0, removed.output
    assert not record_exists(home, record)
