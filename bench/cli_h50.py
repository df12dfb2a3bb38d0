"""The H=50 comparison of ``bench/convergence_warm.py --h50`` through the CLI: real replicas, real rounds, real bytes.

Why: the in-process bench measures loss and counts bytes by arithmetic; a user runs ``diloco launch``. This script
runs the recipe docs/benchmarks.md prints ("Compressed formats at fp32's H"): a 300-step warm start at batch 64
(one replica, the papers' warm start), ``diloco collect``, then fp32 DiLoCo with the papers' outer step, int8, int4
and the sparse format with SparseLoCo's rule, 4 local replicas for 1,200 steps at H=50 from that checkpoint, each
with the bench's 16 held-out batches. Per run, from ``diloco launch -o json``: the final eval loss, each replica's
seconds blocked in sync over the whole run (``sync_s``), the bytes each wrote to the store over the run, and the
tokens per second. ``--pairs N`` then runs fp32 and the sparse format alternately N more times, since sync time on
a shared machine moves by a third from run to run.

``python bench/cli_h50.py [--pairs N] [--fragment-sync-delay D] [--s3-latency-ms MS] [--formats fp32,sparse]
[--json OUT]``: about a minute a run on 2 cores; ``--fragment-sync-delay`` overlaps every round with the next D
inner steps (Streaming DiLoCo), where a round's codec then runs beside compute. ``--s3-latency-ms`` has the
replicas meet on S3 instead of a ``file://`` folder: moto's server on loopback (real boto3/s3fs) behind
``tests/support/faultproxy.py`` adding MS to every request, as S3's own first-byte latency does (tens of ms), so
a round's requests and bytes cost what they cost on an object store, where on ``file://`` with four replicas on
two cores a round is only its CPU. ``--formats`` runs only those (keys ``fp32``, ``int8``, ``int4``, ``sparse``).
Not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WARM = ["-c", "configs/local.yaml", "--replicas", "1", "--steps", "300", "--sync-every", "300",
        "-k", "batch_size=64", "-k", "eval_batches=16", "-k", "eval_batch_size=16"]
PAPER = ["-k", "outer_lr=0.7", "-k", "outer_momentum=0.9"]
FORMATS: dict[str, list[str]] = {
    "fp32, outer lr 0.7 Nesterov 0.9": PAPER,
    "int8, the same": [*PAPER, "--compression", "int8"],
    "int4, the same": [*PAPER, "--compression", "int4"],
    "sparse, SparseLoCo's rule": ["--compression", "topk", "--set", "store.error_feedback_decay=0.95",
                                  "-k", "outer_rule=sparseloco", "-k", "outer_lr=1"],
}


def diloco(home: Path, *args: str) -> dict[str, Any]:
    """``diloco <args> -o json`` in ``home``: the command's JSON, or SystemExit with its error."""
    proc = subprocess.run([sys.executable, "-m", "diloco.cli.main", *args, "-o", "json"], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "DILOCO_HOME": str(home)})
    if proc.returncode != 0:
        raise SystemExit(f"diloco {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


#: ``--formats`` keys.
KEYS = dict(zip(("fp32", "int8", "int4", "sparse"), FORMATS, strict=True))
FP32, SPARSE = KEYS["fp32"], KEYS["sparse"]


def launch_args(warm: Path, name: str, delay: int = 0, rendezvous: str | None = None) -> list[str]:
    """``diloco launch``'s arguments for format ``name`` from the warm start ``warm``: the docs' recipe; ``delay``:
    Streaming DiLoCo's ``fragment_sync_delay`` (the round starts that many inner steps before its outer step);
    ``rendezvous``: the store the replicas meet in (default: the run's ``file://`` folder)."""
    overlap = ["-k", f"fragment_sync_delay={delay}"] if delay else []
    store = ["--rendezvous", rendezvous] if rendezvous else []
    return ["-c", "configs/local.yaml", "--replicas", "4", "--steps", "1200", "--sync-every", "50",
            "-k", f"init_from={warm}", "-k", "eval_batches=16", "-k", "outer_momentum_warmup=0", *overlap, *store,
            *FORMATS[name]]


@contextlib.contextmanager
def s3_with_latency(workdir: str, latency_ms: float) -> Iterator[str]:
    """A bucket prefix on moto's server on loopback, every request to it delayed by ``latency_ms``; the
    environment (endpoint, fake credentials) is this process's until the block ends, so ``diloco`` inherits it."""
    sys.path.insert(0, str(REPO / "tests"))
    from allreduce_round import store_root
    from support.faultproxy import FaultProxy

    with store_root("s3", workdir) as root, FaultProxy(os.environ["AWS_ENDPOINT_URL"], seed=0) as proxy:
        proxy.add("delay", delay_s=latency_ms / 1000)
        moto = os.environ["AWS_ENDPOINT_URL"]
        os.environ["AWS_ENDPOINT_URL"] = proxy.url
        try:
            yield root
        finally:
            os.environ["AWS_ENDPOINT_URL"] = moto


def run(home: Path, warm: Path, name: str, delay: int = 0, rendezvous: str | None = None) -> dict[str, Any]:
    summary = diloco(home, "launch", *launch_args(warm, name, delay,
                                                  rendezvous and f"{rendezvous}/{{run_id}}"))
    ranks = summary["ranks"]
    sync = [r["sync_s"] for r in ranks]
    row = {"format (M=4, H=50, 24 rounds)": name, "final eval loss": round(summary["final_eval_loss"], 4),
           "sync s per replica over the run (mean)": f"{min(sync):.2f}-{max(sync):.2f} ({statistics.mean(sync):.2f})",
           "bytes written per replica": f"{ranks[0]['bytes_written']:,}",
           "tok/s per replica": f"{statistics.mean(r['tokens_per_s'] for r in ranks):,.0f}"}
    print(" | ".join(f"{k}: {v}" for k, v in row.items()), flush=True)
    return row | {"_sync": statistics.mean(sync), "_bytes": ranks[0]["bytes_written"]}


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--pairs", type=int, default=0, help="then fp32 and the sparse format alternately N more times")
    p.add_argument("--fragment-sync-delay", type=int, default=0, metavar="D",
                   help="overlap each round with the next D inner steps (Streaming DiLoCo; default 0: none)")
    p.add_argument("--s3-latency-ms", type=float, default=None, metavar="MS",
                   help="meet on S3 (moto on loopback) with MS added to every request (default: a file:// folder)")
    p.add_argument("--formats", default=",".join(KEYS), help=f"comma-separated, of {', '.join(KEYS)} (default all)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (bench/run_all.py's format)")
    args = p.parse_args(list(argv) if argv is not None else None)
    unknown = [k for k in args.formats.split(",") if k not in KEYS]
    if unknown or FP32 not in [KEYS.get(k) for k in args.formats.split(",")]:
        p.error(f"--formats: {unknown or 'fp32 is missing'}; choose from {', '.join(KEYS)}, fp32 among them")
    if args.s3_latency_ms is not None and args.s3_latency_ms < 0:
        p.error("--s3-latency-ms must be >= 0")
    with tempfile.TemporaryDirectory(prefix="diloco-cli-h50-") as tmp:
        home = Path(tmp)
        warm_run = diloco(home, "launch", *WARM)["run_id"]
        warm = home / "warm.safetensors"
        diloco(home, "collect", warm_run, "--output", str(warm))
        delay = args.fragment_sync_delay
        with s3_with_latency(tmp, args.s3_latency_ms) if args.s3_latency_ms is not None \
                else contextlib.nullcontext() as rendezvous:
            rows = [run(home, warm, KEYS[k], delay, rendezvous) for k in args.formats.split(",")]
            pairs = [(run(home, warm, FP32, delay, rendezvous)["_sync"],
                      run(home, warm, SPARSE, delay, rendezvous)["_sync"]) for _ in range(args.pairs)]
    fp32_bytes = rows[0]["_bytes"]
    for row in rows:
        row["fewer bytes than fp32"] = f"{fp32_bytes / row.pop('_bytes'):.1f}x"
        row.pop("_sync")
    store = "a file:// store" if args.s3_latency_ms is None else (
        f"S3 (moto on loopback, sharing the machine's cores, behind a proxy adding {args.s3_latency_ms:g} ms to "
        "every request)")
    notes = [f"4 local replica processes meeting in {store}, from a 300-step warm start made by the CLI "
             "(one replica, batch 64) and collected; the same 16 held-out batches as the in-process bench.",
             "sync s: each replica's seconds blocked in the all-reduce over the whole run; bytes written: what each "
             "replica wrote to the store over the run, its committed-round records included."]
    if args.fragment_sync_delay:
        notes.append(f"Every round overlaps the next {args.fragment_sync_delay} inner steps (-k fragment_sync_delay="
                     f"{args.fragment_sync_delay}: the outer step applies a pseudo-gradient that many steps old).")
    if pairs:
        fp32_mean = statistics.mean(f for f, _ in pairs)
        sparse_mean = statistics.mean(s for _, s in pairs)
        notes.append(f"{len(pairs)} more runs of fp32 and the sparse format, alternately: fp32 "
                     f"{', '.join(f'{f:.2f}' for f, _ in pairs)} s (mean {fp32_mean:.2f}), sparse "
                     f"{', '.join(f'{s:.2f}' for _, s in pairs)} (mean {sparse_mean:.2f}, "
                     f"{sparse_mean / fp32_mean:.2f}x fp32's).")
    report = {"title": "The H=50 comparison through the CLI (real rounds, bytes and sync time over the run)",
              "columns": list(rows[0]), "rows": rows, "notes": notes}
    for note in notes:
        print(f"- {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
