"""A tiny supervisor around one local replica, so a *later* process can learn how it ended.

``python -m diloco.executors.local_supervisor --log-dir D [--timeout S] [--grace G] -- CMD...`` runs ``CMD`` in
the supervisor's own process group (the executor starts the supervisor in a new session, so one ``killpg``
reaches both) and:

* points the child's stdout and stderr straight at ``stdout.log`` and ``stderr.log`` and follows both into
  ``combined.log``, where every line is ``"<unix time> <out|err> <text>"`` so ``diloco logs`` can merge replicas
  in time order. Files, not pipes: a pipe would close with a killed supervisor (``kill -9``, the OOM killer) and
  the replica's next print would die of it (EPIPE); a file outlives the supervisor, and so do the replica and
  its output;
* forwards SIGTERM/SIGINT/SIGHUP to the child, records that it was stopped by a signal, and SIGKILLs it if it is
  still alive ``--grace`` seconds later (so a cancel's escalation does not depend on the CLI that asked);
* enforces ``--timeout`` (SIGTERM, then SIGKILL after ``--grace`` seconds);
* when the child ends, kills anything it left behind in the group, then writes ``exit.json`` atomically.

``exit.json`` is the only place the exit code lives; the CLI's ``status`` reads it from another process. If the
supervisor itself is SIGKILLed (a second cancel) there is no ``exit.json``, and the backend reads that, plus the
``cancel_requested`` marker, as "cancelled".

Standard library only: it must start fast and never import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import IO, Any, NamedTuple

COMBINED_LOG = "combined.log"
STDOUT_LOG = "stdout.log"
STDERR_LOG = "stderr.log"
SUPERVISOR_LOG = "supervisor.log"
EXIT_FILE = "exit.json"
CHILD_FILE = "child.json"
CANCEL_MARKER = "cancel_requested"

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# ------------------------------------------------------------------ /proc helpers (shared with the executor)
class ProcStat(NamedTuple):
    state: str  # "R", "S", "Z" (zombie), ...
    pgrp: int
    session: int
    start_time: int  # clock ticks since boot: with the pid, identifies a process across pid reuse


def proc_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat`` essentials, or ``None`` if there is no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return ProcStat(fields[0], int(fields[2]), int(fields[3]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def has_procfs() -> bool:
    return os.path.isdir("/proc/self")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``.

    Zombies are skipped on purpose: orphans are re-parented to an init that may never reap them, and a zombie
    holds no resources. Without ``/proc`` (macOS) this falls back to ``killpg(pgid, 0)``.
    """
    if not has_procfs():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None and st.pgrp == pgid and st.state != "Z":
                members.append(int(name))
    return members


def live_process_groups() -> dict[int, list[int]] | None:
    """Every live (non-zombie) process by process group, ``pgid -> pids``, from one pass over ``/proc``.

    One pass instead of ``group_members`` per group, because a run of many replicas asks about all of its groups
    at once (a cancel, a rollback). ``None`` without ``/proc`` (callers fall back to ``group_members``)."""
    if not has_procfs():
        return None
    groups: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None and st.state != "Z":
                groups.setdefault(st.pgrp, []).append(int(name))
    return groups


def processes_with_env(name: str, value: str) -> dict[int, dict[str, str]]:
    """Live processes whose environment has ``name=value``: ``pid -> environment``.

    The last way to find a replica no record names (its launcher was killed between starting it and writing its
    pid down): every replica and everything it starts inherits ``DILOCO_RUN_ID``. Only this user's processes can
    be read, which is also all this user could signal. Empty without ``/proc``."""
    needle = f"{name}={value}".encode()
    found: dict[int, dict[str, str]] = {}
    if not has_procfs():
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                raw = f.read().split(b"\0")
        except OSError:
            continue
        if needle not in raw:
            continue
        st = proc_stat(int(entry))
        if st is None or st.state == "Z":
            continue
        env = dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)
        found[int(entry)] = env
    return found


