"""What one all-reduce round of ``ObjectStoreAllReduce`` costs, over a file:// store and over a real S3 API.

Not a test (timings depend on the machine). Why it exists: DiLoCo trades NCCL for an object store, so the price
of a round (encode + checksum + PUT, poll, N-1 GETs + decode + checksum, fp32 mean) is what decides how large
``sync_every`` must be for communication to stay small next to H inner steps. This bench measures that price
for world sizes {2, 4} and pseudo-gradients of {1, 16, 64} MiB, and how much of it ``allreduce_async`` hides
behind compute.

How it runs: every rank is its own spawned Python process (threads would share one GIL and serialise the
encoding, hashing and decoding that dominate a round), with one torch thread each. The ranks of a world start
each round together (a multiprocessing barrier, outside the timed region), so process start-up and clock skew
are not measured. Each configuration first runs one warm-up round (connections, first-touch allocations), then
``--rounds`` measured rounds. Stores: a ``file://`` temporary directory, and S3 through real boto3/s3fs
against moto's server, which this script starts on a free loopback port in a thread of its own (main) process
and stops at the end, with fake credentials only (``AWS_ACCESS_KEY_ID=testing``...; the user's AWS config and
credential files are hidden from the ranks). Nothing outside a fresh temporary directory and that in-memory
server is written.

    .venv/bin/python bench/allreduce_round.py            # the default: about 2-3 minutes on 2 cores
    .venv/bin/python bench/allreduce_round.py --quick    # small sizes, under a minute
    .venv/bin/python bench/allreduce_round.py --stores s3 --world 4 --sizes 64 --rounds 5

How to read the first table (one row per store x world x size):

* ``wall s``: median over rounds of the slowest rank's ``allreduce(t)`` time, barrier release -> mean in ``t``.
  A round is only done when the last rank has the mean, hence the slowest rank.
* ``best s``: the fastest of those rounds; far below ``wall s`` means the machine was busy (other jobs).
* ``wait s``: median over rounds of the mean over ranks of ``ar.stats.seconds_blocked``: time inside
  ``wait()`` (own upload, polling, reading, averaging). For a blocking ``allreduce`` it is almost all of
  ``wall s``; the rest is the CPU snapshot taken when the round starts.
* ``W MiB`` / ``R MiB``: bytes written / read per rank per round (from ``ar.stats``); ``R=(N-1)W`` says whether
  every rank read exactly N-1 peer objects of its own object's size in every round (``yes``) or not (``NO``).
* ``payload MiB/s``: tensor MiB / ``wall s``, the rate at which a replica's pseudo-gradient gets averaged
  (comparable across world sizes: it falls as N grows because every rank reads N-1 objects).
* ``I/O MiB/s``: (W + R) / ``wall s``, the store traffic one rank sustains.
* The S3 rows measure the S3 protocol path (HTTP, SigV4, s3fs/botocore) plus moto, a single-process Python
  server that shares this machine's cores with the ranks: treat them as a floor for the client-side cost, not as
  AWS throughput. ``--poll-interval`` (default 0.05 s) bounds how late a rank notices a peer's object; real runs
  use ``store.poll_interval_s`` (1 s by default), which adds up to that much per round.

How to read the second table (one size, ``--overlap-size``, per store x world): each round does
``allreduce(t); compute()`` (``blocking+compute s``) and ``work = allreduce_async(t); compute(); work.wait()``
(``async+compute s``), slowest rank, median over rounds. ``compute s`` is the simulated compute: by default as
long as rank 0's median blocking round of that configuration (about ``wall s``), so a perfect overlap would
hide the whole round; ``--overlap-compute-s`` fixes it. ``saved s`` is the difference of the two totals and
``hidden %`` its share of the blocking round (``blocking+compute s`` minus ``compute s``, same rounds); ``wait
s`` is what ``work.wait()`` still blocked for after the compute (mean over ranks). The whole round (upload,
polling, the peers' reads and the reduction) runs on a background thread, so a compute as long as the round can
hide all of it; ``wait()`` then only copies the mean back. ``--compute sleep`` (default) models a GPU step that leaves the
CPU free; ``--compute matmul`` runs a fixed number of single-threaded CPU matmuls calibrated to last ``compute
s`` when every rank computes at once (then ``compute s`` is measured, not set), so it competes with the
encoding, hashing and I/O for the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.context import SpawnContext
    from multiprocessing.queues import Queue
    from multiprocessing.sharedctypes import Synchronized
    from multiprocessing.synchronize import Barrier

    from diloco.collectives.allreduce import ObjectStoreAllReduce

MIB = 2**20
DEFAULT_SIZES_MIB = (1.0, 16.0, 64.0)
QUICK_SIZES_MIB = (0.25, 1.0)
DEFAULT_WORLDS = (2, 4)
DEFAULT_ROUNDS = 3
QUICK_ROUNDS = 2
WARMUP_ROUNDS = 1
STORES = ("file", "s3")
DTYPES = ("float32", "bfloat16", "float16", "float64")
BUCKET = "diloco-bench"
REGION = "us-east-1"
#: Per-rank bound on one all-reduce wait or barrier (a hung rank fails the bench instead of stalling it).
RANK_TIMEOUT_S = 300.0
#: Variables that could route the ranks to a real AWS account or change retries behind the bench's back.
AWS_VARIABLES_TO_CLEAR = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_STS", "AWS_ENDPOINT_URL_IAM",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "DILOCO_S3_URI",
)


# ---------------------------------------------------------------- what a rank process runs
@dataclass(frozen=True)
class RankJob:
    """Everything one rank process needs (picklable: it crosses the spawn boundary)."""

    root_uri: str
    rank: int
    world_size: int
    sizes_mib: tuple[float, ...]
    dtype_name: str
    rounds: int
    poll_interval_s: float
    overlap_size_mib: float | None
    compute_mode: str
    fixed_compute_s: float  # 0: as long as this configuration's median blocking round
    strategy: str = "gather"  # store.allreduce: gather or sharded


@dataclass(frozen=True)
class RoundSample:
    """One rank's view of one measured round."""

    wall_s: float
    blocked_s: float
    bytes_written: int
    bytes_read: int


