"""What a newcomer typed, each through the real CLI: what must neither break nor mislead them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.commands import DILOCO_SCRIPT as DILOCO
from typer.testing import CliRunner

from diloco.cli.main import app

#: One worker runs this module: its module-scoped run (or server) is then started once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_cli_newcomer")

TESTS_DIR = str(Path(__file__).resolve().parents[1])
runner = CliRunner()


def run_cli(*args: str, home: Path, cwd: str = TESTS_DIR, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "DILOCO_HOME": str(home), "NO_COLOR": "1", **env}
    full.pop("DILOCO_DEBUG", None)
    return subprocess.run([DILOCO, *args], capture_output=True, text=True, env=full, cwd=cwd, timeout=240)


def strict_json(text: str) -> object:
    """``json.loads`` that refuses NaN and Infinity, as every non-Python JSON parser does."""
    def refuse(name: str) -> None:
        raise ValueError(f"invalid JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def launch_args(trainer: str, *extra: str, steps: int = 2) -> list[str]:
    return ["launch", "-n", "2", "--trainer", f"support.cli_trainers:{trainer}", "--steps", str(steps), "--sync-every", "1",
            *extra]


@pytest.fixture(scope="module")
def ended_run_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DILOCO_HOME holding one ended 2-replica run of the ``slow`` trainer (which writes no final weights): the
    run that the read-only commands below (logs, completion, collect's refusals) are tried on, launched once."""
    home = tmp_path_factory.mktemp("ended-run") / "home"
    launched = run_cli(*launch_args("slow", "-k", "step_s=0.01"), home=home)
    assert launched.returncode in (0, 1), launched.stderr
    return home


