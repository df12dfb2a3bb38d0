"""README's "Then:" commands as a newcomer types them after ``make demo``: in a fresh shell, in the checkout, whose
``PATH`` does not hold ``.venv/bin`` (make installed ``diloco`` there and put nothing on the shell's PATH). The block
must work as printed, and ``make demo`` must end by printing how to put ``.venv/bin`` on the PATH."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from readme_blocks import ROOT, block_starting
from support.commands import cli_env
from support.store_cli import launch_small_run

FIRST_LINE = ". .venv/bin/activate     # once per shell: `diloco` is .venv/bin/diloco"


def fresh_shell_env(home: Path) -> dict[str, str]:
    """A shell's environment as a login gives it: no virtualenv active, no ``.venv/bin`` on the PATH."""
    venv_bin = str(Path(sys.executable).parent)
    env = cli_env(home)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != Path(venv_bin).resolve())
    return env


def checkout_copy(tmp_path: Path) -> Path:
    """A directory standing for the checkout: its ``.venv`` is this interpreter's virtualenv (what ``make`` made),
    so the model ``collect`` writes lands here, not in the real checkout."""
    where = tmp_path / "checkout"
    where.mkdir()
    (where / ".venv").symlink_to(Path(sys.executable).parent.parent, target_is_directory=True)
    return where


def test_the_then_block_works_in_a_fresh_shell(tmp_path: Path) -> None:
    """The block reads the latest run, whatever trained it: a finished run of torch-free replicas (the real
    entrypoint, one model exported by every replica) stands for the demo's."""
    home = tmp_path / "home"
    run_id = launch_small_run(home, trainer="support.cli_trainers:agreed")
    block = block_starting("What the demo prints", "bash", FIRST_LINE)
    checkout = checkout_copy(tmp_path)
    result = subprocess.run(["bash", "-e", "-c", block], capture_output=True, text=True, cwd=checkout,
                            env=fresh_shell_env(home), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "command not found" not in result.stderr
    assert (checkout / f"{run_id}.safetensors").is_file(), "collect wrote the agreed model"


def test_make_demo_ends_by_saying_how_to_put_diloco_on_the_path() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    last = recipe.strip().splitlines()[-1]
    assert re.match(r"\s*@echo ", last), last
    assert ". $(BIN)/activate" in last and "export PATH=$$PWD/$(BIN):$$PATH" in last
