"""An elastic run against a fixed one of equal samples: does scaling a live run cost the model anything?

Not a test (losses and timings depend on the machine): ``python bench/elastic.py [--seeds 0,1] [--phase 3]
[--sync-every 10]`` trains the built-in trainer's tiny GPT, replicas as threads over one ``file://`` store with the
real managers and committed rounds, twice per seed:

* **elastic**: launched with 2 replicas (``max_replicas`` 4); replica 0 writes the target membership as it opens
  round ``phase`` (so that round's manifest names 4 members for the next) and again as it opens round
  ``2 * phase`` (3 members): ``phase`` rounds of 2, ``phase`` of 4, ``phase`` of 3. The new replicas start once the
  target names them and join from the committed round, as ``diloco scale`` starts them; rank 3 drains.
* **fixed**: 3 replicas for ``3 * phase`` rounds: the same replica-rounds, so the same number of training samples.

It prints one JSON object: per seed, both runs' final eval loss (the global model, evaluated by every member), the
elastic run's member sets read from its manifests, and the mean difference next to the spread between seeds (the
noise a difference must be compared with).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "batch_size": 8, "eval_batches": 4,
        "max_corpus_bytes": 400_000, "threads": 1}


class _Scaling:
    """Replica 0's manager, which writes the target membership as it opens the rounds ``plan`` names (before its
    own contribution, so no manifest of that round exists yet) and starts the replicas it adds."""

    def __init__(self, inner: Any, plan: dict[int, list[int]], start: Any) -> None:
        self._inner, self._plan, self._start = inner, plan, start

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def start_quorum(self) -> None:
        from diloco.collectives.membership import write_target

        members = self._plan.get(self._inner.current_step())
        if members is not None:
            write_target(self._inner.store, "bench", members)
            self._start(members)
        self._inner.start_quorum()


def _manager(uri: str, rank: int, world: int, elastic: bool) -> Any:
    from diloco.collectives.allreduce import create_allreduce
    from diloco.replica.checkpoint import RoundCheckpoints
    from diloco.replica.manager import ObjectStoreManager

    allreduce = create_allreduce(uri, rank, world, run_id="bench", timeout_s=600, poll_interval_s=0.02,
                                 **({"max_replicas": 4} if elastic else {}))
    return ObjectStoreManager(allreduce, rounds=RoundCheckpoints(allreduce.store, run_id="bench", world_size=world))


def run(root: Path, *, seed: int, phase: int, sync_every: int, elastic: bool) -> dict[str, Any]:
    from diloco.collectives.membership import member_history
    from diloco.trainers.gpt import diloco_train

    uri = f"file://{root}"
    world = 2 if elastic else 3
    rounds = 3 * phase
    results: dict[int, Any] = {}
    threads: dict[int, threading.Thread] = {}
    lock = threading.Lock()

    def train(rank: int, manager: Any) -> None:
        try:
            results[rank] = diloco_train(manager=manager, rank=rank, world_size=world, seed=seed,
                                         total_steps=rounds * sync_every, sync_every=sync_every, **TINY)
        except Exception as exc:  # noqa: BLE001 - a drained rank ends here; anything else is reported
            results[rank] = exc

    def start(members: list[int]) -> None:
        with lock:
            for rank in members:
                if rank not in threads:
                    manager = _manager(uri, rank, world, elastic)
                    threads[rank] = threading.Thread(target=train, args=(rank, manager), daemon=True)
                    threads[rank].start()

    plan = {phase - 1: [0, 1, 2, 3], 2 * phase - 1: [0, 1, 2]} if elastic else {}
    began = time.monotonic()
    with lock:
        for rank in range(world):
            manager = _manager(uri, rank, world, elastic)
            if rank == 0 and plan:
                manager = _Scaling(manager, plan, start)
            threads[rank] = threading.Thread(target=train, args=(rank, manager), daemon=True)
    for thread in list(threads.values()):
        thread.start()
    while True:
        with lock:
            pending = [t for t in threads.values() if t.is_alive()]
        if not pending:
            break
        pending[0].join(1.0)
    from diloco.collectives.membership import ReplicaDrained

    failures = {r: repr(v) for r, v in results.items() if isinstance(v, Exception) and not isinstance(v, ReplicaDrained)}
    if failures:
        raise SystemExit(f"replicas failed: {failures}")
    finished = [v for v in results.values() if isinstance(v, dict)]
    losses = {round(v["final_eval_loss"], 6) for v in finished}
    store = _manager(uri, 0, world, elastic).store
    return {"final_eval_loss": finished[0]["final_eval_loss"], "losses_agree": len(losses) == 1,
            "members": [len(m) for m in member_history(store, rounds, world)] if elastic else [3] * rounds,
            "replica_rounds": sum(len(m) for m in member_history(store, rounds, world)) if elastic else 3 * rounds,
            "seconds": round(time.monotonic() - began, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--phase", type=int, default=3, help="rounds per membership (2, then 4, then 3)")
    parser.add_argument("--sync-every", type=int, default=10)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    import diloco.trainers.gpt  # noqa: F401 - imported before the first run's clock starts (torch is most of it)
    report: dict[str, Any] = {"phase": args.phase, "sync_every": args.sync_every, "model": TINY, "seeds": {}}
    with tempfile.TemporaryDirectory(prefix="diloco-bench-elastic-") as tmp:
        for seed in seeds:
            report["seeds"][seed] = {
                kind: run(Path(tmp) / f"{kind}-{seed}", seed=seed, phase=args.phase, sync_every=args.sync_every,
                          elastic=kind == "elastic")
                for kind in ("elastic", "fixed")}
    diffs = [r["elastic"]["final_eval_loss"] - r["fixed"]["final_eval_loss"] for r in report["seeds"].values()]
    fixed = [r["fixed"]["final_eval_loss"] for r in report["seeds"].values()]
    report["mean_difference"] = statistics.fmean(diffs)
    report["fixed_spread_between_seeds"] = (max(fixed) - min(fixed)) if len(fixed) > 1 else None
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
