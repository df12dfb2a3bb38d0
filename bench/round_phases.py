"""Where one all-reduce round's time goes, phase by phase: snapshot, encode, hashing, upload, polls, reads, checks,
decoding into the sum, the mean, the wait and the delete of the previous round's object.

Not a test (the times depend on the machine). Why it exists: with a sparse format a DiLoCo run makes many more
rounds of a much smaller payload than fp32 DiLoCo does, so what a round costs besides its bytes (polling for the
peers, hashing, encoding, metadata, requests) is paid ten times as often and decides whether the sparse run's
sync time over the run is any smaller than fp32's. A round's wall time alone says nothing about which of those to
cut; this bench says it.

How: every rank is a process of its own with one torch thread (threads of one process would share one GIL, and
a small payload's codec is mostly Python: its ranks would wait for each other's interpreter, not for the
store), running real rounds (gather, or ``--allreduce sharded``) on a ``file://`` store (or the paced one, ``bench/allreduce_traffic.py``'s). The bench wraps the functions the round calls for each phase (it changes nothing in
them) and adds, per rank and round, each phase's wall seconds and the CPU seconds of the thread that ran it. A
phase nested in another (the digests inside ``encode_stream``) is counted in the inner phase only. ``round s`` is
the slowest rank's ``allreduce`` (barrier release to the mean in its tensors), median over the measured rounds;
each phase is the mean over ranks and the median over rounds, in milliseconds; ``other`` is what the round thread
spent outside every phase named (its own bookkeeping, waiting for a core).

    python bench/round_phases.py --quick [--json OUT]    # N=4, the built-in model's 29 tensors and 8 MiB, none and topk
    python bench/round_phases.py --formats topk --payloads builtin --rounds 20 --world 4
    python bench/round_phases.py --allreduce sharded --formats int8 --payloads 268435456 --store paced --link-gbs 0.25
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce_round import emit_table  # noqa: E402 - a sibling bench script
from allreduce_traffic import PACED, case_root, open_store  # noqa: E402

MIB = 2**20
TIMEOUT_S = 300.0
#: (phase, module path, attribute path): the functions whose time is the phase's. Outer first: a phase called from
#: inside another is subtracted from the outer one.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("snapshot", "diloco.collectives.gather", "GatherExchange.snapshot"),
    ("snapshot", "diloco.collectives.sharded", "ShardedExchange.snapshot"),
    ("encode", "diloco.collectives.wire", "PayloadCodec.encode_wire"),
    ("encode", "diloco.collectives.wire", "PayloadCodec.encode_plain_into"),
    ("serialize", "diloco.store.codec", "encode_stream"),
    ("upload", "diloco.store.objects", "ObjectStore.put_stream"),
    ("poll", "diloco.collectives.driver", "RoundIO.await_object"),
    ("read", "diloco.store.codec", "read_object"),
    ("read", "diloco.store.codec", "read_header"),
    ("read", "diloco.store.codec", "read_data"),
    ("hash", "diloco.store.codec", "checksum_all"),
    ("check", "diloco.collectives.wire", "PayloadCodec.check"),
    ("decode+add", "diloco.collectives.wire", "PayloadCodec.add_into"),
    ("decode+add", "diloco.collectives.wire", "PayloadCodec.decode_into"),
    ("mean", "diloco.collectives.gather", "finish_mean"),
    ("delete", "diloco.collectives.driver", "RoundIO.delete"),
    ("wait()", "diloco.collectives.driver", "RoundDriver.complete"),
)
PHASE_NAMES = tuple(dict.fromkeys(name for name, _, _ in PHASES))


class PhaseClock:
    """Per (rank, round, phase): wall and thread-CPU seconds, exclusive of nested phases. A thread is attributed
    to a rank and round by ``bind`` (the rank threads) or by its name (the round threads the driver starts:
    ``diloco-allreduce-r{rank}-round{n}``)."""

    def __init__(self) -> None:
        self.wall: dict[tuple[int, int, str], float] = defaultdict(float)
        self.cpu: dict[tuple[int, int, str], float] = defaultdict(float)
        self.round_thread: dict[tuple[int, int], float] = defaultdict(float)
        self._local = threading.local()
        self._lock = threading.Lock()

    def bind(self, rank: int, round_: int) -> None:
        self._local.owner = (rank, round_)

    def owner(self) -> tuple[int, int] | None:
        owner = getattr(self._local, "owner", None)
        if owner is not None:
            return owner
        name = threading.current_thread().name
        if name.startswith("diloco-allreduce-r"):
            rank, _, rest = name[len("diloco-allreduce-r"):].partition("-round")
            return int(rank), int(rest) - 1  # the thread names number rounds from 1
        return None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        owner = self.owner()
        stack: list[list[float]] = self._local.__dict__.setdefault("stack", [])
        if owner is None:
            yield
            return
        frame = [0.0, 0.0]  # wall and CPU of nested phases
        stack.append(frame)
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
            stack.pop()
            if stack:
                stack[-1][0] += wall
                stack[-1][1] += cpu
            key = (*owner, name)
            with self._lock:
                self.wall[key] += wall - frame[0]
                self.cpu[key] += cpu - frame[1]


@contextmanager
def instrumented(clock: PhaseClock) -> Iterator[None]:
    """Wrap every phase's function (restored afterwards), and the round thread's body for its total."""
    import importlib

    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, phase: str) -> None:
        original = owner.__dict__[attr]
        is_static = isinstance(original, staticmethod)
        func = original.__func__ if is_static else original

        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with clock.phase(phase):
                return func(*args, **kwargs)

        saved.append((owner, attr, original))
        setattr(owner, attr, staticmethod(timed) if is_static else timed)

    for phase, module_name, path in PHASES:
        owner: Any = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        wrap(owner, attr, phase)
    from diloco.collectives.driver import RoundDriver

    run_round = RoundDriver._run_round

    def timed_round(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return run_round(self, *args, **kwargs)
        finally:
            owner = clock.owner()
            if owner is not None:
                with clock._lock:
                    clock.round_thread[owner] += time.perf_counter() - started

    RoundDriver._run_round = timed_round  # type: ignore[method-assign]
    try:
        yield
    finally:
        RoundDriver._run_round = run_round  # type: ignore[method-assign]
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def builtin_shapes() -> dict[str, tuple[int, ...]]:
    """The parameter shapes of configs/local.yaml's built-in model (29 tensors, 137K elements): the payload of a
    round of its demo, whose many small tensors cost a codec more than their bytes do."""
    from diloco.trainers.gpt_model import GPTConfig, build_model

    model = build_model(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64), seed=0)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def payload(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def rank_process(uri: str, rank: int, world: int, fmt: str, shapes: dict[str, tuple[int, ...]], rounds: int,
                 poll_s: float, link: float | None, barrier: Any, results: Any, strategy: str = "gather") -> None:
    """One rank in its own process (as a replica is: no GIL shared with its peers): ``rounds`` measured rounds
    of ``strategy`` after one warm-up, every phase timed; reports ``(rank, spans, wall, cpu, round thread)``."""
    try:
        import torch

        torch.set_num_threads(1)
        from diloco.collectives.allreduce import create_allreduce

        clock = PhaseClock()
        spans = []
        with instrumented(clock), create_allreduce(uri, rank, world, compression=fmt, timeout_s=TIMEOUT_S,
                                                   poll_interval_s=poll_s, allreduce=strategy) as ar:
            if link:
                ar.store = open_store(uri, link)
            for k in range(1 + rounds):
                tensors = payload(shapes, rank * 1000 + k)
                clock.bind(rank, k)
                barrier.wait(TIMEOUT_S)
                started = time.time()
                ar.allreduce(tensors)
                spans.append((started, time.time()))
                barrier.wait(TIMEOUT_S)
            time.sleep(0.05)  # the last round thread's delete
        results.put((rank, spans, dict(clock.wall), dict(clock.cpu), dict(clock.round_thread)))
    except BaseException:
        import traceback

        results.put((rank, traceback.format_exc(), None, None, None))
        barrier.abort()


def measure(uri: str, world: int, fmt: str, shapes: dict[str, tuple[int, ...]], rounds: int, poll_s: float,
            link: float | None, clock: PhaseClock, strategy: str = "gather") -> list[float]:
    """``rounds`` measured rounds of ``strategy`` (one process per rank) after one warm-up; the slowest rank's round time
    of each (first start to last end, wall clock); every rank's phases merged into ``clock``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    processes = [ctx.Process(target=rank_process, args=(uri, r, world, fmt, shapes, rounds, poll_s, link, barrier,
                                                        results, strategy)) for r in range(world)]
    for process in processes:
        process.start()
    reports = {}
    try:
        for _ in range(world):
            rank, spans, wall, cpu, thread = next_report(results, processes, reports)
            if isinstance(spans, str):
                raise RuntimeError(f"rank {rank} failed:\n{spans}")
            reports[rank] = spans
            clock.wall.update(wall)
            clock.cpu.update(cpu)
            clock.round_thread.update(thread)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
    return [max(reports[r][k][1] for r in range(world)) - min(reports[r][k][0] for r in range(world))
            for k in range(1, 1 + rounds)]


