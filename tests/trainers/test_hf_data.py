"""Streamed data of the Hugging Face trainer (``diloco.trainers.hf_data``), its saved positions
(``diloco.trainers.data_positions``): real files, a real ``datasets`` dataset written with ``save_to_disk``, a
``file://`` store and the loopback S3 server. The kill-and-resume runs are ``test_hf_data_resume*.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from trainers.hf_data_fixtures import save_dataset
from trainers.test_hf_trainer import tokenizer_dir  # noqa: F401 (tests/ is on sys.path)
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.errors import ConfigError
from diloco.store.objects import ObjectStore
from diloco.trainers import hf, hf_data
from diloco.trainers.data_positions import DataPositions
from diloco.trainers.hf_feed import StreamFeed, restore_position

BLOCK = 10


def id_shards(directory: Path) -> Path:
    """Token ids 0..2999 in three shards (one of each format), so a block's first id names it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    np.save(directory / "a.npy", np.arange(0, 1000, dtype=np.uint16))
    np.arange(1000, 2000, dtype=np.uint16).tofile(directory / "b.bin")
    pq.write_table(pa.table({"input_ids": [list(range(i, i + 50)) for i in range(2000, 3000, 50)]}),
                   directory / "c.parquet")
    (directory / "README.md").write_text("not a shard")
    return directory


def id_rows(directory: Path, rows: int = 60) -> str:
    """A saved dataset of pre-tokenized rows: row r holds 7 ids, r * 100 .. r * 100 + 6."""
    import datasets

    datasets.Dataset.from_dict({"input_ids": [list(range(r * 100, r * 100 + 7)) for r in range(rows)]}) \
        .save_to_disk(str(directory))
    return f"hf:{directory}"


def shard_stream(data: str, slot: int, slots: int = 3, n_eval: int = 4) -> hf_data.TokenShardStream:
    stream = hf_data.open_stream(data, None, block_size=BLOCK, slot=slot, slots=slots, n_eval=n_eval)
    assert isinstance(stream, hf_data.TokenShardStream)
    return stream


# ------------------------------------------------------------------------------------------------ what data= names
def test_hf_values_name_a_dataset_its_config_and_split() -> None:
    assert hf_data.parse_hf("hf:org/stories:en@validation") == hf_data.HFSource("org/stories", "en", "validation")
    assert hf_data.parse_hf("hf:org/stories") == hf_data.HFSource("org/stories", None, "train")
    assert hf_data.parse_hf("hf:./saved@test") == hf_data.HFSource("./saved", None, "test")
    with pytest.raises(ConfigError, match="names no dataset"):
        hf_data.parse_hf("hf:@train")


