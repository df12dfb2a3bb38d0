"""``--rendezvous`` given as a plain path (absolute, relative or ``~/...``) is the same local store as ``file://``
with its absolute path: the same checks before anything starts, the same one-line error and exit code, and the
absolute ``file://`` URI recorded, so a later command run from another directory meets the same store. Through
the real ``diloco`` executable, on a directory that really refuses writes (``tests/readonly.py``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.commands import DILOCO_SCRIPT as DILOCO
from support.readonly import read_only

from diloco.cli import exit_codes

LAUNCH = ["launch", "-n", "2", "--steps", "2", "--sync-every", "1"]


def cli_env(home: Path, user_home: Path) -> dict[str, str]:
    env = {**os.environ, "DILOCO_HOME": str(home), "HOME": str(user_home), "NO_COLOR": "1"}
    env.pop("DILOCO_DEBUG", None)
    return env


def diloco(*args: str, home: Path, cwd: Path, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*(prefix or []), DILOCO, *args], capture_output=True, text=True, cwd=cwd,
                          env=cli_env(home, user_home=cwd), timeout=240)


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco: error: "), result.stderr
    return lines[0]


def spellings(tmp_path: Path, relative: str) -> dict[str, str]:
    """One directory under ``tmp_path`` (the test's working directory and ``$HOME``), written four ways."""
    absolute = tmp_path / relative
    return {"file://": f"file://{absolute}", "absolute": str(absolute), "relative": relative,
            "relative ./": f"./{relative}", "home ~/": f"~/{relative}"}


def assert_nothing_recorded(home: Path) -> None:
    assert not (home / "runs").exists() or not list((home / "runs").iterdir())


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_plain_path_on_a_read_only_directory_gets_the_file_uri_error(tmp_path: Path, dry_run: bool) -> None:
    home = tmp_path / "diloco-home"
    errors = {}
    with read_only(tmp_path / "ro") as prefix:
        for name, uri in spellings(tmp_path, "ro/store/{run_id}").items():
            if dry_run and name not in ("file://", "relative", "home ~/"):
                continue  # the same check as the launch's: three spellings are enough
            result = diloco(*LAUNCH, "--rendezvous", uri, *(["--dry-run"] if dry_run else []), home=home,
                            cwd=tmp_path, prefix=prefix)
            assert result.returncode == exit_codes.USAGE, (name, result.stderr)
            assert "internal error" not in result.stderr
            errors[name] = error_line(result)
            assert_nothing_recorded(home)
    assert "store.rendezvous: cannot create or write" in errors["file://"] and "read-only" in errors["file://"]
    assert set(errors.values()) == {errors["file://"]}, errors  # one message, whichever way the path was written
    assert list((tmp_path / "ro").iterdir()) == []


@pytest.mark.parametrize(("relative", "message"), [
    ("a-file/sub/{run_id}", "a-file is a file, so"),
])
def test_a_plain_path_under_a_regular_file_gets_the_file_uri_error(tmp_path: Path, relative: str,
                                                                  message: str) -> None:
    home = tmp_path / "diloco-home"
    (tmp_path / "a-file").write_text("not a directory")
    errors = {name: error_line(result) for name, uri in spellings(tmp_path, relative).items()
              if (result := diloco(*LAUNCH, "--rendezvous", uri, home=home, cwd=tmp_path)).returncode
              == exit_codes.USAGE}
    assert sorted(errors) == sorted(spellings(tmp_path, relative)), errors
    assert message in errors["file://"]
    assert set(errors.values()) == {errors["file://"]}, errors
    assert_nothing_recorded(home)


def test_a_plain_path_on_a_kernel_filesystem_is_refused_like_file(tmp_path: Path) -> None:
    home = tmp_path / "diloco-home"
    plain, uri = (diloco(*LAUNCH, "--rendezvous", value, home=home, cwd=tmp_path)
                  for value in ("/proc/diloco/{run_id}", "file:///proc/diloco/{run_id}"))
    assert plain.returncode == uri.returncode == exit_codes.USAGE, plain.stderr
    assert error_line(plain) == error_line(uri)
    assert "is on a kernel filesystem" in error_line(plain)
    assert_nothing_recorded(home)


@pytest.mark.parametrize("name", ["relative", "relative ./", "home ~/"])
def test_a_relative_or_home_path_is_planned_as_its_absolute_file_uri(tmp_path: Path, name: str) -> None:
    home = tmp_path / "diloco-home"
    uri = spellings(tmp_path, "meet/{run_id}")[name]
    result = diloco(*LAUNCH, "--rendezvous", uri, "--dry-run", "-o", "json", home=home, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    run_id = plan["spec"]["run_id"]
    assert plan["spec"]["entrypoint_args"]["rendezvous_uri"] == f"file://{tmp_path}/meet/{run_id}"
    assert not (tmp_path / "meet").exists() and not (tmp_path / "~").exists()  # a dry run creates nothing


@pytest.mark.parametrize("uri", ["s3:/bucket/diloco/{run_id}", "file:/tmp/diloco/{run_id}"])
def test_a_scheme_missing_a_slash_is_refused_not_taken_for_a_directory(tmp_path: Path, uri: str) -> None:
    home = tmp_path / "diloco-home"
    result = diloco(*LAUNCH, "--rendezvous", uri, "--dry-run", home=home, cwd=tmp_path)
    assert result.returncode == exit_codes.USAGE, result.stderr
    assert "store.rendezvous:" in error_line(result) and "needs two slashes" in error_line(result)
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_diloco_home_is_named_as_such_not_as_the_rendezvous(tmp_path: Path) -> None:
    """A local run meets by default under ``$DILOCO_HOME/runs/<id>/store``: when DILOCO_HOME refuses writes, the
    one line names DILOCO_HOME and its fix, not a ``store.rendezvous`` the user never set."""
    home = tmp_path / "diloco-home"
    with read_only(home) as prefix:
        result = diloco(*LAUNCH, home=home, cwd=tmp_path, prefix=prefix)
    assert result.returncode == exit_codes.USAGE, result.stderr
    line = error_line(result)
    assert line.startswith(f"diloco: error: DILOCO_HOME: cannot record runs in {home}/runs"), line
    assert "store.rendezvous" not in line and "set DILOCO_HOME to a writable directory" in line
    assert list(home.iterdir()) == []
