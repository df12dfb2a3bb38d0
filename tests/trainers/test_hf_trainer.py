"""``diloco.trainers.hf:train`` end to end: a tiny Llama built from a config, a BPE tokenizer trained here on text
written here, 2 local replicas through ``diloco launch``; nothing comes from a hub.

The collected model must load with ``AutoModelForCausalLM.from_pretrained`` and beat the initial model on the
held-out blocks; the run's data is under an ``s3://`` prefix on the loopback S3 server, and the same files in a
local directory are checked to be the same data.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.errors import ConfigError
from diloco.store.layout import METRICS_KEY
from diloco.store.objects import ObjectStore
from diloco.trainers import hf

runner = CliRunner()
SUBJECTS = ["the cat", "a dog", "the bird", "my friend", "the old man", "a child"]
VERBS = ["sees", "likes", "finds", "follows", "draws", "helps"]
OBJECTS = ["the ball", "a tree", "the river", "some bread", "the moon", "a red box"]
#: ~228k parameters: 2 layers of width 96, a 320-token vocabulary, untied embeddings.
MODEL_CONFIG = {"model_type": "llama", "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
BLOCK, BATCH, SEED = 32, 8, 1337


def sentences(n: int, seed: int) -> list[str]:
    """Documents from a tiny grammar: learnable in a few dozen steps, so a falling loss is a real signal."""
    rng = random.Random(seed)
    return [" ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}." for _ in range(4))
            for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained on the grammar's text, saved as a transformers tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(200, seed=99), trainer)
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(path)
    return path


def write_jsonl(directory: Path) -> Path:
    """Two JSONL files (read in name order) of grammar documents."""
    directory.mkdir(parents=True, exist_ok=True)
    docs = sentences(240, seed=1)
    for i, part in enumerate((docs[:120], docs[120:])):
        (directory / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    return directory


def launch_and_collect(home: Path, tmp_path: Path, data: str, tokenizer: Path) -> tuple[ObjectStore, Path]:
    """2 replicas, 3 rounds of 8 steps; returns the run's store and the collected model file."""
    kwargs = {"model_config": MODEL_CONFIG, "tokenizer": str(tokenizer), "data": data, "block_size": BLOCK,
              "batch_size": BATCH, "lr": 3e-3, "warmup_steps": 2, "eval_batches": 2, "seed": SEED}
    args = ["launch", "--replicas", "2", "--backend", "local", "--trainer", "diloco.trainers.hf:train",
            "--steps", "24", "--sync-every", "8", "-o", "json"]
    for key, value in kwargs.items():
        args += ["-k", f"{key}={json.dumps(value)}"]
    launched = runner.invoke(app, args)
    assert launched.exit_code == 0, launched.output
    run_id = json.loads(launched.stdout)["run_id"]
    model_file = tmp_path / "model.safetensors"
    collected = runner.invoke(app, ["collect", run_id, "--output", str(model_file), "-o", "json"])
    assert collected.exit_code == 0, collected.output
    assert json.loads(collected.stdout)["weights_identical"] is True
    return ObjectStore(f"file://{home.resolve()}/runs/{run_id}/store"), model_file


