"""No image to build: a wheel of the installed diloco, a bootstrap script and the user's source, shipped as the jobs' ``code`` input channel."""

from __future__ import annotations

import fnmatch
import gzip
import io
import tarfile
from collections.abc import Sequence
from pathlib import Path

from diloco.errors import ConfigError
from diloco.executors.wheel_builder import build_wheel  # noqa: F401  (the code channel's wheel: the one builder)

# ---------------------------------------------------------------------------------------------- shipping code
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


def pack_source(source: Path, max_bytes: int) -> bytes:
    """The source directory as a reproducible tar.gz, honouring the ignore file; ``ConfigError`` above
    ``max_bytes`` of files (naming the largest ones)."""
    if not source.is_dir():
        raise ConfigError(f"backend.source_dir: {source} is not a directory", hint="pass --source-dir DIR")
    patterns = [*SOURCE_EXCLUDES, *_ignore_patterns(source)]
    chosen: list[tuple[str, Path]] = []
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source).as_posix()
        if path.is_file() and not path.is_symlink() and not _ignored(relative, patterns):
            chosen.append((relative, path))
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


#: Runs first in a job without a ready image: install the shipped wheel (and whatever requirement of it the
#: image lacks) into /opt/ml/diloco/site, unpack the source into /opt/ml/code, then exec the replica entrypoint
#: there. Paths are derived from this file's own location (the ``code`` channel), never spelled out.
BOOTSTRAP_SCRIPT = r'''"""diloco's no-image bootstrap (written by diloco launch): install, unpack, exec the entrypoint."""
import glob
import importlib.metadata
import os
import subprocess
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))  # /opt/ml/input/data/code
OPT_ML = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # /opt/ml
SITE = os.path.join(OPT_ML, "diloco", "site")
WORK = os.path.join(OPT_ML, "code")
PIP = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input", "--disable-pip-version-check",
       "--no-cache-dir", "--target", SITE]


def fail(message):
    try:
        with open(os.path.join(OPT_ML, "output", "failure"), "w") as f:
            f.write("diloco bootstrap: " + message)
    except OSError:
        pass
    print("diloco bootstrap: error: " + message, file=sys.stderr, flush=True)
    sys.exit(1)


def missing_requirements(wheel_site):
    """Requirements of the installed wheel that this image does not satisfy (pip's own packaging decides)."""
    from pip._vendor.packaging.requirements import Requirement

    metadata = glob.glob(os.path.join(wheel_site, "diloco-*.dist-info", "METADATA"))
    wanted = []
    for line in open(metadata[0]).read().splitlines() if metadata else []:
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line[len("Requires-Dist: "):])
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            wanted.append(str(req))
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            wanted.append(str(req))
    return wanted


def main():
    wheels = sorted(glob.glob(os.path.join(HERE, "*.whl")))
    if not wheels:
        fail("no wheel in the code channel " + HERE)
    os.makedirs(SITE, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    if subprocess.run(PIP + ["--no-deps", wheels[-1]]).returncode:
        fail("pip could not install " + os.path.basename(wheels[-1]))
    missing = missing_requirements(SITE)
    if missing:
        print("diloco bootstrap: installing what the image lacks: " + ", ".join(missing), flush=True)
        if subprocess.run(PIP + missing).returncode:
            fail("pip could not install " + ", ".join(missing))
    archive = os.path.join(HERE, "source.tar.gz")
    if os.path.exists(archive):
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(WORK, filter="data")
            else:
                tar.extractall(WORK)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SITE, WORK] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    print("diloco bootstrap: installed %s into %s; running python %s" % (os.path.basename(wheels[-1]), SITE,
          " ".join(sys.argv[1:3])), flush=True)
    os.chdir(WORK)
    os.execve(sys.executable, [sys.executable] + sys.argv[1:], env)


if __name__ == "__main__":
    main()
'''


