"""README's "Bring your own trainer" example, as a user copies it: the file from the README and the command from
the README, run through ``diloco launch`` with real replica processes.

What must hold: the README's file is the one the other tests run (``tests/byo_trainer.py``); each replica trains
on its own batches (different train losses at the first round), not on the same ones; a run without a config
polls at the documented default, which the replicas really used; and the trainer, which records nothing itself
but the one optional ``report()`` line, ends with a full progress record and checked identical final weights.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
from readme_blocks import block_starting, blocks
from support.commands import DILOCO_SCRIPT as DILOCO

TESTS_DIR = Path(__file__).resolve().parents[1]
SECTION = "Bring your own trainer"
#: Bound on one small launch (2 replicas, 2 rounds of a 17-parameter model): only against a hang.
GUARD_S = 240


def readme_trainer() -> str:
    """The README's trainer file, without its ``# mypkg/train.py`` title line."""
    return block_starting(SECTION, "python", "# mypkg/train.py").split("\n", 1)[1]


def readme_command() -> list[str]:
    """The README's launch command for that trainer, as argv."""
    (command,) = [b for b in blocks(SECTION, "bash") if "--trainer mypkg.train:train" in b]
    return shlex.split(command.replace("\\\n", " "))


def with_option(argv: list[str], option: str, value: str) -> list[str]:
    """``argv`` with ``option``'s value replaced (it must be there: the test runs the README's own command)."""
    assert option in argv, f"the README command has no {option}: {argv}"
    at = argv.index(option)
    return [*argv[: at + 1], value, *argv[at + 2:]]


def run_diloco(argv: list[str], *, home: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``diloco ARGV`` in its own process group; on a hang the group is killed and the run cancelled."""
    env = {**os.environ, "DILOCO_HOME": str(home), "NO_COLOR": "1"}
    env.pop("DILOCO_DEBUG", None)
    proc = subprocess.Popen([DILOCO, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        subprocess.run([DILOCO, "cancel"], env=env, cwd=cwd, capture_output=True, timeout=60)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_the_readme_trainer_is_the_file_the_tests_run() -> None:
    """``tests/byo_trainer.py`` (run by the integration and housekeeping tests) is the README's file, verbatim,
    after its own header comments."""
    lines = (TESTS_DIR / "support" / "byo_trainer.py").read_text().splitlines(keepends=True)
    body = "".join(lines[next(i for i, line in enumerate(lines) if not line.startswith("#")):])
    assert body == readme_trainer()


@pytest.mark.slow
def test_the_readme_trainer_gives_every_replica_its_own_batches(home: Path, tmp_path: Path) -> None:
    """The README's file saved as ``mypkg/train.py``, the README's command from that folder, 2 replicas and 2
    rounds: the replicas' train losses differ at round 1 (the same batches everywhere would give equal ones, since
    every replica starts from the same weights), and the run used the documented default poll interval (what the
    replicas polled at), not the 1 s at which short rounds spend most of their sync time polling. The outer loop
    recorded step/total, round, sync time and bytes, the report() line the loss and tok/s, and every rank exported
    the same global weights."""
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(readme_trainer())
    argv = readme_command()
    assert argv[:2] == ["diloco", "launch"] and "--config" not in argv and "-c" not in argv
    for option, value in (("--replicas", "2"), ("--steps", "40"), ("--sync-every", "20")):
        argv = with_option(argv, option, value)

    launched = run_diloco([*argv[1:], "-o", "json"], home=home, cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    report = json.loads(launched.stdout)
    run_id = report["run_id"]
    store = home / "runs" / run_id / "store"

    first_round = {}
    for rank in (0, 1):
        rows = [json.loads(line) for line in (store / f"metrics/rank_{rank:04d}.jsonl").read_text().splitlines()]
        rounds = [row for row in rows if row["kind"] == "round"]
        assert [row["round"] for row in rounds] == [1, 2]
        first_round[rank] = rounds[0]["train_loss"]
    assert None not in first_round.values()
    assert first_round[0] != first_round[1], f"both replicas trained on the same batches: {first_round}"

    from diloco.launcher.config import StoreConfig

    record = json.loads((home / "runs" / f"{run_id}.json").read_text())
    used = record["config"]["store"]["poll_interval_s"]
    assert used == StoreConfig().poll_interval_s <= 0.25, used  # not 1 s: a round is noticed in a few tenths
    spec = json.loads((store / "spec.json").read_text())
    assert spec["settings"]["poll_interval_s"] == used  # what the replicas polled at
    assert "lr=3e-4" in argv and spec["settings"]["trainer_kwargs"]["lr"] == 3e-4  # the README's setting, a number

    from diloco.launcher.compaction import compacted_verdict
    from diloco.launcher.progress import read_progress
    from diloco.launcher.weights import agreed_tensors
    from diloco.store.objects import ObjectStore

    objects = ObjectStore(f"file://{store}")
    readout = read_progress(objects, 2)
    assert readout.warnings == []
    for rep in readout.replicas:
        assert (rep.step, rep.total_steps, rep.round, rep.finished_training) == (40, 40, 2, True)
        assert rep.train_loss is not None and rep.train_loss > 0 and not rep.diverged
        assert rep.tokens == 40 * 32 and rep.tokens_per_s is not None and rep.tokens_per_s > 0
        assert rep.sync_s is not None and rep.sync_s >= 0
        assert rep.bytes_written and rep.bytes_read  # it really exchanged through the store
    check = compacted_verdict(objects, 2)  # launch checked every rank's copy, then kept one
    assert check is not None and check.identical is True, check
    assert sorted(agreed_tensors(objects, check)) == ["bias", "weight"] and check.value_count == 17
    assert check.metadata["step"] == "40" and check.metadata["round"] == "2"
    for rank in (0, 1):  # the loop's own log line per round
        assert "round 2 step 40/40" in (home / "runs" / run_id / "logs" / f"rank_{rank}" / "stdout.log").read_text()


@pytest.mark.parametrize("option", ["--replicas", "--steps", "--sync-every", "--trainer-kwargs"])
def test_the_readme_command_has_the_options_the_test_changes(option: str) -> None:
    assert option in readme_command()
