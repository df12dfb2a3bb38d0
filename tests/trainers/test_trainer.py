"""The built-in trainer's parts: corpus, shards, model, validation, and one real single-replica run.

Everything here is real: the standard library on disk is the corpus, the store is ``memory://`` or a tmp dir, the
manager is the real ``ObjectStoreManager`` over a world of one.
"""

from __future__ import annotations

import json
import math
import os
import uuid

import pytest
import torch
from support.ranks import run_ranks  # tests/ is on sys.path

from diloco.collectives.allreduce import ObjectStoreAllReduce
from diloco.errors import ConfigError
from diloco.launcher.progress import read_progress
from diloco.launcher.weights import check_final_weights
from diloco.replica.manager import ObjectStoreManager
from diloco.store.codec import decode_tensors
from diloco.store.objects import ObjectStore
from diloco.trainers.data import (
    corpus_files,
    eval_batches,
    load_corpus,
    sample_batch,
    split_corpus,
    stdlib_dir,
)
from diloco.trainers.gpt import diloco_train, inner_lr_at
from diloco.trainers.gpt_model import GPT, GPTConfig, build_model, split_fragments

TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=8, eval_batches=2,
            max_corpus_bytes=60_000)
METRIC_KEYS = {"kind", "round", "step", "total_steps", "train_loss", "eval_loss", "tokens", "tokens_per_s",
               "sync_s", "bytes_written", "bytes_read", "time", "diverged", "extra"}


def _manager(uri: str, rank: int = 0, world_size: int = 1) -> ObjectStoreManager:
    return ObjectStoreManager(ObjectStoreAllReduce(uri, rank, world_size, timeout_s=10, poll_interval_s=0.05))


# ---------------------------------------------------------------------------------------------- corpus
def test_default_corpus_is_the_stdlib_deterministic_and_nontrivial() -> None:
    files = corpus_files()
    names = [os.path.basename(f) for f in files]
    assert names == sorted(names) and len(names) > 50
    assert all(os.path.dirname(f) == stdlib_dir() and f.endswith(".py") for f in files)

    a, b = load_corpus(None, 300_000), load_corpus(None, 300_000)
    assert a == b and len(a) == 300_000
    with open(files[0], "rb") as f:
        assert a.startswith(f.read(1000))  # first file by name comes first
    assert b"def " in a and b"import " in a and b"class " in a
    assert len(set(a)) > 60  # real text, not padding
    assert load_corpus(None, 1000) == a[:1000]  # truncation is a prefix


def test_corpus_from_a_directory_is_ordered_by_relative_path_and_truncated(tmp_path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"ZZZZ")
    (tmp_path / "a.txt").write_bytes(b"AAAA")
    (tmp_path / ".hidden").write_bytes(b"never")
    assert load_corpus(str(tmp_path), 10_000) == b"AAAA\n\nZZZZ\n\n"
    assert load_corpus(str(tmp_path), 7) == b"AAAA\n\nZ"
    assert load_corpus(str(tmp_path / "a.txt"), 100) == b"AAAA\n\n"
    with pytest.raises(ConfigError, match="neither a file nor a directory"):
        load_corpus(str(tmp_path / "missing"))


def test_shards_are_disjoint_contiguous_and_share_the_eval_split() -> None:
    corpus = load_corpus(None, 100_000)
    splits = [split_corpus(corpus, rank=r, world_size=3, block_size=32) for r in range(3)]
    ranges = [s.train_range for s in splits]
    assert ranges[0][0] == 0
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert end == start  # contiguous, no overlap
    assert ranges[-1][1] <= splits[0].eval_range[0] == 90_000  # eval is the held-out last 10%
    for s in splits:
        start, end = s.train_range
        assert bytes(s.train.to(torch.uint8).tolist()) == corpus[start:end]
        assert torch.equal(s.eval, splits[0].eval)
    # Each rank's batches come from its own shard only.
    x, y = sample_batch(splits[1].train, batch_size=4, block_size=32, generator=torch.Generator().manual_seed(0))
    shard = corpus[ranges[1][0]:ranges[1][1]]
    for row, target in zip(x.tolist(), y.tolist(), strict=True):
        assert bytes(row) in shard and bytes(row[1:]) == bytes(target[:-1])


