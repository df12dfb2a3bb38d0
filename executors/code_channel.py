"""No image to build, on every cloud: a wheel of the installed diloco, the bootstrap script and the user's source.

The three files are the run's code channel. SageMaker receives them as the jobs' ``code`` input channel; a
Kubernetes pod copies them from the run's store prefix into a shared volume before its replica container starts.
Either way the job's own interpreter runs ``python <channel>/diloco_bootstrap.py -m <entrypoint> <args>`` (see
``executors/bootstrap.py``), so one bootstrap and one wheel builder serve both backends."""

from __future__ import annotations

import fnmatch
import gzip
import io
import os
import tarfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.executors.replica_requirements import (
    BOOTSTRAP_REQUIREMENTS_ENV,
    REQUIREMENTS_TXT,
    replica_requirements,
    requirements_value,
    streams_hf_data,
)

if TYPE_CHECKING:
    from diloco.executors.base import LaunchSpec


from diloco.errors import ConfigError
from diloco.executors.wheel_builder import build_wheel  # noqa: F401  (the code channel's wheel: the one builder)

# ---------------------------------------------------------------------------------------------- shipping code
#: The file names of the code channel, the same on every backend (the bootstrap finds the wheel and the source
#: archive next to itself).
BOOTSTRAP_FILE = "diloco_bootstrap.py"
SOURCE_ARCHIVE = "source.tar.gz"
#: How large a source directory may be unless the backend's ``max_source_mb`` says otherwise.
DEFAULT_MAX_SOURCE_MB = 50.0
#: Always left out of a shipped source directory.
SOURCE_EXCLUDES = (".git", ".hg", ".venv", "venv", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache",
                   ".ruff_cache", "*.egg-info", "node_modules", ".DS_Store")


def _ignore_patterns(source: Path) -> list[str]:
    """``.dilocoignore`` if present, else ``.gitignore``: one glob per line (``#`` comments, ``dir/`` for
    directories, a leading ``/`` anchors to the source root; ``!`` negation is not supported)."""
    for name in (".dilocoignore", ".gitignore"):
        path = source / name
        if path.is_file():
            return [line.strip() for line in path.read_text(errors="replace").splitlines()
                    if line.strip() and not line.lstrip().startswith(("#", "!"))]
    return []


def _ignored(relative: str, patterns: Sequence[str]) -> bool:
    parts = relative.split("/")
    for raw in patterns:
        pattern = raw.rstrip("/")
        if raw.startswith("/") or "/" in pattern.strip("/"):
            anchored = pattern.lstrip("/")
            if fnmatch.fnmatchcase(relative, anchored) or relative.startswith(anchored + "/"):
                return True
        elif any(fnmatch.fnmatchcase(part, pattern) for part in parts):
            return True
    return False


def _shipped_files(source: Path, patterns: Sequence[str]) -> list[tuple[str, Path]]:
    """(path under ``source``, path) of every regular file to ship, sorted. An ignored directory is pruned, not
    walked: a project's ``.venv`` or ``node_modules`` holds 100,000 files that would each be listed and matched
    against every pattern (seconds at every launch) only to be left out; everything under an ignored directory is
    ignored anyway. Symbolic links are neither shipped nor followed."""
    chosen: list[tuple[str, Path]] = []
    for directory, subdirectories, files in os.walk(source):
        base = Path(directory).relative_to(source).as_posix()
        prefix = "" if base == "." else base + "/"
        subdirectories[:] = [name for name in subdirectories
                             if not os.path.islink(os.path.join(directory, name))
                             and not _ignored(prefix + name, patterns)]
        for name in files:
            path = Path(directory, name)
            if not path.is_symlink() and path.is_file() and not _ignored(prefix + name, patterns):
                chosen.append((prefix + name, path))
    return sorted(chosen, key=lambda item: item[0].split("/"))  # by parts: a/b before a-c, as paths sort


def pack_source(source: Path, max_bytes: int) -> bytes:
    """The source directory as a reproducible tar.gz, honouring the ignore file; ``ConfigError`` above
    ``max_bytes`` of files (naming the largest ones)."""
    if not source.is_dir():
        raise ConfigError(f"backend.source_dir: {source} is not a directory", hint="pass --source-dir DIR")
    chosen = _shipped_files(source, [*SOURCE_EXCLUDES, *_ignore_patterns(source)])
    total = sum(p.stat().st_size for _, p in chosen)
    if total > max_bytes:
        biggest = sorted(chosen, key=lambda item: -item[1].stat().st_size)[:3]
        names = ", ".join(f"{r} ({p.stat().st_size / 2**20:.1f} MB)" for r, p in biggest)
        raise ConfigError(f"backend.source_dir: {source} holds {total / 2**20:.1f} MB to ship (limit "
                          f"{max_bytes / 2**20:g} MB; largest: {names})",
                          hint="list large paths in .dilocoignore, point --source-dir at your code only, or raise "
                               "backend.max_source_mb")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for relative, path in chosen:
            info = tarfile.TarInfo(relative)
            info.size, info.mtime, info.mode = path.stat().st_size, 0, 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    return gzip.compress(raw.getvalue(), mtime=0)


def ships(source: Path, relative: str) -> bool:
    """Whether ``pack_source(source)`` would include the file ``relative`` (its path under ``source``)."""
    path = source / relative
    return path.is_file() and not path.is_symlink() and not _ignored(
        relative, [*SOURCE_EXCLUDES, *_ignore_patterns(source)])


def bootstrap_environment(spec: LaunchSpec, source: Path) -> dict[str, str]:
    """The request's environment entry telling the bootstrap what to install beyond diloco's own requirements
    (``diloco.executors.replica_requirements``): shown by ``--dry-run``, read by the job."""
    args = spec.entrypoint_args
    requirements = replica_requirements(trainer=args.trainer, rendezvous_uri=args.rendezvous_uri,
                                        tensorboard=args.tensorboard is not None, source_dir=source,
                                        ships_requirements_txt=ships(source, REQUIREMENTS_TXT),
                                        trackers=tuple(name for name, run in (("mlflow", args.mlflow_run_id),
                                                                              ("wandb", args.wandb_run_id)) if run),
                                        hf_data=streams_hf_data(args.trainer_kwargs))
    return {BOOTSTRAP_REQUIREMENTS_ENV: requirements_value(requirements)}


#: Runs first in a job without a ready image (``executors/bootstrap.py``, shipped as it is): install the shipped
#: wheel (and whatever requirement of it the image lacks), unpack the source, then exec the replica entrypoint.
BOOTSTRAP_SCRIPT = resources.files("diloco.executors").joinpath("bootstrap.py").read_text(encoding="utf-8")


def source_directory(configured: str | None) -> Path:
    """The directory shipped as the user's source: ``backend.source_dir``, else the working directory."""
    import os

    return Path(configured or os.getcwd()).expanduser().resolve()


def code_files(source: Path, max_source_mb: float) -> list[tuple[str, bytes]]:
    """The code channel's files, in upload order: (name, bytes) of the wheel, the bootstrap and the source
    tarball. ``ConfigError`` for a source directory above ``max_source_mb`` (nothing is uploaded then)."""
    archive = pack_source(source, int(max_source_mb * 2**20))
    wheel_name, wheel = build_wheel()
    return [(wheel_name, wheel), (BOOTSTRAP_FILE, BOOTSTRAP_SCRIPT.encode()), (SOURCE_ARCHIVE, archive)]
