"""The ``diloco`` command as tests run it, in the two forms a user has: the installed console script, and the
module through the test's own interpreter (which needs no script on PATH and carries ``sys.executable``'s flags);
and the one way tests run it: ``run_cli`` (to the end) and ``start_cli`` (in the background), each in its own
``DILOCO_HOME``, with plain output and no debug tracebacks, as a user's shell would."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

#: The console script ``pip install`` puts beside this interpreter: what a user types.
DILOCO_SCRIPT = str(Path(sys.executable).with_name("diloco"))
#: The CLI as a module of this interpreter, for an argv list.
DILOCO_MODULE = [sys.executable, "-m", "diloco.cli.main"]
#: tests/: the working directory from which ``--trainer support.<module>:<fn>`` imports.
TESTS_DIR = str(Path(__file__).resolve().parents[1])


def cli_env(home: Path, *, env: Mapping[str, str] | None = None, restart_backoff_s: float | None = None,
            columns: int | None = None) -> dict[str, str]:
    """This process's environment with its own ``DILOCO_HOME``, ``NO_COLOR``, no ``DILOCO_DEBUG`` or terminal
    size (unless ``env`` or ``columns`` sets them), and ``restart_backoff_s`` as the relaunch backoff."""
    full = {**os.environ, "DILOCO_HOME": str(home), "NO_COLOR": "1"}
    for name in ("DILOCO_DEBUG", "COLUMNS", "LINES"):
        full.pop(name, None)
    if restart_backoff_s is not None:
        full["DILOCO_RESTART_BACKOFF_S"] = str(restart_backoff_s)
    if columns is not None:
        full["COLUMNS"] = str(columns)
    full.update(env or {})
    return full


def _argv(args: tuple[str, ...], script: bool) -> list[str]:
    return [DILOCO_SCRIPT, *args] if script else [*DILOCO_MODULE, *args]


def run_cli(*args: str, home: Path, cwd: Path | str = TESTS_DIR, timeout: float = 240,
            env: Mapping[str, str] | None = None, restart_backoff_s: float | None = None,
            columns: int | None = None, script: bool = False) -> subprocess.CompletedProcess[str]:
    """``diloco ARGS`` to its end, output captured. ``script``: the console script instead of the module form.
    ``timeout`` only bounds a hang: it is never what a test measures."""
    return subprocess.run(_argv(args, script), capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=cli_env(home, env=env, restart_backoff_s=restart_backoff_s, columns=columns))


def start_cli(*args: str, home: Path, cwd: Path | str = TESTS_DIR, env: Mapping[str, str] | None = None,
              restart_backoff_s: float | None = None, script: bool = False) -> subprocess.Popen[str]:
    """``diloco ARGS`` in the background, stdout and stderr piped."""
    return subprocess.Popen(_argv(args, script), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env=cli_env(home, env=env, restart_backoff_s=restart_backoff_s))


@contextmanager
def killed_if_still_running(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``with killed_if_still_running(start_cli(...)) as launch:``: a command started in the background that the
    block did not see to its end (an assertion failed, a wait timed out) is killed and reaped when the block ends,
    so no test leaves a launcher running."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
