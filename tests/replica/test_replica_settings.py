"""The replica settings model (``diloco.replica.settings``): the one declaration of what a replica receives, and
the checks a replica applies to the settings object it reads from the run's store."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.replica.settings import (
    ReplicaSettings,
    SettingsObject,
    SettingsRefused,
    parse_settings_json,
    verify_settings_object,
)

ROOT = "s3://bucket/runs/run-a"


def test_the_launch_spec_publishes_exactly_the_replica_settings_model() -> None:
    args = EntrypointArgs(rendezvous_uri=ROOT, world_size=3, trainer_kwargs={"lr": 3e-4}, min_replicas=2)
    spec = LaunchSpec(run_id="run-a", replicas=3, entrypoint_args=args, spec_uri=f"{ROOT}/spec.json")
    data = spec.spec_object()
    settings = verify_settings_object(data, f"{ROOT}/spec.json", sha256=hashlib.sha256(data).hexdigest(),
                                      run_id="run-a")
    assert settings == ReplicaSettings(**args.model_dump())
    assert spec.entrypoint_argv()[-1] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(("fields", "needle"), [
    ({"world_size": 0}, "world_size"),
    ({"trainer": "no_colon"}, "trainer"),
    ({"min_replicas": 5}, "min_replicas"),
    ({"spread": 0}, "spread"),
    ({"allreduce": "ring"}, "allreduce"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"unknown_setting": 1}, "unknown_setting"),
])
def test_a_bad_setting_is_refused_naming_its_field(fields: dict, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        ReplicaSettings(**{"rendezvous_uri": ROOT, "world_size": 4, **fields})


def test_inline_settings_name_the_field_that_is_wrong() -> None:
    assert parse_settings_json('{"rendezvous_uri": "file:///r", "world_size": 2}').world_size == 2
    with pytest.raises(SettingsRefused, match="world_size"):
        parse_settings_json('{"rendezvous_uri": "file:///r", "world_size": "two"}')


def test_settings_are_frozen_so_no_path_can_change_them_after_publication() -> None:
    settings = ReplicaSettings(rendezvous_uri=ROOT, world_size=1)
    with pytest.raises(ValidationError):
        settings.world_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(("obj", "sha", "run_id", "needle"), [
    (SettingsObject(run_id="run-a", settings=ReplicaSettings(rendezvous_uri=ROOT, world_size=1)), "0" * 64,
     "run-a", "SHA-256"),
    (SettingsObject(run_id="run-b", settings=ReplicaSettings(rendezvous_uri=ROOT, world_size=1)), None,
     "run-a", "run run-b"),
    (SettingsObject(run_id="run-a", settings=ReplicaSettings(rendezvous_uri="s3://b/other", world_size=1)), None,
     "run-a", "names rendezvous"),
    (SettingsObject(format="diloco.replica-settings/0", run_id="run-a",
                    settings=ReplicaSettings(rendezvous_uri=ROOT, world_size=1)), None, "run-a", "object, not"),
])
def test_a_replica_refuses_settings_that_are_not_its_runs(obj: SettingsObject, sha: str | None, run_id: str,
                                                         needle: str) -> None:
    with pytest.raises(SettingsRefused, match=needle):
        verify_settings_object(obj.to_bytes(), f"{ROOT}/spec.json", sha256=sha, run_id=run_id)
