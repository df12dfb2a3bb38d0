"""Whether a local directory a run will write (its ``file://`` rendezvous, its TensorBoard directory) can be created
and written, checked before anything is launched.

Why here: both checks must say the same things in the same words (a kernel filesystem, a path under a regular
file, a read-only mount or a directory without write permission), and the replica side checks its TensorBoard
directory too, so this module stays free of the launcher: the standard library and ``diloco.errors`` only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from diloco.errors import ConfigError

#: Where no run's data belongs: kernel filesystems accept a path and then refuse every write.
PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")


#: Schemes a path written as ``scheme:/...`` almost surely meant as a URI, one slash short.
URI_SCHEMES = ("s3", "file", "memory", "gs", "gcs", "az", "abfs", "http", "https")


def refuse_scheme_without_slashes(value: str, field: str, *, example: str) -> None:
    """``ConfigError`` for ``s3:/bucket/x`` and the like: taken as a path it would quietly become a local
    directory named ``s3:`` under the working directory."""
    scheme = value.split(":", 1)[0].lower() if ":" in value and "://" not in value else ""
    if scheme in URI_SCHEMES:
        raise ConfigError(f"{field}: {value!r} is neither a path nor a URI ({scheme}: needs two slashes)",
                          hint=f"write {scheme}://... (e.g. {example}), or a plain path")


def absolute_path(path: str) -> str:
    """``path`` with ``~`` expanded and made absolute against this process's working directory."""
    return os.path.abspath(os.path.expanduser(path))


def nearest_existing(path: Path) -> Path:
    """``path`` itself if it exists, else its closest ancestor that does (what creating it would write into)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def check_writable_dir(path: str, field: str, *, probe: bool = False) -> None:
    """``ConfigError`` naming ``field`` unless the absolute ``path`` is, or can become, a directory this process
    can write: not on a kernel filesystem, its nearest existing ancestor a directory, writable (``os.access``
    honours a read-only mount for every user, root included).

    ``probe`` also creates and deletes one temporary file in that ancestor, which catches what ``os.access``
    cannot see (an NFS server's root squashing, ACLs, a full disk's refusals) and leaves nothing behind: the
    directory itself is not created, so a launch refused later has nothing to undo here."""
    if any(path == p or path.startswith(p + "/") for p in PSEUDO_FILESYSTEMS):
        raise ConfigError(f"{field}: {path} is on a kernel filesystem, which cannot hold files",
                          hint="use a directory on a disk, e.g. under $HOME or /tmp")
    existing = nearest_existing(Path(path))
    if not existing.is_dir():
        raise ConfigError(f"{field}: {existing} is a file, so {path} cannot be a directory",
                          hint="choose a path that is (or can become) a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}: cannot create or write {path}: {existing} is not writable "
                          f"(read-only or permission denied)", hint="choose a writable directory")
    if not probe:
        return
    try:
        fd, name = tempfile.mkstemp(prefix=".diloco-probe-", dir=existing)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot create or write {path}: {exc.strerror or exc}",
                          hint="choose a writable directory on a local disk") from None
