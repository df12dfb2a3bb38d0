"""What one all-reduce round costs in bytes and requests per rank, counted at the store layer, gather vs sharded.

Not a test (the latencies depend on the machine; the byte and request counts do not). Why it exists: the
bandwidth-optimal sharded all-reduce should read 2S(N-1)/N per rank per round (S: the payload's bytes on the
wire) instead of gather's (N-1)S, and at large N the request count, not the bytes, meets S3's per-prefix rate
first. So every number here is *counted* by each rank's own ``ObjectStore`` (``ObjectStore.traffic``: bytes
and requests per operation, every retry and multipart part included), subtracted around one round, and averaged
over the ranks, never computed from a formula. The formula is printed next to it: ``bound MiB`` is 2S(N-1)/N and
``read/bound`` says how close a rank came (sharded: 1.00 plus one 64 KiB header probe per peer; gather: N/2).

The ``round s`` column is the slowest rank's round (barrier release to the mean in its tensors), median over the
measured rounds; ``raw s`` is, in the same run on the same store, the ranks writing and reading exactly the bytes
their round wrote and read (plain PUTs of that size, ranged GETs spread over the peers' objects, no encoding,
hashing, polling or phases); ``round/raw`` is the price of the protocol over the bare I/O. ``round CPU s`` and
``raw CPU s`` are the CPU seconds the whole process (all ranks) spent on each: they tell a round that computes
(encodes, decodes, sums and checksums its payload) from one that waits. ``checksum CPU s`` is the share of that
the protocol's integrity check costs at the least: the bytes all ranks wrote and read, at this machine's rate per
core for the chunk checksum rounds write (CRC-32, ``diloco.store.digests``; measured in the same run). Every
written byte is checksummed once and every read byte verified, so a round costs its raw transfer plus that, plus
the codec's work, however the rest is optimised.

For a compressing format, ``raw s`` moves the *compressed* bytes, so ``round/raw`` asks for a codec faster than
the store by the compression ratio (topk's 130x fewer bytes would need a codec ~200x faster than the network for
1.5x), which no codec is. What a format is for is to be cheaper than the bytes it saves: ``fp32 raw s`` is, in the
same run on the same store, the bare transfer of the *uncompressed* payload (the bytes the same strategy's fp32
round at that N wrote and read), and ``round/fp32 raw`` is the compressed round against it: below 1, the format
pays for itself on that store. For ``none`` both columns are the same measurement.

Stores: ``file://`` and loopback S3 move bytes at memory speed (the page cache, or moto in this process), faster
than any codec, so there a round's computation shows in full. ``paced`` is the case where the network, not memory,
is the limit: a ``file://`` store in a RAM-backed folder (``/dev/shm`` where there is one: no disk, so an fsync
costs nothing and the store itself keeps up with any link), whose every rank instance has a link of
``--link-gbs`` GB/s each way (1.2 by default, the per-instance S3 throughput of a 10 Gbit/s instance): each upload
or download holds its direction of the rank's link for bytes / rate (transfers queue behind each other; the copy
itself runs while the link is held, as a NIC's DMA does), and a request costs nothing more (no latency per
request). The round and its raw transfer go over the same kind of link. Its ranks are as many as the cores (2 to
4), so each has a core of its own as a replica on its own instance does: with more ranks than cores a round's
computation (a CRC-32 of every byte at about 4 GiB/s per core, the codecs at 1-4) would be measured on a fraction
of a core against a whole link per rank.

How it runs: ranks are threads of this process (each with its own collective and store instance, so the counts are
per rank), so on a machine with fewer cores than ranks the *latencies* include waiting for a core; the counts do
not. Each rank's torch operations use ``cores // N`` threads (at least 1): N ranks share the process's cores the way
N replica processes would share a machine, instead of each spawning the whole intra-op pool. Stores: a ``file://``
temporary folder, S3 through real boto3/s3fs against moto's server on a loopback port (fake credentials only;
nothing outside a temporary folder and that in-memory server is written), and the paced store (a temporary folder
in RAM).

    python bench/allreduce_traffic.py --quick [--json OUT]     # N = 2, 4, 8; about a minute on 2 cores
    python bench/allreduce_traffic.py [--json OUT]             # bigger payloads, every format on every store

Columns ``PUTs`` / ``GETs`` / ``polls``: requests per rank per round: uploads (``put``, ``put_stream``'s single PUT
or multipart parts), downloads (``get`` and ``get_range``), and existence checks while waiting for peers (HEADs on
S3; they depend on ``--poll-interval`` and on timing, so they are shown apart).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce_round import emit_table, store_root  # noqa: E402 - a sibling bench script: the moto + fake-AWS set-up

from diloco.store.objects import ObjectStore  # noqa: E402 - after the sibling import, like it

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
#: The paced store: ``file://`` in a RAM-backed folder behind a per-rank link of ``--link-gbs`` GB/s each way.
PACED = "paced"
#: Linux's RAM-backed folder, for the paced store (elsewhere the system's temporary folder).
RAM_FOLDER = "/dev/shm"
COLUMNS = ["store", "N", "strategy", "compression", "S MiB", "written MiB", "read MiB", "bound MiB", "read/bound",
           "PUTs", "GETs", "polls", "round s", "raw s", "round/raw", "fp32 raw s", "round/fp32 raw", "round CPU s",
           "raw CPU s", "checksum CPU s"]


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


class Link:
    """One direction of one instance's network link: transfers hold it one after the other at ``bytes_per_s``."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def carry(self, began: float, nbytes: int) -> None:
        """Return when ``nbytes``, sent from ``began`` on (or once the transfers queued before them are through),
        have crossed the link."""
        with self._lock:
            start = max(began, self._free_at)
            self._free_at = done = start + nbytes / self.bytes_per_s
        delay = done - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class PacedStore(ObjectStore):
    """An ``ObjectStore`` whose data transfers cross this instance's own link (``Link``, one per direction): what an
    instance with a network of that bandwidth sees of an object store that keeps up with it. Only bytes are paced;
    requests without data (HEAD, DELETE) cost what the store underneath costs."""

    def __init__(self, uri: str, bytes_per_s: float) -> None:
        super().__init__(uri)
        self.up = Link(bytes_per_s)
        self.down = Link(bytes_per_s)

    def put(self, key: str, data: bytes) -> None:
        began = time.perf_counter()
        super().put(key, data)
        self.up.carry(began, len(data))

    def put_stream(self, key: str, chunks: Any, size: int | None = None) -> int:
        began = time.perf_counter()
        written = super().put_stream(key, chunks, size)
        self.up.carry(began, written)
        return written

    def get(self, key: str) -> bytes:
        began = time.perf_counter()
        data = super().get(key)
        self.down.carry(began, len(data))
        return data

    def get_range(self, key: str, start: int, end: int) -> bytearray:
        began = time.perf_counter()
        data = super().get_range(key, start, end)
        self.down.carry(began, len(data))
        return data

    def get_range_into(self, key: str, start: int, into: bytearray | memoryview) -> int:
        began = time.perf_counter()
        got = super().get_range_into(key, start, into)
        self.down.carry(began, got)
        return got


