"""`diloco smoke` against moto's S3 on loopback: real replica processes that find the server via AWS_ENDPOINT_URL.

What these prove: replicas (2: each reads its peer's contribution every round) complete every round through S3 with
bitwise-identical final weights, the smoke reports per-round time and bytes, cleans up exactly its own prefix (or
keeps it with --keep), fails fast
with a clear check when the store refuses it, and rejects bad input with exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import boto3
from support.faultproxy import FaultProxy
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.launcher.smoke import ROUNDS, run_smoke
from diloco.store.s3 import resolve_s3_uri


def smoke(*args: str) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(app, ["smoke", "-o", "json", *args])
    payload = json.loads(result.stdout) if result.stdout.strip() else {}
    return result.exit_code, payload, result.stderr


def assert_passed(report: dict[str, Any], replicas: int) -> None:
    checks = {c["name"]: c for c in report["checks"]}
    assert [c["status"] for c in report["checks"]] == ["pass"] * 4, report["checks"]
    assert checks["final weights bitwise identical"]["detail"].startswith(f"{replicas} replica(s) hold identical")
    assert f"{replicas} rank(s) x {ROUNDS} round(s)" in checks["every rank completed every round"]["detail"]
    stats = report["round_stats"]
    assert [r["round"] for r in stats] == list(range(1, ROUNDS + 1))
    for r in stats:  # every rank wrote one contribution and read every peer's, each round
        assert r["bytes_written"] > 0 and r["bytes_read"] == (replicas - 1) * r["bytes_written"]
    assert report["ok"] is True


def test_smoke_two_replicas_over_s3_passes_and_cleans_up(
    s3_bucket: str, bucket_keys: Callable[[str], list[str]]
) -> None:
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="smokes/other-run/keep.txt", Body=b"not ours")
    code, report, stderr = smoke("--s3", f"s3://{s3_bucket}/smokes", "--replicas", "2")
    assert code == 0, (report, stderr)
    assert_passed(report, 2)
    assert report["uri"].startswith(f"s3://{s3_bucket}/smokes/smoke-")
    assert report["log_dir"] is None and report["kept"] is False
    assert bucket_keys(s3_bucket) == ["smokes/other-run/keep.txt"]  # its own prefix gone, nothing else touched
    assert "rendezvous s3://" in stderr  # narration on stderr, data on stdout


def test_smoke_keep_keeps_its_prefix_and_logs(s3_bucket: str, bucket_keys: Callable[[str], list[str]]) -> None:
    report = run_smoke(s3_uri=f"s3://{s3_bucket}/smokes", replicas=2, keep=True)
    assert report.log_dir is not None and os.path.isdir(report.log_dir)  # --keep keeps the logs too
    shutil.rmtree(os.path.dirname(report.log_dir))
    assert_passed(report.model_dump(mode="json"), 2)
    prefix = report.uri.split("/", 3)[3]
    keys = bucket_keys(s3_bucket)
    assert {f"{prefix}/final/rank_{r:04d}.safetensors" for r in range(2)} <= set(keys)
    assert {f"{prefix}/metrics/rank_{r:04d}.jsonl" for r in range(2)} <= set(keys)
    # Writers delete round k-1 once round k is complete, so only the last round's objects remain.
    assert sorted(k for k in keys if k.startswith(f"{prefix}/round_")) == [
        f"{prefix}/round_{ROUNDS - 1:06d}/rank_{r:04d}.safetensors" for r in range(2)]
    # Every round's global state is committed once (what a restarted replica rejoins from).
    assert {f"{prefix}/committed/round_{n:06d}/COMMITTED" for n in range(1, ROUNDS + 1)} <= set(keys)


def test_smoke_fails_fast_when_the_store_refuses(s3_bucket: str, fault_proxy: FaultProxy) -> None:
    fault_proxy.add("status", method="PUT", status=403, code="AccessDenied")
    code, report, _ = smoke("--s3", f"s3://{s3_bucket}/smokes")
    assert code == 1 and report["ok"] is False
    first = report["checks"][0]
    assert first["name"] == "store writable" and first["status"] == "fail"
    assert "denied by S3 (403)" in first["detail"] and "s3:PutObject" in first["fix"]
    assert len(report["checks"]) == 1  # no replica was launched to hang on a store it cannot write
    assert report["log_dir"] is None  # nothing worth keeping


def test_smoke_bad_input_is_a_usage_error(aws_env: str) -> None:
    result = CliRunner().invoke(app, ["smoke", "--s3", "s3://x/prefix"])
    assert result.exit_code == 2 and "--s3 has an invalid bucket name 'x'" in result.stderr
    result = CliRunner().invoke(app, ["smoke", "--s3", "https://bucket/prefix"])
    assert result.exit_code == 2 and "must be an s3://bucket/prefix URI" in result.stderr
    result = CliRunner().invoke(app, ["smoke", "--replicas", "0"])
    assert result.exit_code == 2 and "--replicas must be between 1 and" in result.stderr


def test_s3_uri_sources_in_order(tmp_path: Any) -> None:
    env = {"DILOCO_S3_URI": "s3://env-bucket/p"}
    assert resolve_s3_uri("s3://flag-bucket/a/", "s3://cfg-bucket/x/{run_id}", env) == "s3://flag-bucket/a"
    assert resolve_s3_uri(None, "s3://cfg-bucket/x/{run_id}/y", env) == "s3://cfg-bucket/x/y"
    assert resolve_s3_uri(None, "file:///tmp/rdv", env) == "s3://env-bucket/p"
    assert resolve_s3_uri(None, None, {}) is None
    config = tmp_path / "run.yaml"
    config.write_text("store:\n  rendezvous: s3://Bad_Bucket/{run_id}\n")
    result = CliRunner().invoke(app, ["smoke", "--config", str(config)])
    assert result.exit_code == 2 and "store.rendezvous has an invalid bucket name" in result.stderr


def test_smoke_past_its_timeout_exits_124_with_the_fix(monkeypatch: Any) -> None:
    monkeypatch.delenv("DILOCO_S3_URI", raising=False)
    code, report, _ = smoke("--timeout", "1")  # file:// store; the replicas need longer than that to start
    assert code == 124, report
    assert report["timed_out"] is True and report["ok"] is False
    replicas = next(c for c in report["checks"] if c["name"] == "replicas exited 0")
    assert replicas["status"] == "fail" and "raise --timeout" in replicas["fix"]
    if report["log_dir"]:
        shutil.rmtree(os.path.dirname(report["log_dir"]), ignore_errors=True)
