"""A stand-in replica for backend tests: ``python -m diloco.executors.testing.fake_replica`` with the entrypoint's
arguments, run by the backend under test exactly where the real entrypoint would run.

It needs nothing beyond this package (no torch, no pytest), so it runs in any replica that has diloco installed.

Behaviour comes from ``--trainer-kwargs-json`` (the executor's contract is only "run this module with these
args and env"): print ``lines`` lines to stdout and one to stderr, optionally spawn a grandchild, optionally
ignore SIGTERM (or log each one's sender to ``term_log``, a file that exists once every SIGTERM will be logged),
say its world size (``announce_world``), wait for the file ``go_on_when`` to exist before printing (so a test can
act between the start and the output), sleep, then exit with ``exit`` (or ``fail_exit`` on ``fail_rank``). Its rank
is the environment's plus ``DILOCO_RANK_OFFSET``, as the real entrypoint reads it. ``env_out`` is a directory where
each rank writes what it saw (argv, cwd, environment) as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time


def main() -> int:
    """Behave as the trainer kwargs say; the exit code to end with."""
    argv = sys.argv[1:]
    kwargs = json.loads(argv[argv.index("--trainer-kwargs-json") + 1])
    from diloco.envvars import rank_offset

    rank = int(os.environ.get("REPLICA_RANK") or os.environ["JOB_COMPLETION_INDEX"]) + rank_offset(os.environ)
    if kwargs.get("env_out"):
        seen = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "pid": os.getpid(),
                "pgid": os.getpgrp()}
        with open(os.path.join(kwargs["env_out"], f"rank_{rank}.json"), "w") as f:
            json.dump(seen, f)
    if kwargs.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if kwargs.get("term_log"):  # record who sent each SIGTERM; exit 143 half a second after the first
        def wait_for_terms() -> None:
            while True:
                info = signal.sigwaitinfo({signal.SIGTERM})
                with open(kwargs["term_log"], "a") as f:
                    f.write(f"SIGTERM from {info.si_pid}\n")
                threading.Timer(0.5, os._exit, args=(143,)).start()

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # delivered to sigwaitinfo only
        threading.Thread(target=wait_for_terms, daemon=True).start()
        open(kwargs["term_log"], "a").close()  # the log exists once every SIGTERM is sure to be logged
    if kwargs.get("spawn_child"):
        # A grandchild that outlives us unless someone kills the whole process group.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if kwargs.get("pid_out"):
            with open(os.path.join(kwargs["pid_out"], f"grandchild_{rank}"), "w") as f:
                f.write(str(child.pid))
    if kwargs.get("announce_world"):
        print(f"rank {rank} of world size {os.environ.get('WORLD_SIZE')}")
    while kwargs.get("go_on_when") and not os.path.exists(kwargs["go_on_when"]):
        time.sleep(0.05)
    for i in range(int(kwargs.get("lines", 3))):
        print(f"rank {rank} line {i}")
        time.sleep(float(kwargs.get("line_gap", 0.0)))
    print(f"rank {rank} says hello on stderr", file=sys.stderr)
    time.sleep(float(kwargs.get("sleep", 0.0)))
    if rank == kwargs.get("fail_rank"):
        print(f"rank {rank}: injected failure", file=sys.stderr)
        return int(kwargs.get("fail_exit", 3))
    return int(kwargs.get("exit", 0))


def run() -> None:
    """The replica process: ship its own output when the backend asks for it, as the real entrypoint does."""
    from diloco.store.logs import ship_output

    shipping = ship_output()
    code = main()
    if shipping is not None:
        shipping.close(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
