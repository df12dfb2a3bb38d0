"""One all-reduce round per wire format at a real pseudo-gradient's size: its time over the raw transfer of its
bytes, each rank's peak host memory over the payload, and on S3 (multipart) its requests and bytes.

Not a test (the times depend on the machine). Why it exists: a 0.5B-8B model's pseudo-gradient is 2-16 GB, where a
round's fixed costs vanish and what decides is whether the codecs, the hashing and the buffers keep up with the
network and fit in memory. The targets: every format's round at most 1.3x the raw transfer of the bytes it moves
on a paced link, and at most 2.5x the payload of extra host memory per rank.

How: N rank processes (spawned, one torch thread each, as replicas on their own instances), each holding a payload
of fp32 tensors shaped like a model's (``bench/round_memory.py``'s: four large matrices, a few vectors). Per format
(``none``, ``bf16``, ``int8`` and ``int4`` with the sharded strategy, the bandwidth-optimal one at this size;
``topk`` with gather, the only one it takes):

* round 1 after the rank's baseline (``VmRSS`` once torch, the store's client and a warm-up round on a tiny payload
  are in, ``VmHWM`` reset): ``peak x`` is that round's ``VmHWM - baseline`` over the payload, the worst rank; it
  includes what a compressed format keeps between rounds (the error-feedback residual, one fp32 copy);
* round 2: ``round s``, the slowest rank (barrier release to the mean in its tensors), and the bytes and requests
  every rank's store counted (``ObjectStore.traffic``), mean over ranks. Its values are Gaussian noise (seeded by
  the rank), as a pseudo-gradient's are near enough: round 1's (value ``i`` is ``i % 1000`` scaled, so that its
  mean can be checked) repeat every thousand elements, and such ties send the sparse format's selection down its
  exact path for tied chunks, 3.5x slower than on noise;
* then ``raw s``: the same ranks PUT as many bytes as their round wrote and read as many as it read (ranged GETs
  spread over the peers' objects), nothing else; ``round/raw`` is the protocol's price over the bare transfer.

Stores: ``paced`` is ``file://`` in RAM (``/dev/shm``) behind a link of ``--link-gbs`` GB/s per rank and direction
(``bench/allreduce_traffic.py``'s ``PacedStore``: bytes paced, no latency per request), the case where the network
is the limit; ``file`` a folder on disk; ``s3`` moto's server on loopback (in this parent process; its memory is not
counted), where every object above 50 MiB is a multipart upload: its rows are for the request counts and bytes
(moto is a Python server sharing the machine's cores, so its times are not AWS's).

    python bench/round_at_scale.py --quick [--json OUT]   # 64 MiB, N=4, paced and file (make bench)
    python bench/round_at_scale.py --full [--json OUT]    # 1 GiB on paced and file, 256 MiB on S3 (slow; run once)
    python bench/round_at_scale.py --stores paced --mib 1024 --world 2   # what fits beside other jobs in 24 GiB
"""

from __future__ import annotations

import argparse
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
from allreduce_round import emit_table, store_root  # noqa: E402 - sibling bench scripts
from allreduce_traffic import PACED, RAM_FOLDER, PacedStore  # noqa: E402
from round_memory import check_mean, make_payload, peak_since_reset, release_and_reset_peak  # noqa: E402

from diloco.store.objects import ObjectStore  # noqa: E402 - after the sibling imports, like them

MiB = 2**20
FORMATS = ("none", "bf16", "int8", "int4", "topk")
#: The strategy each format's row uses: sharded where it can (reads 2S(N-1)/N), gather for the sparse format.
STRATEGY = {"none": "sharded", "bf16": "sharded", "int8": "sharded", "int4": "sharded", "topk": "gather"}
TIMEOUT_S = 1800.0
PUT_OPS = ("put", "put_if_absent", "put_stream", "create_multipart", "put_part", "complete_multipart")
GET_OPS = ("get", "get_range")
COLUMNS = ["store", "N", "format", "strategy", "payload MiB", "written MiB", "read MiB", "PUTs", "multipart parts",
           "GETs", "polls", "round s", "raw s", "round/raw", "<= 1.3x", "fp32 raw s", "round/fp32 raw", "peak extra MiB", "peak x payload",
           "<= 2.5x"]