@dataclass(frozen=True)
class OverlapSample:
    """One rank's view of one overlap round: compute alone, blocking then compute, async around compute."""

    compute_alone_s: float
    blocking_then_compute_s: float
    async_around_compute_s: float
    async_wait_blocked_s: float


def size_label(size_mib: float) -> str:
    return f"{size_mib:g}mib"


def rank_main(job: RankJob, barrier: Barrier, results: Queue[Any], shared_compute_s: Synchronized[float]) -> None:
    """Entry point of a rank process: measure every size, then the overlap size; report through ``results``."""
    try:
        import torch

        torch.set_num_threads(1)  # one core's worth per rank, as N replicas on N machines would each have
        from diloco.collectives.allreduce import create_allreduce

        dtype = getattr(torch, job.dtype_name)
        for size_mib in job.sizes_mib:
            numel = max(1, int(size_mib * MIB) // dtype.itemsize)
            tensor = torch.empty(numel, dtype=dtype)
            uri = f"{job.root_uri}/w{job.world_size}-{size_label(size_mib)}"
            with create_allreduce(uri, job.rank, job.world_size, allreduce=job.strategy, timeout_s=RANK_TIMEOUT_S,
                                  poll_interval_s=job.poll_interval_s) as allreduce:
                samples = [measure_blocking_round(allreduce, tensor, barrier, job)
                           for _ in range(WARMUP_ROUNDS + job.rounds)][WARMUP_ROUNDS:]
            results.put(("rounds", job.rank, size_mib, samples))
            if size_mib == job.overlap_size_mib:
                compute_s = agree_on_compute_seconds(job, samples, barrier, shared_compute_s)
                overlap = measure_overlap(job, tensor, compute_s, barrier, f"{uri}-overlap")
                results.put(("overlap", job.rank, size_mib, overlap))
            del tensor
        results.put(("done", job.rank, None, None))
    except BaseException:
        results.put(("error", job.rank, None, traceback.format_exc()))
        barrier.abort()  # release the peers waiting at the barrier at once
        raise SystemExit(1) from None


def fill_and_check(tensor: Any, rank: int) -> Callable[[int], None]:
    """Fill ``tensor`` with ``rank + 1``; the returned check asserts it now holds the mean ``(N + 1) / 2``."""
    tensor.fill_(rank + 1)

    def check(world_size: int) -> None:
        want = (world_size + 1) / 2
        got = (float(tensor[0]), float(tensor[-1]))
        if got != (want, want):
            raise AssertionError(f"rank {rank}: all-reduce gave {got}, expected the mean {want}")

    return check


def measure_blocking_round(allreduce: ObjectStoreAllReduce, tensor: Any, barrier: Barrier,
                           job: RankJob) -> RoundSample:
    check = fill_and_check(tensor, job.rank)
    before = allreduce.stats
    barrier.wait(RANK_TIMEOUT_S)
    started = time.perf_counter()
    allreduce.allreduce([tensor])
    wall_s = time.perf_counter() - started
    after = allreduce.stats
    check(job.world_size)
    return RoundSample(
        wall_s=wall_s,
        blocked_s=after.seconds_blocked - before.seconds_blocked,
        bytes_written=after.bytes_written - before.bytes_written,
        bytes_read=after.bytes_read - before.bytes_read,
    )


def agree_on_compute_seconds(job: RankJob, samples: Sequence[RoundSample], barrier: Barrier,
                             shared_compute_s: Synchronized[float]) -> float:
    """Every rank simulates the same compute time: ``--overlap-compute-s``, else rank 0's median round."""
    if job.rank == 0:
        shared_compute_s.value = job.fixed_compute_s or statistics.median(s.wall_s for s in samples)
    barrier.wait(RANK_TIMEOUT_S)
    return float(shared_compute_s.value)


def make_compute(mode: str, seconds: float, barrier: Barrier) -> Callable[[], None]:
    """``seconds`` of simulated compute: a sleep (CPU free, like a GPU step) or a fixed number of CPU matmuls."""
    if mode == "sleep":
        return lambda: time.sleep(seconds)
    import torch

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    out = torch.empty(256, 256)
    barrier.wait(RANK_TIMEOUT_S)  # calibrate while every rank calibrates: the same contention as when measured
    iterations, started = 0, time.perf_counter()
    while time.perf_counter() - started < 0.3:
        torch.mm(a, b, out=out)
        iterations += 1
    per_iteration_s = (time.perf_counter() - started) / iterations
    calibrated = max(1, round(seconds / per_iteration_s))

    def matmuls() -> None:
        for _ in range(calibrated):
            torch.mm(a, b, out=out)

    return matmuls


def measure_overlap(job: RankJob, tensor: Any, compute_s: float, barrier: Barrier,
                    uri: str) -> list[OverlapSample]:
    from diloco.collectives.allreduce import create_allreduce

    compute = make_compute(job.compute_mode, compute_s, barrier)
    samples: list[OverlapSample] = []
    with create_allreduce(uri, job.rank, job.world_size, allreduce=job.strategy, timeout_s=RANK_TIMEOUT_S,
                          poll_interval_s=job.poll_interval_s) as allreduce:
        measure_blocking_round(allreduce, tensor, barrier, job)  # warm-up
        for _ in range(job.rounds):
            compute_alone_s = compute_s
            if job.compute_mode != "sleep":
                barrier.wait(RANK_TIMEOUT_S)
                started = time.perf_counter()
                compute()
                compute_alone_s = time.perf_counter() - started

            check = fill_and_check(tensor, job.rank)
            barrier.wait(RANK_TIMEOUT_S)
            started = time.perf_counter()
            allreduce.allreduce([tensor])
            compute()
            blocking_then_compute_s = time.perf_counter() - started
            check(job.world_size)

            check = fill_and_check(tensor, job.rank)
            before = allreduce.stats
            barrier.wait(RANK_TIMEOUT_S)
            started = time.perf_counter()
            work = allreduce.allreduce_async([tensor])
            compute()
            work.wait()
            async_around_compute_s = time.perf_counter() - started
            check(job.world_size)
            samples.append(OverlapSample(
                compute_alone_s=compute_alone_s,
                blocking_then_compute_s=blocking_then_compute_s,
                async_around_compute_s=async_around_compute_s,
                async_wait_blocked_s=allreduce.stats.seconds_blocked - before.seconds_blocked,
            ))
    return samples


# ---------------------------------------------------------------- the driver (main process)
@dataclass(frozen=True)
class RoundRow:
    store: str
    world_size: int
    size_mib: float
    rounds: int
    wall_s: float
    best_wall_s: float
    wait_s: float
    written_mib: float
    read_mib: float
    read_is_n_minus_1_times_written: bool

    @property
    def payload_mib_per_s(self) -> float:
        return self.size_mib / self.wall_s

    @property
    def io_mib_per_s(self) -> float:
        return (self.written_mib + self.read_mib) / self.wall_s


@dataclass(frozen=True)
class OverlapRow:
    store: str
    world_size: int
    size_mib: float
    compute_s: float
    blocking_then_compute_s: float
    async_around_compute_s: float
    async_wait_s: float

    @property
    def saved_s(self) -> float:
        return self.blocking_then_compute_s - self.async_around_compute_s

    @property
    def hidden_percent(self) -> float:
        """Share of the blocking round (blocking+compute minus compute, same phase) that the overlap hid."""
        return 100 * self.saved_s / max(self.blocking_then_compute_s - self.compute_s, 1e-9)


def summarize_rounds(store: str, world_size: int, size_mib: float,
                     per_rank: dict[int, list[RoundSample]]) -> RoundRow:
    """Slowest rank per round for wall time, mean over ranks for blocked time; medians over rounds."""
    rounds = len(per_rank[0])
    by_round = [[per_rank[rank][i] for rank in range(world_size)] for i in range(rounds)]
    slowest_rank_wall_s = [max(s.wall_s for s in ranks) for ranks in by_round]
    every = [s for samples in per_rank.values() for s in samples]
    read_ok = all(s.bytes_read == (world_size - 1) * s.bytes_written for s in every)
    return RoundRow(
        store=store, world_size=world_size, size_mib=size_mib, rounds=rounds,
        wall_s=statistics.median(slowest_rank_wall_s),
        best_wall_s=min(slowest_rank_wall_s),
        wait_s=statistics.median(statistics.fmean(s.blocked_s for s in ranks) for ranks in by_round),
        written_mib=statistics.median(s.bytes_written for s in every) / MIB,
        read_mib=statistics.median(s.bytes_read for s in every) / MIB,
        read_is_n_minus_1_times_written=read_ok,
    )


def summarize_overlap(store: str, world_size: int, size_mib: float,
                      per_rank: dict[int, list[OverlapSample]]) -> OverlapRow:
    rounds = len(per_rank[0])
    by_round = [[per_rank[rank][i] for rank in range(world_size)] for i in range(rounds)]
    return OverlapRow(
        store=store, world_size=world_size, size_mib=size_mib,
        compute_s=statistics.median(max(s.compute_alone_s for s in ranks) for ranks in by_round),
        blocking_then_compute_s=statistics.median(max(s.blocking_then_compute_s for s in ranks)
                                                  for ranks in by_round),
        async_around_compute_s=statistics.median(max(s.async_around_compute_s for s in ranks)
                                                 for ranks in by_round),
        async_wait_s=statistics.median(statistics.fmean(s.async_wait_blocked_s for s in ranks)
                                       for ranks in by_round),
    )


def run_world(ctx: SpawnContext, store: str, root_uri: str, world_size: int,
              args: argparse.Namespace) -> tuple[list[RoundRow], list[OverlapRow]]:
    """Spawn ``world_size`` rank processes that measure every size in turn; collect and summarize their reports."""
    barrier = ctx.Barrier(world_size)
    results: Queue[Any] = ctx.Queue()
    shared_compute_s = ctx.Value("d", 0.0)
    processes = [
        ctx.Process(
            target=rank_main,
            args=(RankJob(root_uri=root_uri, rank=rank, world_size=world_size, sizes_mib=tuple(args.sizes),
                          dtype_name=args.dtype, rounds=args.rounds, poll_interval_s=args.poll_interval,
                          overlap_size_mib=args.overlap_size, compute_mode=args.compute,
                          fixed_compute_s=args.overlap_compute_s, strategy=args.strategy),
                  barrier, results, shared_compute_s),
            name=f"allreduce-bench-rank{rank}",
        )
        for rank in range(world_size)
    ]
    round_reports: dict[float, dict[int, list[RoundSample]]] = {}
    overlap_reports: dict[int, list[OverlapSample]] = {}
    done: set[int] = set()
    try:
        for process in processes:
            process.start()
        while len(done) < world_size:
            try:
                kind, rank, size_mib, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{dead[0].name} exited with {dead[0].exitcode} without reporting") from None
                continue
            if kind == "error":
                raise RuntimeError(f"{store} world {world_size}: rank {rank} failed:\n{payload}")
            if kind == "rounds":
                round_reports.setdefault(size_mib, {})[rank] = payload
                if len(round_reports[size_mib]) == world_size:
                    progress(f"  {store} world {world_size} {size_mib:g} MiB: done")
            elif kind == "overlap":
                overlap_reports[rank] = payload
            elif kind == "done":
                done.add(rank)
        for process in processes:
            process.join(timeout=30)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
    round_rows = [summarize_rounds(store, world_size, size, round_reports[size]) for size in args.sizes]
    overlap_rows = []
    if overlap_reports:
        overlap_rows.append(summarize_overlap(store, world_size, args.overlap_size, overlap_reports))
    return round_rows, overlap_rows


@contextlib.contextmanager
def fake_aws_environment(endpoint: str, workdir: str) -> Iterator[None]:
    """Point this process (and so the ranks it spawns) at ``endpoint`` with fake credentials; restore afterwards."""
    saved = dict(os.environ)
    for name in AWS_VARIABLES_TO_CLEAR:
        os.environ.pop(name, None)
    os.environ.update({
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": os.path.join(workdir, "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": os.path.join(workdir, "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    })
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def store_root(store: str, workdir: str) -> Iterator[str]:
    """A fresh rendezvous root of one store: a folder under ``workdir``, or a bucket on a loopback moto server
    (shared by every bench script that needs one: allreduce_traffic, overlap, round_memory)."""
    if store == "file":
        root = os.path.join(workdir, f"file-store-{uuid.uuid4().hex[:8]}")
        os.makedirs(root)
        try:
            yield f"file://{root}"
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    from moto.server import ThreadedMotoServer

    # No line per request (and no time spent writing it), and no traceback per failed request: a retried
    # CompleteMultipartUpload of a large object (its first attempt outlived the client's read timeout) fails there
    # by design and is resolved client-side (diloco.store.s3).
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()  # a thread of this process: it outlives every rank process of every world
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        with fake_aws_environment(endpoint, workdir):
            import boto3

            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
            yield f"s3://{BUCKET}/allreduce-round-{uuid.uuid4().hex[:8]}"
    finally:
        server.stop()  # moto keeps objects in memory: stopping it frees them


def emit_table(title: str, machine: str, columns: Sequence[str], rows: Sequence[dict[str, Any]],
               notes: Sequence[str], json_path: str | None) -> None:
    """Print a bench result as markdown and, with ``json_path``, write it in ``bench/run_all.py``'s format
    (``{"title", "machine", "columns", "rows", "notes"}``): the one output of the bench scripts that import this."""
    import json

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    print(f"{title} ({machine})\n")
    print("\n".join(lines))
    print("\n" + "\n".join(f"- {n}" for n in notes))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"title": title, "machine": machine, "columns": list(columns), "rows": list(rows),
                       "notes": list(notes)}, f, indent=2)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def print_round_table(rows: Sequence[RoundRow]) -> None:
    print(f"{'store':<5} {'N':>2} {'size MiB':>8} {'wall s':>7} {'best s':>7} {'wait s':>7} {'W MiB':>7} "
          f"{'R MiB':>7} {'R=(N-1)W':>8} {'payload MiB/s':>13} {'I/O MiB/s':>9}")
    for row in rows:
        print(f"{row.store:<5} {row.world_size:>2} {row.size_mib:>8g} {row.wall_s:>7.3f} {row.best_wall_s:>7.3f} "
              f"{row.wait_s:>7.3f} {row.written_mib:>7.2f} {row.read_mib:>7.2f} "
              f"{'yes' if row.read_is_n_minus_1_times_written else 'NO':>8} "
              f"{row.payload_mib_per_s:>13.1f} {row.io_mib_per_s:>9.1f}")


