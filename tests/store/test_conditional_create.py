"""A store that ignores ``If-None-Match`` cannot hold a run whose correctness rests on creating a key exactly once.

The store here is moto behind the fault proxy with every request's ``If-None-Match`` header removed: real S3 API
traffic from real s3fs/boto3, answered by a server that never sees the condition, as an S3-compatible store that
ignores it answers. ``diloco doctor`` fails its "s3 conditional create" row; ``diloco launch --min-replicas`` is
refused before anything is written (its round manifests are "created exactly once" only through that header),
with one line naming the setting and the fix; the same probe passes on moto itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from support.commands import run_cli as cli
from support.faultproxy import FaultProxy

from diloco.cli import exit_codes
from diloco.errors import ConfigError
from diloco.launcher.config import validate
from diloco.launcher.launch import require_conditional_create
from diloco.store.objects import ObjectStore

TESTS_DIR = str(Path(__file__).resolve().parents[1])


@pytest.fixture
def ignores_if_none_match(fault_proxy: FaultProxy) -> FaultProxy:
    fault_proxy.add("strip_header", method="PUT", header="If-None-Match")
    return fault_proxy


def test_launch_with_min_replicas_is_refused_on_a_store_that_ignores_if_none_match(
        s3_bucket: str, ignores_if_none_match: FaultProxy, bucket_keys: Callable[[str], list[str]],
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = cli("launch", "-n", "4", "--min-replicas", "3", "--trainer", "support.fake_replica:idle", "--steps", "2",
              "--sync-every", "1", "--rendezvous", f"s3://{s3_bucket}/runs/{{run_id}}", "--detach", home=home)
    assert out.returncode == exit_codes.USAGE, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco: error: store.rendezvous:"), out.stderr
    assert "ignores conditional writes" in lines[0] and "--min-replicas 3" in lines[0]
    assert "If-None-Match" in lines[0] and "drop --min-replicas" in lines[0]
    stripped = ignores_if_none_match.requests("PUT")
    assert stripped and all(seen.headers.get("if-none-match") == "*" for seen in stripped)  # asked, but ignored
    assert bucket_keys(s3_bucket) == [], "the probe's key went, and nothing else was written"
    assert json.loads(cli("runs", "-o", "json", home=home).stdout)["runs"] == []
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())


def test_the_probe_passes_where_if_none_match_is_honoured_and_only_runs_that_need_it_ask(
        s3_uri: str, fault_proxy: FaultProxy) -> None:
    needs = validate({"replicas": 4, "store": {"rendezvous": s3_uri, "min_replicas": 3}})
    require_conditional_create(ObjectStore(s3_uri), needs)  # moto honours it: no error
    assert fault_proxy.requests("PUT"), "the probe ran"
    assert ObjectStore(s3_uri).list() == []

    fault_proxy.clear()
    fault_proxy.add("strip_header", method="PUT", header="If-None-Match")
    with pytest.raises(ConfigError, match="ignores conditional writes"):
        require_conditional_create(ObjectStore(s3_uri), needs)
    plain = validate({"replicas": 4, "store": {"rendezvous": s3_uri}})
    fault_proxy.clear()
    require_conditional_create(ObjectStore(s3_uri), plain)  # nothing in this run needs it: nothing asked
    assert fault_proxy.requests() == []


def test_doctor_fails_conditional_create_through_the_same_probe(s3_uri: str,
                                                                ignores_if_none_match: FaultProxy,
                                                                tmp_path: Path) -> None:
    out = cli("doctor", "--s3", s3_uri, "-o", "json", home=tmp_path / "home")
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert checks["s3 read/write"]["status"] == "pass", checks
    assert checks["s3 conditional create"]["status"] == "fail"
    assert "If-None-Match: * not honoured" in checks["s3 conditional create"]["detail"]
    assert out.returncode == exit_codes.FAILED
