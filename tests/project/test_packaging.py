"""Packaging rules that keep `pip install 'diloco[aws]'` quick and the backend registry honest, and the one wheel
(the code channel's and the image's) complete and runnable from a fresh virtual environment."""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import zipfile
from pathlib import Path

import pytest
import tomllib

pytest.register_assert_rewrite("wheel_venv")
from support.wheel_venv import SOURCE_PACKAGES, FreshVenv, tree_modules, wheel_modules, where_from  # noqa: E402

#: The image_wheel and wheel_venv fixtures.
pytest_plugins = ("support.wheel_venv",)

ROOT = Path(__file__).resolve().parents[2]


def _requirements(extra: str) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"][extra]


def test_aws_extras_let_s3fs_pin_boto3() -> None:
    """An open ``boto3`` next to ``s3fs`` made pip backtrack for ~7 minutes (aiobotocore pins botocore exactly);
    ``s3fs[boto3]`` resolves directly. Measured by bench/install_extras.py."""
    for extra in ("aws", "sagemaker"):
        reqs = _requirements(extra)
        names = [re.split(r"[\[<>=~! ;]", r, maxsplit=1)[0].lower() for r in reqs]
        assert "boto3" not in names and "botocore" not in names, (extra, reqs)
        assert any(r.replace(" ", "").startswith("s3fs[boto3]") for r in reqs), (extra, reqs)


def test_torch_range_stays_wide() -> None:
    """The set-up picks the torch build (TORCH=...); a narrow pin here would pull a multi-GB build."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = next(r for r in project["dependencies"] if r.startswith("torch"))
    assert "==" not in torch and "<" not in torch


def test_backend_names_live_only_in_the_backends_and_the_registry() -> None:
    """The core and the CLI name no backend (they go through diloco.executors). The one other
    use of the word, async DiLoCo's own "local" state (the seed's vocabulary), is marked ``# not a backend``."""
    offenders = []
    for folder in ("diloco", "cli"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r'"(local|sagemaker|eks)"', line) and "# not a backend" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []


# ---------------------------------------------------------------------------------------------------- the wheel
def _setup_py_package_dir() -> dict[str, str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "PACKAGE_DIR")
    return ast.literal_eval(node.value)


def test_the_builder_ships_the_folders_setup_py_maps() -> None:
    from diloco.executors.wheel_builder import PACKAGE_ROOTS

    mapping = _setup_py_package_dir()
    assert mapping == {package: folder for folder, package in SOURCE_PACKAGES.items()}
    assert PACKAGE_ROOTS == tuple(mapping)


def test_the_code_channel_wheel_holds_every_module_of_the_tree_and_the_metadata() -> None:
    from diloco.executors.sagemaker.code import build_wheel  # what the SageMaker backend uploads

    name, wheel = build_wheel()
    assert name == "diloco-0.1.0-py3-none-any.whl"
    assert sorted(wheel_modules(wheel) ^ tree_modules()) == []  # nothing missing, nothing extra
    assert "diloco.collectives.wire" in wheel_modules(wheel)
    assert build_wheel()[1] == wheel  # reproducible: the same code uploads the same object
    with zipfile.ZipFile(io.BytesIO(wheel)) as zf:
        metadata = zf.read("diloco-0.1.0.dist-info/METADATA").decode()
        entry_points = zf.read("diloco-0.1.0.dist-info/entry_points.txt").decode()
        record = zf.read("diloco-0.1.0.dist-info/RECORD").decode().splitlines()
        assert sorted(line.split(",")[0] for line in record) == sorted(zf.namelist())
    requires = [line[len("Requires-Dist: "):] for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert len(requires) == len(project["dependencies"]) + sum(map(len, project["optional-dependencies"].values()))
    assert any(r.startswith("s3fs[boto3]") and 'extra == "aws"' in r for r in requires), requires
    for extra in project["optional-dependencies"]:
        assert f"Provides-Extra: {extra}" in metadata.splitlines()
    assert "diloco = diloco.cli.main:main" in entry_points.splitlines()
    assert "\n\n" not in metadata and "## " not in metadata  # headers only: the README is not shipped


def test_the_image_wheel_is_the_code_channel_wheel(image_wheel: Path) -> None:
    """docker/Dockerfile's wheel stage (a regular install of the checkout, packed by the same builder) gives every
    module of the tree, and byte for byte the wheel a launch ships from this editable install."""
    from diloco.executors.sagemaker.code import build_wheel

    data = image_wheel.read_bytes()
    missing = sorted(tree_modules() - wheel_modules(data))
    assert missing == [], f"the image's wheel lacks {missing}"
    assert sorted(wheel_modules(data) - tree_modules()) == []
    name, shipped = build_wheel()
    with zipfile.ZipFile(io.BytesIO(data)) as image, zipfile.ZipFile(io.BytesIO(shipped)) as channel:
        metadata = "diloco-0.1.0.dist-info/METADATA"
        assert image.read(metadata) == channel.read(metadata), (
            "this editable install's metadata is older than pyproject.toml: re-run `pip install -e .`")
    assert (image_wheel.name, data) == (name, shipped)


WHERE_TRAINER = '''
import json
import sys
from pathlib import Path

from diloco.trainers.gpt import diloco_train


def train(*, rank, **kwargs):
    """The built-in trainer, then a note of the file every loaded diloco module came from."""
    result = diloco_train(rank=rank, **kwargs)
    files = sorted(m.__file__ for n, m in list(sys.modules.items())
                   if n.split(".")[0] == "diloco" and getattr(m, "__file__", None))
    Path(__file__).with_name(f"imported-r{rank}.json").write_text(json.dumps(files))
    return result
'''


@pytest.mark.slow
def test_a_fresh_venv_with_the_image_wheel_trains_two_replicas_to_identical_weights(
    wheel_venv: FreshVenv, tmp_path: Path
) -> None:
    work = tmp_path / "work"  # outside the checkout: nothing of it is on the path
    work.mkdir()
    (work / "where.py").write_text(WHERE_TRAINER)
    installed = where_from(wheel_venv, work)
    assert installed["installed_in"] == str(wheel_venv.site)
    assert "dir_info" not in installed["direct_url"]  # a wheel install (archive_info), not an editable one
    assert wheel_venv.imported_from_itself(installed["files"]) == []

    env = wheel_venv.env(DILOCO_HOME=str(tmp_path / "home"), NO_COLOR="1")
    env.pop("DILOCO_DEBUG", None)
    launch = subprocess.run([str(wheel_venv.diloco), "launch", "--replicas", "2", "--backend", "local",
                             "--trainer", "where:train", "--steps", "4", "--sync-every", "2", "-k", "n_layer=1",
                             "-k", "n_embd=16", "-k", "eval_batches=1", "-k", "threads=1", "-o", "json"],
                            capture_output=True, text=True, env=env, cwd=work, timeout=240)
    assert launch.returncode == 0, launch.stderr[-3000:]
    summary = json.loads(launch.stdout)
    assert summary["state"] == "succeeded" and summary["weights_identical"] is True, summary
    for rank in range(2):
        files = json.loads((work / f"imported-r{rank}.json").read_text())
        assert any(f.endswith("/diloco/collectives/__init__.py") for f in files), files
        assert wheel_venv.imported_from_itself(files) == [], rank
