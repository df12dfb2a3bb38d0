"""Packaging rules that keep `pip install 'diloco[aws]'` quick and the backend registry honest."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


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
    """Issue 8's check: the core and the CLI name no backend (they go through diloco.executors). The one other
    use of the word, async DiLoCo's own "local" state (the seed's vocabulary), is marked ``# not a backend``."""
    offenders = []
    for folder in ("diloco", "cli"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r'"(local|sagemaker|eks)"', line) and "# not a backend" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []
