"""Backends declare their own flags: each backend's config fields that carry ``cli_flag(...)`` become options of
``diloco launch``, ``smoke`` and ``doctor``, listed under that backend's own help section and routed to whichever
backend the run uses.

The third-party case is real: a package written into ``tmp_path`` (outside the repository) with a
``pyproject.toml`` declaring a ``diloco.backends`` entry point, made importable the way an installed package is:
its directory on ``sys.path`` beside a ``*.dist-info`` whose ``entry_points.txt`` is what ``pip install`` writes,
so ``importlib.metadata`` finds the backend as it would in a user's environment. Every check runs the real
``diloco`` command in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DILOCO = [sys.executable, "-m", "diloco.cli.main"]
#: A subprocess that starts Python and imports the CLI; generous, since CI shares two cores.
GUARD_S = 120

BACKEND_MODULE = '''
"""A third party's backend: its config declares one flag of its own and reuses the shared --image."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from diloco.executors.base import Backend, BackendConfig, LaunchPlan, LaunchSpec, RunHandle
from diloco.executors.flags import cli_flag


class MineConfig(BackendConfig):
    kind: Literal["mine"] = "mine"
    my_flag: str | None = Field(None, description="The third party's own setting.",
                                json_schema_extra=cli_flag("--my-flag", metavar="X"))
    image: str | None = Field(None, description="The image the third party runs.",
                              json_schema_extra=cli_flag("--image", metavar="URI"))

    rendezvous_schemes: ClassVar[tuple[str, ...]] = ("file", "s3")
    places_replicas: ClassVar[bool] = False

    def default_rendezvous(self, run_id: str) -> str | None:
        return f"file:///tmp/mine/{run_id}"


class MineHandle(RunHandle):
    backend: str = "mine"


class MineBackend(Backend[MineConfig, MineHandle]):
    name = "mine"
    config_type = MineConfig
    handle_type = MineHandle

    def plan(self, spec: LaunchSpec) -> LaunchPlan:
        request = {"my_flag": self.config.my_flag, "image": self.config.image}
        return LaunchPlan(backend=self.name, spec=spec, requests=[request] * spec.replicas)
'''

PYPROJECT = '''
[project]
name = "diloco-mine"
version = "1.0"

