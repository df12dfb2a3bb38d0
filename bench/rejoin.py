"""What rejoining costs: time from a replica's restart to its first contribution, next to the time of one round.

Not a test (timings depend on the machine): ``python bench/rejoin.py [--replicas N] [--steps S] [--sync-every H]``
starts N replica processes (``python -m diloco.replica.entrypoint``, the built-in trainer, a ``file://`` store),
waits until round 2 has committed, SIGKILLs the last rank, starts it again at once and reports, as JSON:

* ``restart_to_first_contribution_s``: from the new process's start to its contribution object of the round it
  rejoined (python and torch start-up, one read of the committed round, the trainer's ``sync_every`` inner steps);
* ``startup_s``: from the new process's start to its log line saying which round it rejoins at (start-up plus
  the one read of the committed round: what rejoining adds on top of training);
* ``round_s``: the median time between two committed rounds of the run (one round, as the survivors see it);
* ``committed_round_bytes``: the size of the one object a rejoining replica reads.

Rejoining is one read of the latest committed round (``diloco.replica.checkpoint``), not a replay of the run: the
numbers should show ``startup_s`` flat in the number of rounds already done.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 8, "eval_batches": 2,
        "max_corpus_bytes": 200_000, "threads": 1}


def start_replica(root: Path, rank: int, world: int, kwargs: dict[str, object], attempt: int) -> subprocess.Popen[str]:
    log = open(root / f"rank{rank}.try{attempt}.log", "w")  # noqa: SIM115 - closed with the process
    cmd = [sys.executable, "-m", "diloco.replica.entrypoint", "--rendezvous", f"file://{root / 'store'}",
           "--world-size", str(world), "--rank", str(rank), "--trainer-kwargs-json", json.dumps(kwargs),
           "--timeout", "300", "--poll-interval", "0.02"]
    env = {**os.environ, "DILOCO_RUN_ID": "bench-rejoin", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def committed_times(store: Path) -> dict[int, float]:
    """Committed round number -> when its marker was written (mtime)."""
    out = {}
    for marker in store.glob("committed/round_*/COMMITTED"):
        out[int(marker.parent.name.split("_")[1])] = marker.stat().st_mtime
    return out


def wait_for(predicate, timeout: float = 600, poll: float = 0.01):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError("the benchmark run stalled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--kill-after-round", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a shorter run (60 steps), for make bench")
    parser.add_argument("--full", action="store_true", help="(the default) 120 steps")
    parser.add_argument("--json", metavar="OUT", help="also write the result as a bench/run_all.py table")
    args = parser.parse_args()
    if args.quick:
        args.steps = 60
    kwargs = {**TINY, "total_steps": args.steps, "sync_every": args.sync_every}
    world, victim = args.replicas, args.replicas - 1
    with tempfile.TemporaryDirectory(prefix="diloco-bench-rejoin-") as tmp:
        root = Path(tmp)
        store = root / "store"
        procs = {rank: start_replica(root, rank, world, kwargs, 0) for rank in range(world)}
        wait_for(lambda: max(committed_times(store), default=0) >= args.kill_after_round)
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        restarted = time.time()
        procs[victim] = start_replica(root, victim, world, kwargs, 1)
        log = root / f"rank{victim}.try1.log"
        match = wait_for(lambda: re.search(r"rejoins the run after committed round (\d+)", log.read_text()))
        startup = time.time() - restarted
        rejoined = int(match[1])
        contribution = store / f"round_{rejoined:06d}" / f"rank_{victim:04d}.safetensors"
        wait_for(lambda: contribution.exists())
        first_contribution = contribution.stat().st_mtime - restarted
        for p in procs.values():
            p.wait(timeout=600)
        times = committed_times(store)
        rounds = sorted(times)
        gaps = [times[b] - times[a] for a, b in zip(rounds, rounds[1:], strict=False) if b == a + 1]
        state = store / "committed" / f"round_{rounds[-1]:06d}" / "state.safetensors"
        row = {
            "replicas": world, "sync_every": args.sync_every, "rejoined_after_round": rejoined,
            "restart_to_first_contribution_s": round(first_contribution, 3), "startup_s": round(startup, 3),
            "round_s": round(statistics.median(gaps), 3) if gaps else None,
            "committed_round_bytes": state.stat().st_size if state.exists() else None,
            "exit_codes": [p.returncode for p in procs.values()],
        }
        print(json.dumps(row, indent=2))
        if args.json:
            import platform

            table = {"title": "Rejoining: restart to first contribution vs one round",
                     "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                     "columns": list(row), "rows": [row],
                     "notes": ["a replica SIGKILLed after a committed round and restarted at once; startup_s is "
                               "Python and torch start-up plus one committed-round read (file:// store)"]}
            Path(args.json).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