def next_report(results: Any, processes: list[Any], reports: dict[int, Any]) -> tuple[Any, ...]:
    """The next rank's report; ``RuntimeError`` as soon as a rank process is gone without one (killed by the
    kernel's OOM killer, say: its peers would otherwise wait for it until ``TIMEOUT_S``)."""
    import queue

    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            return tuple(results.get(timeout=1.0))
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(processes) if p.exitcode is not None and r not in reports]
            if dead:
                raise RuntimeError(f"rank {dead[0][0]} ended with exit code {dead[0][1]} and no report "
                                   "(a negative code is the signal that killed it)") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no report from ranks {sorted(set(range(len(processes))) - set(reports))} "
                                   f"within {TIMEOUT_S:g} s") from None


def discard(uri: str) -> None:
    """A finished case's objects (its last round's are still there), so the next case does not find the RAM
    folder of the paced store full of them."""
    import shutil

    if uri.startswith("file://"):
        shutil.rmtree(uri[len("file://"):], ignore_errors=True)


def summarize(clock: PhaseClock, world: int, rounds: int) -> tuple[dict[str, float], dict[str, float], float]:
    """Per phase: wall and CPU ms (mean over ranks, median over rounds), and the round thread's unexplained ms."""
    wall, cpu = {}, {}
    measured = range(1, 1 + rounds)
    for phase in PHASE_NAMES:
        wall[phase] = 1e3 * statistics.median(statistics.fmean(clock.wall[(r, k, phase)] for r in range(world))
                                              for k in measured)
        cpu[phase] = 1e3 * statistics.median(statistics.fmean(clock.cpu[(r, k, phase)] for r in range(world))
                                             for k in measured)
    in_thread = [p for p in PHASE_NAMES if p not in ("snapshot", "wait()")]
    other = 1e3 * statistics.median(statistics.fmean(
        clock.round_thread[(r, k)] - sum(clock.wall[(r, k, p)] for p in in_thread) for r in range(world))
        for k in measured)
    return wall, cpu, other