[project.entry-points."diloco.backends"]
mine = "diloco_mine:MineBackend"
'''


@pytest.fixture(scope="module")
def third_party(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's source tree, and on ``site`` what installing it leaves: the module and its dist-info."""
    root = tmp_path_factory.mktemp("third-party")
    source = root / "diloco-mine"
    source.mkdir()
    (source / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (source / "diloco_mine.py").write_text(BACKEND_MODULE)
    site = root / "site"
    site.mkdir()
    (site / "diloco_mine.py").write_text(BACKEND_MODULE)
    dist = site / "diloco_mine-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: diloco-mine\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text('[diloco.backends]\nmine = diloco_mine:MineBackend\n')
    return site


def diloco(*args: str, site: Path | None, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_DEBUG"}
    env.update({"DILOCO_HOME": str(home), "NO_COLOR": "1", "COLUMNS": "120"})
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return subprocess.run([*DILOCO, *args], capture_output=True, text=True, env=env, timeout=GUARD_S, cwd=home)


def section(help_text: str, title: str) -> str:
    """One section of a help page: from its title line to the next blank line."""
    lines = help_text.splitlines()
    start = lines.index(title)
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return "\n".join(lines[start + 1:end])


def test_a_third_party_backend_lists_its_own_flag_under_its_own_section(third_party: Path, tmp_path: Path) -> None:
    result = diloco("launch", "--help", site=third_party, home=tmp_path)
    assert result.returncode == 0, result.stderr
    mine = section(result.stdout, "Backend options (mine):")
    assert "--my-flag X" in mine and "The third party's own setting (backend.my_flag)." in " ".join(mine.split())
    assert "--image URI" in mine and "The image the third party runs" in mine, "a shared flag, in its own words"
    assert "--my-flag" not in section(result.stdout, "Options:")
    assert "--my-flag" not in section(result.stdout, "Backend options (sagemaker):")


def test_a_third_party_flag_is_routed_into_its_backends_config(third_party: Path, tmp_path: Path) -> None:
    result = diloco("launch", "--backend", "mine", "--my-flag", "X", "--image", "registry.example/mine:1",
                    "--dry-run", "-o", "json", site=third_party, home=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["backend"] == "mine"
    assert plan["requests"][0] == {"my_flag": "X", "image": "registry.example/mine:1"}


def test_a_flag_the_chosen_backend_does_not_declare_names_the_backends_that_take_it(
        third_party: Path, tmp_path: Path) -> None:
    result = diloco("launch", "--backend", "local", "--my-flag", "X", "--dry-run", site=third_party, home=tmp_path)
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert "--my-flag: the local backend has no such setting (backends that take it: mine)" in line, line
    shared = diloco("launch", "--backend", "local", "--image", "x:1", "--dry-run", site=third_party, home=tmp_path)
    assert shared.returncode == 2
    assert "(backends that take it: sagemaker, eks, mine)" in shared.stderr, shared.stderr
    assert not any((tmp_path / "runs").glob("*")), "a refused launch writes nothing"


def test_without_the_package_the_flag_does_not_exist(tmp_path: Path) -> None:
    result = diloco("launch", "--my-flag", "X", "--dry-run", site=None, home=tmp_path)
    assert result.returncode == 2
    assert "--my-flag" in result.stderr


@pytest.mark.parametrize("command", ["smoke", "doctor"])
def test_smoke_and_doctor_offer_every_backends_flags(third_party: Path, tmp_path: Path, command: str) -> None:
    result = diloco(command, "--help", site=third_party, home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--my-flag X" in section(result.stdout, "Backend options (mine):")
    assert "--role ARN" in section(result.stdout, "Backend options (sagemaker):")
    assert "--namespace NS" in section(result.stdout, "Backend options (eks):")


def test_the_doctor_refuses_a_flag_its_backend_does_not_take(tmp_path: Path) -> None:
    result = diloco("doctor", "--role", "arn:aws:iam::123456789012:role/x", site=None, home=tmp_path)
    assert result.returncode == 2
    assert "--role: the local backend has no such setting (backends that take it: sagemaker)" in result.stderr


def test_launch_help_loads_config_models_but_no_backend_sdk(tmp_path: Path) -> None:
    code = ("import sys\nfrom diloco.cli.main import main\ntry:\n    main(['launch', '--help'])\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'boto3', 'botocore', 'kubernetes', 'sagemaker_core') "
            "if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=GUARD_S,
                         env={**os.environ, "DILOCO_HOME": str(tmp_path)})
    assert "--instance-type" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"]])
def test_other_commands_never_load_the_config_models(argv: list[str], tmp_path: Path) -> None:
    """The options are built when ``launch``, ``smoke`` or ``doctor`` is parsed, not when the CLI is imported."""
    code = (f"import sys\nfrom diloco.cli.main import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('diloco.launcher.config', 'diloco.executors.sagemaker', "
            "'diloco.executors.kubernetes') if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=GUARD_S,
                         env={**os.environ, "DILOCO_HOME": str(tmp_path)})
    assert "Usage: diloco" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr


#: What ``diloco launch --help`` has always offered: each flag with its short form and metavar, and where it is.
LAUNCH_FLAGS = {
    "Options:": ["-n, --replicas N", "-b, --backend NAME", "-c, --config FILE", "--steps N", "--sync-every H",
                 "--mode MODE", "--trainer MODULE:FN", "-k, --trainer-kwargs KEY=VALUE", "--rendezvous URI",
                 "--timeout SECONDS", "--allreduce STRATEGY", "--compression FORMAT", "--min-replicas K",
                 "--procs-per-replica K", "--tensorboard DIR", "--set KEY=VALUE", "--gpu TYPE", "-d, --detach",
                 "--dry-run", "--force", "--max-restarts N"],
    "Backend options (sagemaker):": ["--image URI", "--role ARN", "--region REGION", "--instance-type TYPE",
                                     "--spot / --no-spot", "--keep-alive SECONDS", "--source-dir DIR"],
    "Backend options (eks):": ["--image URI", "--namespace NS", "--context NAME", "--source-dir DIR"],
}


def test_launch_keeps_every_flag_its_short_form_and_metavar(tmp_path: Path) -> None:
    result = diloco("launch", "--help", site=None, home=tmp_path)
    assert result.returncode == 0, result.stderr
    for title, flags in LAUNCH_FLAGS.items():
        rows = [line.strip() for line in section(result.stdout, title).splitlines()]
        for flag in flags:
            assert any(row.startswith(flag) for row in rows), (title, flag)
