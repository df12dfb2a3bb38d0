"""How long read commands take on a finished run: ``status``, ``watch``, ``collect`` and ``plot``, next to
``python -c 'import torch'`` (what a command that re-checks the kept weights would add).

Not a test (timings depend on the machine; the tests assert the behaviour: no torch import). One small run of the
built-in trainer (2 replicas, 3 rounds) is launched into a temporary ``DILOCO_HOME``; ``launch``'s summary checks
the weights and compacts the store, recording the verdict. Each command then runs N times after one warm-up run,
and once more under ``python -X importtime`` to say whether it imported torch.

    python bench/read_commands.py [-n RUNS] [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["-k", "n_layer=1", "-k", "n_embd=16", "-k", "block_size=16", "-k", "batch_size=4", "-k", "eval_batches=2",
        "-k", "max_corpus_bytes=60000"]


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


def seconds(argv: list[str], runs: int, env: dict[str, str]) -> list[float]:
    """Wall-clock seconds of ``runs`` executions of ``argv``, after one warm-up run (file cache)."""
    run(argv, env)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        done = run(argv, env)
        samples.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
    return samples


def imports_torch(argv: list[str], env: dict[str, str]) -> bool:
    """Whether ``argv`` (a Python console script or ``python -c``) imports torch, by ``-X importtime``."""
    command = [sys.executable, "-X", "importtime", *argv[1:]] if argv[0] == sys.executable else \
        [sys.executable, "-X", "importtime", *argv]
    err = run(command, env).stderr
    return any(line.startswith("import time:") and line.rsplit("|", 1)[1].strip() == "torch"
               for line in err.splitlines())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=None, help="runs per command (default 5; --quick 3)")
    parser.add_argument("--quick", action="store_true", help="3 runs per command (make bench)")
    parser.add_argument("--full", action="store_true", help="5 runs per command (the default)")
    parser.add_argument("--json", metavar="OUT", help="also write the table as JSON (bench/run_all.py reads it)")
    args = parser.parse_args()
    args.runs = args.runs or (3 if args.quick else 5)
    diloco = str(Path(sys.executable).with_name("diloco"))
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "DILOCO_HOME": os.path.join(tmp, "home"), "NO_COLOR": "1"}
        launched = run([diloco, "launch", "-n", "2", "-b", "local", "--steps", "6", "--sync-every", "2", *TINY,
                        "-o", "json"], env)
        if launched.returncode != 0:
            raise SystemExit(f"launch failed: {launched.stderr[-2000:]}")
        run_id = json.loads(launched.stdout)["run_id"]
        model, png = os.path.join(tmp, "model.safetensors"), os.path.join(tmp, "curves.png")
        commands = {
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "diloco status": [diloco, "status", run_id],
            "diloco watch": [diloco, "watch", run_id],
            "diloco collect": [diloco, "collect", run_id, "--output", model, "--force"],
            "diloco plot": [diloco, "plot", run_id, "--output", png],
        }
        rows = []
        for name, argv in commands.items():
            samples = seconds(argv, args.runs, env)
            rows.append({"command": name, "median s": round(statistics.median(samples), 3),
                         "best s": round(min(samples), 3), "imports torch": imports_torch(argv, env)})
        run([diloco, "rm", run_id], env)
    print(f"{'command':<28} {'median s':>9} {'best s':>8}  imports torch   ({args.runs} runs each)")
    for row in rows:
        print(f"{row['command']:<28} {row['median s']:>9.3f} {row['best s']:>8.3f}  {row['imports torch']}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "title": "Read commands on a finished run",
            "columns": ["command", "median s", "best s", "imports torch"],
            "rows": rows,
            "notes": [f"{args.runs} runs per command after one warm-up run, on a finished, compacted run of the "
                      "built-in trainer (2 replicas, 3 rounds).",
                      "watch and collect reuse the weights verdict recorded at compaction while the kept copy's "
                      "fingerprint (size, mtime/inode or ETag) is unchanged; collect writes the model from the "
                      "kept bytes (header metadata rewritten), so neither imports torch."],
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