def test_eval_batches_are_the_same_for_every_caller_with_the_same_seed() -> None:
    data = split_corpus(load_corpus(None, 50_000), rank=0, world_size=1, block_size=16).eval
    a = eval_batches(data, n_batches=3, batch_size=4, block_size=16, seed=7)
    b = eval_batches(data, n_batches=3, batch_size=4, block_size=16, seed=7)
    c = eval_batches(data, n_batches=3, batch_size=4, block_size=16, seed=8)
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, b, strict=True))
    assert not all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, c, strict=True))


def test_a_corpus_too_small_for_the_shards_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="too small") as info:
        split_corpus(b"x" * 1000, rank=0, world_size=16, block_size=64)
    assert "max_corpus_bytes" in (info.value.hint or "")


# ---------------------------------------------------------------------------------------------- model
def test_forward_shapes_and_initial_loss_near_uniform() -> None:
    config = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = build_model(config, seed=0)
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 256)
    assert loss is not None and loss.shape == ()
    assert abs(loss.item() - math.log(256)) < 0.1  # small init: close to a uniform guess over bytes
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model(idx[:, :5])[1] is None and model(idx[:, :5])[0].shape == (3, 5, 256)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_identical_init_for_a_seed_whatever_ran_before() -> None:
    config = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    a = build_model(config, seed=1337)
    torch.rand(1000)  # another rank may have consumed the global RNG differently
    b = build_model(config, seed=1337)
    c = build_model(config, seed=1338)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_config_validation_and_json_round_trip() -> None:
    config = GPTConfig(block_size=8, n_layer=3, n_head=4, n_embd=16)
    assert GPTConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="n_embd"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_fragments_cover_every_parameter_exactly_once(n: int) -> None:
    model = GPT(GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16))
    frags = split_fragments(model, n)
    assert len(frags) == n
    ids = [id(p) for f in frags for p in f.parameters()]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    with pytest.raises(ValueError, match="fragments must be between 1 and 4"):
        split_fragments(model, 5)


# ---------------------------------------------------------------------------------------------- trainer
def test_total_steps_must_be_a_multiple_of_sync_every_and_nothing_is_written() -> None:
    manager = _manager(f"memory://trainer-{uuid.uuid4().hex}")
    with pytest.raises(ConfigError, match=r"total_steps \(61\) must be a multiple of sync_every \(20\)") as info:
        diloco_train(manager=manager, rank=0, world_size=1, total_steps=61, sync_every=20, **TINY)
    assert "total_steps=60 or 80" in (info.value.hint or "")
    assert manager.store.list() == []


@pytest.mark.parametrize("bad, field", [
    (dict(sync_every=0), "sync_every"),
    (dict(fragments=3), "fragments"),  # 20 is not a multiple of 3
    (dict(fragments=2, fragment_sync_delay=10), "fragment_sync_delay"),
    (dict(fragments=4), "fragments must be between 1 and 3"),  # TINY has n_layer + 2 = 3 units to split
    (dict(outer_momentum=1.0), "outer_momentum"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(eval_batch_size=-2), "eval_batch_size"),
    (dict(batch_size=2.5), "batch_size"),
    (dict(n_embd=30, n_head=4), "n_embd"),
    (dict(device="gpu-please"), "device"),
    (dict(eval_every=0), "eval_every must be an integer >= 1"),
    (dict(eval_every=2, mode="async"), "eval_every: the asynchronous mode"),
    *([] if torch.cuda.is_available() else [(dict(device="cuda"), "no usable CUDA device")]),
])
def test_bad_trainer_values_are_config_errors_naming_the_field(bad: dict, field: str) -> None:
    manager = _manager(f"memory://trainer-{uuid.uuid4().hex}")
    kwargs = {**TINY, "total_steps": 20, "sync_every": 20, **bad}
    with pytest.raises(ConfigError, match=field):
        diloco_train(manager=manager, rank=0, world_size=1, **kwargs)
    assert manager.store.list() == []


def test_unknown_trainer_kwarg_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="learning_rate"):
        diloco_train(manager=None, rank=0, world_size=1, learning_rate=1.0)  # type: ignore[call-arg]


