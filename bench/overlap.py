"""How much of the training loop's wall time is spent blocked in sync: vanilla DiLoCo vs Streaming DiLoCo's delay.

Not a test (times depend on the machine). Why it exists: with Streaming DiLoCo's delay
(``fragment_sync_delay = 1``: a round's all-reduce starts one inner step before the outer step waits for it) the
training loop should never wait on the store, even when every store request takes 50 ms. The all-reduce runs its whole
round (upload, polling, downloads, reduction) on a background thread, so ``Work.wait()`` only copies the mean back;
this bench shows what fraction of wall time is still blocked, next to vanilla DiLoCo (delay 0) in the same run.

What it runs: the built-in trainer (``diloco.trainers.gpt:diloco_train``, a small GPT on the bundled corpus, CPU, one
torch thread), M replicas as spawned processes, meeting through S3 (real boto3/s3fs) on moto's loopback server
behind ``tests/faultproxy.py``, which delays *every* request (PUT, GET, HEAD, list) by ``--latency-ms`` (default
50). Fake credentials only; nothing outside a temporary folder and that in-memory server is written.

    python bench/overlap.py --quick [--json OUT]     # 2 replicas, 3 rounds each mode: 1-2 minutes on 2 cores

Columns: ``blocked s`` is ``AllReduceStats.seconds_blocked`` (exactly the time the loop spent inside
``Work.wait()``, ``sync s`` in ``diloco status``), mean over replicas; ``wall s`` the replica's whole
``diloco_train`` call (model set-up, evaluation and metric writes included, so the fraction is if anything
understated); ``blocked %`` their ratio; ``per round ms`` the blocked time per round. The model is sized so one
inner step takes a few hundred ms on a CPU core, longer than a round at 50 ms per request, which is the condition
for one step of delay to hide a round; with a smaller model (or a slower store) raise the delay.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from allreduce_round import emit_table, store_root  # noqa: E402 - sibling bench script: moto on loopback + fake AWS env

COLUMNS = ["mode", "fragment_sync_delay", "replicas", "rounds", "wall s", "blocked s", "blocked %",
           "per round ms"]
MODEL = {"n_layer": 3, "n_head": 4, "n_embd": 96, "block_size": 128, "batch_size": 64, "eval_batches": 1,
         "threads": 1, "device": "cpu"}


def replica_main(rank: int, world: int, uri: str, kwargs: dict[str, Any], results: Any) -> None:
    """One replica process: the built-in trainer through the store collective; report wall and blocked time."""
    try:
        from diloco.collectives.allreduce import create_allreduce
        from diloco.replica.manager import ObjectStoreManager
        from diloco.replica.metrics import reporting_to
        from diloco.trainers.gpt import diloco_train

        allreduce = create_allreduce(uri, rank, world, timeout_s=300, poll_interval_s=0.02)
        manager = ObjectStoreManager(allreduce, total_steps=kwargs["total_steps"])
        started = time.perf_counter()
        with reporting_to(manager.metrics):
            diloco_train(manager=manager, rank=rank, world_size=world, **kwargs)
        wall = time.perf_counter() - started
        stats = allreduce.stats
        allreduce.close()
        results.put((rank, wall, stats.seconds_blocked, stats.rounds, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        results.put((rank, 0.0, 0.0, 0, f"{exc!r}\n{traceback.format_exc()}"))


def run_mode(ctx: Any, uri: str, world: int, kwargs: dict[str, Any]) -> list[tuple[int, float, float, int]]:
    results = ctx.Queue()
    procs = [ctx.Process(target=replica_main, args=(r, world, uri, kwargs, results), name=f"overlap-rank{r}")
             for r in range(world)]
    for p in procs:
        p.start()
    out = []
    for _ in procs:
        rank, wall, blocked, rounds, error = results.get(timeout=600)
        if error:
            raise RuntimeError(f"replica {rank} failed: {error}")
        out.append((rank, wall, blocked, rounds))
    for p in procs:
        p.join(60)
    return out


def row(mode: str, delay: int, reports: list[tuple[int, float, float, int]]) -> dict[str, Any]:
    wall = statistics.fmean(r[1] for r in reports)
    blocked = statistics.fmean(r[2] for r in reports)
    rounds = reports[0][3]
    return {"mode": mode, "fragment_sync_delay": delay, "replicas": len(reports), "rounds": rounds,
            "wall s": round(wall, 2), "blocked s": round(blocked, 3), "blocked %": round(100 * blocked / wall, 2),
            "per round ms": round(1000 * blocked / max(rounds, 1), 1)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 rounds of 4 steps per mode (default: 8 rounds of 10)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (make bench reads it)")
    p.add_argument("--latency-ms", type=float, default=50.0, help="delay added to every store request (default 50)")
    p.add_argument("--replicas", type=int, default=2, help="replica processes (default 2)")
    p.add_argument("--delay", type=int, default=1, help="fragment_sync_delay of the streaming run (default 1)")
    args = p.parse_args(argv)
    if args.latency_ms < 0 or args.replicas < 1 or args.delay < 1:
        p.error("--latency-ms must be >= 0, --replicas >= 1 and --delay >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from support.faultproxy import FaultProxy

    args = parse_args(argv)
    sync_every = 4 if args.quick else 10
    rounds = 3 if args.quick else 8
    if args.delay >= sync_every:
        print(f"--delay must be below sync_every ({sync_every})", file=sys.stderr)
        return 2
    base = {**MODEL, "total_steps": sync_every * rounds, "sync_every": sync_every}
    ctx = mp.get_context("spawn")
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="diloco-overlap-bench-") as workdir, \
            store_root("s3", workdir) as root:
        with FaultProxy(os.environ["AWS_ENDPOINT_URL"], seed=0) as proxy:
            proxy.add("delay", delay_s=args.latency_ms / 1000)
            os.environ["AWS_ENDPOINT_URL"] = proxy.url  # the replica processes inherit it (store_root restores)
            for mode, delay in (("vanilla", 0), ("streaming", args.delay)):
                print(f"{mode}: fragment_sync_delay {delay}", file=sys.stderr, flush=True)
                reports = run_mode(ctx, f"{root}/{mode}", args.replicas, {**base, "fragment_sync_delay": delay})
                rows.append(row(mode, delay, reports))
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"
    title = f"Training loop blocked in sync, {args.latency_ms:g} ms per store request: vanilla vs streaming"
    notes = [
        f"Built-in trainer {json.dumps(MODEL)}, sync_every {sync_every}, {rounds} rounds, {args.replicas} replica "
        f"processes on this machine; S3 = moto on loopback behind tests/faultproxy.py delaying every request.",
        "blocked = AllReduceStats.seconds_blocked (time inside Work.wait()); wall = the whole diloco_train call.",
        f"Target: streaming under 5%. Total {time.perf_counter() - started:.0f} s.",
    ]
    emit_table(title, machine, COLUMNS, rows, notes, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