def command_line(pid: int) -> list[str]:
    """``/proc/<pid>/cmdline`` as arguments (empty if the process is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` so that a reader in another process sees the whole file or none of it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def uncopied_output(log_dir: str) -> list[tuple[str, str]]:
    """``(out|err, text)`` of the lines the replica wrote into ``stdout.log`` and ``stderr.log`` that its
    supervisor did not copy into ``combined.log`` (all of them are copied unless the supervisor was killed): the
    lines after as many as ``combined.log`` holds of each stream since this attempt began. A last line without its
    newline is left out: it may still be being written. Empty without a ``child.json``."""
    child = read_json(os.path.join(log_dir, CHILD_FILE))
    if child is None:
        return []
    copied = {"out": 0, "err": 0}
    for raw in read_from(os.path.join(log_dir, COMBINED_LOG), int(child.get("combined_at", 0))).split(b"\n"):
        parsed = parse_combined_line(raw.decode(errors="replace"))
        if parsed is not None and parsed[1] in copied:
            copied[parsed[1]] += 1
    found: list[tuple[str, str]] = []
    for tag, name in (("out", STDOUT_LOG), ("err", STDERR_LOG)):
        lines = read_from(os.path.join(log_dir, name), int(child.get(f"{tag}_at", 0))).split(b"\n")[:-1]
        found += [(tag, line.decode(errors="replace")) for line in lines[copied[tag]:]]
    return found


def read_from(path: str, offset: int) -> bytes:
    """The bytes of ``path`` from ``offset`` on; none when there is no such file (yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""


def parse_combined_line(line: str) -> tuple[float, str, str] | None:
    """``"<ts> <out|err> <text>"`` -> ``(ts, stream, text)``; ``None`` for a malformed line."""
    parts = line.split(" ", 2)
    if len(parts) < 2:
        return None
    try:
        ts = float(parts[0])
    except ValueError:
        return None
    return ts, parts[1], parts[2] if len(parts) == 3 else ""


# ------------------------------------------------------------------ the supervisor itself
#: How often the supervisor looks for new output while the child writes, and while it is quiet: a line's time in
#: ``combined.log`` is at most this late, and stdout and stderr lines written within it may be merged out of order.
FOLLOW_BUSY_S = 0.05
FOLLOW_QUIET_S = 0.1
#: A line longer than this (a progress bar redrawn with carriage returns, never a newline) is cut and copied, so
#: the supervisor's memory stays bounded.
MAX_LINE_BYTES = 64 * 1024


class _LogFollower:
    """Copies the new lines of the child's own ``stdout.log`` and ``stderr.log``, each with the time it was
    seen, into ``combined.log``; ``close`` copies the last unterminated line too."""

    def __init__(self, sources: list[tuple[str, str]], combined: IO[bytes]):
        self._sources: list[tuple[IO[bytes], str]] = []
        #: Where this attempt's output begins in each file (an earlier attempt's, appended to the same file, was
        #: copied then): recorded in ``child.json`` as ``<tag>_at``, with ``combined_at``.
        self.starts: dict[str, int] = {"combined": combined.tell()}
        for path, tag in sources:
            f = open(path, "rb")  # noqa: SIM115 - held until close()
            self.starts[tag] = f.seek(0, os.SEEK_END)
            self._sources.append((f, tag))
        self._combined = combined
        self._partial = {tag: b"" for _, tag in sources}

    def copy(self, *, final: bool = False) -> bool:
        """Copy what is new; whether there was anything."""
        stamp = f"{time.time():.6f}"
        out: list[bytes] = []
        grew = False
        for f, tag in self._sources:
            data = f.read()
            grew = grew or bool(data)
            *lines, rest = (self._partial[tag] + data).split(b"\n")
            if rest and (final or len(rest) > MAX_LINE_BYTES):
                lines.append(rest)
                rest = b""
            self._partial[tag] = rest
            out.extend(f"{stamp} {tag} ".encode() + line + b"\n" for line in lines)
        if out:
            self._combined.write(b"".join(out))
            self._combined.flush()
        return grew

    def close(self) -> None:
        self.copy(final=True)
        for f, _ in self._sources:
            f.close()


class _ExitWaiter:
    """Waits for the child's exit for at most a given time, woken by the exit itself (a Linux pidfd) rather than
    by polling, which is what ``Popen.wait(timeout)`` does every 50 ms; polls where there is no pidfd."""

    def __init__(self, child: subprocess.Popen[bytes]):
        self._child = child
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(child.pid)
        except (AttributeError, OSError):
            pass

    def wait(self, timeout_s: float) -> None:
        if self._pidfd is None:
            try:
                self._child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
            return
        select.select([self._pidfd], [], [], timeout_s)

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)


