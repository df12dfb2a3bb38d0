"""Synchronous vs asynchronous DiLoCo with one replica slowed down, side by side in one run.

Not a test (timings depend on the machine). Why it exists: synchronous rounds wait for the slowest replica, and
asynchronous DiLoCo (``diloco.replica.async_diloco``, ``train.mode: async``) is meant not to. This bench runs the built-in
trainer twice with the same model, data, replicas and steps, once per mode, with the last replica slowed
``--slow-factor`` times (the built-in trainer's ``slow_rank``/``slow_factor``: it sleeps ``factor - 1`` times its
own compute time after each inner step), every replica a real ``python -m diloco.replica.entrypoint`` process on
a ``file://`` store in a fresh temporary directory.

    .venv/bin/python bench/async_vs_sync.py                 # 4 replicas, 120 steps, H=20, 3x slower replica
    .venv/bin/python bench/async_vs_sync.py --steps 60 --sync-every 10 --replicas 3

How to read it:

* ``wall s``: launch to the last replica's exit.
* ``final eval``: the held-out loss of the final global model (identical on every rank in both modes).
* ``reached sync final at``: async only, the first moment (seconds after launch) an evaluation recorded by any
  replica was at or below sync mode's final loss. Async replicas evaluate their *local* model at their
  boundaries (the global one only at the end), so this is when some replica's model got there, not the global's;
  ``-`` means it never did and the line below says by how much it missed.

On a machine with fewer cores than replicas the comparison is skewed against async (its fast replicas compete
with the slow one for CPU, while in sync mode they sleep waiting for it); the bench prints a note then.

Every replica runs the same number of inner steps in both modes, so the slow replica bounds the wall time in
both: the gain async can show is in how early the loss comes down, not in when the last replica ends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 8, "eval_batches": 4,
        "max_corpus_bytes": 150_000}


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Launch one run of ``args.replicas`` processes in ``mode``; return its wall time and evaluations."""
    from diloco.store.objects import ObjectStore

    uri = f"file://{workdir / mode / 'store'}"
    kwargs = {**TINY, "total_steps": args.steps, "sync_every": args.sync_every, "mode": mode,
              "slow_rank": args.replicas - 1, "slow_factor": args.slow_factor}
    env = {**os.environ, "TMPDIR": str(workdir), "OMP_NUM_THREADS": "1"}
    began = time.time()
    procs = []
    for rank in range(args.replicas):
        cmd = [sys.executable, "-m", "diloco.replica.entrypoint", "--rendezvous", uri, "--world-size",
               str(args.replicas), "--trainer", "diloco.trainers.gpt:diloco_train", "--trainer-kwargs-json",
               json.dumps(kwargs), "--timeout", "600", "--poll-interval", "0.05"]
        with open(workdir / f"{mode}-r{rank}.log", "w") as log:  # a file, never a pipe that could fill up
            procs.append(subprocess.Popen(cmd, env={**env, "REPLICA_RANK": str(rank)}, stdout=log, stderr=log))
    codes = [p.wait() for p in procs]
    wall = time.time() - began
    for rank, code in enumerate(codes):
        if code:
            tail = (workdir / f"{mode}-r{rank}.log").read_text()[-3000:]
            raise SystemExit(f"{mode} rank {rank} exited {code}:\n{tail}")
    store = ObjectStore(uri)
    evals: list[tuple[float, float]] = []
    final = None
    for rank in range(args.replicas):
        rows = [json.loads(line) for line in store.get(f"metrics/rank_{rank:04d}.jsonl").decode().splitlines()]
        evals += [(row["time"] - began, row["eval_loss"]) for row in rows if row.get("eval_loss") is not None]
        final = rows[-1]["eval_loss"]
    return {"wall": wall, "final": final, "evals": sorted(evals)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--slow-factor", type=float, default=3.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="diloco-bench-async-") as tmp:
        sync = run_mode("sync", args, Path(tmp))
        asyn = run_mode("async", args, Path(tmp))
    target = sync["final"]
    reached = next((t for t, loss in asyn["evals"] if loss <= target), None)
    best = min(loss for _, loss in asyn["evals"])
    print(f"{args.replicas} replicas, {args.steps} steps, H={args.sync_every}, replica {args.replicas - 1} "
          f"slowed {args.slow_factor:g}x")
    print(f"{'mode':<6} {'wall s':>8} {'final eval':>11} {'reached sync final at':>22}")
    print(f"{'sync':<6} {sync['wall']:>8.1f} {sync['final']:>11.3f} {'-':>22}")
    print(f"{'async':<6} {asyn['wall']:>8.1f} {asyn['final']:>11.3f} "
          f"{(f'{reached:.1f} s' if reached is not None else '-'):>22}")
    cores = os.cpu_count() or 1
    if cores < args.replicas:
        print(f"note: {args.replicas} replicas share {cores} core(s) here; in async mode the fast replicas keep "
              f"computing and take CPU from the slow one (in sync mode they sleep while they wait), so these wall "
              f"times say little about replicas on machines of their own")
    if reached is None:
        print(f"async missed sync's final eval loss {target:.3f}: its best evaluation was {best:.3f} "
              f"({best - target:+.3f}); its final global model {asyn['final']:.3f} ({asyn['final'] - target:+.3f})")
    elif reached < sync["wall"]:
        print(f"async reached sync's final eval loss {target:.3f} after {reached:.1f} s, "
              f"{sync['wall'] - reached:.1f} s before sync finished ({sync['wall']:.1f} s)")
    else:
        print(f"async reached sync's final eval loss {target:.3f} only after {reached:.1f} s, "
              f"{reached - sync['wall']:.1f} s after sync finished")


if __name__ == "__main__":
    main()
