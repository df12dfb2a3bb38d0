"""A directory that really refuses writes, for tests of what a launch does with one.

Permission bits (``chmod 0555``) stop an ordinary user; they do not stop root, who writes through them. As root the
directory is instead bind-mounted read-only onto itself inside a private mount namespace (``unshare --mount``)
that only the command under test lives in: the kernel answers every write with EROFS, as on a read-only mount,
and the mount disappears with the command, so nothing outlives the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_BIND_READ_ONLY = 'mount --bind -o ro "$0" "$0" && exec "$@"'


@contextmanager
def read_only(directory: Path) -> Iterator[list[str]]:
    """Yield the prefix under which a command sees ``directory`` read-only (empty for an ordinary user, whose
    directory is ``chmod 0555`` for the duration). Checked: a file cannot be created there under the prefix."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            _assert_refuses_writes([], directory)
            yield []
        finally:
            directory.chmod(0o755)
        return
    prefix = ["unshare", "--mount", "sh", "-c", _BIND_READ_ONLY, str(directory)]
    if shutil.which("unshare") is None:
        pytest.skip("running as root, where permission bits do not stop writes, and without unshare(1) for a "
                    "read-only mount")
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"running as root, where permission bits do not stop writes, and a read-only bind mount is "
                    f"refused here: {probe.stderr.strip()}")
    _assert_refuses_writes(prefix, directory)
    yield prefix


def _assert_refuses_writes(prefix: list[str], directory: Path) -> None:
    attempt = subprocess.run([*prefix, sys.executable, "-c", "import sys; open(sys.argv[1], 'w')",
                              str(directory / "probe")], capture_output=True, text=True, timeout=60)
    assert attempt.returncode != 0, f"{directory} accepted a write: the test would prove nothing"
    assert not (directory / "probe").exists()
