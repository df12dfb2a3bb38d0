"""A user's fresh virtual environment with diloco's wheel installed the way docker/Dockerfile installs it.

* ``image_wheel`` (session): the wheel built exactly as the Dockerfile's ``wheel`` stage builds it: the files that
  stage COPYs (read from the Dockerfile, so a file the build needs but the Dockerfile forgets fails here), copied
  into a scratch folder, and the stage's own RUN line (``executors/wheel_builder.py --source .``), with this
  environment's setuptools instead of a freshly downloaded one (``--no-build-isolation``).
* ``wheel_venv`` (session): a fresh ``python -m venv`` with that wheel ``pip install``ed (not editable), as the
  image's final stage does.

Installing torch and every other dependency into a fresh environment from the package index takes minutes, so
the fresh environment borrows this (development) environment's installed packages: a ``.pth`` file in its
site-packages names the development site-packages, and the wheel is installed with ``--no-deps``. A folder named by
a ``.pth`` line joins ``sys.path`` after the environment's own site-packages but is not a site directory, so its
own ``.pth`` files, among them the editable install's finder, are not processed: the checkout's diloco is
invisible there and every diloco module comes from the wheel (``FreshVenv.imported_from_itself`` checks it).

Both are built once per test session, also under pytest-xdist: the workers share them through the session's common
temporary folder, the first to need one building it under a file lock while the others wait for it.

Use from a test module: ``from wheel_venv import image_wheel, wheel_venv  # noqa: F401`` (pytest fixtures).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
#: The source folders and the import names they are installed as (setup.py's PACKAGE_DIR).
SOURCE_PACKAGES = {"diloco": "diloco", "executors": "diloco.executors", "cli": "diloco.cli"}


# ------------------------------------------------------------------------------------------ what a wheel holds
def tree_modules(root: Path = ROOT) -> set[str]:
    """Every module and package of the source tree, by import name: each ``.py`` under diloco/, executors/, cli/."""
    names: set[str] = set()
    for folder, package in SOURCE_PACKAGES.items():
        for path in (root / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.add(".".join([package, *parts]))
    return names


def wheel_modules(wheel: bytes) -> set[str]:
    """Every module and package a wheel installs, by import name."""
    names: set[str] = set()
    with zipfile.ZipFile(io.BytesIO(wheel)) as zf:
        for name in zf.namelist():
            if name.endswith(".py") and ".dist-info/" not in name:
                parts = name[: -len(".py")].split("/")
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                names.add(".".join(parts))
    return names


# ----------------------------------------------------------------------------------------- the Dockerfile's way
@dataclass(frozen=True)
class WheelStage:
    """The Dockerfile's ``wheel`` stage: what it copies (source -> destination, relative to its WORKDIR) and the
    command it runs."""

    copies: list[tuple[str, str]]
    run: list[str]


def wheel_stage(dockerfile: Path = DOCKERFILE) -> WheelStage:
    lines = [line.strip() for line in dockerfile.read_text().splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("FROM ") and line.endswith(" AS wheel"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("FROM ")), len(lines))
    copies: list[tuple[str, str]] = []
    run: list[str] = []
    for line in lines[start + 1:end]:
        if line.startswith("COPY "):
            *sources, dest = shlex.split(line[len("COPY "):])
            copies += [(source, dest) for source in sources]
        elif line.startswith("RUN "):
            assert not run, "the wheel stage runs one command"
            run = shlex.split(line[len("RUN "):])
    assert copies and run, f"no COPY/RUN in the wheel stage of {dockerfile}"
    return WheelStage(copies=copies, run=run)


def build_like_the_image(scratch: Path) -> Path:
    """The wheel the Dockerfile's wheel stage builds, built the same way in ``scratch``; its path."""
    stage = wheel_stage()
    src, dist = scratch / "src", scratch / "dist"
    src.mkdir(parents=True)
    for source, dest in stage.copies:
        target = src / dest if not dest.endswith("/") else src / dest / Path(source).name
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / source, target)
    assert stage.run[0] == "python" and "--output" in stage.run, stage.run
    argv = [sys.executable, *stage.run[1:], "--no-build-isolation"]
    argv[argv.index("--output") + 1] = str(dist)
    done = subprocess.run(argv, cwd=src, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = sorted(dist.glob("diloco-*.whl"))
    assert len(wheels) == 1 and done.stdout.strip() == str(wheels[0]), (wheels, done.stdout)
    return wheels[0]


# ----------------------------------------------------------------------------------------------- the fresh venv
@dataclass(frozen=True)
class FreshVenv:
    path: Path
    site: Path
    wheel: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def diloco(self) -> Path:
        return self.path / "bin" / "diloco"

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment as a user's shell in the fresh venv would have it: its bin first on PATH,
        no PYTHONPATH or other virtual environment leaking the checkout in."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env["PATH"] = os.pathsep.join([str(self.path / "bin"), env.get("PATH", "")])
        env["VIRTUAL_ENV"] = str(self.path)
        return {**env, **extra}

    def imported_from_itself(self, files: list[str]) -> list[str]:
        """The files in ``files`` that do not lie in the fresh venv's diloco (should be none)."""
        inside = str(self.site / "diloco") + os.sep
        return [f for f in files if not f.startswith(inside)]


def venv_site(path: Path) -> Path:
    """The site-packages folder of the virtual environment at ``path``, as its own interpreter names it."""
    return Path(subprocess.run([str(path / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, timeout=120).stdout.strip())


def create_fresh_venv(path: Path, wheel: Path) -> FreshVenv:
    """``python -m venv`` at ``path``, this environment's packages borrowed through a ``.pth``, and ``wheel``
    installed into it with pip (``--no-deps``: the dependencies are the borrowed ones)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    site = venv_site(path)
    borrowed = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "borrowed_dependencies.pth").write_text("".join(f"{p}\n" for p in borrowed))
    venv = FreshVenv(path=path, site=site, wheel=wheel)
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-input",
                              "--disable-pip-version-check", "--no-deps", "--no-compile", str(wheel)],
                             capture_output=True, text=True, env=venv.env(), cwd=path, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    return venv


#: Run by the fresh venv's python: where diloco, its metadata and the console script come from.
WHERE_FROM = """
import importlib.metadata, json, sys
import diloco, diloco.collectives.allreduce, diloco.collectives, diloco.executors.local, diloco.cli.main
dist = importlib.metadata.distribution("diloco")
print(json.dumps({"files": sorted(m.__file__ for n, m in sys.modules.items()
                                  if n.split(".")[0] == "diloco" and getattr(m, "__file__", None)),
                  "installed_in": str(dist.locate_file("")), "direct_url": json.loads(dist.read_text("direct_url.json"))}))
"""


def where_from(venv: FreshVenv, cwd: Path) -> dict[str, object]:
    done = subprocess.run([str(venv.python), "-c", WHERE_FROM], capture_output=True, text=True, env=venv.env(),
                          cwd=cwd, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# ------------------------------------------------------------------------------------ once per session, shared
def session_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every process of this test session shares: the xdist workers' common parent of their own
    temporary folders (``.../pytest-N/popen-gwK``), or this process's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(folder: Path, build: Callable[[Path], Path]) -> Path:
    """``build(folder / "work")``'s result, built by the first process that asks (under a lock on ``folder``)
    and recorded in ``folder / "built"``; every later caller, in any worker, gets the recorded path. A build that
    failed records nothing: the next caller builds again (and fails the same way, in its own test)."""
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / "built"
    with (folder / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            return Path(record.read_text())
        shutil.rmtree(folder / "work", ignore_errors=True)  # what a failed build in another worker left
        built = build(folder / "work")
        record.write_text(str(built))
        return built


@pytest.fixture(scope="session")
def image_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built_once(session_folder(tmp_path_factory) / "image-wheel", build_like_the_image)


@pytest.fixture(scope="session")
def wheel_venv(image_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> FreshVenv:
    path = built_once(session_folder(tmp_path_factory) / "fresh-venv",
                      lambda work: create_fresh_venv(work / "venv", image_wheel).path)
    return FreshVenv(path=path, site=venv_site(path), wheel=image_wheel)
