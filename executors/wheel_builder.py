"""The one way diloco's wheel is built: for the SageMaker code channel, for the replica image, for a user.

The wheel is packed from the diloco this interpreter imports (an editable install of a checkout, or a regular
install of a wheel: a user who ran ``pip install diloco`` has no source tree) with the installed distribution's own
metadata, so it needs no build tool at launch time and is byte-for-byte reproducible (fixed timestamps): the same
code uploads the same object. ``docker/Dockerfile`` builds the image's wheel with this same builder::

    python executors/wheel_builder.py --source . --output dist   # from a checkout: plain install, then pack
    python -m diloco.executors.wheel_builder --output dist       # from the installed diloco

Only the standard library is imported here: the script runs before anything else of diloco is installed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import importlib.util
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

#: The import names that setup.py maps to their own folders (``diloco/``, ``executors/``, ``cli/``): in a regular
#: install the last two sit inside the first, in an editable one each is its own folder.
PACKAGE_ROOTS = ("diloco", "diloco.executors", "diloco.cli")
#: Files of the installed distribution's metadata that travel with the wheel (METADATA's headers: version,
#: Requires-Dist with its extras; entry_points.txt: the ``diloco`` console script and any other entry point).
METADATA_FILES = ("METADATA", "entry_points.txt")
#: Never shipped: compiled caches that an interpreter writes next to the sources.
_SKIPPED_DIRS = frozenset({"__pycache__"})
_SKIPPED_SUFFIXES = (".pyc", ".pyo")
#: Every entry of the archive carries this timestamp, so equal files give an equal wheel.
_EPOCH = (2020, 1, 1, 0, 0, 0)


def _error(message: str, *, hint: str) -> Exception:
    """A ``BackendError``, imported only here: as a script (``--source``) this file runs before diloco is
    importable, and only the packing step, which runs with diloco importable, can fail this way."""
    from diloco.errors import BackendError

    return BackendError(message, hint=hint)


def build_wheel() -> tuple[str, bytes]:
    """``(file name, bytes)`` of a wheel of the installed diloco: every file of its packages (walked from the
    folders the interpreter imports them from, so a new module or subpackage is never left out) plus the installed
    METADATA and entry points."""
    distribution = _distribution()
    files = dict(_package_files())
    dist_info = f"diloco-{distribution.version}.dist-info"
    for name in METADATA_FILES:
        text = distribution.read_text(name)
        if text is not None:
            files[f"{dist_info}/{name}"] = (_without_description(text) if name == "METADATA" else text).encode()
    if f"{dist_info}/METADATA" not in files:
        raise _error("the installed diloco has no METADATA", hint="reinstall diloco")
    files[f"{dist_info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: diloco\nRoot-Is-Purelib: true\n"
                                   b"Tag: py3-none-any\n")
    record = [f"{name},sha256={_urlsafe_digest(data)},{len(data)}" for name, data in sorted(files.items())]
    files[f"{dist_info}/RECORD"] = ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in sorted(files.items()):
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return f"diloco-{distribution.version}-py3-none-any.whl", buf.getvalue()


def _without_description(metadata: str) -> str:
    """METADATA's headers only: the long description (the whole README, after the first blank line) installs
    nothing, adds its size to every job's download, and in an editable install is the README of install time."""
    headers = metadata.split("\n\n", 1)[0].splitlines()
    return "".join(f"{line}\n" for line in headers if not line.startswith("Description-Content-Type:"))


def _distribution() -> importlib.metadata.Distribution:
    """The installed distribution that carries wheel metadata (``*.dist-info/METADATA``). An editable install made
    with an older pip leaves a ``diloco.egg-info`` (PKG-INFO, no METADATA) in the checkout, which comes first on
    ``sys.path`` when the current directory is the checkout: it is skipped, not taken for the install."""
    for distribution in importlib.metadata.distributions(name="diloco"):
        if distribution.read_text("METADATA") is not None:
            return distribution
    raise _error("diloco's metadata is not installed, so there is no wheel to build",
                 hint="install diloco (`pip install -e .` in a checkout)")


def _package_files() -> Iterator[tuple[str, bytes]]:
    """``(path in the wheel, bytes)`` of every file in every package under :data:`PACKAGE_ROOTS`, each once."""
    seen: set[str] = set()
    for package in PACKAGE_ROOTS:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise _error(f"cannot find the installed {package} package to ship it",
                         hint="reinstall diloco (`pip install -e .` in its checkout)")
        root = Path(list(spec.submodule_search_locations)[0])
        prefix = package.replace(".", "/")
        for path in _package_tree(root):
            name = f"{prefix}/{path.relative_to(root).as_posix()}"
            if name not in seen:
                seen.add(name)
                yield name, path.read_bytes()


def _package_tree(folder: Path) -> Iterator[Path]:
    """The files of a package folder and of every subpackage (a folder with ``__init__.py``) below it, sorted."""
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            if path.name not in _SKIPPED_DIRS and (path / "__init__.py").is_file():
                yield from _package_tree(path)
        elif path.is_file() and path.suffix not in _SKIPPED_SUFFIXES:
            yield path


def _urlsafe_digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(output: Path) -> Path:
    """Build the wheel into the ``output`` folder; its path."""
    name, data = build_wheel()
    output.mkdir(parents=True, exist_ok=True)
    (output / name).write_bytes(data)
    return output / name


def build_from_source(source: Path, output: Path, *, pip_args: Sequence[str] = ()) -> Path:
    """A checkout's wheel, by the same builder: install the checkout (``pip install --no-deps --target``, the
    regular, non-editable install a user gets) into a scratch folder, then pack that install in a clean
    interpreter (``-S``: no site-packages, so no other diloco can be picked up)."""
    with tempfile.TemporaryDirectory(prefix="diloco-wheel-") as scratch:
        site = Path(scratch) / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-input", "--disable-pip-version-check",
                        "--no-deps", "--no-compile", "--target", str(site), *pip_args, str(source)], check=True)
        env = {**os.environ, "PYTHONPATH": str(site)}
        done = subprocess.run([sys.executable, "-S", "-m", "diloco.executors.wheel_builder", "--output",
                               str(output.resolve())], env=env, cwd=scratch, check=True, capture_output=True,
                              text=True)
    return Path(done.stdout.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--output", type=Path, default=Path("dist"), help="folder for the wheel (default: dist)")
    parser.add_argument("--source", type=Path, default=None,
                        help="a diloco checkout to build from (default: the installed diloco)")
    parser.add_argument("--no-build-isolation", action="store_true",
                        help="with --source: build with this environment's setuptools instead of a fresh one")
    args = parser.parse_args(argv)
    try:
        if args.source is not None:
            wheel = build_from_source(args.source, args.output,
                                      pip_args=["--no-build-isolation"] if args.no_build_isolation else [])
        else:
            wheel = write_wheel(args.output)
    except subprocess.CalledProcessError as exc:
        sys.stderr.write(f"wheel_builder: error: {exc}\n{exc.stderr or ''}")
        return 1
    except Exception as exc:
        hint = getattr(exc, "hint", None)
        if hint is None:
            raise
        sys.stderr.write(f"wheel_builder: error: {exc} ({hint})\n")
        return 1
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