@contextmanager
def request_latency(latency_ms: float) -> Iterator[None]:
    """Every S3 request of the ranks (spawned inside the block: they inherit the endpoint) through a proxy on
    loopback that delays it by ``latency_ms`` (``tests/support/faultproxy.py``); nothing when 0."""
    if not latency_ms:
        yield
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from support.faultproxy import FaultProxy

    moto = os.environ["AWS_ENDPOINT_URL"]
    with FaultProxy(moto, seed=0) as proxy:
        proxy.add("delay", delay_s=latency_ms / 1000)
        os.environ["AWS_ENDPOINT_URL"] = proxy.url
        try:
            yield
        finally:
            os.environ["AWS_ENDPOINT_URL"] = moto


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the make bench sizes (the default sizes; fewer rounds)")
    p.add_argument("--full", action="store_true", help="the default sizes and rounds (what make bench --full passes)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (make bench reads it)")
    p.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--formats", default="none,topk", help="comma-separated store.compression formats")
    p.add_argument("--payloads", default=f"builtin,{2 * MIB}",
                   help="comma-separated payloads: 'builtin' (the built-in model's 29 parameter tensors) or a number "
                        "of fp32 elements in one tensor (default: builtin and 8 MiB)")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds per case (default 10; --quick 5)")
    p.add_argument("--poll-interval", type=float, default=0.2,
                   help="store.poll_interval_s (default 0.2, configs/local.yaml's)")
    p.add_argument("--store", choices=("file", PACED, "s3"), default="file",
                   help="file:// (default), the paced store, or S3 (moto's server on loopback)")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="with --store s3: a proxy adds this to every request, as S3's own latency does (default 0)")
    p.add_argument("--link-gbs", type=float, default=1.2, help="the paced store's link per rank and direction")
    p.add_argument("--allreduce", choices=("gather", "sharded"), default="gather",
                   help="the round's strategy (store.allreduce; default gather)")
    args = p.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    args.payloads = [e for e in args.payloads.split(",") if e]
    args.rounds = args.rounds or (5 if args.quick else 10)
    if args.world < 2 or args.rounds < 1 or not all(e == "builtin" or (e.isdigit() and int(e) > 0)
                                                    for e in args.payloads):
        p.error("--world must be >= 2, --rounds >= 1 and --payloads 'builtin' or numbers of elements > 0")
    return args


