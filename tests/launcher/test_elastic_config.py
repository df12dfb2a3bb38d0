"""What an elastic run (``--max-replicas``) is refused at launch, in one line naming the setting, before anything
is created; and the counts ``diloco scale`` reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.commands import run_cli

from diloco.errors import ConfigError
from diloco.launcher.api import resolve
from diloco.launcher.scale import parse_request, target_count


@pytest.mark.parametrize("overrides, message", [
    (dict(replicas=3, store={"max_replicas": 2}), "store.max_replicas: must be at least the replicas launched (3)"),
    (dict(store={"max_replicas": 4}, train={"mode": "async"}), "store.max_replicas: an elastic run is synchronous"),
    (dict(store={"max_replicas": 4}, train={"procs_per_replica": 2}),
     "store.max_replicas: an elastic run has one process per replica"),
    (dict(store={"max_replicas": 4, "allreduce": "sharded"}), "an elastic run needs allreduce gather"),
    (dict(store={"max_replicas": 4, "min_replicas": 5}), "must be at most"),
])
def test_an_elastic_config_that_cannot_work_is_refused_naming_the_setting(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="max_replicas|min_replicas") as info:
        resolve(backend="local", **overrides)
    assert message in str(info.value), str(info.value)


def test_an_elastic_config_is_accepted_and_reaches_the_replicas_settings() -> None:
    from diloco.launcher.launch import build_spec

    cfg = resolve(backend="local", replicas=2, store={"max_replicas": 4, "min_replicas": 2})
    assert build_spec(cfg, "run").entrypoint_args.max_replicas == 4


@pytest.mark.parametrize("request_, members, count", [("4", [0, 1], 4), ("+2", [0, 1], 4), ("-1", [0, 1, 2, 3], 3),
                                                     (3, [0, 1], 3)])
def test_a_scale_request_is_a_count_or_a_change(request_: str | int, members: list[int], count: int) -> None:
    assert target_count(request_, members) == count


@pytest.mark.parametrize("bad", ["four", "+", "0", "-0", "2.5"])
def test_a_scale_request_that_is_no_count_is_refused_naming_replicas(bad: str) -> None:
    with pytest.raises(ConfigError, match="--replicas"):
        parse_request(bad)


def test_scaling_a_run_that_is_not_known_is_one_line_exit_2(tmp_path: Path) -> None:
    result = run_cli("scale", "nosuchrun", "--replicas", "+1", home=tmp_path / "home")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    missing = run_cli("scale", "nosuchrun", home=tmp_path / "home")
    assert missing.returncode == 2, missing.stderr


def test_growing_a_run_whose_record_masks_a_secret_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """The record keeps secret-looking values masked; new replicas would get the mask instead of the value."""
    from types import SimpleNamespace

    from diloco.launcher.scale import launch_spec_of
    from diloco.store.objects import ObjectStore

    store = ObjectStore(f"file://{tmp_path / 'store'}")
    record = SimpleNamespace(config={"env": {"HF_TOKEN": "****", "MODE": "x"}}, run_id="r",
                             rendezvous_uri=store.url(""))
    store.put("spec.json", b'{"format": "diloco.replica-settings/1", "run_id": "r", "settings": '
                           b'{"rendezvous_uri": "file:///x", "world_size": 2, "max_replicas": 4}}')
    run = SimpleNamespace(store=store, record=record, run_id="r", policy=SimpleNamespace(max_restarts=0))
    with pytest.raises(ConfigError, match=r"secret value\(s\) the run record keeps masked \(HF_TOKEN\)"):
        launch_spec_of(run, 3)  # type: ignore[arg-type]
    assert store.list() == ["spec.json"]
