"""What a launch ships of the user's source directory: the ignore rules, symbolic links, the order, the size limit,
and that an ignored directory (a project's ``.venv`` of 100,000 files) is never walked."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from diloco.errors import ConfigError
from diloco.executors.code_channel import pack_source, ships


def names(archive: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(archive))) as tar:
        return tar.getnames()


def write(root: Path, relative: str, data: bytes = b"x") -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    for relative in ("train.py", "pkg/model.py", "pkg/a-b.py", "pkg/sub/deep.py", "a-c.txt", "logs/run.log",
                     "pkg/out.log", "build/lib/x.py", "pkg/build/keep.py", "data/big.bin",
                     ".venv/lib/site.py", "node_modules/m/index.js", "pkg/__pycache__/model.cpython-311.pyc",
                     ".git/HEAD"):
        write(root, relative)
    (root / ".gitignore").write_text("# comment\n*.log\n/build/\ndata/\n!data/keep\n")
    os.symlink(root / "pkg", root / "linked-pkg")  # a linked directory: not followed
    os.symlink(root / "train.py", root / "linked.py")  # a linked file: not shipped
    return root


def test_the_ignore_rules_links_and_order(project: Path) -> None:
    shipped = names(pack_source(project, 2**20))
    assert shipped == [".gitignore", "a-c.txt", "pkg/a-b.py", "pkg/build/keep.py", "pkg/model.py",
                       "pkg/sub/deep.py", "train.py"]  # by path parts: pkg/a-b.py before pkg/build, as paths sort
    assert pack_source(project, 2**20) == pack_source(project, 2**20)  # reproducible: the same bytes again
    assert ships(project, "pkg/model.py") and not ships(project, "pkg/out.log") and not ships(project, "linked.py")


def test_a_dilocoignore_replaces_the_gitignore(project: Path) -> None:
    (project / ".dilocoignore").write_text("pkg/\n")
    shipped = names(pack_source(project, 2**20))
    assert "pkg/model.py" not in shipped and "logs/run.log" in shipped and "build/lib/x.py" in shipped


def test_too_much_source_is_refused_naming_the_largest_files(project: Path) -> None:
    write(project, "weights.bin", b"w" * 300_000)
    with pytest.raises(ConfigError) as refused:
        pack_source(project, 200_000)
    assert "weights.bin (0.3 MB)" in str(refused.value) and ".dilocoignore" in (refused.value.hint or "")


WALK_WATCHER = """
import json, sys
from pathlib import Path
listed = []
sys.addaudithook(lambda event, args: listed.append(str(args[0])) if event == "os.scandir" else None)
from diloco.executors.code_channel import pack_source
pack_source(Path(sys.argv[1]), 2**20)
print(json.dumps(listed))
"""


def test_ignored_directories_are_not_walked(project: Path) -> None:
    """Every directory listed while packing (Python's audit events, in a process of its own) is one that ships
    something: neither ``.venv``, ``node_modules``, ``.git`` nor a ``.gitignore``'d directory is listed."""
    out = subprocess.run([sys.executable, "-c", WALK_WATCHER, str(project)], capture_output=True, text=True,
                         check=True).stdout
    listed = {Path(path).relative_to(project).as_posix() for path in json.loads(out)}
    assert listed == {".", "pkg", "pkg/sub", "pkg/build", "logs"}