def open_store(uri: str, link_bytes_per_s: float | None) -> ObjectStore:
    """A rank's store instance: paced when the case runs over a limited link."""
    return PacedStore(uri, link_bytes_per_s) if link_bytes_per_s else ObjectStore(uri)


@contextlib.contextmanager
def case_root(store: str, workdir: str) -> Iterator[str]:
    """A fresh root of ``store``: the paced store's is a temporary folder in RAM (deleted at the end); the others
    are ``allreduce_round.store_root``'s."""
    if store != PACED:
        with store_root(store, workdir) as root:
            yield root
        return
    ram = RAM_FOLDER if os.path.isdir(RAM_FOLDER) and os.access(RAM_FOLDER, os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="diloco-traffic-paced-", dir=ram) as folder:
        yield f"file://{folder}"


@contextlib.contextmanager
def rank_threads(world: int) -> Iterator[int]:
    """torch's intra-op threads for each of ``world`` ranks sharing this process: ``cores // world`` (at least 1),
    restored afterwards. Rank and round threads are started inside, so they take this count (torch gives a new
    thread the process's current setting)."""
    import torch

    before = torch.get_num_threads()
    threads = max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


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


def measure_rounds(uri: str, case: Case, rounds: int, poll_s: float, link: float | None = None
                   ) -> tuple[list[list[RankCount]], list[float], list[float]]:
    """Per measured round: every rank's counts, the slowest rank's round time (after one warm-up round), and the
    CPU seconds all ranks spent on it. ``link``: each rank's store is paced at that many bytes per second."""
    import torch

    from diloco.collectives.allreduce import create_allreduce

    cpu = CpuClock()

    def body(rank: int, barrier: threading.Barrier) -> list[tuple[RankCount, float, float]]:
        out = []
        with create_allreduce(uri, rank, case.world, allreduce=case.strategy, compression=case.compression,
                              timeout_s=TIMEOUT_S, poll_interval_s=poll_s) as ar:
            if link:
                ar.store = open_store(uri, link)  # before the first round: every round uses this instance
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


def measure_raw(uri: str, world: int, written: int, read: int, rounds: int, link: float | None = None
                ) -> tuple[list[float], list[float]]:
    """The same bytes as a round, as bare I/O: each rank PUTs ``written`` bytes, then reads ``read`` bytes as
    ranged GETs spread evenly over its peers' objects. Slowest rank, and the CPU seconds of all ranks, per round."""
    cpu = CpuClock()

    def body(rank: int, barrier: threading.Barrier) -> list[tuple[float, float]]:
        store = open_store(uri, link)
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


