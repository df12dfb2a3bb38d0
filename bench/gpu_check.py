"""The GPU check: the code paths only a CUDA machine runs (NCCL, bf16 on the GPU, DDP ``device_ids``, FSDP2 over
NCCL, a compressed round of CUDA tensors), each through a real ``diloco launch``, printed as one table.

    make gpu-check                                  # or: .venv/bin/python bench/gpu_check.py [--json OUT]

Without CUDA it prints one line and exits 0 (``gpu-check: skipped: no CUDA device (torch ..., ...)``), so it can
run anywhere. With CUDA, each case is 2 local replicas meeting in a ``file://`` store under a temporary
``DILOCO_HOME``, nothing from a hub (the Hugging Face cases train a byte-level BPE tokenizer here on generated
text):

* ``hf ddp bf16``: the Hugging Face trainer, a small Llama, 2 replicas x P processes (P = 2 with at least 2 GPUs:
  both replicas' local process p on GPU p), ``fsdp=false``: DDP over NCCL with ``device_ids``, bf16 autocast.
* ``hf fsdp bf16``: the same with ``fsdp=true``: FSDP2 over NCCL, bf16 compute, each process exchanging its rows.
* ``hf fsdp bf16 int8``: the same with ``store.compression=int8``: a compressed round of CUDA tensors.
* ``gpt vanilla`` / ``gpt streaming``: the built-in trainer on the GPU, DiLoCo against Streaming DiLoCo (4
  fragments, each all-reduce started 1 inner step before it is needed), for the share of wall time blocked in
  sync.

Columns: whether the run succeeded with bitwise identical final weights across the replicas, the eval loss before
training and after, tokens/s (mean over replicas), GPU utilisation (mean of ``nvidia-smi`` samples every 0.5 s over
every GPU during the run; ``n/a`` without ``nvidia-smi``), the share of the training wall time the replicas were
blocked in sync (``sync_s`` over the time from the first to the last metrics row, the worst replica) and the run's
wall time. The exit status is 1 when a case failed or its replicas' weights differ.

``--cpu`` runs the same cases on the CPU with gloo, fp32 and a tiny model: the check's own plumbing, on any
machine (not the GPU paths it exists for).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
COLUMNS = ["case", "replicas x procs", "ok", "weights identical", "eval loss", "tok/s", "GPU util %",
           "blocked in sync %", "wall s"]
#: Small enough to start in seconds, big enough that a step is GPU work (about 10 M parameters).
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256}
WORDS = ["the cat", "a dog", "my friend", "the river", "sees", "likes", "draws", "some bread", "the moon", "a box"]


def skip_reason() -> str | None:
    """Why this machine cannot run the check (``None``: it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
    return None


# ---------------------------------------------------------------------------------------------- inputs
def write_corpus(directory: Path, documents: int = 600) -> Path:
    rng = random.Random(0)
    directory.mkdir(parents=True, exist_ok=True)
    for part in range(2):
        lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(40)) + "."})
                 for _ in range(documents // 2)]
        (directory / f"part-{part}.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def write_tokenizer(directory: Path, corpus: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for path in sorted(corpus.glob("*.jsonl")) for line in path.read_text().split(
        "\n") if line]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------- one case
class GpuSampler:
    """``nvidia-smi`` utilisation of every GPU every 0.5 s on a thread, while a case runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._tool = shutil.which("nvidia-smi")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._tool and not self._stop.wait(0.5):
            try:
                out = subprocess.run([self._tool, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            self.samples += [float(v) for v in out.split() if v.strip().replace(".", "", 1).isdigit()]

    def stop(self) -> str:
        self._stop.set()
        self._thread.join()
        return f"{statistics.mean(self.samples):.0f}" if self.samples else "n/a"


def launch_case(name: str, home: Path, args: list[str], timeout_s: float) -> dict[str, Any]:
    """``diloco launch`` (waits, checks the weights) in ``home``; -> the table row."""
    env = {**os.environ, "DILOCO_HOME": str(home)}
    sampler = GpuSampler()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", *args, "-o", "json"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout_s)
    wall = time.monotonic() - started
    utilisation = sampler.stop()
    try:
        summary = json.loads(proc.stdout)
    except json.JSONDecodeError:
        summary = {}
    row: dict[str, Any] = {"case": name, "ok": "yes" if proc.returncode == 0 else f"NO (exit {proc.returncode})",
                           "weights identical": str(summary.get("weights_identical")), "GPU util %": utilisation,
                           "wall s": round(wall)}
    ranks = summary.get("ranks") or []
    start = [r.get("initial_eval_loss") for r in ranks if r.get("initial_eval_loss") is not None]
    end = [r.get("eval_loss") for r in ranks if r.get("eval_loss") is not None]
    row["eval loss"] = f"{statistics.mean(start):.2f} -> {statistics.mean(end):.2f}" if start and end else "-"
    speeds = [r.get("tokens_per_s") for r in ranks if r.get("tokens_per_s")]
    row["tok/s"] = f"{statistics.mean(speeds):,.0f}" if speeds else "-"
    row["blocked in sync %"] = blocked_share(home, summary.get("run_id"), len(ranks))
    if proc.returncode != 0:
        print(f"[{name}] failed:\n{proc.stderr[-4000:]}", file=sys.stderr)
    return row


def blocked_share(home: Path, run_id: str | None, replicas: int) -> str:
    """The worst replica's seconds blocked in sync over its training wall time (first to last metrics row)."""
    if not run_id:
        return "-"
    shares = []
    for rank in range(replicas):
        path = home / "runs" / run_id / "store" / "metrics" / f"rank_{rank:04d}.jsonl"
        try:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except OSError:
            continue
        timed = [r for r in rows if r.get("time") is not None]
        if len(timed) >= 2 and timed[-1].get("sync_s") is not None:
            span = timed[-1]["time"] - timed[0]["time"]
            if span > 0:
                shares.append(100 * timed[-1]["sync_s"] / span)
    return f"{max(shares):.1f}" if shares else "-"


