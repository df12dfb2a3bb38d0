"""The Hugging Face trainer with FSDP2 (``fsdp=true``), on CPU with gloo: 2 replicas x 2 local processes through the
real ``diloco launch`` (local backend, ``file://`` store), a tiny Llama built from a config.

What it proves: every local process holds half of each parameter's rows (a sharded model, not DDP), exchanges its
own rows through the store (one object per local process per replica per round, and no whole-model contribution),
commits its own rows of every round; the two replicas end on bitwise identical final weights; the gathered
``save_pretrained`` directory loads with ``from_pretrained`` and beats the initial model on held-out blocks. All on
one run in which local process 1 of replica 1 is SIGKILLed mid-run: the replica is relaunched and each of its
processes rejoins with its own rows' state (a run without the kill would prove nothing the killed one does not).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from trainers.test_hf_trainer import BLOCK, SEED, tokenizer_dir, write_jsonl  # noqa: F401 (tests/ is on sys.path)
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.store.layout import METRICS_KEY
from diloco.store.objects import ObjectStore
from diloco.trainers import hf

runner = CliRunner()
#: A few layers of width 48: rows that 2 processes split evenly and unevenly (the 2 key/value heads of 12).
TINY_LLAMA = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
STEPS, SYNC = 12, 6
PART = re.compile(r"^round_(\d{6})/rank_(\d{4})/part_(\d{4})\.safetensors$")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"fsdp": "yes"}, "fsdp must be true, false or auto"),
    ({"fsdp": True, "precision": "fp16"}, "precision fp16 with fsdp"),
    ({"activation_checkpointing": 1}, "activation_checkpointing must be true or false"),
])
def test_bad_fsdp_settings_fail_in_one_line_naming_the_knob(kwargs: dict[str, Any], message: str) -> None:
    from diloco.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        hf.check_config({"data": "s3://b/p", "model": "m", **kwargs})


def test_auto_shards_only_a_model_that_cannot_train_on_one_gpu() -> None:
    import torch

    from diloco.trainers.hf_fsdp import choose_fsdp

    gpu, gib = torch.device("cuda", 0), 2**30
    small = choose_fsdp("auto", params=500_000_000, local_size=8, device=gpu, device_bytes=24 * gib)
    big = choose_fsdp("auto", params=8_000_000_000, local_size=8, device=gpu, device_bytes=24 * gib)
    alone = choose_fsdp("auto", params=8_000_000_000, local_size=1, device=gpu, device_bytes=24 * gib)
    cpu = choose_fsdp("auto", params=8_000_000_000, local_size=8, device=torch.device("cpu"))
    assert not small[0] and "fits one 24 GiB GPU" in small[1]
    assert big[0] and "119.2 GiB" in big[1] and "sharded over 8 processes" in big[1]
    assert not alone[0] and "--procs-per-replica" in alone[1]
    assert not cpu[0] and choose_fsdp(True, params=1, local_size=1, device=gpu)[0]


@pytest.mark.slow
@pytest.mark.long  # two replica starts of 2 processes each, one relaunch: about a minute on two cores
def test_two_replicas_of_two_fsdp_processes_survive_a_killed_process_agree_and_save_a_model_that_loads(
        home: Path, tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Local process 1 of replica 1 is SIGKILLed after inner step 8 (round 1 committed at step 6). The replica
    fails, the launcher relaunches it, and both of its processes rejoin after round 1: each reads its own rows of
    the committed round and gets its rows' inner optimizer state back. The run then holds what a sharded run
    must: per-process contributions of half the rows each, per-row commits, identical final weights, a model
    that loads and learned."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from diloco.launcher import api

    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0")
    monkeypatch.setenv("DILOCO_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # tests/: the replicas import support.fsdp_kill_trainer
    (tmp_path / "done").mkdir()
    data = str(write_jsonl(tmp_path / "corpus"))
    kwargs = {"model_config": TINY_LLAMA, "tokenizer": str(tokenizer_dir), "data": data, "block_size": BLOCK,
              "batch_size": 4, "lr": 3e-3, "eval_batches": 2, "seed": SEED, "fsdp": True, "kill_step": 8,
              "done_dir": str(tmp_path / "done")}
    args = ["launch", "--replicas", "2", "--backend", "local", "--trainer", "support.fsdp_kill_trainer:train",
            "--steps", str(STEPS), "--sync-every", str(SYNC), "--procs-per-replica", "2", "--max-restarts", "1",
            "--set", "store.timeout_s=120", "--detach", "-o", "json"]
    for key, value in kwargs.items():
        args += ["-k", f"{key}={json.dumps(value)}"]
    launched = runner.invoke(app, args)
    assert launched.exit_code == 0, launched.output
    run_id = str(json.loads(launched.stdout)["run_id"])
    run = api.get_run(run_id)
    waited = run.wait()  # relaunches the failed replica (the run's --max-restarts)
    assert waited.state.value == "succeeded", waited
    assert [r.restarts for r in waited.ranks] == [0, 1]

    # The kill landed where planned, and each process of the relaunched replica came back with its own state.
    logs = home / "runs" / run_id / "logs"
    killed = (next(logs.glob("rank_1.try*")) / "combined.log").read_text(errors="replace")
    again = (logs / "rank_1" / "combined.log").read_text(errors="replace")
    assert "SIGKILL local process 1 of replica 1 after inner step 8" in killed
    assert "rank 1 rejoins the run after committed round 1" in again
    for local in (0, 1):  # each process: its own rows' inner optimizer state of round 1, restored
        assert re.search(rf"\[rank 1\.{local}\] .*restored the inner optimizer state of round 1 from .*"
                         rf"local_000{local}_of_0002", again), again[-4000:]

    store = ObjectStore(f"file://{home.resolve()}/runs/{run_id}/store")
    keys = store.list()
    # One contribution per local process per replica, for the last round (earlier rounds are deleted as the run
    # goes); no whole-model contribution at all.
    parts = sorted((int(m[2]), int(m[3])) for k in keys if (m := PART.match(k)) and int(m[1]) == STEPS // SYNC - 1)
    assert parts == [(0, 0), (0, 1), (1, 0), (1, 1)], keys
    assert not [k for k in keys if re.match(r"^round_\d{6}/rank_\d{4}\.safetensors$", k)]
    # The rows each process sent: half of the embedding (320 rows: 160 each), not the whole of it.
    from diloco.store import codec

    header = codec.read_header(store, f"round_{STEPS // SYNC - 1:06d}/rank_0001/part_0001.safetensors")
    embed = [name for name in header.tensors if name.startswith("model.embed_tokens.weight@")]
    assert embed == ["model.embed_tokens.weight@160-320"], sorted(header.tensors)[:5]
    # Every round committed by rows: a marker naming 2 parts.
    marker = json.loads(store.get(f"committed/round_{STEPS // SYNC:06d}/COMMITTED"))
    assert marker["parts"] == 2 and len(marker["sha256"]) == 2

    finals = [load_file(store.path(f"final/rank_{r:04d}.safetensors")) for r in (0, 1)]
    assert hf.tensors_digest(finals[0]) == hf.tensors_digest(finals[1])  # the replicas agree, bitwise
    collected = runner.invoke(app, ["collect", run_id, "--output", str(tmp_path / "model.safetensors"), "-o", "json"])
    assert collected.exit_code == 0 and json.loads(collected.stdout)["weights_identical"] is True, collected.output
    assert finals[0]["model.embed_tokens.weight"].shape == (320, 48)  # gathered whole for the export

    loaded = AutoModelForCausalLM.from_pretrained(store.path("hf_model"))
    state = loaded.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in finals[0].items())
    tok = AutoTokenizer.from_pretrained(store.path("hf_model"))
    held_out = hf.split_blocks(hf.load_blocks(data, tok, block_size=BLOCK), rank=0, world_size=2,
                               eval_fraction=0.1).eval[:8]
    initial = hf.build_model(model=None, model_config=TINY_LLAMA, vocab_size=len(tok), seed=SEED)
    start, end = (hf.evaluate(m, held_out, batch_size=4) for m in (initial, loaded))
    assert end < start - 0.3, (start, end)

    rows = [json.loads(line) for line in store.get(METRICS_KEY.format(rank=0)).decode().splitlines()]
    rounds = [r for r in rows if r["kind"] == "round"]
    assert len(rounds) == STEPS // SYNC and rounds[0]["bytes_written"] > 0  # the replica's parts, counted
    every_log = "".join(p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file())
    assert "fsdp=true" in every_log and "FSDP2 over 2 local processes" in every_log


def test_the_gpu_check_skips_in_one_line_without_cuda() -> None:
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run for minutes (make gpu-check)")
    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"gpu-check: skipped: no CUDA device (torch {torch.__version__}, CUDA build "
                                        f"{torch.version.cuda or 'none'})"]


def test_the_memory_table_in_the_docs_is_the_formula_the_bench_checks() -> None:
    """docs/trainers.md's host memory rows come from ``diloco.replica.host_memory`` (whose round factor is
    bench/round_memory.py's target), not from numbers typed in."""
    from diloco.replica.host_memory import ROUND_PEAK_PAYLOADS, outer_loop_host_bytes

    def gb(n: float) -> str:
        return f"{n / 1e9:.1f} GB" if n < 1e10 else f"{n / 1e9:.0f} GB"

    text = (Path(__file__).resolve().parents[2] / "docs" / "trainers.md").read_text()
    for params, label, k in ((5e8, "0.5 B", 4), (8e9, "8 B", 4), (8e9, "8 B", 8)):
        whole, sharded = outer_loop_host_bytes(int(params), k), outer_loop_host_bytes(int(params), k, sharded=True)
        row = (f"| {label} | {k} | {gb(whole.per_process)} + {gb(whole.leader_extra)} | {gb(whole.replica(k))} | "
               f"{gb(sharded.per_process)} | {gb(sharded.replica(k))} |")
        assert row in text, row
    assert f"at most {ROUND_PEAK_PAYLOADS:g} payloads on top" in text
