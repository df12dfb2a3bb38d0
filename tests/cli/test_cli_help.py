"""The help a newcomer reads first: ``diloco --help`` lists every command on one whole line (not cut at the first
period, as in "Wait on a run (e.g."), and each command's ``--help`` ends with the exit codes that command can
return, not ``launch``'s for all (plain ``status`` and ``logs`` exit 0 once they have shown what was asked)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from support.cli_runs import run_cli
from typer.testing import CliRunner

from diloco.cli.main import app

runner = CliRunner()
COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()

#: The exit codes each command can return (README "Exit codes"): what its --help must list, and only those.
EXIT_CODES = {
    "launch": {0, 1, 2, 3, 4, 5, 124, 130},
    "watch": {0, 1, 2, 4, 5, 124, 130},
    "collect": {0, 1, 2, 4, 5, 124, 130},
    "status": {0, 1, 2, 4, 5, 124, 130},  # 4, 5 and 124 only with --watch
    "logs": {0, 1, 2, 130},
    "cancel": {0, 1, 2, 130},
    "runs": {0, 1, 2, 130},
    "rm": {0, 1, 2, 130},
    "prune": {0, 1, 2, 130},
    "plot": {0, 1, 2, 130},
    "scale": {0, 1, 2, 130},
    "smoke": {0, 1, 2, 124, 130},
    "doctor": {0, 1, 2, 130},
    "eval": {0, 1, 2, 130},
}


def test_every_command_is_known_here_and_in_readme() -> None:
    assert set(COMMANDS) == set(EXIT_CODES)
    for name in COMMANDS:
        assert f"| `diloco {name}" in README, f"README's Commands table lacks diloco {name}"


def test_the_command_list_gives_every_command_one_whole_line(tmp_path: Path) -> None:
    result = run_cli("--help", home=tmp_path, columns=80)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("Commands:") + 1
    section = lines[start:lines.index("", start)]
    assert len(section) == len(COMMANDS), "\n".join(section)  # one line each: nothing wraps onto a second
    listed = {}
    for line in section:
        match = re.fullmatch(r"  (\S+)\s{2,}(\S.*)", line)
        assert match is not None, line
        listed[match[1]] = match[2]
    assert sorted(listed) == COMMANDS
    for name, text in listed.items():
        assert len(f"  {name}  {text}") <= 80, text
        assert not text.endswith("...") and text.endswith("."), f"{name}: {text!r} is cut"
        assert text.count("(") == text.count(")") and not text.endswith("e.g."), f"{name}: {text!r} is cut"
        assert len(text.split()) >= 4, f"{name}: {text!r} says too little"
    assert "Wait on a run" in listed["watch"] and "relaunch" in listed["watch"], listed["watch"]


def exit_codes_of(help_text: str) -> dict[int, str]:
    """The ``Exit codes:`` block at the end of a command's help: code -> meaning."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "Exit codes:") + 1
    codes: dict[int, str] = {}
    for line in lines[start:]:
        assert len(line) <= 80, line
        match = re.fullmatch(r"\s+(\d+)\s+(\S.*)", line)
        if match is not None:
            codes[int(match[1])] = match[2]
        elif line.strip() and codes:  # a meaning wrapped onto the next line
            codes[list(codes)[-1]] += " " + line.strip()
        else:
            break
    return codes


@pytest.mark.parametrize("command", sorted(EXIT_CODES))
def test_every_command_help_lists_the_exit_codes_it_can_return(command: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    codes = exit_codes_of(result.stdout)
    assert set(codes) == EXIT_CODES[command], result.stdout
    assert all(len(meaning.split()) >= 2 for meaning in codes.values()), codes
    assert "DILOCO_DEBUG=1" in result.stdout
    if command in ("status", "logs"):  # README: plain status and logs exit 0 when they could report
        assert "succeeded" not in codes[0] or "--watch" in codes[0], codes[0]
        assert "launch refused" not in result.stdout


def test_top_level_help_says_where_each_command_lists_its_exit_codes(tmp_path: Path) -> None:
    text = " ".join(run_cli("--help", home=tmp_path).stdout.split())
    assert "diloco COMMAND --help" in text and "4 cancelled, 5 succeeded with replicas left behind" in text, text
