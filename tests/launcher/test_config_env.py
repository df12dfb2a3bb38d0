"""The replicas' environment (``--env KEY=VALUE``, ``env:``): merged like every setting, validated before anything is
planned (one line naming ``--env`` or ``env.<KEY>``, exit 2, nothing launched), passed to every replica, and masked
where it looks secret in the dry run (table, JSON, YAML) and in what diloco records (the run record, ``run.json``),
while the replicas get the real values. A local run checks it from inside the replicas (``support.env_trainer``)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from support.commands import run_cli

from diloco.errors import ConfigError
from diloco.executors.user_env import MASK, mask_value, masked
from diloco.launcher.config import resolve_config
from diloco.launcher.launch import build_spec

SECRET = "hf_not-a-real-token-3f9a"
TINY = ["--steps", "1", "--sync-every", "1"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def error_of(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(**kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------- merging
def test_env_flags_add_to_the_configs_mapping_and_set_wins_last(tmp_path: Path) -> None:
    path = write(tmp_path, "env: {PIP_INDEX_URL: 'https://a.example/simple', OMP_NUM_THREADS: 4}\n")
    cfg = resolve_config(path, flags={"env": ["HF_HOME=/data/hf", "PIP_INDEX_URL=https://b.example/simple?x=1"]},
                         sets=["env.HF_HOME=/scratch"])
    assert cfg.env == {"PIP_INDEX_URL": "https://b.example/simple?x=1",  # the flag beats the file, verbatim
                       "OMP_NUM_THREADS": "4",  # a YAML number is the text it reads as
                       "HF_HOME": "/scratch"}  # --set is applied last
    # A value is never parsed as YAML: a leading zero, an equals sign and an empty value stay what was typed.
    assert resolve_config(flags={"env": ["A=007", "B=x=y", "C="]}).env == {"A": "007", "B": "x=y", "C": ""}


def test_the_spec_carries_the_env_to_every_replicas_environment() -> None:
    cfg = resolve_config(flags={"env": ["PIP_INDEX_URL=https://pypi.example/simple"], "replicas": 2})
    spec = build_spec(cfg, "run-env")
    assert spec.env == {"PIP_INDEX_URL": "https://pypi.example/simple"}
    for rank in (0, 1):
        env = spec.replica_env(rank)
        assert env["PIP_INDEX_URL"] == "https://pypi.example/simple" and env["REPLICA_RANK"] == str(rank)


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("item", "expected"), [
    ("NOEQUALS", "--env: expected KEY=VALUE (got 'NOEQUALS')"),
    ("=x", "--env: expected KEY=VALUE"),
    ("1ABC=x", "--env 1ABC: not a valid variable name"),
    ("MY-VAR=x", "--env MY-VAR: not a valid variable name"),
    ("REPLICA_RANK=3", "--env REPLICA_RANK: diloco sets this variable for every replica itself"),
    ("WORLD_SIZE=3", "--env WORLD_SIZE: diloco sets this variable"),
    ("RENDEZVOUS_URI=s3://x", "--env RENDEZVOUS_URI: diloco sets this variable"),
    ("DILOCO_BOOTSTRAP_REQUIREMENTS=x", "--env DILOCO_BOOTSTRAP_REQUIREMENTS: diloco sets this variable"),
    ("JOB_COMPLETION_INDEX=0", "--env JOB_COMPLETION_INDEX: diloco sets this variable"),
])
def test_a_bad_env_flag_is_one_line_naming_it(item: str, expected: str) -> None:
    assert error_of(flags={"env": [item]}).startswith(expected)


@pytest.mark.parametrize(("yaml", "expected"), [
    ("env: {1ABC: x}\n", "env.1ABC: not a valid variable name"),
    ("env: {DILOCO_RUN_ID: x}\n", "env.DILOCO_RUN_ID: diloco sets this variable"),
    ("env: {VERBOSE: yes}\n", 'env.VERBOSE: must be text (got True); quote it in YAML, e.g. VERBOSE: "True"'),
    ("env: {RATIO: 0.5}\n", "env.RATIO: must be text (got 0.5)"),
    ("env: [A=1]\n", "env: must be a mapping of keys to values"),
])
def test_a_bad_env_entry_in_the_config_is_one_line_naming_it(tmp_path: Path, yaml: str, expected: str) -> None:
    assert error_of(config_path=write(tmp_path, yaml)).startswith(expected)


def test_a_refused_env_exits_2_and_launches_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = run_cli("launch", "--env", "REPLICA_RANK=7", *TINY, home=home)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") <= 2 and "--env REPLICA_RANK: diloco sets this variable" in out.stderr
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())


# ---------------------------------------------------------------------------------------------- masking
@pytest.mark.parametrize(("name", "value", "shown"), [
    ("HF_TOKEN", SECRET, MASK),
    ("AWS_SECRET_ACCESS_KEY", "abc", MASK),
    ("WANDB_API_KEY", "abc", MASK),
    ("PGPASSWORD", "abc", MASK),
    ("GOOGLE_APPLICATION_CREDENTIALS", "/x.json", MASK),
    ("proxy_auth", "abc", MASK),
    ("PIP_INDEX_URL", "https://pypi.example/simple", "https://pypi.example/simple"),
    ("PIP_INDEX_URL", "https://ci:s3cr3t@pypi.example:8443/simple", "https://ci:****@pypi.example:8443/simple"),
    ("PIP_EXTRA_INDEX_URL", "https://tok3n@pypi.example/simple", "https://****@pypi.example/simple"),
    ("PIP_FIND_LINKS", "file:///wheels/a@b", "file:///wheels/a@b"),
    ("HF_HOME", "/data/hf", "/data/hf"),
])
def test_values_that_look_secret_are_masked(name: str, value: str, shown: str) -> None:
    assert mask_value(name, value) == shown


def test_masking_a_request_touches_only_the_users_variables() -> None:
    env = {"HF_TOKEN": SECRET, "HF_HOME": "/data/hf"}
    request = {"KmsKeyId": "alias/k", "Environment": {"HF_TOKEN": SECRET, "HF_HOME": "/data/hf"},
               "containers": [{"env": [{"name": "HF_TOKEN", "value": SECRET}, {"name": "TOKEN_FILE", "value": "f"}]}]}
    shown = masked(request, env)
    assert shown == {"KmsKeyId": "alias/k", "Environment": {"HF_TOKEN": MASK, "HF_HOME": "/data/hf"},
                     "containers": [{"env": [{"name": "HF_TOKEN", "value": MASK}, {"name": "TOKEN_FILE", "value": "f"}]}]}
    assert request["Environment"]["HF_TOKEN"] == SECRET  # the request itself is left as it is


@pytest.mark.parametrize("fmt", ["table", "json", "yaml"])
def test_the_dry_run_masks_secret_values_in_every_format(tmp_path: Path, fmt: str) -> None:
    out = run_cli("launch", "--dry-run", "-o", fmt, "--env", f"HF_TOKEN={SECRET}", "--env", "MARKER=visible",
                  *TINY, home=tmp_path / "home")
    assert out.returncode == 0, out.stderr
    assert SECRET not in out.stdout + out.stderr
    assert "visible" in out.stdout and "HF_TOKEN" in out.stdout
    if fmt == "json":
        plan = json.loads(out.stdout)
        assert plan["spec"]["env"] == {"HF_TOKEN": MASK, "MARKER": "visible"}
        assert all(r["env"]["HF_TOKEN"] == MASK and r["env"]["MARKER"] == "visible" for r in plan["requests"])


# ---------------------------------------------------------------------------------------------- a real local run
def test_every_local_replica_gets_the_env_and_nothing_recorded_holds_the_secret(tmp_path: Path) -> None:
    home = tmp_path / "home"
    launched = run_cli("launch", "-n", "2", "--trainer", "support.env_trainer:report", "-k",
                       "names=MARKER,HF_TOKEN,PIP_INDEX_URL", "--env", "MARKER=from-the-launch", "--env",
                       f"HF_TOKEN={SECRET}", "--env", "PIP_INDEX_URL=https://pypi.example/simple", *TINY,
                       "--detach", "-o", "json", home=home)
    assert launched.returncode == 0, launched.stderr
    run_id = json.loads(launched.stdout)["run_id"]
    waited = run_cli("status", run_id, "--watch", home=home)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    store = home / "runs" / run_id / "store"
    for rank in (0, 1):  # what each replica process saw: the real values
        seen = json.loads((store / "env" / f"rank_{rank}.json").read_text())
        assert seen == {"MARKER": "from-the-launch", "HF_TOKEN": SECRET, "PIP_INDEX_URL": "https://pypi.example/simple"}
    record = json.loads((home / "runs" / f"{run_id}.json").read_text())
    assert record["config"]["env"] == {"MARKER": "from-the-launch", "HF_TOKEN": MASK,
                                       "PIP_INDEX_URL": "https://pypi.example/simple"}
    assert SECRET not in (store / "run.json").read_text() and SECRET not in (store / "spec.json").read_text()
    # The one file that keeps it is the local backend's requests.json, which a relaunch repeats: its owner's only.
    holders = [p for p in home.rglob("*") if p.is_file() and not p.is_relative_to(store / "env")
               and SECRET.encode() in p.read_bytes()]
    assert [p.name for p in holders] == ["requests.json"], holders
    assert stat.S_IMODE(os.stat(holders[0]).st_mode) == 0o600
