"""Where ``--tensorboard DIR`` (``metrics.tensorboard``) is written, and whether it can be: the layout and the check
the launcher (at launch, and to give each run its directory) and every replica (before training) share. The
writer is ``diloco.replica.tensorboard``.

Layout: ``DIR/<run_id>/rank_RRRR/`` for a launched run (``run_directory``, ``rank_dir``); a replica started by
hand with ``--tensorboard DIR`` writes ``DIR/rank_RRRR/``. DIR is a local directory (a path, ``~/...``, or
``file://``) or an ``s3://`` prefix.
"""

from __future__ import annotations

import importlib.util

from diloco.errors import ConfigError
from diloco.local_dirs import absolute_path, check_writable_dir, refuse_scheme_without_slashes

FIELD = "metrics.tensorboard (--tensorboard)"
_INSTALL_HINT = "pip install tensorboard (or the diloco[hf] extra), or drop --tensorboard"


def check_tensorboard(directory: str, *, on_this_machine: bool = True, probe: bool = False) -> None:
    """Whether ``--tensorboard DIR`` can work: a local directory that can be created and written, or an ``s3://``
    prefix, and the ``tensorboard`` package importable here (found, not imported). ``ConfigError`` naming the flag
    otherwise. ``probe`` (at launch) also writes and deletes one temporary file where DIR will be created
    (``diloco.local_dirs.check_writable_dir``).

    ``on_this_machine=False`` (a backend that runs the replicas on machines of its own: SageMaker, EKS): the
    package is the image's business (each replica checks it at start), and a local directory would stay on those
    machines, so only an ``s3://`` prefix is accepted."""
    if not isinstance(directory, str) or not directory.strip():
        raise ConfigError(f"{FIELD}: empty directory",
                          hint="pass a local directory or an s3:// prefix, e.g. --tensorboard ./tb")
    refuse_scheme_without_slashes(directory, FIELD, example="s3://<bucket>/tb")
    scheme = _scheme(directory)
    if scheme not in ("", "file", "s3"):
        raise ConfigError(f"{FIELD}: {directory} is a {scheme}:// URI; events are written to a local directory or "
                          f"an s3:// prefix", hint="pass a local directory or an s3:// prefix")
    if not on_this_machine:
        if scheme != "s3":
            raise ConfigError(f"{FIELD}: {directory} would be written on the replicas' own machines, which this "
                              f"backend does not keep",
                              hint="pass an s3:// prefix, e.g. --tensorboard s3://<bucket>/tb/")
        return
    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"{FIELD}: the tensorboard package is not installed here", hint=_INSTALL_HINT)
    if scheme != "s3":
        check_writable_dir(local_directory(directory), FIELD, probe=probe)


def _scheme(directory: str) -> str:
    return directory.split("://", 1)[0].lower() if "://" in directory else ""


def local_directory(directory: str) -> str:
    """A local DIR (a path, ``~/...``, relative, or ``file://``) as the absolute path it names here."""
    return absolute_path(directory[len("file://"):] if _scheme(directory) == "file" else directory)


def normalized(directory: str) -> str:
    """DIR as the launcher records it: an ``s3://`` prefix without its trailing slash, a local directory as its
    absolute path (resolved against the launcher's working directory, ``~`` expanded), so the replicas and a
    later relaunch from another directory write to the same place."""
    return directory.rstrip("/") if _scheme(directory) == "s3" else local_directory(directory)


def run_directory(directory: str, run_id: str) -> str:
    """The run's own directory under DIR (``DIR/<run_id>``), given to its replicas: runs into one DIR stay apart."""
    return f"{normalized(directory)}/{run_id}"


def rank_dir(rank: int) -> str:
    """Each rank's run directory under DIR."""
    return f"rank_{rank:04d}"
