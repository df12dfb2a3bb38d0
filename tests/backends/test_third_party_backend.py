"""A third party's backend, in a package outside this repository, registered through the ``diloco.backends``
entry point the standard way (a ``*.dist-info/entry_points.txt`` that ``importlib.metadata`` reads), passes the
shipped conformance suite from its own test module and is a backend the CLI launches.

The package is ``tests/backends/third_party_backend`` (a backend that runs each replica as a subprocess under a runner of its
own), copied into a temporary directory with a ``pyproject.toml`` declaring the entry point; its own test module
is run by ``python -m pytest`` in a subprocess, from there, as its authors would run it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.executors.testing import BackendCase, BackendConformance

SOURCE = Path(__file__).resolve().parent / "third_party_backend"
#: The package's entry points, written into its pyproject.toml and, as an installer would, its dist-info.
ENTRY_POINTS = {"diloco.backends": {"subproc": "diloco_subproc:SubprocBackend"}}
SUITE_TESTS = sorted(name for name in dir(BackendConformance) if name.startswith("test_"))


def pyproject() -> str:
    lines = ['[project]', 'name = "diloco-subproc"', 'version = "0.1"', 'dependencies = ["diloco"]',
             '[project.optional-dependencies]', 'test = ["pytest"]']
    for group, points in ENTRY_POINTS.items():
        lines.append(f'[project.entry-points."{group}"]')
        lines += [f'{name} = "{target}"' for name, target in points.items()]
    return "\n".join(lines) + "\n"


def entry_points_txt() -> str:
    return "".join(f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
                   for group, points in ENTRY_POINTS.items())


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The third party's project, outside the repository, importable with its entry point registered."""
    root = tmp_path / "diloco-subproc"
    shutil.copytree(SOURCE / "diloco_subproc", root / "diloco_subproc")
    (root / "tests").mkdir()
    shutil.copy(SOURCE / "check_conformance.py", root / "tests" / "test_conformance.py")
    (root / "pyproject.toml").write_text(pyproject())
    info = root / "diloco_subproc-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: diloco-subproc\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points_txt())
    return root


def environment(project: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DILOCO_"))}
    return {**env, "PYTHONPATH": str(project), "DILOCO_HOME": str(project.parent / "home"), "NO_COLOR": "1"}


def test_a_third_party_backend_passes_the_shipped_conformance_suite_from_its_own_tests(project: Path) -> None:
    assert not project.is_relative_to(Path(__file__).resolve().parents[2])  # outside the repository
    # Each suite test waits at most a few times the case's patience; the rest is the interpreter starting.
    deadline = 120 + len(SUITE_TESTS) * 4 * BackendCase.patience_s
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests"], cwd=project,
                          env=environment(project), capture_output=True, text=True, timeout=deadline)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passed = sorted(re.findall(r"::TestSubprocBackend::(test_\w+) PASSED", done.stdout))
    assert passed == SUITE_TESTS, done.stdout[-4000:]  # every test of the suite ran, and passed


def test_the_cli_plans_a_run_on_the_third_party_backend(project: Path) -> None:
    env = environment(project)
    out = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", "--backend", "subproc", "-n", "3",
                          "--steps", "20", "--sync-every", "10", "--dry-run", "-o", "json"], cwd=project, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["backend"] == "subproc" and [r["rank"] for r in plan["requests"]] == [0, 1, 2]
    assert plan["requests"][0]["argv"][1:3] == ["-m", "diloco.replica.entrypoint"]

    # The backend's own flag: declared on its config model, listed in its help panel, routed into its config.
    helped = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", "--help"], cwd=project, env=env,
                            capture_output=True, text=True, timeout=240)
    assert helped.returncode == 0, helped.stderr
    panel = helped.stdout.split("Backend options (subproc)", 1)
    assert len(panel) == 2 and "--subproc-grace" in panel[1], helped.stdout
    flagged = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", "--backend", "subproc",
                              "--subproc-grace", "2.5", "--dry-run", "-o", "json"], cwd=project, env=env,
                             capture_output=True, text=True, timeout=240)
    assert flagged.returncode == 0, flagged.stderr
    assert {r["grace_s"] for r in json.loads(flagged.stdout)["requests"]} == {2.5}

    bad = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", "--backend", "subproc", "--set",
                          "backend.grace=2", "--dry-run"], cwd=project, env=env, capture_output=True, text=True,
                         timeout=240)
    assert bad.returncode == 2 and "backend.grace: unknown key for the subproc backend" in bad.stderr

    shutil.rmtree(project / "diloco_subproc-0.1.dist-info")  # the module is still importable, but not registered
    gone = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", "--backend", "subproc", "--dry-run"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=240)
    assert gone.returncode == 2 and "backend: must be one of" in gone.stderr and "subproc" in gone.stderr


def test_the_wheel_ships_the_suite_and_its_stand_in_replica() -> None:
    """What a third party installs from the wheel holds the suite (so ``pip install diloco pytest`` is enough)."""
    import io
    import zipfile

    from diloco.executors.wheel_builder import build_wheel

    _, wheel = build_wheel()
    with zipfile.ZipFile(io.BytesIO(wheel)) as zf:
        names = set(zf.namelist())
    assert {"diloco/executors/testing/__init__.py", "diloco/executors/testing/conformance.py",
            "diloco/executors/testing/fake_replica.py"} <= names


def test_the_stand_in_replica_needs_no_pytest() -> None:
    """A replica imports ``diloco.executors.testing.fake_replica`` where only diloco is installed."""
    code = ("import sys, diloco.executors.testing.fake_replica\n"
            "print(sorted(m for m in ('pytest', 'torch', 'boto3') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
