"""A replica SIGKILLed mid-run resumes at its committed data position, with ``hf:`` streamed data and with
pre-tokenized shards on S3: 2 replicas of the Hugging Face trainer through the real ``diloco launch`` (local
backend), a tiny Llama, data built here.

Replica 1 kills itself after inner step 6 (round 1 committed at step 4, round 2 not yet), the launcher relaunches
it, it rejoins at round 1. Every process logs a digest of the token ids of each inner step (``data_log``). The
relaunch must train steps 5..12 on exactly the token ids a run without the kill trains on (a fresh stream of the
same slot, and the killed process's own steps 5 and 6), restoring the position saved with round 1 rather than the
one the killed process had reached at step 6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from trainers.hf_data_fixtures import check_resumed_exactly, launch_with_a_kill, save_dataset
from trainers.test_hf_trainer import tokenizer_dir  # noqa: F401 (tests/ is on sys.path)


@pytest.mark.slow
def test_a_killed_replica_on_hf_streamed_data_resumes_at_its_committed_position(
        home: Path, tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0")
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # tests/: the replicas import support.*
    data = save_dataset(tmp_path / "dataset")
    run_id, logs = launch_with_a_kill(home, tmp_path, data, tokenizer_dir)
    check_resumed_exactly(home, tmp_path, run_id, logs, data, tokenizer_dir)
