"""Peak resident memory of one replica process during one all-reduce round, as a multiple of the payload.

Why: a 0.5B-8B model's pseudo-gradient is 1-16 GB per round, so the host memory a round needs
on top of the model must not be a multiple of it. The target is at most 2.5x the payload: the snapshot, plus what
is in flight (an accumulator, one range of a peer's object).

How it measures: each case is N=2 rank processes (spawned children, one torch thread each) that run one round of
``diloco.collectives.allreduce.create_allreduce(allreduce=...)`` together. In each rank, after torch and the store's client
libraries are imported, the payload (fp32 tensors of the given size, shaped like a model's: a few large matrices
and some small vectors) is allocated and one warm-up round on a tiny payload has run (threads, connections), the
rank frees what it can (``gc``, ``malloc_trim``), reads ``VmRSS`` from ``/proc/self/status`` as its baseline and
resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``). Then it runs the round and reads
``VmHWM``: ``peak extra = VmHWM - baseline`` is what the round itself cost at its worst moment, and ``x payload``
is that over the payload's size. The table shows the worse of the two ranks. The page cache (file:// writes) is
not resident memory of the process and is not counted. The mean each rank received is checked.

Sharded replicas (FSDP2, ``--parts 1,2,4``, on by default): N=2 replicas of K local processes each, every process
holding its rows of the payload (FSDP2's cut, ``diloco.collectives.part_layout``) and running one round of its own
parts collective (``diloco.collectives.parts``). The same measurement per process; the table shows the worst
process against its own share of the payload (payload / K): the target is the same 2.5x, so a process of a
replica of K needs about 1/K of what a one-process replica needs (``diloco.replica.host_memory``, which the
documentation's memory figures come from, uses that factor).

Stores: a ``file://`` folder, and S3 through real boto3/s3fs against moto's server on loopback (started in this
parent process, so its memory is not counted; fake credentials only). With s3fs's default 50 MiB parts, every
payload here is a multipart upload.

    .venv/bin/python bench/round_memory.py --quick          # the 256 MiB cases (about a minute on 2 cores)
    .venv/bin/python bench/round_memory.py                  # 256 MiB and 1 GiB
    .venv/bin/python bench/round_memory.py --breakdown      # where the memory goes: each step of a round alone

``--breakdown`` measures, in one process and the same way, the extra memory of each primitive a round is made of
(snapshot copy, whole-object encode, PUT of those bytes, GET, decode, streamed encode + PUT, verified ranged
read), to show which step of a round needs rewriting to stay under the target.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from allreduce_round import store_root  # noqa: E402 - sibling bench script: a file:// folder or moto on loopback

from diloco.replica.host_memory import ROUND_PEAK_PAYLOADS  # noqa: E402 - the documentation's figures use it too

MiB = 2**20
TARGET = ROUND_PEAK_PAYLOADS
WORLD = 2
COLUMNS = ["payload MiB", "strategy", "store", "peak extra MiB", "x payload", f"<= {TARGET}x", "round s"]
PARTS_COLUMNS = ["payload MiB", "K", "store", "per-process payload MiB", "peak extra MiB", "x (payload / K)",
                 f"<= {TARGET}x", "round s"]


# ---------------------------------------------------------------------------------------------- in a rank
def status_kib(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only)")


def release_and_reset_peak() -> int:
    """Return freed heap to the OS, reset the high-water mark to the current RSS; -> that RSS in bytes."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS") * 1024


def peak_since_reset(baseline: int) -> int:
    return status_kib("VmHWM") * 1024 - baseline