def test_token_shards_are_streamed_and_text_is_not(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = id_shards(tmp_path / "shards")
    (tmp_path / "text").mkdir()
    pq.write_table(pa.table({"text": ["a document"], "input_ids": [[1, 2]]}), tmp_path / "text" / "t.parquet")
    assert hf_data.is_streamed(str(shards)) and hf_data.is_streamed("hf:anything")
    assert not hf_data.is_streamed(str(tmp_path / "text"))  # Parquet with a text column is the text path's
    assert [f.name for f in hf_data.token_files(str(shards))] == ["a.npy", "b.bin", "c.parquet"]


# ------------------------------------------------------------------------------------------------ token shards
def test_shards_are_dealt_block_by_block_disjoint_covering_every_block_after_the_held_out_ones(tmp_path: Path) -> None:
    data = str(id_shards(tmp_path / "shards"))
    streams = [shard_stream(data, slot) for slot in range(3)]
    assert streams[0].eval_blocks[:, 0].tolist() == [0, 10, 20, 30]  # the start of the stream, on every slot
    assert all(s.eval_blocks.equal(streams[0].eval_blocks) for s in streams)
    firsts = [s.take(100)[:, 0].tolist() for s in streams]  # 300 blocks, 4 held out: 296 = 99 + 99 + 98 per epoch
    epoch = sorted(firsts[0][:99] + firsts[1][:99] + firsts[2][:98])
    assert epoch == list(range(40, 3000, BLOCK))
    assert firsts[0][:3] == [40, 70, 100] and firsts[1][:3] == [50, 80, 110]
    assert firsts[2][98:] == firsts[2][:2]  # the next epoch: the same order again


def test_a_shard_stream_resumes_from_its_json_position_and_advance_equals_take(tmp_path: Path) -> None:
    data = str(id_shards(tmp_path / "shards"))
    ran = shard_stream(data, 1)
    ran.take(37)
    position = json.loads(json.dumps(ran.state_dict()))
    resumed = shard_stream(data, 1)
    resumed.load_state_dict(position)
    skipped = shard_stream(data, 1)
    skipped.advance(37)
    after = ran.take(80)  # crosses into the next epoch
    assert resumed.take(80).equal(after) and skipped.take(80).equal(after)
    with pytest.raises(ValueError, match="not a diloco.token-shards/1 position"):
        resumed.load_state_dict({"format": "diloco.hf-stream/1", "row": 3, "carry": []})


def test_s3_shards_read_like_local_ones(tmp_path: Path, s3_uri: str) -> None:
    local = id_shards(tmp_path / "shards")
    store = ObjectStore(f"{s3_uri}/shards")
    for path in sorted(local.iterdir()):
        store.put(path.name, path.read_bytes())
    assert shard_stream(store.url(), 2).take(120).equal(shard_stream(str(local), 2).take(120))


def test_a_bin_dtype_and_too_little_data_fail_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token_dtype must be one of"):
        hf.check_config({"model": "m", "data": "s3://b/p", "token_dtype": "float32"})
    data = str(id_shards(tmp_path / "shards"))
    with pytest.raises(ConfigError, match="fewer than 400 blocks"):
        shard_stream(data, 0, n_eval=400)
    with pytest.raises(ConfigError, match="no training block for slot 299 of 300"):
        shard_stream(data, 299, slots=300).take(1)


# ------------------------------------------------------------------------------------------------ hf: datasets
def test_hf_rows_are_dealt_row_by_row_packed_and_resumed_exactly(tmp_path: Path) -> None:
    data = id_rows(tmp_path / "rows")
    streams = [hf_data.open_stream(data, None, block_size=BLOCK, slot=s, slots=2, n_eval=2) for s in range(2)]
    # 2 held-out blocks of 10 take rows 0..2 (their first 20 ids); training rows 3, 5, 7, ... to slot 0, 4, 6, ... to 1
    assert streams[0].eval_blocks.flatten().tolist() == [*range(7), *range(100, 107), *range(200, 206)]
    for slot, stream in enumerate(streams):
        packed = [t for row in range(3 + slot, 60, 2) for t in range(row * 100, row * 100 + 7)]
        assert stream.take(3).flatten().tolist() == packed[:30]
    position = json.loads(json.dumps(streams[0].state_dict()))
    assert position["row"] == 12 and position["carry"] == list(range(1102, 1107))  # rows 3..11 read, 5 ids over
    resumed = hf_data.open_stream(data, None, block_size=BLOCK, slot=0, slots=2, n_eval=2)
    resumed.load_state_dict(position)
    skipped = hf_data.open_stream(data, None, block_size=BLOCK, slot=0, slots=2, n_eval=2)
    skipped.advance(3)
    after = streams[0].take(20)  # 57 rows after the held-out ones, 29 to slot 0: 20.3 blocks, so into the next epoch
    assert resumed.take(20).equal(after) and skipped.take(20).equal(after)
    assert streams[0].epoch == 1


def test_text_rows_are_tokenized_as_they_come_and_a_resume_tokenizes_no_skipped_row(
        tmp_path: Path, tokenizer_dir: Path) -> None:  # noqa: F811
    """A text row is tokenized when reached, EOS appended; a resumed stream reopens at its row with ``skip`` and
    tokenizes only what it trains on."""
    tok = hf.load_tokenizer(str(tokenizer_dir))
    data = save_dataset(tmp_path / "dataset")
    calls: list[str] = []

    def counting(text: str, **kwargs: Any) -> Any:
        calls.append(text)
        return tok(text, **kwargs)

    counting.eos_token_id = tok.eos_token_id  # type: ignore[attr-defined]
    ran = hf_data.open_stream(data, tok, block_size=32, slot=1, slots=2, n_eval=2)
    ran.take(6)
    position = ran.state_dict()
    resumed = hf_data.open_stream(data, counting, block_size=32, slot=1, slots=2, n_eval=2)
    held_out = len(calls)
    resumed.load_state_dict(position)
    assert resumed.take(4).equal(ran.take(4))
    assert 0 < len(calls) - held_out <= 4 * 32 // 10  # the few rows of 4 blocks, not the 6 blocks' rows before them
    import datasets

    rows = datasets.load_from_disk(data.removeprefix("hf:"))
    assert set(calls[held_out:]) <= {rows[i]["text"] for i in range(position["row"], len(rows))}


# ------------------------------------------------------------------------------------------------ saved positions
def test_positions_are_kept_per_round_per_process_and_read_back_for_the_round_rejoined_at(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}/store")
    mine = DataPositions(store, rank=1, local_rank=0, data="hf:x")
    for n in range(1, 6):
        mine.save(n, {"round": n})
    DataPositions(store, rank=0, local_rank=0, data="hf:x").save(6, {"round": 6})  # another rank's: not read
    assert store.list("data_positions/rank_0001/") == [mine.key(n) for n in (3, 4, 5)]  # the newest 3
    assert mine.load(4) is not None and mine.load(4).position == {"round": 4}  # type: ignore[union-attr]
    assert mine.load(9).round == 5  # type: ignore[union-attr]
    assert mine.load(2) is None
    assert DataPositions(store, rank=1, local_rank=0, data="hf:other").load(5) is None  # other data: refused


def test_a_rejoin_restores_the_saved_position_or_moves_on_from_an_older_one(tmp_path: Path) -> None:
    data = str(id_shards(tmp_path / "shards"))
    positions = DataPositions(ObjectStore(f"file://{tmp_path}/store"), rank=0, local_rank=0, data=data)
    through = StreamFeed(shard_stream(data, 0), "")
    for n in (1, 2):
        through.take(5)
        positions.save(n, through.state_dict())
    through.take(10)  # rounds 3 and 4, never saved (their process died before)
    for round_number, how in [(2, "data position of round 2 restored"),
                              (4, "data position of round 2 restored and moved on by 2 round(s)")]:
        feed = StreamFeed(shard_stream(data, 0), "")
        assert restore_position(feed, positions, round_number=round_number, blocks_per_round=5) == how
        expected = StreamFeed(shard_stream(data, 0), "")
        expected.advance(round_number * 5)
        assert feed.state_dict() == expected.state_dict()
    feed = StreamFeed(shard_stream(data, 0), "")
    assert "from the start by 4" in restore_position(feed, None, round_number=4, blocks_per_round=5)
    assert feed.state_dict() == through.state_dict()


# ------------------------------------------------------------------------------------------------ checks
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"eval_every": 0}, "eval_every must be an integer >= 1"),
    ({"eval_every": True}, "eval_every must be an integer >= 1"),
    ({"data_log": 3}, "data_log must be a directory path"),
    ({"data": "hf:"}, "names no dataset"),
])
def test_bad_streaming_settings_fail_in_one_line_naming_the_knob(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        hf.check_config({"model": "m", "data": "s3://b/p", **kwargs})


def test_a_hub_dataset_without_the_hub_is_refused_before_launch(
        home: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(app, ["launch", "-n", "2", "-b", "local", "--trainer", "diloco.trainers.hf:train",
                                      "--steps", "4", "--sync-every", "2", "-k", f"model={tokenizer_dir}",
                                      "-k", "data=hf:org/stories@train"])
    assert result.exit_code == 2, result.output
    assert "data: 'hf:org/stories@train' is not a local path" in result.output and "HF_HUB_OFFLINE" in result.output
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())
