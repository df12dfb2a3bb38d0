"""What one all-reduce round costs in bytes and requests per rank, counted at the store layer, gather vs sharded.

Not a test (the latencies depend on the machine; the byte and request counts do not). Why it exists: issue 12 asks
for the bandwidth-optimal sharded all-reduce to read 2S(N-1)/N per rank per round (S: the payload's bytes on the
wire) instead of gather's (N-1)S, and warns that at large N the request count, not the bytes, meets S3's per-prefix
rate first. So every number here is *counted* by each rank's own ``ObjectStore`` (``ObjectStore.traffic``: bytes
and requests per operation, every retry and multipart part included), subtracted around one round, and averaged
over the ranks, never computed from a formula. The formula is printed next to it: ``bound MiB`` is 2S(N-1)/N and
``read/bound`` says how close a rank came (sharded: 1.00 plus one 64 KiB header probe per peer; gather: N/2).

The ``round s`` column is the slowest rank's round (barrier release to the mean in its tensors), median over the
measured rounds; ``raw s`` is, in the same run on the same store, the ranks writing and reading exactly the bytes
their round wrote and read (plain PUTs of that size, ranged GETs spread over the peers' objects, no encoding,
hashing, polling or phases); ``round/raw`` is the price of the protocol over the bare I/O. ``round CPU s`` and
``raw CPU s`` are the CPU seconds the whole process (all ranks) spent on each: they tell a round that computes
(encodes, decodes, sums and hashes its payload) from one that waits.

How it runs: ranks are threads of this process (each with its own collective and store instance, so the counts are
per rank), so on a machine with fewer cores than ranks the *latencies* include waiting for a core; the counts do
not. Stores: a ``file://`` temporary folder, and S3 through real boto3/s3fs against moto's server on a loopback
port (fake credentials only; nothing outside a temporary folder and that in-memory server is written).

    python bench/allreduce_traffic.py --quick [--json OUT]     # N = 2, 4, 8; about a minute on 2 cores
    python bench/allreduce_traffic.py [--json OUT]             # bigger payloads, every format on both stores

Columns ``PUTs`` / ``GETs`` / ``polls``: requests per rank per round: uploads (``put``, ``put_stream``'s single PUT
or multipart parts), downloads (``get`` and ``get_range``), and existence checks while waiting for peers (HEADs on
S3; they depend on ``--poll-interval`` and on timing, so they are shown apart).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce_round import emit_table, store_root  # noqa: E402 - a sibling bench script: the moto + fake-AWS set-up

MIB = 2**20
WORLDS = (2, 4, 8)
STRATEGIES = ("gather", "sharded")
FORMATS = ("none", "bf16", "int8", "int4", "topk")
#: The sparse format goes with gather only (the sharded strategy refuses it: it would re-sparsify reduced shards).
GATHER_ONLY = ("topk",)
PUT_OPS = ("put", "put_if_absent", "put_stream", "create_multipart", "put_part", "complete_multipart")
GET_OPS = ("get", "get_range")
POLL_OPS = ("exists",)
TIMEOUT_S = 300.0
COLUMNS = ["store", "N", "strategy", "compression", "S MiB", "written MiB", "read MiB", "bound MiB", "read/bound",
           "PUTs", "GETs", "polls", "round s", "raw s", "round/raw", "round CPU s", "raw CPU s"]


@dataclass(frozen=True)
class Case:
    store: str
    world: int
    strategy: str
    compression: str
    elements: int


@dataclass(frozen=True)
class RankCount:
    """What one rank's store counted during one round."""

    written: int
    read: int
    puts: int
    gets: int
    polls: int


def count(traffic: Any) -> RankCount:
    req = traffic.requests
    return RankCount(traffic.bytes_written, traffic.bytes_read, sum(req.get(op, 0) for op in PUT_OPS),
                     sum(req.get(op, 0) for op in GET_OPS), sum(req.get(op, 0) for op in POLL_OPS))


def run_threads(world: int, body: Callable[[int, threading.Barrier], Any]) -> list[Any]:
    """``body(rank, barrier)`` on one thread per rank; results in rank order, the first error re-raised."""
    barrier = threading.Barrier(world, timeout=TIMEOUT_S)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, barrier)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    if errors:
        raise errors[0]
    return results