COLUMNS_HEAD = ["format", "payload", "payload MiB", "round ms"]


def main(argv: Sequence[str] | None = None) -> int:
    import tempfile

    args = parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    link = args.link_gbs * 1e9 if args.store == PACED else None
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diloco-phases-") as workdir, case_root(args.store, workdir) as root, \
            request_latency(args.latency_ms if args.store == "s3" else 0.0):
        for i, (spec, fmt) in enumerate((e, f) for e in args.payloads for f in args.formats):
            shapes = builtin_shapes() if spec == "builtin" else {"g": (int(spec),)}
            elements = sum(math.prod(shape) for shape in shapes.values())
            label = f"built-in model ({len(shapes)} tensors)" if spec == "builtin" else "one tensor"
            print(f"{fmt} {label}, {elements} elements", file=sys.stderr, flush=True)
            clock = PhaseClock()
            try:
                times = measure(f"{root}/case{i}", args.world, fmt, shapes, args.rounds, args.poll_interval, link,
                                clock, args.allreduce)
            finally:
                discard(f"{root}/case{i}")
            wall, cpu, other = summarize(clock, args.world, args.rounds)
            row: dict[str, Any] = {"format": fmt, "payload": label, "payload MiB": round(elements * 4 / MIB, 2),
                                   "round ms": round(1e3 * statistics.median(times), 1)}
            for phase in PHASE_NAMES:
                row[phase] = f"{wall[phase]:.1f} ({cpu[phase]:.1f})"
            row["other"] = round(other, 1)
            rows.append(row)
            print(" | ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr, flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"
    notes = [
        f"N={args.world} ranks (one process each, one torch thread each), {args.allreduce}, "
        f"{args.store} store{f' with {args.latency_ms:g} ms per request' if args.store == 's3' and args.latency_ms else ''}, poll interval {args.poll_interval:g} s, {args.rounds} measured rounds after a warm-up.",
        "Each phase: wall ms (thread CPU ms), mean over ranks, median over rounds, nested phases excluded "
        "(hashing is counted in 'hash', not in 'serialize' or 'read'); 'wait()' is Work.wait() on the caller's "
        "thread: waiting for the round thread (so about the whole round), then copying the mean into the caller's "
        "tensors (its CPU). 'other' is the round thread outside every "
        "named phase. The chunk digests of a large object are computed on the process's hashing pool "
        "(diloco.store.digests), whose threads' CPU shows in no column: 'hash' wall is then the wait for them.",
        f"1-minute load average when it started: {load:.2f} on {os.cpu_count()} CPUs. "
        f"Total {time.perf_counter() - started:.0f} s.",
    ]
    title = "Where a round's time goes, per phase (ms per rank)"
    emit_table(title, machine, [*COLUMNS_HEAD, *PHASE_NAMES, "other"], rows, notes, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