def checksum_seconds_per_byte() -> float:
    """CPU seconds the chunk checksum (``diloco.store.digests.crc32_hex``) takes per byte on one core of this
    machine (best of a few runs over 64 MiB): what checking a round's bytes costs at the least."""
    from diloco.store.digests import crc32_hex

    data = bytes(64 * MIB)
    best = float("inf")
    for _ in range(3):
        began = time.thread_time()
        crc32_hex([data])
        best = min(best, time.thread_time() - began)
    return best / len(data)


def row_of(case: Case, counts: list[list[RankCount]], times: list[float], raw: list[float],
           cpu: tuple[list[float], list[float]] = ([], []), fp32_raw: list[float] | None = None,
           checksum_s_per_byte: float | None = None) -> dict[str, Any]:
    flat = [c for per_round in counts for c in per_round]
    mean = lambda f: statistics.fmean(f(c) for c in flat)  # noqa: E731
    s = wire_bytes(case.elements, case.compression)
    bound = 2 * s * (case.world - 1) / case.world
    read = mean(lambda c: c.read)
    round_s, raw_s = statistics.median(times), statistics.median(raw)
    fp32_raw_s = statistics.median(fp32_raw) if fp32_raw else None
    return {"store": case.store, "N": case.world, "strategy": case.strategy, "compression": case.compression,
            "S MiB": round(s / MIB, 2), "written MiB": round(mean(lambda c: c.written) / MIB, 2),
            "read MiB": round(read / MIB, 2), "bound MiB": round(bound / MIB, 2),
            "read/bound": round(read / bound, 3), "PUTs": round(mean(lambda c: c.puts), 1),
            "GETs": round(mean(lambda c: c.gets), 1), "polls": round(mean(lambda c: c.polls), 1),
            "round s": round(round_s, 3), "raw s": round(raw_s, 3), "round/raw": round(round_s / raw_s, 2),
            "fp32 raw s": round(fp32_raw_s, 3) if fp32_raw_s else None,
            "round/fp32 raw": round(round_s / fp32_raw_s, 2) if fp32_raw_s else None,
            "round CPU s": round(statistics.median(cpu[0]), 3) if cpu[0] else None,
            "raw CPU s": round(statistics.median(cpu[1]), 3) if cpu[1] else None,
            "checksum CPU s": round(case.world * (mean(lambda c: c.written) + read) * checksum_s_per_byte, 3)
            if checksum_s_per_byte else None}


