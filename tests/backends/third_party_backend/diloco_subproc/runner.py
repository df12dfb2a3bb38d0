"""``python -m diloco_subproc.runner DIR GRACE -- ARGV...``: run one replica and keep its state in DIR.

Writes ``replica.pid``, every output line as ``time<TAB>out|err<TAB>text`` to ``log.tsv``, and the exit code to
``exit`` when the replica ends. SIGTERM is passed on to the replica's process group, and SIGKILL follows after
GRACE seconds, so a cancel returns at once and still stops a replica that ignores SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO


def main() -> int:
    where, grace = Path(sys.argv[1]), float(sys.argv[2])
    argv = sys.argv[sys.argv.index("--") + 1:]
    lock = threading.Lock()
    log = (where / "log.tsv").open("a")

    def pump(pipe: IO[str], stream: str) -> None:
        for line in pipe:
            with lock:
                log.write(f"{time.time():.6f}\t{stream}\t{line.rstrip(chr(10))}\n")
                log.flush()

    stopping = threading.Event()  # a SIGTERM before the replica exists stops it as soon as it does

    def stop(*_: object) -> None:
        stopping.set()
        if replica is not None:
            for sig, delay in ((signal.SIGTERM, 0.0), (signal.SIGKILL, grace)):
                threading.Timer(delay, _signal_group, args=(replica.pid, sig)).start()

    replica: subprocess.Popen[str] | None = None
    signal.signal(signal.SIGTERM, stop)
    replica = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    (where / "replica.pid").write_text(str(replica.pid))
    if stopping.is_set():
        stop()
    pumps = [threading.Thread(target=pump, args=(replica.stdout, "out")),
             threading.Thread(target=pump, args=(replica.stderr, "err"))]
    for thread in pumps:
        thread.start()
    code = replica.wait()
    for thread in pumps:
        thread.join()
    log.close()
    (where / "exit.tmp").write_text(str(code))
    os.replace(where / "exit.tmp", where / "exit")
    os._exit(0)  # a SIGKILL timer still pending has nothing left to kill


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