def rank_process(uri: str, rank: int, world: int, fmt: str, nbytes: int, link: float | None, barrier: Any,
                 results: Any) -> None:
    """One rank: baseline, round 1 (peak memory), round 2 (time, traffic), the raw transfer; one report."""
    try:
        import torch

        torch.set_num_threads(1)
        from diloco.collectives.allreduce import create_allreduce

        ar = create_allreduce(uri, rank, world, allreduce=STRATEGY[fmt], compression=fmt, timeout_s=TIMEOUT_S,
                              poll_interval_s=0.02)
        if link:
            ar.store = PacedStore(uri, link)
        ar.allreduce({"w": torch.full((1024,), float(rank + 1))})  # imports, threads, connections
        tensors = make_payload(nbytes, scale=float(rank + 1))
        baseline = release_and_reset_peak()
        barrier.wait(TIMEOUT_S)
        ar.allreduce(tensors)
        peak = peak_since_reset(baseline)
        if fmt == "none":
            check_mean(tensors, world)
        del tensors  # before the next payload: never two of them at once
        tensors = make_payload(nbytes, scale=float(rank + 1))
        noise = torch.Generator().manual_seed(rank)
        for t in tensors.values():  # the timed round's values are noise, as a pseudo-gradient's (docstring)
            t.normal_(generator=noise)
        before = ar.store.traffic
        barrier.wait(TIMEOUT_S)
        started = time.time()
        ar.allreduce(tensors)
        ended = time.time()
        traffic = ar.store.traffic - before
        del tensors
        ar.close()
        raw = raw_transfer(ar.store, rank, world, traffic.bytes_written, traffic.bytes_read, barrier)
        req = traffic.requests
        results.put((rank, {
            "peak": peak, "span": (started, ended), "raw": raw, "written": traffic.bytes_written,
            "read": traffic.bytes_read, "puts": sum(req.get(op, 0) for op in PUT_OPS),
            "parts": req.get("put_part", 0), "gets": sum(req.get(op, 0) for op in GET_OPS),
            "polls": req.get("exists", 0)}))
    except BaseException:
        import traceback

        results.put((rank, traceback.format_exc()))
        barrier.abort()


def raw_transfer(store: Any, rank: int, world: int, written: int, read: int, barrier: Any) -> tuple[float, float]:
    """PUT ``written`` bytes, then (once every rank's object exists) read ``read`` bytes as ranged GETs spread
    over the peers' objects, into one reused buffer; -> (start, end) wall clock."""
    data = bytes([rank % 256]) * written
    per_peer = read // max(world - 1, 1)
    buffer = bytearray(min(per_peer, 64 * MiB))
    barrier.wait(TIMEOUT_S)
    started = time.time()
    store.put(f"raw/{rank}", data)
    del data
    barrier.wait(TIMEOUT_S)
    for peer in range(world):
        if peer == rank:
            continue
        for begin in range(0, per_peer, len(buffer) or 1):
            end = min(begin + len(buffer), per_peer)
            got = store.get_range(f"raw/{peer}", begin, end)
            buffer[: len(got)] = got
    ended = time.time()
    barrier.wait(TIMEOUT_S)
    return started, ended


