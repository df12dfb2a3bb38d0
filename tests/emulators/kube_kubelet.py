"""The emulator's kubelet and container runtime: each container is a real local process with a captured log.

A container start is one process in its own process group (``start_new_session``), so stopping a container
reaches everything it spawned, as a cgroup kill would. It begins as ``kube_sandbox.py``, which gives the process
its volumes, ``/dev/shm`` and working directory and then execs the container's command (``kube_runtime`` says
how, and what limits the node holds it to). Its stdout and stderr go into one pipe; a reader thread
timestamps every line with nanoseconds as the container runtime does, which is what ``timestamps=true`` prints
(``RFC3339NanoFixed``). When the main process exits, whatever is left in its group is killed, so the log reaches
end-of-file and ``follow`` ends, like a container whose cgroup is torn down.

Log files as the kubelet keeps them (``pkg/kubelet/logs/container_log_manager.go``; the kubelet configuration's
``containerLogMaxSize``, default ``10Mi``, and ``containerLogMaxFiles``, default 5): once the current file has
reached the size, the kubelet renames it and the runtime reopens a new, empty one; at most ``MaxFiles`` files are
kept, the oldest deleted. A file's size counts each line in the CRI format the runtime writes
(``<RFC3339Nano> stdout F <line>``). The real kubelet checks every ``containerLogMonitorInterval`` (10 s), so a
file can grow past the limit in between; the emulator checks every controller tick.

Reading, as the kubelet's CRI log reader does it (``pkg/kubelet/kuberuntime/logs/logs.go`` ``ReadLogs``):

- Only the current file is read: after a rotation a plain read returns the lines written since ("only the
  contents of the latest log file are available through kubectl logs", kubernetes.io "Logging Architecture").
- ``tailLines`` picks the last N lines of that file first (``FindTailLineStartIndex``), then lines older than
  ``sinceTime``/``sinceSeconds`` are skipped (``msg.timestamp.Before(since)``: a line stamped exactly at
  ``since`` is kept), and ``limitBytes`` cuts the output, timestamp prefixes included.
- ``follow`` goes on into the new file after a rotation (kubernetes/kubernetes#115702, in 1.29+), and it reads
  the old file to its end first, so a follower loses nothing.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kube_runtime import ContainerView, sandbox_argv
from .kube_store import now_rfc3339

#: Variables a container inherits from the machine running the emulator; everything else comes from the pod.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "SYSTEMROOT", "USER")


def rfc3339_nano(ns: int) -> str:
    """``RFC3339NanoFixed``: ``2006-01-02T15:04:05.000000000Z`` (always nine digits, UTC)."""
    seconds, nanos = divmod(ns, 1_000_000_000)
    stamp = dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{nanos:09d}Z"


def exit_code_of(returncode: int) -> int:
    """A container's exit code: a process killed by signal N reports 128+N (137 for SIGKILL, 143 for SIGTERM)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class ContainerRun:
    """One start of one container: its process, its log lines and how it ended."""

    name: str
    started_at: str = ""
    finished_at: str = ""
    process: subprocess.Popen[bytes] | None = None
    #: Every line the container wrote, oldest first; the node's log files hold ``lines[file_starts[0]:]``.
    lines: list[tuple[int, bytes]] = field(default_factory=list)
    #: Where each log file still on the node begins in ``lines``; the last one is the current file.
    file_starts: list[int] = field(default_factory=lambda: [0])
    #: The current file's size on disk, in the runtime's CRI format.
    current_bytes: int = 0
    eof: bool = False
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    forced: tuple[int, str] | None = None
    container_id: str = ""
    #: ``terminationMessagePolicy: FallbackToLogsOnError``: a failed container's message is its log's tail.
    fallback_to_logs: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)
    #: What the runtime tears down with the container (called once, when its exit is noticed).
    on_exit: list[Callable[[], None]] = field(default_factory=list)

    @property
    def terminated(self) -> bool:
        """The process is gone and its log is complete (the runtime only reports exit after both)."""
        return self.exit_code is not None and self.eof

    def poll(self) -> bool:
        """Notice the exit of the main process (killing what is left of its group); true once terminated."""
        if self.exit_code is None and self.process is not None:
            returncode = self.process.poll()
            if returncode is not None:
                self.signal(signal.SIGKILL)
                code = exit_code_of(returncode)
                if self.forced is not None:
                    code, self.reason = self.forced
                else:
                    self.reason = "Completed" if code == 0 else "Error"
                self.exit_code = code
                for teardown in self.on_exit:
                    teardown()
        if self.exit_code is not None and not self.finished_at and self.eof:
            self.finished_at = now_rfc3339()
        return self.terminated

    def signal(self, sig: int) -> None:
        """Send a signal to the container's whole process group (never after its exit: the id may be reused)."""
        if self.process is None or self.exit_code is not None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def read_output(self) -> None:
        """The reader thread: one timestamped entry per line until end-of-file."""
        assert self.process is not None and self.process.stdout is not None
        for line in iter(self.process.stdout.readline, b""):
            with self.cond:
                entry = (time.time_ns(), line)
                self.lines.append(entry)
                self.current_bytes += cri_size(entry)
                self.cond.notify_all()
        self.process.stdout.close()
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def log_tail(self) -> str:
        """What the kubelet copies into the message: the last 80 lines of the current file, at most 2048 bytes."""
        with self.cond:
            tail = b"".join(line for _, line in self.lines[self.file_starts[-1]:][-80:])
        return tail[-2048:].decode(errors="replace")

    def current_file(self) -> tuple[list[tuple[int, bytes]], int]:
        """The lines of the current log file, and where the file ends in ``lines`` (for ``follow`` to go on)."""
        with self.cond:
            return self.lines[self.file_starts[-1]:], len(self.lines)

    def on_disk(self) -> list[tuple[int, bytes]]:
        """The lines the node still holds: the rotated files kept and the current one."""
        with self.cond:
            return self.lines[self.file_starts[0]:]

    def rotate(self, max_files: int) -> bool:
        """Rename the current file and start an empty one, keeping ``max_files`` files; false for an empty file."""
        with self.cond:
            if self.file_starts[-1] == len(self.lines):
                return False
            self.file_starts = [*self.file_starts, len(self.lines)][-max(1, max_files):]
            self.current_bytes = 0
            self.cond.notify_all()
            return True

    def follow(self, start: int, stop: threading.Event,
               cut: Callable[[], bool] | None = None) -> Iterator[tuple[int, bytes]]:
        """Lines from index ``start`` of ``lines`` on, across rotations, waiting for new ones until the log is
        complete, ``stop`` is set or ``cut()`` says the stream's connection is gone (checked at least every 0.1 s)."""
        index = start
        while not stop.is_set():
            if cut is not None and cut():
                return
            with self.cond:
                if index >= len(self.lines) and not self.eof:
                    self.cond.wait(0.1)
                batch, done = self.lines[index:], self.eof
            yield from batch
            index += len(batch)
            if done and index >= len(self.lines):
                return

    def state(self) -> dict[str, Any]:
        """The container's ``state`` as the kubelet reports it."""
        if self.terminated:
            terminated: dict[str, Any] = {"exitCode": self.exit_code, "reason": self.reason,
                                          "startedAt": self.started_at or None,
                                          "finishedAt": self.finished_at, "containerID": self.container_id}
            message = self.message or (self.log_tail() if self.fallback_to_logs and self.exit_code else "")
            if message:
                terminated["message"] = message
            return {"terminated": terminated}
        return {"running": {"startedAt": self.started_at}}