def make_payload(nbytes: int, scale: float) -> dict[str, Any]:
    """fp32 tensors totalling ``nbytes``, shaped like a model (four big matrices, a few vectors); value i of each
    tensor is ``(i % 1000) / 1000 * scale``, so the mean over ranks is known exactly enough to check."""
    import torch

    elements = nbytes // 4
    small = [4096, 1024, 257]
    big = elements - sum(small)
    rows = [big // 4] * 3 + [big - 3 * (big // 4)]
    tensors = {}
    for i, n in enumerate(rows + small):
        t = torch.arange(n, dtype=torch.float32)
        t.remainder_(1000).mul_(scale / 1000)
        tensors[f"layer{i}.weight" if i < 4 else f"layer{i}.bias"] = t
    return tensors


def check_mean(tensors: dict[str, Any], world: int) -> None:
    import torch

    want = sum(r + 1 for r in range(world)) / world
    for name, t in tensors.items():
        head = t[:2000]
        expected = torch.arange(head.numel(), dtype=torch.float32).remainder_(1000).mul_(want / 1000)
        if not torch.allclose(head, expected, atol=1e-5):
            raise AssertionError(f"{name}: the round produced a wrong mean")


def parts_main(args: argparse.Namespace) -> None:
    """One local process of one replica of a sharded case: only its rows of the payload, one round of parts."""
    import torch

    from diloco.collectives.part_layout import spec_of_part
    from diloco.collectives.parts import PartsAllReduce

    torch.set_num_threads(1)
    ar = PartsAllReduce(args.uri, args.rank, args.world, part=args.part, parts=args.parts, timeout_s=600,
                        poll_interval_s=0.02)
    warm = torch.full((1024,), float(args.rank + 1))
    spec = spec_of_part((1024,), args.parts, args.part)
    ar.allreduce_shards_async({"w": warm[spec.row_start:spec.row_end].clone()}, {"w": spec}).wait()
    whole = make_payload(args.bytes, scale=float(args.rank + 1))
    specs = {name: spec_of_part(tuple(t.shape), args.parts, args.part) for name, t in whole.items()}
    tensors = {name: whole[name][s.row_start:s.row_end].clone() for name, s in specs.items()}
    del whole
    baseline = release_and_reset_peak()
    started = time.perf_counter()
    ar.allreduce_shards_async(tensors, specs).wait()
    seconds = time.perf_counter() - started
    peak = peak_since_reset(baseline)
    check_rows(tensors, specs, args.world)
    ar.close()
    print(json.dumps({"rank": args.rank, "part": args.part, "baseline": baseline, "peak_extra": peak,
                      "seconds": seconds}), flush=True)


def check_rows(tensors: dict[str, Any], specs: dict[str, Any], world: int) -> None:
    """``check_mean`` for the rows a process holds (value i of a tensor depends on its index in the whole)."""
    import torch

    want = sum(r + 1 for r in range(world)) / world
    for name, t in tensors.items():
        head = t[:2000]
        index = torch.arange(specs[name].row_start, specs[name].row_start + head.numel(), dtype=torch.float32)
        if not torch.allclose(head, index.remainder_(1000).mul_(want / 1000), atol=1e-5):
            raise AssertionError(f"{name}: the round produced a wrong mean")


def rank_main(args: argparse.Namespace) -> None:
    """One rank of one case: baseline, one round, peak; prints one JSON line."""
    import torch

    torch.set_num_threads(1)
    from diloco.collectives.allreduce import create_allreduce

    ar = create_allreduce(args.uri, args.rank, args.world, allreduce=args.strategy, timeout_s=600,
                          poll_interval_s=0.02, compression=args.compression)
    warm = {"w": torch.full((1024,), float(args.rank + 1))}
    ar.allreduce(warm)  # imports, threads, connections: not the round's cost
    tensors = make_payload(args.bytes, scale=float(args.rank + 1))
    baseline = release_and_reset_peak()
    sampler = PeakSampler() if args.trace_peak else None
    started = time.perf_counter()
    ar.allreduce(tensors)
    seconds = time.perf_counter() - started
    peak = peak_since_reset(baseline)
    if args.compression == "none":
        check_mean(tensors, args.world)
    ar.close()
    report = {"rank": args.rank, "baseline": baseline, "peak_extra": peak, "seconds": seconds}
    if sampler is not None:
        report["peak_stacks"] = sampler.stop()
    print(json.dumps(report), flush=True)


class PeakSampler:
    """Samples RSS every few ms on a thread; at each new maximum it records where every other thread was (the
    innermost frames of the diloco code), so ``--trace-peak`` says which step of a round holds the peak."""

    def __init__(self, interval_s: float = 0.005) -> None:
        import threading

        self._stop = threading.Event()
        self._max = 0
        self._stacks: list[str] = []
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        import threading
        import traceback

        me = threading.get_ident()
        while not self._stop.wait(interval_s):
            rss = status_kib("VmRSS") * 1024
            if rss > self._max + MiB:
                self._max = rss
                frames = sys._current_frames()
                self._stacks = [
                    " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
                                for f in reversed(traceback.extract_stack(frame)) if "diloco" in f.filename)[:600]
                    for ident, frame in frames.items() if ident != me]

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join()
        return [f"rss {self._max / MiB:.0f} MiB: {s}" for s in self._stacks if s]


