"""Synchronous vs asynchronous DiLoCo with one replica slowed down, and asynchronous DiLoCo whose master is killed.

Not a test (timings depend on the machine). Why it exists: synchronous rounds wait for the slowest replica, and
asynchronous DiLoCo (``diloco.replica.async_diloco``, ``train.mode: async``) is meant not to; and an asynchronous
run must survive its master (its outer state is committed to the store with each version it publishes, and a
relaunched node resumes at its recorded step). This bench runs the built-in trainer three times with the same
model, data, replicas and steps, with the last replica slowed ``--slow-factor`` times (the built-in trainer's
``slow_rank``/``slow_factor``: it sleeps ``factor - 1`` times its own compute time after each inner step), every
replica a real ``python -m diloco.replica.entrypoint`` process on a ``file://`` store in a fresh temporary
directory:

* ``sync``: synchronous rounds;
* ``async``: asynchronous;
* ``async, master killed``: asynchronous, with the master (rank 0) SIGKILLed once it has recorded half its steps
  and started again at once, as ``diloco launch`` relaunches it.

    .venv/bin/python bench/async_vs_sync.py                 # 4 replicas, 120 steps, H=20, 3x slower replica
    .venv/bin/python bench/async_vs_sync.py --quick         # 3 replicas, 60 steps, H=10 (make bench)
    .venv/bin/python bench/async_vs_sync.py --steps 60 --sync-every 10 --replicas 3 --json OUT

How to read it:

* ``wall s``: launch to the last replica's exit.
* ``final eval``: the held-out loss of the final global model (identical on every rank in every mode).
* ``reached sync final at``: async only, the first moment (seconds after launch) an evaluation recorded by any
  replica was at or below sync mode's final loss. Async replicas evaluate their *local* model at their
  boundaries (the global one only at the end), so this is when some replica's model got there, not the global's;
  ``-`` means it never did.
* ``master resumed at``: the step the relaunched master resumed at (its last recorded step, not step 1), and
  ``restart s``: from its new process's start to its first inner step (Python and torch start-up, one read of its
  committed state and its position).

On a machine with fewer cores than replicas the comparison is skewed against async (its fast replicas compete
with the slow one for CPU, while in sync mode they sleep waiting for it); the bench notes it then.

Every replica runs the same number of inner steps in every mode, so the slow replica bounds the wall time:
the gain async can show is in how early the loss comes down, not in when the last replica ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 8, "eval_batches": 4,
        "max_corpus_bytes": 150_000}
MODES = ("sync", "async", "async, master killed")


def start(workdir: Path, name: str, rank: int, uri: str, world: int, kwargs: dict[str, Any],
          attempt: int = 0) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "diloco.replica.entrypoint", "--rendezvous", uri, "--world-size", str(world),
           "--trainer", "diloco.trainers.gpt:diloco_train", "--trainer-kwargs-json", json.dumps(kwargs),
           "--timeout", "600", "--poll-interval", "0.05"]
    env = {**os.environ, "TMPDIR": str(workdir), "OMP_NUM_THREADS": "1", "REPLICA_RANK": str(rank),
           "DILOCO_RUN_ID": f"bench-{name}"}
    with open(workdir / f"{name}-r{rank}.try{attempt}.log", "w") as log:  # a file, never a pipe that could fill
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=log)


def recorded_step(store: Path, node: str) -> int:
    try:
        return int(json.loads((store / "async" / "nodes" / f"{node}.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Launch one run of ``args.replicas`` processes; its wall time, evaluations and (killed master) restart."""
    from diloco.store.objects import ObjectStore

    name = mode.replace(", ", "-").replace(" ", "-")
    store_dir = workdir / name / "store"
    uri = f"file://{store_dir}"
    kwargs = {**TINY, "total_steps": args.steps, "sync_every": args.sync_every, "mode": mode.split(",")[0],
              "slow_rank": args.replicas - 1, "slow_factor": args.slow_factor}
    began = time.time()
    procs = {rank: start(workdir, name, rank, uri, args.replicas, kwargs) for rank in range(args.replicas)}
    out: dict[str, Any] = {}
    if mode == "async, master killed":
        while recorded_step(store_dir, "replica-0") < args.steps // 2:
            if procs[0].poll() is not None:
                raise SystemExit("the master ended before half its steps: use more --steps")
            time.sleep(0.01)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        restarted = time.time()
        procs[0] = start(workdir, name, 0, uri, args.replicas, kwargs, attempt=1)
        log = workdir / f"{name}-r0.try1.log"
        deadline = time.monotonic() + 600
        while not (found := re.search(r"rejoins the run at step (\d+)", log.read_text(errors="replace"))):
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the relaunched master did not resume:\n{log.read_text()[-3000:]}")
            time.sleep(0.01)
        out.update(resumed_at=int(found[1]), restart_s=time.time() - restarted)
    codes = {rank: p.wait() for rank, p in procs.items()}
    out["wall"] = time.time() - began
    for rank, code in codes.items():
        if code:
            tail = max(workdir.glob(f"{name}-r{rank}.try*.log")).read_text()[-3000:]
            raise SystemExit(f"{mode} rank {rank} exited {code}:\n{tail}")
    store = ObjectStore(uri)
    evals: list[tuple[float, float]] = []
    finals = set()
    for rank in range(args.replicas):
        rows = [json.loads(line) for line in store.get(f"metrics/rank_{rank:04d}.jsonl").decode().splitlines()]
        evals += [(row["time"] - began, row["eval_loss"]) for row in rows if row.get("eval_loss") is not None]
        finals.add(rows[-1]["eval_loss"])
    if len(finals) != 1:
        raise SystemExit(f"{mode}: the replicas ended with different final models (eval losses {sorted(finals)})")
    return {**out, "final": finals.pop(), "evals": sorted(evals)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="3 replicas, 60 steps, H=10 (make bench)")
    parser.add_argument("--full", action="store_true", help="(the default) 4 replicas, 120 steps, H=20")
    parser.add_argument("--json", metavar="OUT", help="also write the result as a bench/run_all.py table")
    args = parser.parse_args()
    if args.quick:
        args.replicas, args.steps, args.sync_every = 3, 60, 10
    with tempfile.TemporaryDirectory(prefix="diloco-bench-async-") as tmp:
        results = {mode: run_mode(mode, args, Path(tmp)) for mode in MODES}
    target = results["sync"]["final"]
    columns = ["mode", "wall s", "final eval", "reached sync final at", "master resumed at", "restart s"]
    rows = []
    for mode, result in results.items():
        reached = next((t for t, loss in result["evals"] if loss <= target), None) if mode != "sync" else None
        rows.append({"mode": mode, "wall s": round(result["wall"], 1), "final eval": round(result["final"], 3),
                     "reached sync final at": f"{reached:.1f} s" if reached is not None else "-",
                     "master resumed at": (f"step {result['resumed_at']} of {args.steps}" if "resumed_at" in result
                                           else "-"),
                     "restart s": round(result["restart_s"], 1) if "restart_s" in result else "-"})
    setup = (f"{args.replicas} replicas, {args.steps} steps, H={args.sync_every}, replica {args.replicas - 1} "
             f"slowed {args.slow_factor:g}x")
    print(setup)
    print("  ".join(f"{c:>22}" for c in columns))
    for row in rows:
        print("  ".join(f"{str(row[c]):>22}" for c in columns))
    notes = [setup + "; every replica a process on a file:// store; the final model is identical on every "
             "replica in each mode (checked)",
             "the killed master was SIGKILLed once it had recorded half its steps, then started again at once"]
    cores = os.cpu_count() or 1
    if cores < args.replicas:
        notes.append(f"{args.replicas} replicas share {cores} core(s) here: in async mode the fast replicas keep "
                     f"computing and take CPU from the slow one (in sync mode they sleep while they wait), so these "
                     f"wall times say little about replicas on machines of their own")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        import platform

        Path(args.json).write_text(json.dumps({
            "title": "Synchronous vs asynchronous DiLoCo with a slow replica, and an asynchronous master killed",
            "machine": f"{platform.processor() or platform.machine()}, {cores} cores",
            "columns": columns, "rows": rows, "notes": notes}, indent=2))


if __name__ == "__main__":
    main()
