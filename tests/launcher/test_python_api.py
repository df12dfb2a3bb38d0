"""The Python API (``diloco.launcher.api``) drives real local runs as the CLI does, and the CLI sees them.

The example script runs as a real subprocess and trains the built-in GPT for two rounds; the lifecycle tests use
do-nothing replicas (``tests/support/fake_replica.py``: ``idle``) or torch-free ones that export one model
(``support.cli_trainers:agreed``), run by the real replica entrypoint.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import REPO, TESTS_DIR
from support.faultproxy import FaultProxy

from diloco.errors import ConfigError, RunNotFound
from diloco.executors.base import RunState
from diloco.launcher import api
from diloco.store.layout import METRICS_KEY, PROGRESS_KEY

EXAMPLE = REPO / "examples" / "python_api.py"


def safetensors_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file, read from its header (8-byte length, then JSON)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sorted(k for k in header if k != "__metadata__")


def test_the_example_script_launches_waits_and_collects_the_agreed_model(tmp_path: Path) -> None:
    home, out_dir = tmp_path / "home", tmp_path / "models"
    env = {"DILOCO_HOME": str(home), "NO_COLOR": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(EXAMPLE), f"{out_dir}/"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    model = Path(done.stdout.strip().splitlines()[-1])
    assert model.parent == out_dir and model.suffix == ".safetensors" and model.is_file()
    names = safetensors_names(model)
    assert names and any("wte" in n or "embed" in n for n in names), names
    run_id = model.stem
    assert f"launched {run_id}" in done.stderr and f"{run_id} succeeded" in done.stderr

    # A run like any other: the CLI finds it in the same registry, with its outcome.
    runs = subprocess.run([sys.executable, "-m", "diloco.cli.main", "runs", "-o", "json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert runs.returncode == 0, runs.stderr
    [row] = json.loads(runs.stdout)["runs"]
    assert row["run_id"] == run_id and row["state"] == "succeeded" and row["replicas"] == 2


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh run registry, and the tests directory as the working directory (where ``support.fake_replica`` is)."""
    monkeypatch.setenv("DILOCO_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(TESTS_DIR)
    return tmp_path / "home"


@pytest.fixture
def idle_run(home: Path) -> Iterator[api.Run]:
    run = api.launch(replicas=2, train={"trainer": "support.fake_replica:idle", "steps": 2, "sync_every": 1},
                     **{"backend.grace_period_s": 1})
    try:
        yield run
    finally:
        run.cancel(wait=True)


def test_a_detached_run_is_found_listed_described_and_cancelled(idle_run: api.Run, home: Path) -> None:
    assert idle_run.backend == "local" and idle_run.replicas == 2 and idle_run.submitted
    found = api.get_run(idle_run.run_id[-8:])  # any unique part of the id, as the CLI takes it
    assert found.run_id == idle_run.run_id
    assert api.get_run().run_id == idle_run.run_id  # the latest
    assert [s.run_id for s in api.list_runs()] == [idle_run.run_id]
    assert found.status().state in (RunState.PENDING, RunState.RUNNING)

    with pytest.raises(api.RunWaitTimeout) as waited:  # idle replicas sleep 600 s: this wait cannot see the end
        found.wait(timeout_s=0.5)
    assert waited.value.report.run_id == idle_run.run_id and not waited.value.report.state.is_terminal

    report = found.cancel(wait=True)
    assert report.state == RunState.CANCELLED and [r.state.value for r in report.ranks] == ["cancelled"] * 2
    assert found.has_ended()
    assert found.cancel().state == RunState.CANCELLED  # again: nothing to do, no error
    records = list(found.logs())
    assert {r.rank for r in records} <= {0, 1} and [r.ts for r in records] == sorted(r.ts for r in records)

    cli = subprocess.run([sys.executable, "-m", "diloco.cli.main", "status", idle_run.run_id, "-o", "json"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["state"] == "cancelled"


def test_a_poll_of_a_synchronous_run_on_s3_reads_its_ranks_progress_not_an_async_record(
        fault_proxy: FaultProxy, s3_uri: str, home: Path) -> None:
    """What each poll of a waiting ``launch`` or ``watch`` reads on S3: each rank's metrics and progress, not an
    asynchronous run's published record (looked for through a client built afresh each poll, that tripled the
    CLI's CPU on a SageMaker run)."""
    run = api.launch(replicas=2, train={"trainer": "support.fake_replica:idle", "steps": 2, "sync_every": 1},
                     **{"backend.grace_period_s": 1, "store.rendezvous": f"{s3_uri}/{{run_id}}"})
    try:
        found = api.get_run(run.run_id)
        fault_proxy.clear()
        assert found.status().state in (RunState.PENDING, RunState.RUNNING)
        # The replicas go through the same proxy (a sync replica never looks under async/): the keys asked about.
        asked = {seen.path.split("?")[0].split(run.run_id + "/", 1)[-1] for seen in fault_proxy.requests()}
        expected = {key.format(rank=rank) for rank in range(2) for key in (METRICS_KEY, PROGRESS_KEY)}
        assert expected <= asked and not any(key.startswith("async/") for key in asked), asked
    finally:
        run.cancel(wait=True)


def test_collect_refuses_an_existing_model_file_before_waiting(idle_run: api.Run, tmp_path: Path) -> None:
    existing = tmp_path / "model.safetensors"
    existing.write_bytes(b"kept")
    with pytest.raises(ConfigError, match="already exists"):
        idle_run.collect(existing)  # the run is still going: a refusal after the wait would come far too late
    assert existing.read_bytes() == b"kept"
    with pytest.raises(ConfigError, match="--replica: replica 5 does not exist"):
        idle_run.logs(ranks=[5])


def test_bad_settings_raise_one_config_error_and_launch_nothing(home: Path) -> None:
    with pytest.raises(ConfigError) as bad:
        api.launch(replicas=0)
    assert str(bad.value).startswith("replicas:")
    with pytest.raises(ConfigError, match="backend: must be one of"):
        api.launch(backend="no-such-backend")
    with pytest.raises(ConfigError, match="train.steps"):
        api.plan(**{"train.steps": "many"})
    assert api.list_runs() == []
    assert not list(home.glob("runs/*"))
    with pytest.raises(RunNotFound):
        api.get_run()


def test_an_attached_launch_returns_the_ended_run(home: Path) -> None:
    """What the API does with an attached launch, not training, is under test here (the example script trains):
    torch-free replicas of the real entrypoint that report their steps and export one model."""
    run = api.launch(REPO / "configs" / "local.yaml", detach=False, replicas=2,
                     train={"steps": 10, "sync_every": 10, "trainer": "support.cli_trainers:agreed"})
    assert run.has_ended()
    report = run.status()
    assert report.state == RunState.SUCCEEDED and [r.step for r in report.ranks] == [10, 10]
    out = run.collect(f"{home / 'models'}/")  # a string: a pathlib.Path would drop the "/" that means a directory
    assert out.weights_identical is True and Path(out.model_path).parent == home / "models"


def test_a_plan_is_the_dry_run_and_creates_nothing(home: Path) -> None:
    plan = api.plan(REPO / "configs" / "local.yaml", replicas=3, train__steps=100)
    assert plan.backend == "local" and plan.spec.replicas == 3 and len(plan.requests) == 3
    cfg = api.resolve(REPO / "configs" / "local.yaml", train={"steps": 100})
    assert cfg.train.steps == 100 and cfg.train.sync_every == 50  # the file's other train settings stay
    assert api.list_runs() == [] and not home.exists()


def test_readmes_python_api_block_is_the_tested_example() -> None:
    """README shows the example's lines, so what a reader copies is what this module runs."""
    from readme_blocks import section

    text = section("Python API")
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    example = EXAMPLE.read_text()
    missing = [line for line in block.splitlines() if line.strip() and line.strip() not in example]
    assert not missing, f"README's Python API lines not in {EXAMPLE.name}: {missing}"