def start_error(name: str, message: str) -> ContainerRun:
    """A container the runtime could not start (``StartError``, exit code 128), e.g. executable not found."""
    run = ContainerRun(name=name, started_at="", eof=True, exit_code=128, reason="StartError", message=message)
    run.finished_at = now_rfc3339()
    return run


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables are replaced, ``$$`` escapes, the rest stays literal."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", replace, text)


def python_shim(bin_dir: Path, interpreter: str) -> None:
    """``python`` and ``python3`` scripts that stand for the image's interpreter (a symlink would lose the venv)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("python", "python3"):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{interpreter}" "$@"\n')
        shim.chmod(0o755)


def launch(name: str, argv: list[str], env: dict[str, str], cwd: str, view: ContainerView, mode: str,
           scratch: Path) -> ContainerRun:
    """Start one container process through ``kube_sandbox.py`` (volumes, ``/dev/shm``, working directory, then
    the exec); a setup step or an exec that fails is a ``StartError`` worded like containerd's, with no process
    left. ``scratch`` is a folder of this machine's own that the container's setup may use."""
    scratch.mkdir(parents=True, exist_ok=True)
    read_end, write_end = os.pipe()
    try:
        process = subprocess.Popen(sandbox_argv(argv, cwd, view, mode, scratch, write_end), env=env, cwd=scratch,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True, pass_fds=(write_end,))
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as status:
        failure = status.read()  # end-of-file at the exec (close-on-exec) or at the sandbox's exit
    if failure:
        process.wait()
        assert process.stdout is not None
        process.stdout.close()
        return start_error(name, failure.decode(errors="replace"))
    digest = hashlib.sha256(f"{name}-{process.pid}-{time.time_ns()}".encode()).hexdigest()
    run = ContainerRun(name=name, started_at=now_rfc3339(), process=process, container_id=f"containerd://{digest}")
    threading.Thread(target=run.read_output, name=f"log-{name}-{process.pid}", daemon=True).start()
    return run


def cri_size(entry: tuple[int, bytes]) -> int:
    """The bytes a line takes in a CRI log file: ``<timestamp> stdout F <line>``."""
    return len(rfc3339_nano(entry[0])) + len(" stdout F ") + len(entry[1])


def select_lines(lines: list[tuple[int, bytes]], *, tail: int | None, since_ns: int | None) -> list[tuple[int, bytes]]:
    """``tailLines`` first (the last N lines of the file), then lines older than ``since`` are skipped, in the
    kubelet's order (``ReadLogs`` seeks to the tail, the writer drops ``timestamp.Before(since)``)."""
    if tail is not None and tail >= 0:
        lines = lines[-tail:] if tail > 0 else []
    if since_ns is not None:
        lines = [entry for entry in lines if entry[0] >= since_ns]
    return lines


def format_line(entry: tuple[int, bytes], timestamps: bool) -> bytes:
    """One log line, prefixed with its ``RFC3339NanoFixed`` timestamp and a space when asked."""
    ns, line = entry
    return (rfc3339_nano(ns).encode() + b" " + line) if timestamps else line


__all__ = ["ContainerRun", "INHERITED_ENV", "cri_size", "expand", "format_line", "launch", "python_shim", "rfc3339_nano",
           "select_lines", "start_error"]
