"""The same kill and resume as ``test_hf_data_resume.py``, with pre-tokenized shards (``.npy``, ``.bin`` and
Parquet of token ids) under an ``s3://`` prefix on the loopback S3 server: read as training goes, never tokenized,
and the relaunched replica continues at the block its committed round left it."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainers.hf_data_fixtures import check_resumed_exactly, launch_with_a_kill, write_shards
from trainers.test_hf_trainer import tokenizer_dir  # noqa: F401 (tests/ is on sys.path)

from diloco.store.objects import ObjectStore
from diloco.trainers import hf


@pytest.mark.slow
def test_a_killed_replica_on_pre_tokenized_s3_shards_resumes_at_its_committed_position(
        home: Path, tmp_path: Path, tokenizer_dir: Path, s3_uri: str,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0")
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    shards = ObjectStore(f"{s3_uri}/shards")
    for name, payload in write_shards(tmp_path / "shards", hf.load_tokenizer(str(tokenizer_dir))).items():
        shards.put(name, payload)
    run_id, logs = launch_with_a_kill(home, tmp_path, shards.url(), tokenizer_dir)
    check_resumed_exactly(home, tmp_path, run_id, logs, shards.url(), tokenizer_dir)
