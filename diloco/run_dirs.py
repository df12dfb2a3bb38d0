"""Where a run's local files live, and the one safe way to delete a run's directory.

Layout under ``$DILOCO_HOME`` (default ``~/.diloco``)::

    runs/<run_id>.json          the launcher's run record (``diloco.launcher.runs``)
    runs/<run_id>/store/        the default file:// rendezvous of a local run
    runs/<run_id>/logs/rank_<r> a local replica's logs and exit record

Both programs need these paths (the launcher records runs there, the local backend writes its replicas' logs and
store there, ``remove`` deletes them), so they are a shared basic: the standard library and ``diloco.errors`` only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from diloco import envvars
from diloco.errors import DilocoError


def diloco_home() -> Path:
    """``$DILOCO_HOME``, else ``~/.diloco``."""
    home = os.environ.get(envvars.DILOCO_HOME)
    return Path(home).expanduser().resolve() if home else Path.home() / ".diloco"


def runs_dir() -> Path:
    return diloco_home() / "runs"


def default_local_rendezvous(run_id: str) -> str:
    """``file://$DILOCO_HOME/runs/<run_id>/store``: each local run meets in its own fresh directory."""
    return f"file://{runs_dir() / run_id / 'store'}"


#: What a local run directory (``<log_root>/<run_id>/``) holds; one of them must be there before
#: ``remove_run_files`` deletes a directory, so a wrong path can never take an unrelated directory with it.
RUN_DIR_ENTRIES = ("handle.json", "logs", "store", "cancel_requested")


def remove_run_files(run_dir: str, *, dry_run: bool = False) -> list[str]:
    """The local backend's ``remove``: delete a finished run's directory (logs, exit records, handle, and the default
    ``file://`` store) and return what was (or, with ``dry_run``, would be) removed.

    The rule "only a directory that looks like a run directory" is stated here once; a symlink is unlinked, never
    followed. A missing directory is already removed (idempotent)."""
    if os.path.islink(run_dir):
        if not dry_run:
            os.unlink(run_dir)
        return [run_dir]
    if not os.path.isdir(run_dir):
        return []
    if not any(os.path.lexists(os.path.join(run_dir, name)) for name in RUN_DIR_ENTRIES):
        raise DilocoError(f"{run_dir} does not look like a run directory (none of {', '.join(RUN_DIR_ENTRIES)}); "
                          f"not removed", hint="remove it yourself if it is no longer needed")
    if not dry_run:
        shutil.rmtree(run_dir)
    return [run_dir]
