"""The SageMaker launch a user watches from four shells, against an emulator as strict as the service.

Why: the account holds 5,000 older jobs (a filtered listing walks them all, 100 per call, at 2 calls/s), every
API has its per-account rate (ListTrainingJobs 2/s, GetLogEvents 10/s, ...), and the user runs ``diloco
status``, ``diloco logs -f`` and ``diloco cancel`` from other shells while ``diloco launch`` waits. Every
command must do its job without showing a throttling error, and the cancel must leave no job running. Real CLI
processes, real boto3, the emulator's jobs as real processes (tests/sagemaker_scenario.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from emulators.sagemaker import SageMakerEmulator
from support.sagemaker_scenario import image_interpreter, run_watched_launch

pytestmark = pytest.mark.slow

HISTORY = 5000
REPLICAS = 8


@pytest.fixture
def strict_emulator(aws_env: str, s3_bucket: str, tmp_path: Path) -> Iterator[SageMakerEmulator]:
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=2.0,
                           log_flush_s=0.2, history=HISTORY, rate_limits=True,
                           interpreter=image_interpreter(tmp_path / "image")) as emu:
        yield emu


def test_a_watched_launch_of_8_replicas_in_an_account_with_history_shows_no_throttling_and_cancels_cleanly(
    strict_emulator: SageMakerEmulator, s3_bucket: str, tmp_path: Path
) -> None:
    run = run_watched_launch(strict_emulator, bucket=s3_bucket, home=tmp_path / "home", workdir=tmp_path / "shells",
                             replicas=REPLICAS)
    shells = run.shells
    assert shells["status"].returncode == 0, shells["status"].stderr[-2000:]
    assert shells["cancel"].returncode == 0, shells["cancel"].stderr[-2000:]
    assert shells["launch"].returncode == 4, shells["launch"].stderr[-3000:]  # cancelled (README's exit codes)
    assert shells["logs"].returncode == 0, shells["logs"].stderr[-2000:]  # followed to the run's end
    for name, shell in shells.items():
        shown = (shell.stdout + shell.stderr).lower()
        assert "throttl" not in shown and "rate exceeded" not in shown, (name, shown[-2000:])
    assert "cancelled" in shells["cancel"].stdout.lower()
    for rank in range(REPLICAS):
        assert f"[r{rank}] rank {rank} tick 0" in shells["logs"].stdout

    jobs = [j for j in strict_emulator.jobs() if j.name.startswith(run.run_id)]
    assert sorted(j.name for j in jobs) == sorted(f"{run.run_id}-r{r}" for r in range(REPLICAS))
    assert [j.status for j in jobs] == ["Stopped"] * REPLICAS
    assert strict_emulator.running_pids() == []
    # no command listed the account's jobs: each poll cost one describe per unfinished job, whatever the history
    assert strict_emulator.operation_calls("ListTrainingJobs") == []
