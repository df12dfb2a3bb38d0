"""How fast the pseudo-gradient codecs encode and decode, per core, next to a plain tensor copy in the same run.

Not a test (throughput depends on the machine and on what else runs on it). Why it exists: a codec slower than the
network it saves bytes on makes a round slower, not faster; the target is at least 1 GiB/s per core for encoding
and decoding int8, int4 and topk, and the honest yardstick is how fast this machine copies memory at all.

What is timed, with ``torch.set_num_threads(1)`` (``--threads`` to change), on one fp32 tensor of ``--mib`` MiB
(random normal, as pseudo-gradients are roughly), the best of ``--reps`` runs (the run least disturbed by other
processes on a shared machine), timed in CPU seconds of the measuring thread (``--clock cpu``, the default: time
spent waiting for a core that another process holds is not this codec's; ``--clock wall`` for wall-clock time):

* ``encode``: ``compression.encode`` (fp32 in -> the wire tensors), counted in fp32 input bytes.
* ``decode``: ``compression.decode`` into a fresh fp32 tensor, counted in fp32 output bytes. Fresh memory is
  paid for in page faults, so its yardstick is ``clone``.
* ``decode+add``: ``compression.decode_into(..., mode="add")``, what the all-reduce does for every peer: add
  the decoded values into the running sum. Its yardstick is ``y += x``.
* the ``memcpy`` row: ``y.copy_(x)`` into an existing tensor (encode column), ``x.clone()`` (decode column) and
  ``y.add_(x)`` (decode+add column), on the same tensor.

    python bench/codec_throughput.py --quick [--json OUT]      # 64 MiB, 9 runs each: about 10 s
    python bench/codec_throughput.py [--mib 256] [--reps 9]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce_round import emit_table  # noqa: E402 - a sibling bench script: the JSON contract of make bench

GIB = 2**30
MIB = 2**20
FORMATS = ("bf16", "int8", "int4", "topk")
#: The formats the issue holds to 1 GiB/s per core, encode and decode.
TARGET_FORMATS = ("int8", "int4", "topk")
TARGET_GIB_S = 1.0
COLUMNS = ["codec", "wire MiB", "fp32 / wire", "encode GiB/s", "decode GiB/s", "decode+add GiB/s", "encode vs memcpy",
           "decode vs clone"]


#: ``--clock``: CPU seconds of this thread (page faults included), or wall-clock seconds.
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]


def best_seconds(fn: Callable[[], Any], reps: int) -> float:
    """The fastest of ``reps`` runs of ``fn`` (after one warm-up run), on ``clock``."""
    fn()
    best = float("inf")
    for _ in range(reps):
        began = clock()
        fn()
        best = min(best, clock() - began)
    return best


def measure(mib: float, reps: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    import torch

    from diloco.collectives import compression

    n = int(mib * MIB) // 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    nbytes = x.nbytes
    layout = {"g": ((n,), torch.float32)}
    y = torch.empty_like(x)
    memcpy = {"copy": nbytes / best_seconds(lambda: y.copy_(x), reps) / GIB,
              "clone": nbytes / best_seconds(lambda: x.clone(), reps) / GIB,
              "add": nbytes / best_seconds(lambda: y.add_(x), reps) / GIB}
    rows = [{"codec": "memcpy (copy_ / clone / add_)", "wire MiB": round(nbytes / MIB, 2), "fp32 / wire": 1.0,
             "encode GiB/s": round(memcpy["copy"], 2), "decode GiB/s": round(memcpy["clone"], 2),
             "decode+add GiB/s": round(memcpy["add"], 2), "encode vs memcpy": 1.0, "decode vs clone": 1.0}]
    for fmt in FORMATS:
        print(f"{fmt} ...", file=sys.stderr, flush=True)
        wire, meta = compression.encode({"g": x}, fmt)
        wire_bytes = sum(t.numel() * t.element_size() for t in wire.values())
        encode_gib_s = nbytes / best_seconds(lambda fmt=fmt: compression.encode({"g": x}, fmt), reps) / GIB
        decode_gib_s = nbytes / best_seconds(lambda w=wire, m=meta: compression.decode(w, m, layout), reps) / GIB
        y.zero_()
        add_gib_s = nbytes / best_seconds(
            lambda w=wire, m=meta: compression.decode_into(w, m, layout, {"g": y}, mode="add"), reps) / GIB
        rows.append({"codec": fmt, "wire MiB": round(wire_bytes / MIB, 3), "fp32 / wire": round(nbytes / wire_bytes, 1),
                     "encode GiB/s": round(encode_gib_s, 2), "decode GiB/s": round(decode_gib_s, 2),
                     "decode+add GiB/s": round(add_gib_s, 2),
                     "encode vs memcpy": round(encode_gib_s / memcpy["copy"], 2),
                     "decode vs clone": round(decode_gib_s / memcpy["clone"], 2)})
    return rows, memcpy


def verdict(rows: Sequence[dict[str, Any]]) -> str:
    """Which of the target formats reach ``TARGET_GIB_S`` for encode and decode (fresh and into a sum)."""
    short = [f"{r['codec']} {col.split()[0]} {r[col]}" for r in rows if r["codec"] in TARGET_FORMATS
             for col in ("encode GiB/s", "decode GiB/s", "decode+add GiB/s") if r[col] < TARGET_GIB_S]
    if not short:
        return f"Target met: int8, int4 and topk encode and decode at {TARGET_GIB_S:g} GiB/s per core or more."
    return f"Below the {TARGET_GIB_S:g} GiB/s per core target: {', '.join(short)}."


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="64 MiB, 9 runs per measurement (make bench)")
    p.add_argument("--full", action="store_true", help="256 MiB, 9 runs per measurement (the default)")
    p.add_argument("--mib", type=float, default=None, help="size of the fp32 tensor in MiB")
    p.add_argument("--reps", type=int, default=None, help="runs per measurement; the best is reported")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: throughput per core)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="cpu: CPU seconds of the measuring thread (default); wall: wall-clock seconds")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (make bench reads it)")
    args = p.parse_args(argv)
    args.mib = args.mib or (64.0 if args.quick else 256.0)
    args.reps = args.reps or 9  # the best of more runs is likelier to be one no other process disturbed
    if args.mib <= 0 or args.reps < 1 or args.threads < 1:
        p.error("--mib, --reps and --threads must be positive")
    return args


def topk_note() -> str:
    """What the topk row measures: the format's defaults, read from ``TopkSpec`` so the note cannot go stale."""
    from diloco.formats.kernels.topk import TopkSpec, low_bits

    spec = TopkSpec()
    return (f"topk: {spec.k} of every {spec.chunk} elements ({100 * spec.k / spec.chunk:.2g}%), positions as "
            f"Elias-Fano ({low_bits(spec.chunk, spec.k)} low bits each and a bitmap per chunk), "
            f"{spec.value_bits}-bit values, {spec.levels} fp32 levels per chunk.")


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    global clock
    args = parse_args(argv)
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    began = time.perf_counter()
    rows, _ = measure(args.mib, args.reps)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
               f"{torch.backends.cpu.get_cpu_capability()}")
    notes = [
        verdict(rows),
        f"One fp32 tensor of {args.mib:g} MiB (random normal), {args.threads} torch thread(s), best of {args.reps} "
        f"runs each, {'CPU seconds of the measuring thread' if args.clock == 'cpu' else 'wall clock'}. Encode "
        "counts fp32 input bytes, decode fp32 output bytes.",
        "decode writes a fresh tensor (its pages are faulted in: compare with clone); decode+add adds into an "
        "existing sum, as the all-reduce does for every peer (compare with y += x; topk touches only its kept "
        "elements, which is why it beats a copy).",
        topk_note(),
        f"1-minute load average when it started: {load:.2f} on {os.cpu_count()} CPUs (other processes slow every "
        f"row alike). Total {time.perf_counter() - began:.0f} s.",
    ]
    emit_table("Codec throughput per core: encode and decode next to memcpy", machine, COLUMNS, rows, notes,
               args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