def run_case(uri: str, store: str, world: int, fmt: str, nbytes: int, link: float | None) -> dict[str, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    processes = [ctx.Process(target=rank_process, args=(f"{uri}/{fmt}", r, world, fmt, nbytes, link, barrier,
                                                        results)) for r in range(world)]
    for process in processes:
        process.start()
    reports: dict[int, dict[str, Any]] = {}
    try:
        for _ in range(world):
            rank, report = results.get(timeout=TIMEOUT_S)
            if isinstance(report, str):
                raise RuntimeError(f"{store} {fmt}: rank {rank} failed:\n{report}")
            reports[rank] = report
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
    round_s = max(r["span"][1] for r in reports.values()) - min(r["span"][0] for r in reports.values())
    raw_s = max(r["raw"][1] for r in reports.values()) - min(r["raw"][0] for r in reports.values())
    mean = lambda key: statistics.fmean(r[key] for r in reports.values())  # noqa: E731
    peak = max(r["peak"] for r in reports.values())
    return {"store": store, "N": world, "format": fmt, "strategy": STRATEGY[fmt], "payload MiB": nbytes // MiB,
            "written MiB": round(mean("written") / MiB, 1), "read MiB": round(mean("read") / MiB, 1),
            "PUTs": round(mean("puts"), 1), "multipart parts": round(mean("parts"), 1),
            "GETs": round(mean("gets"), 1), "polls": round(mean("polls"), 1), "round s": round(round_s, 2),
            "raw s": round(raw_s, 2), "round/raw": round(round_s / raw_s, 2),
            "<= 1.3x": "yes" if round_s <= 1.3 * raw_s else "NO",
            "peak extra MiB": round(peak / MiB), "peak x payload": round(peak / nbytes, 2),
            "<= 2.5x": "yes" if peak <= 2.5 * nbytes else "NO"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="64 MiB, paced and file (the default; make bench)")
    p.add_argument("--full", action="store_true", help="1 GiB on paced and file, 256 MiB on S3 (slow)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (make bench reads it)")
    p.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats (default all)")
    p.add_argument("--stores", default=None, help="comma-separated: paced, file, s3")
    p.add_argument("--mib", type=int, default=None, help="payload MiB on paced and file (default 64; --full 1024)")
    p.add_argument("--s3-mib", type=int, default=None, help="payload MiB on S3 (default 256 with --full)")
    p.add_argument("--link-gbs", type=float, default=1.2,
                   help="the paced store's link per rank and direction, GB/s (default 1.2: a 10 Gbit/s instance)")
    args = p.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    args.stores = [s for s in (args.stores or ("paced,file,s3" if args.full else "paced,file")).split(",") if s]
    args.mib = args.mib or (1024 if args.full else 64)
    args.s3_mib = args.s3_mib or (256 if args.full else 32)
    if set(args.formats) - set(FORMATS) or set(args.stores) - {PACED, "file", "s3"} or args.world < 2:
        p.error(f"--formats from {','.join(FORMATS)}, --stores from paced,file,s3, --world >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="diloco-scale-") as workdir:
        for store in args.stores:
            nbytes = (args.s3_mib if store == "s3" else args.mib) * MiB
            link = args.link_gbs * 1e9 if store == PACED else None
            ram = RAM_FOLDER if store == PACED and os.access(RAM_FOLDER, os.W_OK) else None
            with tempfile.TemporaryDirectory(prefix="diloco-scale-store-", dir=ram) as folder:
                context = store_root("s3", workdir) if store == "s3" else None
                uri = context.__enter__() if context else f"file://{folder}"
                try:
                    fp32_raw: float | None = None
                    for fmt in sorted(args.formats, key=lambda f: f != "none"):  # fp32 first: its raw is the yardstick
                        print(f"{store} {fmt} {nbytes // MiB} MiB N={args.world}", file=sys.stderr, flush=True)
                        try:
                            row = run_case(uri, store, args.world, fmt, nbytes, link)
                        finally:  # a case leaves its objects (a few payloads): free them before the next
                            ObjectStore(uri).delete_prefix(fmt)
                        fp32_raw = row["raw s"] if fmt == "none" else fp32_raw
                        row["fp32 raw s"] = fp32_raw
                        row["round/fp32 raw"] = round(row["round s"] / fp32_raw, 2) if fp32_raw else None
                        rows.append(row)
                        print(f"  round {rows[-1]['round s']} s, raw {rows[-1]['raw s']} s, peak x "
                              f"{rows[-1]['peak x payload']}", file=sys.stderr, flush=True)
                finally:
                    if context:
                        context.__exit__(None, None, None)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"
    notes = [
        f"N={args.world} rank processes, one torch thread each, on {os.cpu_count()} CPUs; payload fp32, "
        + ", ".join(f"{args.s3_mib if store == 's3' else args.mib} MiB on {store}" for store in args.stores)
        + ". Round 1 measures memory, round 2 time and traffic.",
        "peak extra: VmHWM - baseline of round 1, the worst rank (it includes the error-feedback residual a "
        "compressed format keeps: one fp32 copy of the payload).",
        "raw s: the same ranks PUT the bytes their round wrote and read the bytes it read (ranged GETs), nothing "
        "else, on the same store; round/raw is the protocol's price (hashing, encoding, decoding, polling) over it. "
        f"paced: file:// in RAM behind {args.link_gbs:g} GB/s per rank and direction.",
        "fp32 raw s: the raw transfer of the fp32 round's bytes (the none row, same store and N): what the format "
        "saves against; round/fp32 raw below 1 means the format's round is cheaper than sending fp32 would be.",
        "PUTs count multipart parts (and their create/complete requests); polls are HEADs while waiting for peers.",
        f"1-minute load average when it started: {load:.2f} on {os.cpu_count()} CPUs (other jobs share this machine "
        f"when it is above 0). Total {time.perf_counter() - started:.0f} s.",
    ]
    title = "One round at a real payload size, per format: time over the raw transfer, peak memory, S3 requests"
    emit_table(title, machine, COLUMNS, rows, notes, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