# ---------------------------------------------------------------------------------------------- breakdown
def breakdown_main(args: argparse.Namespace) -> None:
    """Each step of a round alone, in this one process: its peak extra memory over the payload."""
    import torch

    torch.set_num_threads(1)
    from diloco.store.codec import decode_tensors, encode_stream, encode_tensors, read_data, read_header
    from diloco.store.objects import ObjectStore

    store = ObjectStore(args.uri)
    store.put("warm", b"x")
    store.get("warm")
    payload = make_payload(args.bytes, 1.0)
    rows: list[dict[str, Any]] = []

    def measure(step: str, fn: Callable[[], object]) -> object:
        baseline = release_and_reset_peak()
        started = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - started
        peak = peak_since_reset(baseline)
        rows.append({"step": step, "peak extra MiB": round(peak / MiB), "x payload": round(peak / args.bytes, 2),
                     "s": round(seconds, 2)})
        return result

    held: dict[str, Any] = {}  # results kept alive from one step to the next, then dropped
    measure("snapshot: CPU copy of every tensor", lambda: {n: t.clone() for n, t in payload.items()})
    held["data"] = measure("encode_tensors -> one bytes object", lambda: encode_tensors(payload, {"rank": 0}))
    measure("store.put(bytes)", lambda: store.put("whole", held["data"]))
    held.clear()
    held["got"] = measure("store.get -> bytes", lambda: store.get("whole"))
    measure("decode_tensors(bytes)", lambda: decode_tensors(held["got"], source="whole"))
    held.clear()

    def streamed() -> int:
        size, chunks = encode_stream(payload, {"rank": 0})
        return store.put_stream("streamed", chunks, size=size)

    measure("encode_stream + put_stream", streamed)
    header = read_header(store, "streamed")
    half = header.data_size // 2 // header.chunk_bytes * header.chunk_bytes
    measure("read_data: half of the data (one shard, N=2)", lambda: read_data(store, "streamed", header, 0, half))
    measure("read_data: all of the data", lambda: read_data(store, "streamed", header, 0, header.data_size))
    print(json.dumps({"rows": rows}), flush=True)


# ---------------------------------------------------------------------------------------------- the parent
def child_argv(*extra: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), *extra]