#: ``--cpu``: the plumbing only, in seconds.
TINY = {"llama": {**LLAMA, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2}, "n_embd": 32, "precision": "fp32",
        "device": "cpu"}


def hf_args(procs: int, data: Path, tokenizer: Path, steps: int, *, cpu: bool = False, **extra: Any) -> list[str]:
    kwargs = {"model_config": TINY["llama"] if cpu else LLAMA, "tokenizer": str(tokenizer), "data": str(data),
              "block_size": 128, "batch_size": 8, "lr": 1e-3, "eval_batches": 2,
              "precision": TINY["precision"] if cpu else "bf16", **extra}
    out = ["--replicas", "2", "--backend", "local", "--trainer", "diloco.trainers.hf:train", "--steps", str(steps),
           "--sync-every", str(steps // 4), "--procs-per-replica", str(procs)]
    for key, value in kwargs.items():
        out += ["-k", f"{key}={json.dumps(value)}"]
    return out


#: The built-in trainer's rounds: 4 fragments of 2 steps each, so Streaming DiLoCo can start each all-reduce one step
#: early.
GPT_SYNC_EVERY = 8


def gpt_args(steps: int, fragments: int, delay: int, *, cpu: bool = False) -> list[str]:
    kwargs = {"device": TINY["device"] if cpu else "cuda", "n_embd": TINY["n_embd"] if cpu else 256, "n_layer": 4,
              "n_head": 4, "batch_size": 16, "fragments": fragments, "fragment_sync_delay": delay,
              "eval_batches": 2, "max_corpus_bytes": 2_000_000}
    out = ["--replicas", "2", "--backend", "local", "--steps", str(steps), "--sync-every", str(GPT_SYNC_EVERY)]
    for key, value in kwargs.items():
        out += ["-k", f"{key}={json.dumps(value)}"]
    return out


def run_checks(workdir: Path, steps: int, timeout_s: float, *, cpu: bool = False) -> list[dict[str, Any]]:
    import torch

    gpus = torch.cuda.device_count()
    procs = 2 if gpus >= 2 or cpu else 1  # each process of a replica needs its own GPU (NCCL)
    data = write_corpus(workdir / "corpus")
    tokenizer = write_tokenizer(workdir / "tokenizer", data)
    bits = "fp32" if cpu else "bf16"
    cases: list[tuple[str, list[str], str]] = [
        (f"hf ddp {bits}", hf_args(procs, data, tokenizer, steps, cpu=cpu, fsdp=False), f"2 x {procs}"),
        (f"hf fsdp {bits}", hf_args(procs, data, tokenizer, steps, cpu=cpu, fsdp=True), f"2 x {procs}"),
        (f"hf fsdp {bits} int8", [*hf_args(procs, data, tokenizer, steps, cpu=cpu, fsdp=True), "--set",
                                  "store.compression=int8"], f"2 x {procs}"),
        ("gpt vanilla", gpt_args(steps, fragments=1, delay=0, cpu=cpu), "2 x 1"),
        ("gpt streaming", gpt_args(steps, fragments=4, delay=1, cpu=cpu), "2 x 1"),
    ]
    rows = []
    for index, (name, args, shape) in enumerate(cases):
        print(f"gpu-check: {name} ({shape}) ...", file=sys.stderr, flush=True)
        row = launch_case(name, workdir / f"home{index}", args, timeout_s)
        rows.append({**row, "replicas x procs": shape})
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", metavar="OUT", help="also write the table as JSON here")
    p.add_argument("--steps", type=int, default=40, help="inner steps per case, a multiple of 8 (default 40: 4 rounds "
                                                         "of the Hugging Face cases, 5 of the built-in trainer's)")
    p.add_argument("--timeout", type=float, default=420, help="seconds per case before it is stopped")
    p.add_argument("--cpu", action="store_true", help="the same cases on the CPU (gloo, fp32, a tiny model): the "
                                                      "check's plumbing only")
    args = p.parse_args(argv)
    reason = None if args.cpu else skip_reason()
    if reason is not None:
        print(f"gpu-check: skipped: {reason}")
        return 0
    import torch

    gpus = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)}) or ["no GPU: --cpu"]
    with tempfile.TemporaryDirectory(prefix="diloco-gpu-check-") as tmp:
        rows = run_checks(Path(tmp), args.steps, args.timeout, cpu=args.cpu)
    title = f"GPU check: {gpus} x {', '.join(names)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    print(f"{title}\n\n{markdown(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"title": title, "columns": COLUMNS, "rows": rows}, indent=2))
    good = all(r["ok"] == "yes" and r["weights identical"] == "True" for r in rows)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
