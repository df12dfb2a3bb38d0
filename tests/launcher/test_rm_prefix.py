"""``diloco rm --prefix URI``: what a launch wrote is reachable even without a run record.

The case it exists for, end to end: a launch is refused while the store denies deletes (so its own clean-up cannot
take back ``run.json`` and the spec object); the error names the command; once the store allows it again, that
command removes the prefix. And its safety rules: a prefix whose run is still going (its backend, rebuilt from
``run.json``, sees it) is kept; a prefix of a run recorded here goes through its record; ``--dry-run`` removes
nothing. Real processes (``fake_replica``), real S3 traffic to moto through the fault proxy.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.commands import run_cli as cli
from support.faultproxy import FaultProxy

from diloco.cli import exit_codes
from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.executors.local import LocalBackend, LocalBackendConfig, LocalRunHandle
from diloco.launcher.runs import RunRecord, RunRegistry
from diloco.store.layout import RUN_INFO_KEY, SPEC_KEY
from diloco.store.objects import ObjectStore

TESTS_DIR = str(Path(__file__).resolve().parents[1])


def test_a_refused_launch_that_could_not_clean_up_names_rm_prefix_which_then_removes_it(
        s3_bucket: str, fault_proxy: FaultProxy, bucket_keys: Callable[[str], list[str]], tmp_path: Path) -> None:
    home = tmp_path / "home"
    not_a_dir = tmp_path / "logs-here"
    not_a_dir.write_text("a file where the replicas' log directories should go: starting replica 0 fails")
    denied = fault_proxy.add("status", method="DELETE", status=403, code="AccessDenied")
    out = cli("launch", "-n", "2", "--trainer", "support.fake_replica:idle", "--steps", "2", "--sync-every", "1",
              "--rendezvous", f"s3://{s3_bucket}/runs/{{run_id}}", "--set", f"backend.log_root={not_a_dir}",
              home=home)
    assert out.returncode == exit_codes.REFUSED, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert "could not start local replica 0" in line and "could not be removed: diloco rm --prefix s3://" in line
    uri = line.split("diloco rm --prefix ", 1)[1].split()[0].rstrip(")")
    assert denied.fired and sorted(k.rsplit("/", 1)[1] for k in bucket_keys(s3_bucket)) == [RUN_INFO_KEY, SPEC_KEY]
    assert json.loads(cli("runs", "-o", "json", home=home).stdout)["runs"] == []

    fault_proxy.clear()
    dry = cli("rm", "--prefix", uri, "--dry-run", "-o", "json", home=home)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["runs"][0]["store_objects"] == 2 and len(bucket_keys(s3_bucket)) == 2
    removed = cli("rm", "--prefix", uri, "-o", "json", home=home)
    assert removed.returncode == 0, removed.stderr
    assert json.loads(removed.stdout)["runs"][0]["removed"] is True
    assert bucket_keys(s3_bucket) == []


def start_unrecorded_run(home: Path, tmp_path: Path, run_id: str,
                         monkeypatch: pytest.MonkeyPatch) -> tuple[str, LocalBackend, LocalRunHandle]:
    """A local run of sleeping replicas whose store has run.json (as launch writes it) but whose record is gone,
    as on another machine; returns its rendezvous, backend and handle."""
    monkeypatch.setenv("DILOCO_HOME", str(home))  # the backend's run directories, as the CLI's
    uri = f"file://{tmp_path}/store/{run_id}"
    backend = LocalBackend(LocalBackendConfig(grace_period_s=1.0))
    args = EntrypointArgs(rendezvous_uri=uri, world_size=2, trainer="fake:train", trainer_kwargs={"sleep": 120})
    spec = LaunchSpec(run_id=run_id, replicas=2, entrypoint="support.fake_replica", entrypoint_args=args,
                      env={"PYTHONPATH": TESTS_DIR})
    config = {"replicas": 2, "backend": backend.config.model_dump(mode="json")}
    store = ObjectStore(uri)
    store.put(RUN_INFO_KEY, json.dumps({"run_id": run_id, "config": config}).encode())
    store.put("metrics/rank_0000.jsonl", b'{"kind": "init"}\n')
    store.put("notes/by-hand.txt", b"not a layout key: goes because run.json proves the prefix is the run's")
    return uri, backend, backend.submit(backend.plan(spec))


def test_rm_prefix_keeps_a_run_its_backend_sees_going_and_removes_it_once_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    uri, backend, handle = start_unrecorded_run(home, tmp_path, "diloco-20240101-000000-0e0e", monkeypatch)
    try:
        kept = cli("rm", "--prefix", uri, "-o", "json", home=home)
        assert kept.returncode == exit_codes.FAILED, kept.stderr
        row = json.loads(kept.stdout)["runs"][0]
        assert row["removed"] is False and "sees run diloco-20240101-000000-0e0e running" in row["reason"], row
        assert len(ObjectStore(uri).list()) == 3
    finally:
        backend.cancel(handle)
        assert backend.wait(handle, timeout_s=60, poll_interval_s=0.1).terminal
    removed = cli("rm", "--prefix", uri, "-o", "json", home=home)
    assert removed.returncode == 0, removed.stderr
    assert json.loads(removed.stdout)["runs"][0]["store_objects"] == 3
    assert not (tmp_path / "store" / "diloco-20240101-000000-0e0e").exists()


def test_rm_prefix_of_a_recorded_run_removes_it_through_its_record(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    run_id = "diloco-20240101-000000-0f0f"
    uri, backend, handle = start_unrecorded_run(home, tmp_path, run_id, monkeypatch)
    backend.cancel(handle)
    assert backend.wait(handle, timeout_s=60, poll_interval_s=0.1).terminal
    registry = RunRegistry(home)
    registry.save(RunRecord(run_id=run_id, backend="local", created_at=time.time(), rendezvous_uri=uri, replicas=2,
                            config={"replicas": 2, "backend": backend.config.model_dump(mode="json")},
                            handle=handle.model_dump(mode="json")))
    out = cli("rm", "--prefix", uri, "-o", "json", home=home)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)["runs"][0]
    assert row["run_id"] == run_id and row["removed"] is True and row["record_path"] == str(registry.path(run_id))
    assert not registry.path(run_id).exists() and not Path(handle.run_dir).exists()  # its logs went too
    assert ObjectStore(uri).list() == []


def test_rm_needs_a_run_or_a_prefix(tmp_path: Path) -> None:
    out = cli("rm", home=tmp_path / "home")
    assert out.returncode == exit_codes.USAGE and "give a RUN" in out.stderr


SLOW_TRAINER = '''
import time


def train(*, manager, rank, world_size, total_steps=1, sync_every=1):
    print(f"slow trainer started on rank {rank}", flush=True)
    time.sleep(120)
'''


@pytest.mark.slow
def test_rm_of_a_sagemaker_run_also_removes_what_it_wrote_under_output_s3_uri(
        emulator: object, s3_bucket: str, bucket_keys: Callable[[str], list[str]], tmp_path: Path) -> None:
    """With ``backend.output_s3_uri`` the shipped code, outputs and checkpoints live outside the rendezvous."""
    home = tmp_path / "home"
    source = tmp_path / "src"
    source.mkdir()
    (source / "slowtrain.py").write_text(SLOW_TRAINER)
    role = f"arn:aws:iam::{emulator.account_id}:role/e2e"  # type: ignore[attr-defined]
    out = cli("launch", "--backend", "sagemaker", "--role", role, "--region", "us-east-1", "-n", "1",
              "--rendezvous", f"s3://{s3_bucket}/runs/{{run_id}}", "--source-dir", str(source),
              "--set", f"backend.output_s3_uri=s3://{s3_bucket}/elsewhere", "--trainer", "slowtrain:train",
              "--detach", "-o", "json", home=home, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run_id = json.loads(out.stdout)["run_id"]
    assert any(k.startswith(f"elsewhere/{run_id}/code/") for k in bucket_keys(s3_bucket))
    cancel = cli("cancel", run_id, home=home, cwd=tmp_path)
    assert cancel.returncode == 0, cancel.stderr
    deadline = time.monotonic() + 60
    while cli("status", run_id, "-o", "json", home=home, cwd=tmp_path).stdout.count('"cancelled"') < 2:
        assert time.monotonic() < deadline, "the job never ended"
        time.sleep(0.5)
    removed = cli("rm", run_id, "-o", "json", home=home, cwd=tmp_path)
    assert removed.returncode == 0, removed.stderr
    assert json.loads(removed.stdout)["runs"][0]["files"] == [f"s3://{s3_bucket}/elsewhere/{run_id}/"]
    assert bucket_keys(s3_bucket) == []