def run_case(store: str, strategy: str, nbytes: int, workdir: str, trace_peak: bool = False,
             compression: str = "none") -> dict[str, Any]:
    """One round of ``strategy`` over ``store`` with WORLD rank processes -> a table row."""
    with store_root(store, workdir) as uri:
        trace = (["--trace-peak"] if trace_peak else []) + ["--compression", compression]
        procs = [subprocess.Popen(child_argv("--rank", str(rank), "--world", str(WORLD), "--uri", uri,
                                             "--strategy", strategy, "--bytes", str(nbytes), *trace),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(WORLD)]
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"{store} {strategy} {nbytes // MiB} MiB: a rank failed:\n{err[-3000:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    for report in reports:
        for line in report.get("peak_stacks", []):
            print(f"  [{store} {strategy} rank {report['rank']}] {line}", file=sys.stderr)
    worst = max(r["peak_extra"] for r in reports)
    ratio = worst / nbytes
    return {"payload MiB": nbytes // MiB, "strategy": strategy, "store": store,
            "peak extra MiB": round(worst / MiB), "x payload": round(ratio, 2),
            f"<= {TARGET}x": "yes" if ratio <= TARGET else "NO",
            "round s": round(max(r["seconds"] for r in reports), 1)}


def run_parts_case(store: str, parts: int, nbytes: int, workdir: str) -> dict[str, Any]:
    """One round of WORLD replicas of ``parts`` local processes each -> a table row (the worst process)."""
    with store_root(store, workdir) as uri:
        procs = [subprocess.Popen(child_argv("--rank", str(rank), "--world", str(WORLD), "--uri", uri, "--parts-of",
                                             str(parts), "--part", str(part), "--bytes", str(nbytes)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(WORLD) for part in range(parts)]
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"{store} parts K={parts} {nbytes // MiB} MiB: a process failed:\n{err[-3000:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    worst = max(r["peak_extra"] for r in reports)
    share = nbytes / parts
    return {"payload MiB": nbytes // MiB, "K": parts, "store": store, "per-process payload MiB": round(share / MiB),
            "peak extra MiB": round(worst / MiB), "x (payload / K)": round(worst / share, 2),
            f"<= {TARGET}x": "yes" if worst / share <= TARGET else "NO",
            "round s": round(max(r["seconds"] for r in reports), 1)}


def run_breakdown(store: str, nbytes: int, workdir: str) -> list[dict[str, Any]]:
    with store_root(store, workdir) as uri:
        proc = subprocess.run(child_argv("--breakdown-child", "--uri", uri, "--bytes", str(nbytes)),
                              capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"breakdown on {store} failed:\n{proc.stderr[-3000:]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    return [{"store": store, "payload MiB": nbytes // MiB, **row} for row in rows]


def machine() -> str:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores, {total:.0f} GiB RAM, Python {platform.python_version()}"


def markdown(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def strategies_available(wanted: Sequence[str]) -> list[str]:
    from diloco.errors import ConfigError

    available = []
    for strategy in wanted:
        try:
            from diloco.collectives.allreduce import create_allreduce

            create_allreduce(f"memory://probe-{uuid.uuid4().hex[:6]}", 0, 1, allreduce=strategy).close()
            available.append(strategy)
        except ConfigError as exc:
            print(f"skipping strategy {strategy}: {exc}", file=sys.stderr)
    return available


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank is not None and args.part is not None:
        parts_main(args)
        return 0
    if args.rank is not None:
        rank_main(args)
        return 0
    if args.breakdown_child:
        breakdown_main(args)
        return 0
    sizes = [256] if args.quick else args.sizes
    # --quick (make bench) still measures the 1 GiB round the issue names, on file:// only (S3 adds minutes).
    extra = [(1024, "file")] if args.quick and "file" in args.stores else []
    notes = [
        "peak extra = VmHWM - VmRSS measured in the rank process around one round (baseline: torch and the store "
        "client imported, payload allocated, one warm-up round done); the worse of the 2 ranks.",
        f"target: at most {TARGET}x the payload. S3 is moto on loopback through real "
        "boto3/s3fs, 50 MiB multipart parts.",
    ]
    with tempfile.TemporaryDirectory(prefix="round-memory-") as workdir:
        if args.breakdown:
            rows = [row for store in args.stores for size in sizes for row in run_breakdown(store, size * MiB, workdir)]
            columns = ["store", "payload MiB", "step", "peak extra MiB", "x payload", "s"]
            result = {"title": "Peak extra memory of each step of a round, alone", "machine": machine(),
                      "columns": columns, "rows": rows, "notes": notes}
        else:
            rows = []
            for size in sizes:
                for strategy in strategies_available(args.strategies):
                    for store in args.stores:
                        print(f"{store} {strategy} {size} MiB ...", file=sys.stderr, flush=True)
                        rows.append(run_case(store, strategy, size * MiB, workdir, args.trace_peak, args.compression))
            for size, store in extra:
                for strategy in strategies_available(args.strategies):
                    print(f"{store} {strategy} {size} MiB ...", file=sys.stderr, flush=True)
                    rows.append(run_case(store, strategy, size * MiB, workdir, args.trace_peak, args.compression))
            parts_rows = []
            parts_stores = ["file"] if args.quick and "file" in args.stores else args.stores  # --quick: no S3
            for parts in args.parts_list:
                for store in parts_stores:
                    print(f"{store} parts K={parts} {sizes[0]} MiB ...", file=sys.stderr, flush=True)
                    parts_rows.append(run_parts_case(store, parts, sizes[0] * MiB, workdir))
            columns = COLUMNS
            notes.append("sharded replicas: N=2 replicas of K local processes, each process holding its rows of the "
                         "payload (FSDP2's cut) and running its own parts round; the worst of the 2K processes, "
                         "against its share of the payload (payload / K).")
            result = {"title": "Peak resident memory of one replica during one all-reduce round (N=2)",
                      "machine": machine(), "columns": columns, "rows": rows, "notes": notes,
                      "tables": [{"title": "Sharded replicas (FSDP2): peak resident memory of each local process "
                                           "during one round of parts (N=2 replicas of K processes)",
                                  "columns": PARTS_COLUMNS, "rows": parts_rows}] if parts_rows else []}
    print(f"## {result['title']}\n\n{result['machine']}\n\n{markdown(columns, rows)}\n")
    for table in result.get("tables", []):
        print(f"## {table['title']}\n\n{markdown(table['columns'], table['rows'])}\n")
    for note in notes:
        print(f"- {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="256 MiB cases, and 1 GiB on file:// only")
    p.add_argument("--full", action="store_true", help="(the default) 256 MiB and 1 GiB")
    p.add_argument("--json", metavar="OUT", help="also write the table as JSON here")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024],
                   help="payload sizes in MiB, comma-separated (default 256,1024)")
    p.add_argument("--strategies", type=lambda s: s.split(","), default=["gather", "sharded"])
    p.add_argument("--stores", type=lambda s: s.split(","), default=["file", "s3"])
    p.add_argument("--parts", dest="parts_list", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 2, 4],
                   help="local processes per sharded replica to measure, comma-separated (default 1,2,4; '' for none)")
    p.add_argument("--breakdown", action="store_true", help="measure each step of a round alone instead")
    p.add_argument("--trace-peak", action="store_true",
                   help="also print where each rank's threads were when its memory peaked")
    # internal: one rank of one case, or the breakdown's process
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=WORLD, help=argparse.SUPPRESS)
    p.add_argument("--uri", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="gather", help=argparse.SUPPRESS)
    p.add_argument("--compression", default="none",
                   help="store.compression of the rounds (default none; a lossy format's mean is not checked)")
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--breakdown-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", type=int, help=argparse.SUPPRESS)
    p.add_argument("--parts-of", dest="parts", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
