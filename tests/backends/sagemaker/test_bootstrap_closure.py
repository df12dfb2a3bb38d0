"""The bootstrap finds an image whose packages meet diloco's requirements by name and version but whose installed
dependency closure is broken (AWS's PyTorch 2.10 training image forces botocore above what its aiobotocore
requires), and sends those requirements to pip instead of trusting the top-level names.

The bootstrap runs as it does in a job: the shipped file, in a fresh interpreter, reading installed distributions
through ``importlib.metadata``. The installed packages are ``*.dist-info`` folders written here, each with the
METADATA pip writes (the same files a real install leaves), on the interpreter's path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.executors.code_channel import BOOTSTRAP_FILE, BOOTSTRAP_SCRIPT


def install_metadata(site: Path, name: str, version: str, requires: list[str], extras: list[str] = ()) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
             *(f"Provides-Extra: {e}" for e in extras), *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def bootstrap_says(tmp_path: Path, site: Path, requirements: list[str]) -> dict[str, object]:
    """``unsatisfied`` and ``broken_closure`` of the shipped bootstrap, run with ``site`` first on the path."""
    script = tmp_path / BOOTSTRAP_FILE
    script.write_text(BOOTSTRAP_SCRIPT)
    code = ("import json, runpy, sys\n"
            f"ns = runpy.run_path({str(script)!r})\n"
            "reqs = json.loads(sys.argv[1])\n"
            "print(json.dumps({'unsatisfied': ns['unsatisfied'](reqs), 'broken': ns['broken_closure'](reqs)}))\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(requirements)], capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def image_site(tmp_path: Path) -> Path:
    """The 2.10 image's AWS SDK set in miniature: s3fs and aiobotocore of one release, botocore forced above what
    that aiobotocore requires, boto3 matching the forced botocore."""
    site = tmp_path / "site"
    install_metadata(site, "zz-s3fs", "2026.7.0", ["zz-aiobotocore<4.0.0,>=2.19.0", "zz-fsspec==2026.7.0"])
    install_metadata(site, "zz-fsspec", "2026.7.0", [])
    install_metadata(site, "zz-aiobotocore", "3.7.0", ["zz-botocore<1.43.1,>=1.42.90",
                                                       'zz-httpx<0.29; extra == "httpx"'], extras=["httpx"])
    install_metadata(site, "zz-botocore", "1.43.34", ['zz-awscrt==0.32.2; extra == "crt"'], extras=["crt"])
    install_metadata(site, "zz-boto3", "1.43.34", ["zz-botocore<1.44.0,>=1.43.34"])
    return site


def test_a_forced_botocore_under_an_older_aiobotocore_is_a_broken_closure(tmp_path: Path, image_site: Path) -> None:
    said = bootstrap_says(tmp_path, image_site, ["zz-s3fs>=2025.7.0", "zz-boto3>=1.40"])
    assert said["unsatisfied"] == [], "by name and version every top-level requirement is met"
    assert said["broken"] == [["zz-s3fs>=2025.7.0", "zz-aiobotocore 3.7.0 requires zz-botocore<1.43.1,>=1.42.90, "
                                                    "but this image has zz-botocore 1.43.34"]]


def test_a_consistent_closure_and_unrequested_extras_are_not_broken(tmp_path: Path, image_site: Path) -> None:
    # boto3 and botocore agree; botocore's "crt" extra (a missing awscrt) is not asked for
    assert bootstrap_says(tmp_path, image_site, ["zz-boto3>=1.40"])["broken"] == []
    # an extra counts only where it is asked for
    site = tmp_path / "other-site"
    install_metadata(site, "zz-lib", "1.0", ['zz-speedup>=2; extra == "fast"'], extras=["fast"])
    install_metadata(site, "zz-plain", "1.0", ["zz-lib>=1"])
    install_metadata(site, "zz-quick", "1.0", ["zz-lib[fast]>=1"])
    said = bootstrap_says(tmp_path, site, ["zz-plain", "zz-quick", "zz-lib"])
    assert said["unsatisfied"] == []
    assert said["broken"] == [["zz-quick", 'zz-lib 1.0 requires zz-speedup>=2; extra == "fast", which this image '
                                           "lacks"]]


def test_a_dependency_cycle_ends_and_a_missing_top_level_name_is_left_to_unsatisfied(tmp_path: Path) -> None:
    site = tmp_path / "site"
    install_metadata(site, "zz-a", "1.0", ["zz-b>=1"])
    install_metadata(site, "zz-b", "1.0", ["zz-a>=1"])
    said = bootstrap_says(tmp_path, site, ["zz-a", "zz-missing>=1"])
    assert said == {"unsatisfied": ["zz-missing>=1"], "broken": []}