def check_trained_model(store: ObjectStore, model_file: Path, data: str, tokenizer: Path) -> None:
    """The store's save_pretrained directory loads, holds exactly the collected weights, and beats the start."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert {"hf_model/config.json", "hf_model/model.safetensors", "hf_model/tokenizer.json"} <= set(store.list())
    loaded = AutoModelForCausalLM.from_pretrained(store.path("hf_model"))
    collected = load_file(str(model_file))
    state = loaded.state_dict()
    assert collected and all(torch.equal(state[name], tensor) for name, tensor in collected.items())

    tok = AutoTokenizer.from_pretrained(store.path("hf_model"))
    assert len(tok) == len(AutoTokenizer.from_pretrained(tokenizer))
    split = hf.split_blocks(hf.load_blocks(data, tok, block_size=BLOCK), rank=0, world_size=2, eval_fraction=0.1)
    held_out = split.eval[: 2 * BATCH]
    initial = hf.build_model(model=None, model_config=MODEL_CONFIG, vocab_size=len(tok), seed=SEED)
    start, end = (hf.evaluate(m, held_out, batch_size=BATCH) for m in (initial, loaded))
    assert end < start - 0.5, (start, end)

    for rank in (0, 1):  # the metrics agree: an init row with the start's loss, a final one with the end's
        rows = [json.loads(line) for line in store.get(METRICS_KEY.format(rank=rank)).decode().splitlines()]
        assert rows[0]["kind"] == "init" and rows[0]["eval_loss"] == pytest.approx(start, rel=1e-4)
        assert [r["round"] for r in rows if r["kind"] == "round"] == [1, 2, 3]
        assert rows[-1]["kind"] == "final" and rows[-1]["eval_loss"] == pytest.approx(end, rel=1e-4)


def corpus_under_an_s3_prefix(tmp_path: Path, s3_uri: str) -> tuple[Path, ObjectStore]:
    """The JSONL corpus as local files and the same files under an ``s3://`` prefix (beside a file that is not
    data: no data suffix, so it is ignored)."""
    corpus = write_jsonl(tmp_path / "corpus")
    data = ObjectStore(f"{s3_uri}/corpus")
    for path in sorted(corpus.iterdir()):
        data.put(path.name, path.read_bytes())
    data.put("README", b"not data: ignored (no data suffix)")
    return corpus, data


def test_two_replicas_on_data_under_an_s3_prefix_train_a_model_that_loads_with_from_pretrained(
        home: Path, tmp_path: Path, tokenizer_dir: Path, s3_uri: str) -> None:
    _, data = corpus_under_an_s3_prefix(tmp_path, s3_uri)
    store, model_file = launch_and_collect(home, tmp_path, data.url(), tokenizer_dir)
    check_trained_model(store, model_file, data.url(), tokenizer_dir)


def test_a_local_directory_and_an_s3_prefix_of_the_same_files_are_the_same_data(
        tmp_path: Path, tokenizer_dir: Path, s3_uri: str) -> None:
    """Where the files live changes nothing the trainer reads (the run above trains on the prefix): local JSONL
    files, by path or as ``file://``, give exactly the prefix's blocks."""
    import torch
    from transformers import AutoTokenizer

    corpus, data = corpus_under_an_s3_prefix(tmp_path, s3_uri)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    remote = hf.load_blocks(data.url(), tok, block_size=BLOCK)
    assert remote.shape[0] > 20
    for local in (str(corpus), f"file://{corpus}"):
        assert torch.equal(hf.load_blocks(local, tok, block_size=BLOCK), remote)


# ------------------------------------------------------------------------------------------------ pieces
def test_shards_are_disjoint_and_cover_the_training_blocks() -> None:
    import torch

    blocks = torch.arange(50 * 4).view(50, 4)
    splits = [hf.split_blocks(blocks, rank=r, world_size=3, eval_fraction=0.1) for r in range(3)]
    seen = torch.cat([s.train[:, 0] for s in splits]).tolist()
    assert sorted(seen) == list(range(0, 45 * 4, 4))  # every training block exactly once
    assert all(torch.equal(s.eval, blocks[45:]) for s in splits)


def test_the_sampler_resumes_exactly_where_it_stopped() -> None:
    a = hf.BlockSampler(7, seed=3)
    first = a.take(10)  # crosses an epoch boundary
    b = hf.BlockSampler(7, seed=3)
    b.load_state_dict(a.state_dict())
    assert a.take(9) == b.take(9) and sorted(first[:7]) == list(range(7))


@pytest.mark.parametrize("count", [0, 3, 7, 10, 23])
def test_a_rejoining_sampler_skips_exactly_what_the_steps_done_took(count: int) -> None:
    taken, skipped = hf.BlockSampler(7, seed=5), hf.BlockSampler(7, seed=5)
    taken.take(count)
    skipped.advance(count)
    assert skipped.take(12) == taken.take(12)


def test_a_restarted_replica_rejoins_and_trains_only_the_remaining_steps(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Started again in a run whose round 2 is committed, the trainer runs steps 5..6 (round 3) from round 2's
    weights, its data position and inner schedule moved on by the 4 steps done, instead of 6 more steps."""
    from diloco.collectives.allreduce import ObjectStoreAllReduce
    from diloco.replica.checkpoint import RoundCheckpoints
    from diloco.replica.manager import ObjectStoreManager

    uri = f"file://{tmp_path}/store"

    def manager() -> ObjectStoreManager:
        allreduce = ObjectStoreAllReduce(uri, 0, 1, timeout_s=10, poll_interval_s=0.05)
        return ObjectStoreManager(allreduce, rounds=RoundCheckpoints(allreduce.store, run_id="r", world_size=1))

    kwargs = {"model_config": MODEL_CONFIG, "tokenizer": str(tokenizer_dir), "block_size": BLOCK, "batch_size": 4,
              "grad_accum": 2, "sync_every": 2, "eval_batches": 1, "seed": SEED,
              "data": str(write_jsonl(tmp_path / "corpus"))}
    first = hf.train(manager=manager(), rank=0, world_size=1, total_steps=4, **kwargs)
    second = hf.train(manager=manager(), rank=0, world_size=1, total_steps=6, **kwargs)
    assert first["rounds"] == 2 and second["rounds"] == 3
    shard = len(hf.split_blocks(hf.load_blocks(kwargs["data"], hf.load_tokenizer(str(tokenizer_dir)),
                                               block_size=BLOCK), rank=0, world_size=1, eval_fraction=0.1).train)
    expected = hf.BlockSampler(shard, seed=SEED + 7919)
    expected.advance(6 * 2 * 4)  # 6 steps of 2 micro-batches of 4 blocks: nothing replayed, nothing skipped
    assert second["data_position"] == expected.state_dict()


def test_parquet_and_text_files_are_documents(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["one doc", "two doc"]}), tmp_path / "a.parquet")
    (tmp_path / "b.txt").write_text("a whole file")
    files = hf.data_files(str(tmp_path))
    assert [name for name, _ in files] == ["a.parquet", "b.txt"]
    assert hf.parse_documents(*files[0], text_field="body") == ["one doc", "two doc"]
    assert hf.parse_documents(*files[1], text_field="body") == ["a whole file"]
    with pytest.raises(ConfigError, match="no column 'text'"):
        hf.parse_documents(*files[0], text_field="text")


def test_warmup_then_cosine() -> None:
    factors = [hf.lr_factor(s, warmup_steps=4, total_steps=20, min_ratio=0.1) for s in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and factors[4] == 1.0
    assert all(x >= y for x, y in zip(factors[4:], factors[5:], strict=False)) and factors[20] == pytest.approx(0.1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one of model"),
    ({"model": "m", "model_config": {"model_type": "llama"}}, "exactly one of model"),
    ({"model_config": {"hidden_size": 8}, "tokenizer": "t"}, "model_config must be a mapping with a model_type"),
    ({"model_config": {"model_type": "llama"}}, "tokenizer: required"),
    ({"model": "m", "total_steps": 10, "sync_every": 4}, "must be a multiple of sync_every"),
    ({"model": "m", "precision": "fp8"}, "precision must be one of"),
    ({"model": "m", "grad_accum": 0}, "grad_accum must be an integer >= 1"),
])
def test_bad_settings_fail_in_one_line_naming_the_knob(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        hf.check_config({"data": "s3://b/p", **kwargs})


def test_launch_refuses_bad_settings_before_anything_starts(home: Path) -> None:
    result = runner.invoke(app, ["launch", "-n", "2", "-b", "local", "--trainer", "diloco.trainers.hf:train",
                                 "--steps", "10", "--sync-every", "5", "-k", "model=m", "-k", "data=/nonexistent"])
    assert result.exit_code == 2 and "data: /nonexistent does not exist" in result.output


def test_save_model_writes_the_store_and_sm_model_dir_and_model_loads_it_back(
        tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rank 0 writes hf_model/ into the store, every rank writes $SM_MODEL_DIR; `model=<that directory>` (how a
    user continues from a checkpoint) rebuilds the same weights."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    net = hf.build_model(model=None, model_config=MODEL_CONFIG, vocab_size=len(tok), seed=5)
    store = ObjectStore(f"file://{tmp_path}/store")
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "sm"))
    (tmp_path / "sm").mkdir()
    manager = type("Manager", (), {"store": store})()
    assert hf.save_model(net, tok, manager=manager, rank=1) == [str(tmp_path / "sm")]  # not rank 0: no store
    assert store.list() == []
    assert len(hf.save_model(net, tok, manager=manager, rank=0)) == 2
    for directory in (store.path("hf_model"), str(tmp_path / "sm")):
        again = hf.build_model(model=directory, model_config=None, vocab_size=0, seed=0)
        assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), again.state_dict().values(),
                                                     strict=True))


def test_bf16_autocast_and_gradient_accumulation_step_on_cpu(tokenizer_dir: Path, tmp_path: Path) -> None:
    """The inner step with bf16 autocast (fp32 weights kept) and 2 micro-batches: the weights move and stay fp32;
    fp16 is refused on CPU in one line."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    blocks = hf.load_blocks(str(write_jsonl(tmp_path / "c")), tok, block_size=BLOCK)
    net = hf.build_model(model=None, model_config=MODEL_CONFIG, vocab_size=len(tok), seed=SEED)
    before = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    cpu = torch.device("cpu")
    amp = hf._resolve_precision("bf16", cpu)
    loss = hf._accumulate(net, blocks, hf.BlockSampler(len(blocks), seed=0), grad_accum=2, batch_size=4,
                          device=cpu, amp_dtype=amp, scaler=None)
    hf._inner_step(net, opt, None, grad_clip=1.0)
    assert torch.isfinite(loss) and all(p.dtype == torch.float32 for p in net.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        hf._resolve_precision("fp16", cpu)