def _kill_leftovers() -> None:
    """SIGKILL whatever the child left in our process group (e.g. data-loader workers), except ourselves."""
    me = os.getpid()
    for pid in group_members(os.getpgrp()):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _describe_end(returncode: int, received: int | None, timed_out: float | None) -> tuple[int, str | None, str]:
    """(shell-style exit code, signal name, one-line reason)."""
    sig_name = signal.Signals(-returncode).name if returncode < 0 else None
    code = 128 - returncode if returncode < 0 else returncode
    if timed_out is not None:
        reason = f"exceeded its time limit of {timed_out:g}s (timeout_s) and was stopped"
    elif received is not None and returncode != 0:
        reason = f"stopped by {signal.Signals(received).name}"
    elif sig_name:
        reason = f"killed by {sig_name}"
    else:
        reason = f"exited with code {code}"
    return code, sig_name, reason


def supervise(log_dir: str, command: list[str], timeout_s: float | None, grace_s: float,
              stop_file: str | None = None) -> int:
    """Run ``command`` to completion under supervision; returns its shell-style exit code.

    ``stop_file``: the run's cancel marker. A supervisor that finds it when it starts does not start its child:
    its launcher was killed while starting it and the run has been cancelled since. The cancel writes the marker
    before it looks for the run's processes, so a supervisor is either found by that look (and stopped) or
    finds the marker: none is left running, however late its start."""
    os.makedirs(log_dir, exist_ok=True)
    received: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        if child is not None and child.poll() is None:
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)

    started_at = time.time()
    exit_path = os.path.join(log_dir, EXIT_FILE)
    if received:  # cancelled before the child was even started
        write_json_atomic(exit_path, {"exit_code": 128 + received[0], "signal": signal.Signals(received[0]).name,
                                      "reason": "cancelled before start", "started_at": started_at,
                                      "ended_at": time.time()})
        return 128 + received[0]
    if stop_file is not None and os.path.exists(stop_file):  # the run was cancelled before this start
        with open(os.path.join(log_dir, CANCEL_MARKER), "a"):
            pass
        write_json_atomic(exit_path, {"exit_code": 128 + signal.SIGTERM, "signal": None,
                                      "reason": "not started: its run had been cancelled",
                                      "started_at": started_at, "ended_at": time.time()})
        return 128 + signal.SIGTERM

    with open(os.path.join(log_dir, STDOUT_LOG), "ab") as out_raw, \
         open(os.path.join(log_dir, STDERR_LOG), "ab") as err_raw, \
         open(os.path.join(log_dir, COMBINED_LOG), "ab") as combined:
        follower = _LogFollower([(out_raw.name, "out"), (err_raw.name, "err")], combined)
        try:
            child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out_raw, stderr=err_raw)
        except OSError as exc:
            follower.close()
            write_json_atomic(exit_path, {"exit_code": 127, "signal": None, "reason": f"could not start: {exc}",
                                          "started_at": started_at, "ended_at": time.time()})
            return 127
        if received:  # a signal that arrived while the child was being started
            forward(received[0], None)
        write_json_atomic(os.path.join(log_dir, CHILD_FILE), {
            "pid": child.pid, "started_at": started_at, **{f"{tag}_at": at for tag, at in follower.starts.items()}})
        exited = _ExitWaiter(child)

        timed_out: float | None = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        kill_at: float | None = None  # SIGKILL the child then: a stop request or the time limit, plus grace
        while child.poll() is None:
            now = time.monotonic()
            if deadline is not None and now >= deadline and timed_out is None:
                timed_out = timeout_s
                child.terminate()
            if kill_at is None and (received or timed_out is not None):
                kill_at = now + grace_s  # the supervisor owns the escalation: no CLI needs to stay alive for it
            if kill_at is not None and now >= kill_at:
                child.kill()
            exited.wait(FOLLOW_BUSY_S if follower.copy() else FOLLOW_QUIET_S)
        exited.close()
        _kill_leftovers()  # nothing the child started outlives it, nor writes after the last copy
        follower.close()

    code, sig_name, reason = _describe_end(child.returncode, received[0] if received else None, timed_out)
    write_json_atomic(exit_path, {"exit_code": code, "signal": sig_name, "reason": reason,
                                  "started_at": started_at, "ended_at": time.time(), "pid": child.pid,
                                  "timed_out": timed_out is not None})
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco.executors.local_supervisor")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--timeout", type=float, default=None, help="wall-clock limit for the child, seconds")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (on a stop request or the timeout)")
    parser.add_argument("--stop-file", default=None,
                        help="the run's cancel marker: if it exists at start, the command is not started")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    return supervise(args.log_dir, command, args.timeout, args.grace, args.stop_file)


if __name__ == "__main__":
    sys.exit(main())