def test_single_replica_run_writes_metrics_and_a_rebuildable_final_model(tmp_path, monkeypatch) -> None:
    """One replica, two fragments (Streaming DiLoCo): the exported model is the global one, rebuildable."""
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    manager = _manager(f"file://{tmp_path / 'rdv'}")
    summary = diloco_train(manager=manager, rank=0, world_size=1, total_steps=20, sync_every=10, fragments=2,
                           fragment_sync_delay=1, **TINY)

    rows = [json.loads(line) for line in manager.store.get("metrics/rank_0000.jsonl").decode().splitlines()]
    # Two fragments synced in turn every 10 // 2 = 5 steps: 4 outer rounds, each with its own row.
    assert [r["kind"] for r in rows] == ["init", "round", "round", "round", "round", "final"]
    assert all(set(r) == METRIC_KEYS for r in rows)
    assert [(r["round"], r["step"]) for r in rows] == [(0, 0), (1, 5), (2, 10), (3, 15), (4, 20), (4, 20)]
    assert all(r["total_steps"] == 20 for r in rows)  # the trainer's own total_steps: no entrypoint here
    # The trainer's report() after a round (its mean train loss, its eval) amends that round's row.
    assert rows[0]["train_loss"] is None and rows[1]["train_loss"] is None and rows[2]["train_loss"] > 0
    assert rows[-1]["tokens"] == 20 * TINY["batch_size"] * TINY["block_size"] and rows[-1]["tokens_per_s"] > 0
    assert not any(r["diverged"] for r in rows)
    assert rows[-1]["bytes_written"] > rows[1]["bytes_written"] > 0  # cumulative all-reduce traffic
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert summary["final_eval_loss"] == rows[-1]["eval_loss"]

    data = manager.store.get(summary["final_key"])
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == data
    tensors, meta = decode_tensors(data, expect={"rank": 0, "step": 20})
    config = GPTConfig.from_json(meta["model_config"])
    assert (config.n_layer, config.n_embd, config.block_size) == (1, 32, 32)
    model = GPT(config)
    model.load_state_dict(tensors)  # strict: every parameter is there, nothing else
    # The exported weights are the ones the final eval loss was measured on.
    split = split_corpus(load_corpus(None, TINY["max_corpus_bytes"]), rank=0, world_size=1, block_size=32)
    model.eval()
    with torch.no_grad():
        batches = eval_batches(split.eval, n_batches=2, batch_size=8, block_size=32, seed=1337)
        loss = torch.stack([model(x, y)[1] for x, y in batches]).mean().item()
    assert loss == pytest.approx(rows[-1]["eval_loss"], abs=1e-5)


def test_eval_every_evaluates_the_global_model_every_k_rounds_and_after_the_last(tmp_path) -> None:
    """``eval_every=2`` over 3 rounds: replica 0 evaluates at the start, after round 2 and after the last round;
    the rows of the other rounds carry no new eval loss of their own."""
    manager = _manager(f"file://{tmp_path / 'rdv'}")
    summary = diloco_train(manager=manager, rank=0, world_size=1, total_steps=30, sync_every=10, eval_every=2,
                           **TINY)
    rows = [json.loads(line) for line in manager.store.get("metrics/rank_0000.jsonl").decode().splitlines()]
    assert [(r["kind"], r["round"]) for r in rows] == [("init", 0), ("round", 1), ("round", 2), ("round", 3),
                                                       ("final", 3)]
    evaluated = [r["eval_loss"] for r in rows]
    assert evaluated[0] is not None and evaluated[2] is not None and evaluated[3] is not None
    assert evaluated[1] in (None, evaluated[0])  # nothing measured after round 1
    assert len({evaluated[0], evaluated[2], evaluated[3]}) == 3  # three measurements of a model that trained
    assert summary["final_eval_loss"] == evaluated[3]


def test_a_diverged_run_is_reported_as_divergence_with_valid_json_and_agreeing_weights() -> None:
    """A run pushed to diverge (``-k lr=1000 -k outer_lr=100``, with the momentum 0.9 and no warm-up of that time): losses go non-finite. The metrics say "diverged" with
    nulls (strict JSON), and the replicas, which still computed identical global weights, are found to agree."""
    uri, world = f"memory://diverge-{uuid.uuid4().hex}", 2

    def run(rank: int) -> dict:
        return diloco_train(manager=_manager(uri, rank, world), rank=rank, world_size=world, total_steps=20,
                            sync_every=10, lr=1000.0, outer_lr=100.0, outer_momentum=0.9, outer_momentum_warmup=0, **TINY)

    summaries = run_ranks(world, run, timeout=120)
    assert not any(math.isfinite(s["final_eval_loss"]) for s in summaries)  # it really diverged
    store = _manager(uri).store
    readout = read_progress(store, world)
    assert readout.warnings == []
    for rep in readout.replicas:
        assert rep.diverged and rep.eval_loss is None and rep.finished_training

    def refuse(token: str) -> None:
        raise ValueError(token)

    json.loads(readout.model_dump_json(), parse_constant=refuse)  # no NaN/Infinity tokens
    for r in range(world):
        for line in store.get(f"metrics/rank_{r:04d}.jsonl").decode().splitlines():
            json.loads(line, parse_constant=refuse)
    check = check_final_weights(store, world)
    assert check.identical is True, check.detail