def print_overlap_table(rows: Sequence[OverlapRow], compute_mode: str) -> None:
    print(f"{'store':<5} {'N':>2} {'size MiB':>8} {f'compute s ({compute_mode})':>19} {'blocking+compute s':>18} "
          f"{'async+compute s':>15} {'saved s':>7} {'hidden %':>8} {'wait s':>7}")
    for row in rows:
        print(f"{row.store:<5} {row.world_size:>2} {row.size_mib:>8g} {row.compute_s:>19.3f} "
              f"{row.blocking_then_compute_s:>18.3f} {row.async_around_compute_s:>15.3f} {row.saved_s:>7.3f} "
              f"{row.hidden_percent:>8.0f} {row.async_wait_s:>7.3f}")


def comma_separated(convert: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [convert(part) for part in text.split(",") if part.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list: {exc}") from None

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", type=comma_separated(float), default=None,
                        help="pseudo-gradient sizes in MiB (default 1,16,64; --quick: 0.25,1)")
    parser.add_argument("--world", type=comma_separated(int), default=list(DEFAULT_WORLDS),
                        help="world sizes, one process per rank (default 2,4)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"measured rounds per configuration, after {WARMUP_ROUNDS} warm-up (default "
                             f"{DEFAULT_ROUNDS}; --quick: {QUICK_ROUNDS})")
    parser.add_argument("--stores", type=comma_separated(str), default=list(STORES),
                        help="file and/or s3 (moto on loopback) (default file,s3)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="tensor dtype (default float32)")
    parser.add_argument("--strategy", choices=("gather", "sharded"), default="gather",
                        help="store.allreduce to measure (default gather); R=(N-1)W is checked for gather only")
    parser.add_argument("--quick", action="store_true", help="small sizes and 2 rounds: under a minute")
    parser.add_argument("--overlap-size", type=float, default=None,
                        help="the size (one of --sizes) of the allreduce_async overlap measurement "
                             "(default: the middle of --sizes; 0 skips it)")
    parser.add_argument("--overlap-compute-s", type=float, default=0.0,
                        help="simulated compute per overlap round (default 0: as long as that blocking round)")
    parser.add_argument("--compute", choices=("sleep", "matmul"), default="sleep",
                        help="simulated compute: sleep (CPU free, like a GPU step) or CPU matmuls")
    parser.add_argument("--poll-interval", type=float, default=0.05,
                        help="seconds between polls for a peer's object (default 0.05)")
    args = parser.parse_args(argv)
    args.sizes = args.sizes or list(QUICK_SIZES_MIB if args.quick else DEFAULT_SIZES_MIB)
    args.rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    if args.overlap_size is None:
        args.overlap_size = sorted(args.sizes)[len(args.sizes) // 2]
    elif args.overlap_size == 0:
        args.overlap_size = None
    problems = []
    if any(size <= 0 for size in args.sizes):
        problems.append("--sizes must be > 0")
    if any(world < 1 for world in args.world):
        problems.append("--world must be >= 1")
    if args.rounds < 1:
        problems.append("--rounds must be >= 1")
    if not args.stores or set(args.stores) - set(STORES):
        problems.append(f"--stores must be a subset of {','.join(STORES)}")
    if args.overlap_size is not None and args.overlap_size not in args.sizes:
        problems.append("--overlap-size must be one of --sizes")
    if args.poll_interval <= 0 or args.overlap_compute_s < 0:
        problems.append("--poll-interval must be > 0 and --overlap-compute-s >= 0")
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "s3" in args.stores:
        try:
            import boto3  # noqa: F401
            import moto.server  # noqa: F401
            import s3fs  # noqa: F401
        except ImportError as exc:
            print(f"--stores s3 needs the dev extras (moto[server], boto3, s3fs): {exc}", file=sys.stderr)
            return 2
    ctx = mp.get_context("spawn")
    started = time.perf_counter()
    round_rows: list[RoundRow] = []
    overlap_rows: list[OverlapRow] = []
    with tempfile.TemporaryDirectory(prefix="diloco-allreduce-bench-") as workdir:
        for store in args.stores:
            with store_root(store, workdir) as root_uri:
                for world_size in args.world:
                    progress(f"{store} world {world_size}: sizes {','.join(f'{s:g}' for s in args.sizes)} MiB, "
                             f"{args.rounds} rounds each")
                    try:
                        rows, overlaps = run_world(ctx, store, root_uri, world_size, args)
                    except RuntimeError as exc:  # a rank failed: its traceback is in the message
                        print(f"allreduce_round: {exc}", file=sys.stderr)
                        return 1
                    round_rows += rows
                    overlap_rows += overlaps
    print(f"one all-reduce round, {args.strategy} ({args.dtype}, {args.rounds} measured rounds after "
          f"{WARMUP_ROUNDS} warm-up, one process per rank, {os.cpu_count()} CPUs, poll {args.poll_interval:g} s)")
    print_round_table(round_rows)
    if overlap_rows:
        print()
        print("allreduce_async overlap: allreduce+compute vs allreduce_async, compute, wait")
        print_overlap_table(overlap_rows, args.compute)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0 if args.strategy != "gather" or all(row.read_is_n_minus_1_times_written for row in round_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