def cases(args: argparse.Namespace) -> list[Case]:
    """Every strategy at every N with fp32 on the wire, the compressed formats at the middle N (topk with gather
    only); on the paced store, fp32 and every format at ``paced_world`` only. A store's fp32 cases come before its
    compressed ones: their bytes are the compressed cases' ``fp32 raw``."""
    out = []
    for store in args.stores:
        elements = int((args.s3_payload_mib if store == "s3" else args.payload_mib) * MIB / 4)
        format_world = args.paced_world if store == PACED else args.format_world
        for world in args.world if store != PACED else (args.paced_world,):
            for strategy in STRATEGIES:
                out.append(Case(store, world, strategy, "none", elements))
        for fmt in args.formats if store in args.format_stores else ():
            if fmt != "none":
                for strategy in STRATEGIES:
                    if strategy == "gather" or fmt not in GATHER_ONLY:
                        out.append(Case(store, format_world, strategy, fmt, elements))
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="small payloads, 3 measured rounds (1 on S3), formats on file:// and the paced store")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (make bench reads it)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measured rounds per case, after one warm-up (default 3; --quick: 3, and 1 on S3)")
    p.add_argument("--poll-interval", type=float, default=0.02, help="seconds between polls (default 0.02)")
    p.add_argument("--link-gbs", type=float, default=1.2,
                   help="the paced store's link per rank and direction, GB/s (default 1.2: a 10 Gbit/s instance)")
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    if not args.link_gbs > 0:
        p.error("--link-gbs must be > 0")
    args.stores = ("file", "s3", PACED)
    args.world = WORLDS
    args.format_world = 4
    args.paced_world = max(2, min(args.format_world, os.cpu_count() or 1))  # a core (or more) for every rank
    args.formats = FORMATS
    args.format_stores = ("file", PACED) if args.quick else ("file", "s3", PACED)
    if args.quick:
        args.payload_mib, args.s3_payload_mib = 8.0, 4.0
        # moto rounds take seconds: one measured S3 round keeps make bench's time, and its counts need no more
        args.s3_rounds, args.rounds = args.rounds or 1, args.rounds or 3
    else:
        args.payload_mib, args.s3_payload_mib, args.rounds = 64.0, 16.0, args.rounds or 3
        args.s3_rounds = args.rounds
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    fp32_bytes: dict[tuple[str, int, str], tuple[int, int]] = {}  # (store, N, strategy) -> fp32 written, read
    checksum_s = checksum_seconds_per_byte()
    with tempfile.TemporaryDirectory(prefix="diloco-traffic-bench-") as workdir:
        for store in args.stores:
            link = args.link_gbs * 1e9 if store == PACED else None
            rounds = args.s3_rounds if store == "s3" else args.rounds
            with case_root(store, workdir) as root:
                for i, case in enumerate(c for c in cases(args) if c.store == store):
                    print(f"{store} N={case.world} {case.strategy} {case.compression}", file=sys.stderr, flush=True)
                    with rank_threads(case.world):
                        counts, times, round_cpu = measure_rounds(f"{root}/case{i}", case, rounds,
                                                                  args.poll_interval, link)
                    flat = [c for per_round in counts for c in per_round]
                    written = int(statistics.fmean(c.written for c in flat))
                    read = int(statistics.fmean(c.read for c in flat))
                    raw, raw_cpu = measure_raw(f"{root}/raw{i}", case.world, written, read, rounds, link)
                    fp32_raw: list[float] | None = raw
                    if case.compression == "none":
                        fp32_bytes[(store, case.world, case.strategy)] = (written, read)
                    elif (store, case.world, case.strategy) in fp32_bytes:
                        fp32_written, fp32_read = fp32_bytes[(store, case.world, case.strategy)]
                        fp32_raw, _ = measure_raw(f"{root}/fp32raw{i}", case.world, fp32_written, fp32_read,
                                                  rounds, link)
                    else:  # no fp32 case of this strategy at this N on this store ran
                        fp32_raw = None
                    rows.append(row_of(case, counts, times, raw, (round_cpu, raw_cpu), fp32_raw, checksum_s))
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"
    notes = [
        f"Counted by each rank's ObjectStore (bytes and requests), {args.rounds} round(s) after a warm-up "
        f"({args.s3_rounds} on S3), mean over rounds and ranks.",
        "bound = 2S(N-1)/N with S the payload's bytes on the wire in that format (gather's own figure is "
        "(N-1)S, read/bound = N/2). Objects read by ranges cost one 64 KiB header probe each "
        "(codec.HEADER_PROBE_BYTES): what read/bound above 1.00 (sharded) or N/2 (gather) is.",
        "round s / raw s: slowest rank, median over rounds; raw = the same bytes as plain PUT + ranged GETs on the "
        "same store in the same run (for a compressed format: its compressed bytes). Ranks are threads of one "
        "process, each with cores // N torch threads: latencies include waiting for a core, counts do not.",
        "fp32 raw s: the bare transfer of the uncompressed payload (the bytes the fp32 round of the same strategy "
        "and N wrote and read) on the same store in the same run; round/fp32 raw below 1 means the format made the "
        "round cheaper than sending fp32 would be. round/raw of a compressed format asks its codec to beat the store "
        "by the compression ratio as well (topk: 130x), which on memory-speed stores no codec can.",
        "round CPU s / raw CPU s: CPU seconds of the whole process (every rank) per round, median: where round s "
        "exceeds raw s by about what round CPU s exceeds raw CPU s over the cores, the round is computing "
        "(encoding, decoding, summing, checksumming every byte), not waiting on the protocol.",
        f"checksum CPU s: what the CRC-32 of the bytes every rank wrote and read costs at this machine's rate, "
        f"{1 / checksum_s / 2**30:.2f} GiB/s per core (measured in this run): every byte a round writes is "
        "checksummed once and every byte it reads verified, which a bare transfer does not do. round CPU s is about "
        "raw CPU s + checksum CPU s + the codec's work.",
        f"Stores: file:// (the page cache, fsync to disk) and S3 (moto on loopback, in this process) move bytes at "
        f"memory speed; paced = file:// in RAM behind a {args.link_gbs:g} GB/s link per rank and direction (bytes "
        "paced, no latency per request): where the network, not memory, is the limit.",
        f"payload {args.payload_mib:g} MiB fp32 on file:// and paced, {args.s3_payload_mib:g} MiB on S3; compressed "
        f"formats at N={args.format_world} ({args.paced_world} on the paced store, a core or more per rank) on "
        f"{', '.join(args.format_stores)}. 1-minute load average when it "
        f"started: {load:.2f} on {os.cpu_count()} CPUs. Total {time.perf_counter() - started:.0f} s.",
    ]
    title = "All-reduce traffic per rank per round: gather vs sharded, counted at the store layer"
    emit_table(title, machine, COLUMNS, rows, notes, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