# ---------------------------------------------------------------------------------------------- inner schedule
def test_inner_schedule_warms_up_then_decays_over_the_whole_run_without_restarting_per_round() -> None:
    def lr(step: int, **kw: float) -> float:
        return inner_lr_at(step, **{"lr": 1e-2, "warmup_steps": 10, "total_steps": 110, "min_lr_ratio": 0.1, **kw})

    assert [lr(s) for s in (1, 5, 10)] == pytest.approx([1e-3, 5e-3, 1e-2])  # linear warm-up to the peak
    assert lr(60) == pytest.approx(1e-2 * (0.1 + 0.9 * 0.5))  # half-way through the decay: the cosine's midpoint
    assert lr(110) == pytest.approx(1e-3)  # ends at lr * min_lr_ratio
    decay = [lr(s) for s in range(10, 111)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))  # falls at every step, rounds or not
    assert inner_lr_at(500, lr=1e-2, warmup_steps=0, total_steps=110, min_lr_ratio=0.1) == pytest.approx(1e-3)
    assert {inner_lr_at(s, lr=3e-3, warmup_steps=0, total_steps=100, min_lr_ratio=1.0) for s in (1, 50, 100)} == {3e-3}


def test_the_schedule_changes_training_and_a_fixed_eval_batch_size_compares_batch_sizes_on_the_same_data() -> None:
    """Same seed and data: a decayed schedule trains a different model than a constant one (the knob is wired);
    eval_batch_size fixes the held-out batches whatever batch_size is (an untrained model scores them the same)."""
    def run(**kw: object) -> dict:
        manager = _manager(f"memory://trainer-{uuid.uuid4().hex}")
        return diloco_train(manager=manager, rank=0, world_size=1, total_steps=10, sync_every=10,
                            **{**TINY, **kw})

    constant, decayed = run(min_lr_ratio=1.0), run(warmup_steps=3, min_lr_ratio=0.0)
    assert constant["init_eval_loss"] == decayed["init_eval_loss"]
    assert constant["final_eval_loss"] != decayed["final_eval_loss"]
    small, large = run(batch_size=4, eval_batch_size=8), run(batch_size=16, eval_batch_size=8)
    assert small["init_eval_loss"] == large["init_eval_loss"] == constant["init_eval_loss"]  # TINY: batch 8


# ---------------------------------------------------------------------------------------------- init_from
def test_init_from_starts_every_replica_from_a_collected_model(tmp_path) -> None:
    """A warm start: a run's final weights, as ``diloco collect`` writes them, are where a new run begins (its
    first evaluation is the old run's last), from a path or a store URI; a file of another model is refused."""
    first_uri = f"memory://init-{uuid.uuid4().hex[:8]}"
    first = diloco_train(manager=_manager(first_uri), rank=0, world_size=1, total_steps=4, sync_every=2, **TINY)
    model_file = tmp_path / "model.safetensors"
    model_file.write_bytes(ObjectStore(first_uri).get(first["final_key"]))
    for source in (str(model_file), model_file.as_uri()):
        again = diloco_train(manager=_manager(f"memory://init-{uuid.uuid4().hex[:8]}"), rank=0, world_size=1,
                             total_steps=2, sync_every=2, init_from=source, **TINY)
        assert again["init_eval_loss"] == first["final_eval_loss"]
    other = {**TINY, "n_embd": 16}
    with pytest.raises(ConfigError, match=r"init_from: .* does not fit this model \(.*is \(.*16\)"):
        diloco_train(manager=_manager(f"memory://init-{uuid.uuid4().hex[:8]}"), rank=0, world_size=1, total_steps=2,
                     sync_every=2, init_from=str(model_file), **other)
    with pytest.raises(ConfigError, match="init_from: cannot read"):
        diloco_train(manager=_manager(f"memory://init-{uuid.uuid4().hex[:8]}"), rank=0, world_size=1, total_steps=2,
                     sync_every=2, init_from=str(tmp_path / "missing.safetensors"), **TINY)