@pytest.fixture
def ended_run(ended_run_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``ended_run_home`` as this test's DILOCO_HOME."""
    monkeypatch.setenv("DILOCO_HOME", str(ended_run_home))
    return ended_run_home


# ---------------------------------------------------------------------------------------------- B: true reports
def test_a_diverged_run_gives_valid_json(home: Path) -> None:
    launched = run_cli(*launch_args("diverge"), "-o", "json", home=home)
    report = strict_json(launched.stdout)
    assert isinstance(report, dict) and report["ranks"][0]["train_loss"] is None
    status = run_cli("status", "-o", "json", home=home)
    assert status.returncode == 0
    assert strict_json(status.stdout)["ranks"][1]["eval_loss"] is None


def test_status_shows_why_a_replica_failed_and_prints_trainer_text_literally(home: Path) -> None:
    text = "bad :smile: from mypkg.train:train: [bold]x[/bold]"
    launched = run_cli(*launch_args("crash_with_text", "-k", f"text={text}"), home=home)
    assert launched.returncode == 1
    status = run_cli("status", home=home)
    assert status.returncode == 0
    assert f"RuntimeError: {text}" in status.stdout  # the reason, not just "exited with code 1"
    assert "😄" not in status.stdout and "🚋" not in status.stdout + launched.stderr


# ---------------------------------------------------------------------------------------------- C: fail before launch
@pytest.mark.parametrize(("args", "message"), [
    (["--trainer", "support.cli_trainers:nofn"], "train.trainer: 'support.cli_trainers' has no function 'nofn'"),
    (["--trainer", "nosuch_pkg.train:fn"], "train.trainer: module 'nosuch_pkg.train' is not importable here"),
    (["--rendezvous", "file:///proc/diloco/{run_id}"], "is on a kernel filesystem"),
    (["--rendezvous", "file:///etc/hostname/sub/{run_id}"], "/etc/hostname is a file"),
    (["--rendezvous", "file:///tmp/{foo}/x"], "store.rendezvous: unknown placeholder {foo}"),
    (["--role", "arn:aws:iam::123456789012:role/x"], "--role: the local backend has no such setting"),
    # docs/concepts.md's SparseLoCo recipe without its --compression topk: the trainer/store combination
    (["--sync-every", "5", "--set", "store.error_feedback_decay=0.95", "-k", "outer_rule=sparseloco", "-k",
      "outer_lr=2"], "train.trainer_kwargs.outer_rule: sparseloco needs error feedback, but store.compression is "
                     "none"),
    (["--compression", "int8", "--set", "store.error_feedback=false", "-k", "outer_rule=sparseloco"],
     "train.trainer_kwargs.outer_rule: sparseloco needs error feedback, but store.error_feedback is false"),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_invalid_settings_fail_before_launch(home: Path, args: list[str], message: str, dry_run: bool) -> None:
    result = runner.invoke(app, ["launch", "-n", "2", *args, *(["--dry-run"] if dry_run else [])])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (home / "runs").exists() or not list((home / "runs").glob("*.json"))  # nothing recorded


def test_a_read_only_rendezvous_fails_before_launch_without_retrying(home: Path, tmp_path: Path) -> None:
    mount = tmp_path / "ro"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only filesystem here: {mounted.stderr.strip()}")
    try:
        result = runner.invoke(app, ["launch", "-n", "2", "--rendezvous", f"file://{mount}/{{run_id}}"])
        assert result.exit_code == 2, result.output
        assert "store.rendezvous: cannot create or write" in result.stderr
        assert "read-only" in result.stderr
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_yaml_12_numbers_everywhere(home: Path, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  trainer_kwargs:\n    lr: 3e-4\n")
    result = runner.invoke(app, ["launch", "-c", str(config), "-k", "weight_decay=1E-2",
                                 "--set", "train.trainer_kwargs.outer_lr=5e-1", "--dry-run", "-o", "json"])
    assert result.exit_code == 0, result.output
    kwargs = json.loads(result.stdout)["spec"]["entrypoint_args"]["trainer_kwargs"]
    assert (kwargs["lr"], kwargs["weight_decay"], kwargs["outer_lr"]) == (3e-4, 1e-2, 0.5)


def test_diloco_home_pointing_at_a_file_fails_every_command_clearly(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for args in (["status"], ["runs"], ["logs"], ["launch", "--dry-run"]):
        result = run_cli(*args, home=tmp_path / "file")
        assert result.returncode == 2, (args, result.stderr)
        assert "DILOCO_HOME:" in result.stderr and "is a file, not a directory" in result.stderr


# ---------------------------------------------------------------------------------------------- collect --output
def test_collect_output_directory_empty_path_and_overwrite(ended_run: Path, tmp_path: Path) -> None:
    home = ended_run
    run_id = strict_json(run_cli("status", "-o", "json", home=home).stdout)["run_id"]
    empty = runner.invoke(app, ["collect", "--output", ""])
    assert empty.exit_code == 2 and "--output: must be a file or directory path" in empty.stderr
    missing = runner.invoke(app, ["collect", "--output", str(tmp_path / "nodir" / "m.safetensors")])
    assert missing.exit_code in (0, 1) and "internal error" not in missing.stderr  # missing directories are made...
    assert not (tmp_path / "nodir").exists()  # ...when a model is written: `slow` writes none
    existing = tmp_path / "model.safetensors"
    existing.write_text("keep me")
    refused = runner.invoke(app, ["collect", "--output", str(existing)])
    assert refused.exit_code == 2 and "already exists" in refused.stderr and "--force" in refused.stderr
    assert existing.read_text() == "keep me"
    target_dir = tmp_path / "models"
    target_dir.mkdir()
    into_dir = runner.invoke(app, ["collect", "--output", str(target_dir)])
    assert "internal error" not in into_dir.stderr
    assert into_dir.exit_code in (0, 1)  # `slow` writes no final weights; what matters: no crash, no stray file
    assert not (target_dir / f"{run_id}.safetensors").exists() or into_dir.exit_code == 0


# ---------------------------------------------------------------------------------------------- E: other launchers
def test_version() -> None:
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"diloco {version('diloco')}"


def test_logs_as_json_lines(ended_run: Path) -> None:
    result = runner.invoke(app, ["logs", "-o", "json"])
    assert result.exit_code == 0
    rows = [strict_json(line) for line in result.stdout.splitlines()]
    assert rows and all(set(r) == {"rank", "time", "stream", "text"} for r in rows)  # type: ignore[arg-type]
    assert {r["rank"] for r in rows} == {0, 1}  # type: ignore[index]
    assert [r["time"] for r in rows] == sorted(r["time"] for r in rows)  # type: ignore[index]


def test_one_json_vocabulary_across_commands(home: Path) -> None:
    detached = run_cli(*launch_args("slow", "-k", "step_s=0.5", steps=200), "--detach", "-o", "json", home=home)
    assert detached.returncode == 0, detached.stderr
    launched = strict_json(detached.stdout)
    try:
        status = strict_json(run_cli("status", "-o", "json", home=home).stdout)
        runs = strict_json(run_cli("runs", "-o", "json", home=home).stdout)
    finally:
        cancelled = strict_json(run_cli("cancel", "-o", "json", home=home).stdout)
    for report in (launched, status, cancelled):
        assert isinstance(report, dict) and report["replicas"] == 2 and len(report["ranks"]) == 2
        assert {"state", "timed_out", "created_at", "ended_at", "run_id", "backend"} <= set(report)
    assert runs["runs"][0]["replicas"] == 2  # type: ignore[index]
    assert cancelled["state"] == "cancelled" and cancelled["ended_at"] is not None  # type: ignore[index]
    assert cancelled["final_eval_loss"] is None  # type: ignore[index]  # only a succeeded run has a final loss


def test_timeout_is_a_launch_flag_with_a_documented_default(home: Path) -> None:
    result = runner.invoke(app, ["launch", "--help"])
    assert "--timeout" in result.stdout and "86400" in result.stdout
    plan = json.loads(runner.invoke(app, ["launch", "--dry-run", "-o", "json"]).stdout)
    assert plan["spec"]["timeout_s"] == 86400
    plan = json.loads(runner.invoke(app, ["launch", "--timeout", "60", "--dry-run", "-o", "json"]).stdout)
    assert plan["requests"][0]["timeout_s"] == 60


def test_shell_completion_of_run_ids_and_backends(ended_run: Path) -> None:
    home = ended_run
    run_id = strict_json(run_cli("status", "-o", "json", home=home).stdout)["run_id"]  # type: ignore[index]

    def complete(words: str) -> list[str]:
        env = {"_DILOCO_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()))}
        out = run_cli(home=home, **env)
        return out.stdout.split()

    assert run_id in complete("diloco status ")
    assert complete("diloco launch --backend ") == ["local", "sagemaker", "eks", "mixed"]


def test_the_documented_json_schema_matches_the_models_and_the_output(home: Path) -> None:
    from diloco.cli.schema import output_schema

    shipped = json.loads((Path(__file__).resolve().parents[2] / "docs" / "output-schema.json").read_text())
    assert shipped == json.loads(json.dumps(output_schema())), \
        "docs/output-schema.json is stale: python -m diloco.cli.schema > docs/output-schema.json"
    import jsonschema
    plan = json.loads(runner.invoke(app, ["launch", "--dry-run", "-o", "json"]).stdout)
    jsonschema.validate(plan, {**shipped, "$ref": "#/$defs/plan"})


def test_non_numeric_metrics_are_skipped_with_one_warning_naming_rank_and_field(home: Path) -> None:
    launched = run_cli(*launch_args("bad_metrics"), home=home)
    assert "internal error" not in launched.stderr
    for args in (["status"], ["status", "-o", "json"], ["collect", "--output", str(home.parent)]):
        result = run_cli(*args, home=home)
        assert "internal error" not in result.stderr, result.stderr
        warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 2, result.stderr  # one per replica, each naming its rank and the field
        assert all("train_loss" in w for w in warnings) and any("rank 0" in w for w in warnings)
    assert strict_json(run_cli("status", "-o", "json", home=home).stdout)["ranks"][0]["eval_loss"] == 4.0


@pytest.mark.parametrize(("kwargs", "message"), [
    (["-k", "lrr=0.1"], "lrr"),
    (["--set", "train.trainer_kwargs.n_embd=33"], "n_embd"),
    (["-k", "device=cuda"], "cuda"),
    (["-k", "lr=fast"], "lr"),
])
def test_built_in_trainer_kwargs_are_checked_before_launch(home: Path, kwargs: list[str], message: str) -> None:
    result = runner.invoke(app, ["launch", "-n", "2", *kwargs])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and message in line and line.startswith("diloco: error: ")
    assert not (home / "runs").exists() or not list((home / "runs").glob("*.json"))


def test_tables_fit_a_60_column_terminal_and_summarize_hidden_replicas() -> None:
    from rich.console import Console

    from diloco.cli.views import replica_table
    from diloco.executors.base import ReplicaState, RunState
    from diloco.launcher.reports import ReplicaReport, RunReport

    ranks = [ReplicaReport(rank=i, state=ReplicaState.FAILED if i == 7 else ReplicaState.RUNNING, step=10,
                           total_steps=100, round=1, train_loss=2.6, eval_loss=2.5, tokens_per_s=12345.0, sync_s=1.2)
             for i in range(20)]
    report = RunReport(run_id="r", backend="x", state=RunState.RUNNING, created_at=0.0, rendezvous_uri="file:///r",
                       replicas=20, ranks=ranks)
    console = Console(width=60, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(replica_table(report, width=60, max_rows=6))
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 60
    assert not any("…" in line for line in lines)  # columns dropped, never truncated mid-value
    assert any(line.strip().startswith("r7") and "failed" in line for line in lines)  # the one needing attention
    assert "+15 more replicas not shown: 15 running" in text
