"""The bootstrap's persistent cache: a job on a warm instance (SageMaker's warm-pool cache, a node's hostPath)
reuses the packages an earlier job installed for the same wheel, requirements and image, and runs no pip.

The real bootstrap script runs as a job runs it (``python <channel>/diloco_bootstrap.py -m <module>``, the
channel at ``<root>/input/data/code``), with a real pip installing a small wheel built here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BOOTSTRAP = Path(__file__).resolve().parents[3] / "executors" / "bootstrap.py"


def tiny_wheel(folder: Path, version: str = "0.1") -> Path:
    """A pure-Python wheel whose module prints where it was imported from."""
    path = folder / f"tinypkg-{version}-py3-none-any.whl"
    info = f"tinypkg-{version}.dist-info"
    files = {
        "tinypkg/__init__.py": f"VERSION = {version!r}\n",
        "tinypkg/__main__.py": "import tinypkg\nprint('tinypkg', tinypkg.VERSION, 'from', tinypkg.__file__)\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: tinypkg\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():  # a fixed date: the same wheel is the same bytes, as a build's is
            zf.writestr(zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0)), text)
    return path


def job(tmp_path: Path, name: str, cache: Path, *, version: str = "0.1",
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One job: a fresh ``/opt/ml`` stand-in with the code channel (the bootstrap and the wheel), run to its end."""
    channel = tmp_path / name / "input" / "data" / "code"
    channel.mkdir(parents=True)
    (channel / "diloco_bootstrap.py").write_text(BOOTSTRAP.read_text())
    tiny_wheel(channel, version)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "DILOCO_", "PYTHONPATH"))}
    env.update({"DILOCO_BOOTSTRAP_CACHE": str(cache), "DILOCO_BOOTSTRAP_REQUIREMENTS": "[]", "PIP_NO_INDEX": "1",
                **(extra_env or {})})
    return subprocess.run([sys.executable, str(channel / "diloco_bootstrap.py"), "-m", "tinypkg"], env=env,
                          capture_output=True, text=True, timeout=300)


def reused(result: subprocess.CompletedProcess[str]) -> bool:
    return "diloco bootstrap: reusing the packages an earlier job installed for" in result.stdout


def test_a_second_job_with_the_same_wheel_reuses_the_site_and_a_different_one_installs_its_own(
        tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    first = job(tmp_path, "job1", cache)
    assert first.returncode == 0, first.stderr
    assert not reused(first)
    site = next(cache.glob("diloco-site-*/"))
    assert f"tinypkg 0.1 from {site}/tinypkg/__init__.py" in first.stdout, first.stdout
    assert json.loads((site / ".diloco-installed").read_text())["wheel"] == "tinypkg-0.1-py3-none-any.whl"

    second = job(tmp_path, "job2", cache)
    assert second.returncode == 0, second.stderr
    assert reused(second), second.stdout
    assert f"tinypkg 0.1 from {site}/tinypkg/__init__.py" in second.stdout, second.stdout
    # Its own lines are still kept next to its own job, not in the shared site.
    kept = tmp_path / "job2" / "diloco" / "site" / ".diloco-bootstrap-log.jsonl"
    assert any("reusing the packages" in json.loads(line)[1] for line in kept.read_text().splitlines())

    # pip settings that change what would be installed (another index, a broken pip) get a site of their own.
    other_index = job(tmp_path, "job3", cache, extra_env={"PIP_FIND_LINKS": str(tmp_path)})
    assert other_index.returncode == 0 and not reused(other_index)
    assert len(list(cache.glob("diloco-site-*/"))) == 2


def test_a_site_cut_short_is_installed_again(tmp_path: Path) -> None:
    """A job stopped while pip ran leaves a site without its marker: the next job starts it afresh."""
    cache = tmp_path / "cache"
    cache.mkdir()
    assert job(tmp_path, "job1", cache).returncode == 0
    site = next(cache.glob("diloco-site-*/"))
    (site / ".diloco-installed").unlink()
    (site / "tinypkg" / "__init__.py").write_text("raise SystemExit('half-installed')\n")
    again = job(tmp_path, "job2", cache)
    assert again.returncode == 0 and not reused(again), again.stdout + again.stderr
    assert "tinypkg 0.1 from" in again.stdout and (site / ".diloco-installed").exists()


def test_jobs_starting_together_install_once(tmp_path: Path) -> None:
    """Two jobs on one warm machine take turns on the site: one installs, the other reuses what it installed.
    (Without a cache directory every job installs into its own ``/opt/ml/diloco/site``: every other emulated job
    that is not given one shows it.)"""
    cache = tmp_path / "cache"
    cache.mkdir()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda name: job(tmp_path, name, cache), ["a", "b"]))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    assert sorted(reused(r) for r in results) == [False, True]
    assert len(list(cache.glob("diloco-site-*/"))) == 1