class CpuClock:
    """CPU seconds of this whole process (every rank's threads) between the barrier that starts a round and the
    one after it: what a round costs in computation, whatever else runs on the machine."""

    def __init__(self) -> None:
        self.marks: dict[int, list[float]] = {}

    def mark(self, round_: int, arrival: int) -> None:
        """Called by every rank after a barrier; the one that arrived first (index 0) reads the clock."""
        if arrival == 0:
            self.marks.setdefault(round_, []).append(time.process_time())

    def seconds(self, round_: int) -> float:
        start, end = self.marks[round_]
        return end - start


def measure_rounds(uri: str, case: Case, rounds: int, poll_s: float
                   ) -> tuple[list[list[RankCount]], list[float], list[float]]:
    """Per measured round: every rank's counts, the slowest rank's round time (after one warm-up round), and the
    CPU seconds all ranks spent on it."""
    import torch

    from diloco.collectives.allreduce import create_allreduce

    cpu = CpuClock()

    def body(rank: int, barrier: threading.Barrier) -> list[tuple[RankCount, float, float]]:
        out = []
        with create_allreduce(uri, rank, case.world, allreduce=case.strategy, compression=case.compression,
                              timeout_s=TIMEOUT_S, poll_interval_s=poll_s) as ar:
            for k in range(1 + rounds):
                t = torch.randn(case.elements, generator=torch.Generator().manual_seed(rank * 1000 + k))
                cpu.mark(k, barrier.wait())
                before, started = ar.store.traffic, time.perf_counter()
                ar.allreduce({"g": t})
                ended = time.perf_counter()
                cpu.mark(k, barrier.wait())  # after the timing: every rank is done with round k
                if k:
                    out.append((count(ar.store.traffic - before), started, ended))
        return out

    per_rank = run_threads(case.world, body)
    counts = [[per_rank[r][k][0] for r in range(case.world)] for k in range(rounds)]
    times = [max(per_rank[r][k][2] for r in range(case.world)) - min(per_rank[r][k][1] for r in range(case.world))
             for k in range(rounds)]
    return counts, times, [cpu.seconds(k) for k in range(1, 1 + rounds)]


def measure_raw(uri: str, world: int, written: int, read: int, rounds: int) -> tuple[list[float], list[float]]:
    """The same bytes as a round, as bare I/O: each rank PUTs ``written`` bytes, then reads ``read`` bytes as
    ranged GETs spread evenly over its peers' objects. Slowest rank, and the CPU seconds of all ranks, per round."""
    from diloco.store.objects import ObjectStore

    cpu = CpuClock()

    def body(rank: int, barrier: threading.Barrier) -> list[tuple[float, float]]:
        store = ObjectStore(uri)
        data = bytes([rank % 256]) * written
        per_peer = read // max(world - 1, 1)
        out = []
        for k in range(1 + rounds):
            cpu.mark(k, barrier.wait())
            started = time.perf_counter()
            store.put(f"raw/{k}/{rank}", data)
            barrier.wait()  # every object exists before anyone reads (a round's polling, without the polls)
            for peer in range(world):
                if peer != rank:
                    store.get_range(f"raw/{k}/{peer}", 0, per_peer)
            ended = time.perf_counter()
            cpu.mark(k, barrier.wait())  # after the timing: every rank is done with round k
            if k:
                out.append((started, ended))
        return out

    per_rank = run_threads(world, body)
    return ([max(per_rank[r][k][1] for r in range(world)) - min(per_rank[r][k][0] for r in range(world))
             for k in range(rounds)], [cpu.seconds(k) for k in range(1, 1 + rounds)])


def wire_bytes(elements: int, fmt: str) -> int:
    import torch

    from diloco.collectives import compression

    return compression.wire_nbytes({"g": ((elements,), torch.float32)}, fmt)


def row_of(case: Case, counts: list[list[RankCount]], times: list[float], raw: list[float],
           cpu: tuple[list[float], list[float]] = ([], [])) -> dict[str, Any]:
    flat = [c for per_round in counts for c in per_round]
    mean = lambda f: statistics.fmean(f(c) for c in flat)  # noqa: E731
    s = wire_bytes(case.elements, case.compression)
    bound = 2 * s * (case.world - 1) / case.world
    read = mean(lambda c: c.read)
    round_s, raw_s = statistics.median(times), statistics.median(raw)
    return {"store": case.store, "N": case.world, "strategy": case.strategy, "compression": case.compression,
            "S MiB": round(s / MIB, 2), "written MiB": round(mean(lambda c: c.written) / MIB, 2),
            "read MiB": round(read / MIB, 2), "bound MiB": round(bound / MIB, 2),
            "read/bound": round(read / bound, 3), "PUTs": round(mean(lambda c: c.puts), 1),
            "GETs": round(mean(lambda c: c.gets), 1), "polls": round(mean(lambda c: c.polls), 1),
            "round s": round(round_s, 3), "raw s": round(raw_s, 3), "round/raw": round(round_s / raw_s, 2),
            "round CPU s": round(statistics.median(cpu[0]), 3) if cpu[0] else None,
            "raw CPU s": round(statistics.median(cpu[1]), 3) if cpu[1] else None}


def cases(args: argparse.Namespace) -> list[Case]:
    """Every strategy at every N with fp32 on the wire; the compressed formats at the middle N (each store; topk
    with gather only)."""
    out = []
    for store in args.stores:
        elements = int(args.payload_mib * MIB / 4) if store == "file" else int(args.s3_payload_mib * MIB / 4)
        for world in args.world:
            for strategy in STRATEGIES:
                out.append(Case(store, world, strategy, "none", elements))
        for fmt in args.formats if store in args.format_stores else ():
            if fmt != "none":
                for strategy in STRATEGIES:
                    if strategy == "gather" or fmt not in GATHER_ONLY:
                        out.append(Case(store, args.format_world, strategy, fmt, elements))
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small payloads, 1 measured round, formats on file:// only")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (make bench reads it)")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds per case (after one warm-up)")
    p.add_argument("--poll-interval", type=float, default=0.02, help="seconds between polls (default 0.02)")
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    args.stores = ("file", "s3")
    args.world = WORLDS
    args.format_world = 4
    args.formats = FORMATS
    args.format_stores = ("file",) if args.quick else ("file", "s3")
    if args.quick:
        args.payload_mib, args.s3_payload_mib, args.rounds = 8.0, 4.0, args.rounds or 1
    else:
        args.payload_mib, args.s3_payload_mib, args.rounds = 64.0, 16.0, args.rounds or 3
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="diloco-traffic-bench-") as workdir:
        for store in args.stores:
            with store_root(store, workdir) as root:
                for i, case in enumerate(c for c in cases(args) if c.store == store):
                    print(f"{store} N={case.world} {case.strategy} {case.compression}", file=sys.stderr, flush=True)
                    uri = f"{root}/case{i}"
                    counts, times, round_cpu = measure_rounds(uri, case, args.rounds, args.poll_interval)
                    flat = [c for per_round in counts for c in per_round]
                    raw, raw_cpu = measure_raw(f"{root}/raw{i}", case.world,
                                               int(statistics.fmean(c.written for c in flat)),
                                               int(statistics.fmean(c.read for c in flat)), args.rounds)
                    rows.append(row_of(case, counts, times, raw, (round_cpu, raw_cpu)))
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"
    notes = [
        "Counted by each rank's ObjectStore (bytes and requests), one round after a warm-up, mean over ranks.",
        "bound = 2S(N-1)/N with S the payload's bytes on the wire in that format (gather's own figure is "
        "(N-1)S, read/bound = N/2). Objects read by ranges cost one 64 KiB header probe each "
        "(codec.HEADER_PROBE_BYTES): what read/bound above 1.00 (sharded) or N/2 (gather) is.",
        "round s / raw s: slowest rank, median; raw = the same bytes as plain PUT + ranged GETs on the same store "
        "in the same run. Ranks are threads of one process: latencies include waiting for a core, counts do not.",
        "round CPU s / raw CPU s: CPU seconds of the whole process (every rank) per round, median: where round s "
        "exceeds raw s by about what round CPU s exceeds raw CPU s over the cores, the round is computing "
        "(encoding, decoding, summing, hashing every byte), not waiting on the protocol.",
        f"payload {args.payload_mib:g} MiB fp32 on file://, {args.s3_payload_mib:g} MiB on S3 (moto on loopback); "
        f"compressed formats at N={args.format_world} on {', '.join(args.format_stores)}. "
        f"Total {time.perf_counter() - started:.0f} s.",
    ]
    title = "All-reduce traffic per rank per round: gather vs sharded, counted at the store layer"
    emit_table(title, machine, COLUMNS, rows, notes, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
