"""Where a command writes its file (``collect``'s model, ``plot``'s PNG): one rule for every ``--output PATH``.

* A path that names a directory (one that exists, or any path ending in ``/``) gets the command's default file
  name inside it: ``--output models/`` writes ``models/<run_id>.safetensors``.
* Anything else is the file itself.
* Missing directories on the way are created when the file is written (as ``mkdir -p`` would), not when the path
  is checked: a command that waits hours for a run and then writes nothing leaves no empty directory behind.

The path is checked before any waiting, so a typo costs nothing: the nearest directory that exists must be
writable, nothing on the way may be a file, and it may not be on a kernel filesystem (``/proc``, ``/sys``:
the same refusal ``--rendezvous`` gets). Standard library and ``diloco.local_dirs`` only: the CLI imports it.
"""

from __future__ import annotations

import os

from diloco.errors import ConfigError
from diloco.local_dirs import PSEUDO_FILESYSTEMS


def resolve_output(output: str | None, default_name: str, *, option: str = "--output") -> str:
    """The absolute file path ``output`` stands for (default: ``default_name`` in the current directory), checked
    as the module docstring says; ``ConfigError`` naming ``option`` otherwise."""
    if output is not None and not output.strip():
        raise ConfigError(f"{option}: must be a file or directory path (got '')")
    text = os.path.expanduser(output) if output is not None else os.curdir
    names_directory = text.endswith(("/", os.sep)) or os.path.isdir(text)
    path = os.path.abspath(os.path.join(text, default_name) if names_directory else text)
    if any(path == p or path.startswith(p + "/") for p in PSEUDO_FILESYSTEMS):  # writable by os.access, for root
        raise ConfigError(f"{option}: {path} is on a kernel filesystem, which cannot hold files",
                          hint="use a directory on a disk, e.g. under $HOME or /tmp")
    if os.path.isdir(path):
        raise ConfigError(f"{option}: {path} is a directory, not a file",
                          hint="give a file path, or a directory to write the default file name in")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise ConfigError(f"{option}: {path} is not a regular file")
    check_can_create(os.path.dirname(path), option=option)
    return path


def check_can_create(directory: str, *, option: str = "--output") -> None:
    """``directory`` exists and is writable, or can be created: its nearest existing ancestor is a writable
    directory (a file in the way, or a read-only ancestor, is a ``ConfigError`` now rather than after the wait)."""
    probe = directory
    while not os.path.exists(probe):
        if os.path.lexists(probe):  # a dangling symlink: creating through it would fail later
            raise ConfigError(f"{option}: {probe} is a broken symbolic link", hint="remove it or choose another path")
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{option}: {probe} is a file, so {directory} cannot be a directory",
                          hint="choose a path whose directories are directories")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "write in" if probe == directory else f"create {directory} in"
        raise ConfigError(f"{option}: cannot {what} {probe} (permission denied)", hint="choose a writable path")


def make_parent(path: str) -> None:
    """Create ``path``'s missing directories (the write that follows then lands where the user asked)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
