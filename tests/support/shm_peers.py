"""What NCCL's shared-memory transport does to ``/dev/shm`` when one replica runs several local processes.

Why: a multi-process replica (``--procs-per-replica`` > 1) on one node connects its ranks through NCCL's SHM
transport, which creates one ``/dev/shm/nccl-XXXXXX`` segment per connection and reserves it with ``fallocate``
before mapping it (NVIDIA/nccl ``src/misc/shmutils.cc``). With the container runtime's 64 MiB ``/dev/shm`` that
reservation fails and NCCL logs, from each rank (the wording of NVIDIA/nccl-tests#166 and NVIDIA/nccl#525)::

    misc/shmutils.cc:71 NCCL WARN Error: failed to extend /dev/shm/nccl-fjwOOB to 5967876 bytes
    misc/shmutils.cc:112 NCCL WARN Error while creating shared memory segment /dev/shm/nccl-fjwOOB (size 5967872)

Run as ``python shm_peers.py --procs 4 --segments 2 --size-mib 10 [--hold S]``: the launcher forks one process
per rank and, when one fails, ends the others (SIGTERM, then SIGKILL after ``GRACE_S``, as torchrun's agent
does); each rank creates its segments (``open`` + ``posix_fallocate``), maps them and touches every page as a
communicator's first collective does, holds them ``--hold`` seconds (a communicator keeps them for the whole
run), unlinks them and exits 0. A reservation that fails prints NCCL's two lines and exits 1, as torch's
``DistBackendError`` ends a rank.
"""

from __future__ import annotations

import argparse
import mmap
import os
import secrets
import signal
import string
import sys
import time

SHM = "/dev/shm"
#: How long ranks told to stop (SIGTERM) have before they are killed: torch.distributed.elastic's
#: ``PContext.close`` sends SIGTERM, waits, then SIGKILLs whatever is left.
GRACE_S = 5.0
_ALPHABET = string.ascii_letters + string.digits


def rank_main(rank: int, segments: int, size: int, hold: float) -> int:
    """One rank: create, reserve, map and touch its segments; hold them; clean up."""
    made: list[tuple[str, int, mmap.mmap]] = []
    try:
        for _ in range(segments):
            path = f"{SHM}/nccl-{''.join(secrets.choice(_ALPHABET) for _ in range(6))}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size + 4)
            except OSError as exc:
                os.close(fd)
                os.unlink(path)
                print(f"emulated:{os.getpid()}:0 [{rank}] misc/shmutils.cc:71 NCCL WARN Error: failed to extend "
                      f"{path} to {size + 4} bytes, error: {exc.strerror}", flush=True)
                print(f"emulated:{os.getpid()}:0 [{rank}] misc/shmutils.cc:112 NCCL WARN Error while creating "
                      f"shared memory segment {path} (size {size})", flush=True)
                return 1
            region = mmap.mmap(fd, size)
            for offset in range(0, size, mmap.PAGESIZE):
                region[offset] = 1
            made.append((path, fd, region))
        print(f"rank {rank}: {segments} segments of {size} bytes mapped", flush=True)
        time.sleep(hold)
        return 0
    finally:
        for path, fd, region in made:
            region.close()
            os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--segments", type=int, default=2, help="segments per rank")
    parser.add_argument("--size-mib", type=float, default=10.0, help="size of each segment")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds to keep the segments mapped")
    args = parser.parse_args(argv)
    size = int(args.size_mib * 1024 * 1024)
    children: set[int] = set()
    for rank in range(args.procs):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unlink the segments on the way out
            code = 1
            try:
                code = rank_main(rank, args.segments, size, args.hold)
            except SystemExit as stop:
                code = int(stop.code or 0)
            finally:
                os._exit(code)
        children.add(pid)
    code = 0
    kill_at: float | None = None
    while children:  # the launcher's part (torchrun's agent): the first rank that fails ends the others
        pid, status = os.waitpid(-1, 0 if kill_at is None else os.WNOHANG)
        if pid == 0:  # ranks told to stop that are still alive
            if kill_at is not None and time.monotonic() >= kill_at:
                for other in children:
                    os.kill(other, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.05)
            continue
        children.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not code:
            code = 1
            kill_at = time.monotonic() + GRACE_S
            for other in children:
                os.kill(other, signal.SIGTERM)
    if code == 0:
        print(f"all {args.procs} ranks connected through {SHM}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
