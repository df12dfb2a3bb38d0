"""DiLoCo vs data-parallel in the papers' regime: from a warm start, for many rounds, at equal samples.

Why a second convergence bench: ``bench/convergence.py`` compares the methods from a random initialisation over 12
rounds, where DiLoCo trails data-parallel by about 5%. The papers' parity (DiLoCo 2311.08105, its scaling laws
2503.09799) is measured another way: a model first trained data-parallel, then DiLoCo from that checkpoint for
many rounds. This script measures that: ``warm_start`` data-parallel steps (batch M x b, one step per step on the
M replicas' batches together), then, from that checkpoint (weights, AdamW state, every replica's place in its own
shard), data-parallel and DiLoCo M=4 continue for the same samples, and all are evaluated on the same held-out
batches after every round. The warm-up is computed once and shared (``convergence.warm_up``).

It reuses ``bench/convergence.py``'s in-process machinery (the same math as the trainer and
``diloco.replica.outer``); the trainer itself starts from such a checkpoint with ``-k init_from=...``.

``python bench/convergence_warm.py --quick --json OUT`` is what ``make bench`` runs: 300 warm-up steps, then 300
more (12 rounds of H=25) for data-parallel, DiLoCo with the papers' outer step (lr 0.7, Nesterov 0.9) and DiLoCo
with the built-in trainer's outer defaults (tuned for short runs from scratch); ``--full`` continues for 900
steps (36 rounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterable
from typing import Any

from convergence import Result, Setting, run_diloco, run_dp, run_plan, trainer_defaults

#: The papers' outer step: Nesterov SGD, lr 0.7, momentum 0.9, from the first round.
PAPER = {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_momentum_warmup": 0}


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="300 warm-up steps, then 300 (make bench)")
    p.add_argument("--full", action="store_true", help="300 warm-up steps, then 900")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (make bench reads it)")
    p.add_argument("--warm-start", type=int, default=300, metavar="STEPS")
    p.add_argument("--sync-every", type=int, default=25, metavar="H")
    return p.parse_args(list(argv) if argv is not None else None)


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    steps = 900 if args.full else 300
    base = trainer_defaults(Setting(steps=steps, sync_every=args.sync_every, warm_start=args.warm_start))
    plan = [(run_dp, base), (run_diloco, dataclasses.replace(base, **PAPER)), (run_diloco, base)]
    return run_plan(plan, lambda results: build_report(base, results), args.json)


def name_of(r: Result) -> str:
    s = r.setting
    if r.method == "dp":
        return f"data-parallel (1 model, batch {s.replicas}x{s.batch_size})"
    ramp = f" ramped over {s.outer_momentum_warmup} rounds" if s.outer_momentum_warmup else ""
    which = "papers'" if s.outer_lr == PAPER["outer_lr"] and s.outer_momentum == PAPER["outer_momentum"] else \
        "trainer's default"
    return (f"DiLoCo M={s.replicas} H={s.sync_every}, {which} outer step (lr {s.outer_lr:g}, Nesterov "
            f"{s.outer_momentum:g}{ramp})")


def build_report(base: Setting, results: list[Result]) -> dict[str, Any]:
    dp = next((r for r in results if r.method == "dp"), None)
    rows = []
    for r in results:
        start = r.curve[0][1]
        rows.append({
            "method": name_of(r),
            "eval loss at the warm start": round(start, 4),
            "final eval loss": round(r.final, 4),
            "vs data-parallel": "" if dp is None else f"{100 * (r.final / dp.final - 1):+.2f}%",
            "s": round(r.seconds),
        })
    rounds = base.steps // base.sync_every
    series = {name_of(r): [[base.warm_start + step, round(v, 4)] for step, v in r.curve] for r in results}
    later = [v for r in results for _, v in r.curve]
    return {
        "title": "DiLoCo vs data-parallel from a warm start, many rounds (built-in model)",
        "columns": ["method", "eval loss at the warm start", "final eval loss", "vs data-parallel", "s"],
        "rows": rows,
        "notes": [
            f"{base.warm_start} data-parallel steps (batch {base.replicas}x{base.batch_size}) from the seed's "
            f"initialisation, then {base.steps} more steps per replica ({rounds} rounds of H={base.sync_every}) "
            f"for every method from that checkpoint: the same samples, the same held-out batches "
            f"({base.eval_batches} x {base.eval_batch_size} windows of the corpus's last 10%).",
            f"Model n_layer={base.n_layer} n_embd={base.n_embd} block_size={base.block_size}, inner AdamW lr "
            f"{base.lr:g} (constant), corpus: the first {base.max_corpus_bytes:,} bytes of the standard library.",
            "DiLoCo's replicas start from the checkpoint's weights and AdamW state, each in its own shard where the "
            "warm-up left it; the trainer takes such a checkpoint with -k init_from=FILE.",
            "In one process, the same math as the trainer and diloco.replica.outer (see bench/convergence.py). "
            "The first row's seconds include the shared warm-up.",
        ],
        "plots": [{"file": "convergence_warm.png", "title": "Held-out eval loss after a data-parallel warm start",
                   "xlabel": "inner step (warm-up included)", "ylabel": "eval loss", "series": series,
                   "ylim": [round(min(later) - 0.05, 2), round(max(later) + 0.05, 2)]}],
    }


if __name__ == "__main__":
    sys.exit(main())
