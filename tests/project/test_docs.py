"""The documentation site: its generated reference pages match the code, it builds strictly, and every command that
README or a docs page prints is one the tools take as printed.

The reference pages (``docs/reference/cli.md``, ``docs/reference/configuration.md``) are regenerated in memory
from the Typer app and the pydantic models and compared with the files; ``mkdocs build --strict`` runs into a
temporary directory, and fails on a broken link or a page left out of the nav (shown by building a copy with one
of each). A shell command in a ``bash`` block (or after ``$ `` in an output block) is checked against what runs
it: a ``diloco`` command against the CLI's own commands and options, ``make`` against the Makefile's targets,
``python -m`` against the importable modules, ``pip install 'diloco[extra]'`` against the package's extras.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from readme_blocks import ROOT, all_blocks, documents

from diloco.cli import reference
from diloco.cli.main import app

MKDOCS = str(Path(sys.executable).with_name("mkdocs"))


# ------------------------------------------------------------------------------------------- generated pages
@pytest.mark.parametrize("name", sorted(reference.PAGE_WRITERS))
def test_a_generated_reference_page_matches_the_code(name: str) -> None:
    path = ROOT / "docs" / "reference" / name
    assert path.is_file(), f"docs/reference/{name} is missing: regenerate with {reference.REGENERATE}"
    assert path.read_text() == reference.PAGE_WRITERS[name](), (
        f"docs/reference/{name} is stale (the CLI or a config model changed): regenerate with "
        f"{reference.REGENERATE}")


def test_the_reference_names_every_command_option_and_config_field() -> None:
    """What the pages are for: nothing the code takes is left out of them."""
    from diloco.executors import BUILTIN_BACKENDS, config_type
    from diloco.launcher.config import RunConfig

    cli = reference.cli_page()
    root = typer.main.get_command(app)
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        assert f"## `diloco {name}`" in cli
        for param in command.get_params(command.context_class(command)):
            if param.param_type_name == "option" and not param.hidden:
                assert all(opt in cli for opt in param.opts), (name, param.opts)
    config = reference.configuration_page()
    assert "`store.allreduce`" in config and "`train.sync_every`" in config and "`store.min_replicas`" in config
    for name in BUILTIN_BACKENDS:
        for field in config_type(name).model_fields:
            assert f"`backend.{field}`" in config, (name, field)
    assert all(f"`{key}`" in config for key in ("replicas", "timeout_s", "max_restarts") if key in
               RunConfig.model_fields)


def test_check_mode_exits_1_on_a_stale_page_and_names_the_command(tmp_path: Path) -> None:
    assert reference.main(["--write", str(tmp_path)]) == 0
    assert reference.main(["--check", str(tmp_path)]) == 0
    (tmp_path / "cli.md").write_text((tmp_path / "cli.md").read_text() + "| `--gone` | an option |\n")
    result = subprocess.run([sys.executable, "-m", "diloco.cli.reference", "--check", str(tmp_path)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1
    assert "cli.md" in result.stderr and reference.REGENERATE in result.stderr


# ------------------------------------------------------------------------------------------- strict build
def _build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MKDOCS, "build", "--strict", "--config-file", str(project / "mkdocs.yml"),
                           "--site-dir", str(site)], capture_output=True, text=True, cwd=project)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    built = _build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()


@pytest.mark.parametrize("breakage", ["broken link", "page missing from nav"])
def test_the_strict_build_fails_on_a_broken_link_or_a_page_outside_the_nav(tmp_path: Path, breakage: str) -> None:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs", project / "docs")
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    if breakage == "broken link":
        with (project / "docs" / "concepts.md").open("a") as page:
            page.write("\nSee [the page that is not there](no-such-page.md).\n")
    else:
        (project / "docs" / "orphan.md").write_text("# Orphan\n\nIn no nav.\n")
    built = _build(project, tmp_path / "site")
    assert built.returncode != 0, built.stderr[-3000:]
    assert ("no-such-page.md" if breakage == "broken link" else "orphan.md") in built.stderr


# ------------------------------------------------------------------------------------------- commands as printed
def _commands(path: Path) -> list[str]:
    """Every shell command ``path`` prints: ``bash`` block lines (continuations joined, comments dropped) and
    ``$ `` lines of output blocks, each split at pipes and ``&&``."""
    lines: list[str] = []
    for block in all_blocks(path, "bash"):
        lines += block.replace("\\\n", " ").splitlines()
    for block in all_blocks(path, ""):
        lines += [line[2:] for line in block.splitlines() if line.startswith("$ ")]
    commands = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;")
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("|", "||", "&&", ";", "&"):
                if words:
                    commands.append(shlex.join(words))
                words = []
            else:
                words.append(token)
    return commands


def _options(command: object) -> set[str]:
    found = {"--help"}
    # get_params, not .params: launch, smoke and doctor add the flags the config models declare on first use.
    for param in command.get_params(command.context_class(command)):  # type: ignore[attr-defined]
        found |= {*param.opts, *getattr(param, "secondary_opts", [])}
    return found


def _check_diloco(words: list[str]) -> str | None:
    root = typer.main.get_command(app)
    commands = root.commands  # type: ignore[attr-defined]
    if len(words) < 2 or words[1].startswith("-"):
        unknown = [w for w in words[1:] if w.startswith("-") and w not in _options(root)]
        return f"unknown option {unknown}" if unknown else None
    if words[1] not in commands:
        return f"no command {words[1]!r}"
    known = _options(commands[words[1]])
    unknown = [w.split("=", 1)[0] for w in words[2:] if w.startswith("-") and w != "-"
               and w.split("=", 1)[0] not in known]
    return f"diloco {words[1]} has no option {unknown}" if unknown else None


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def _check(command: str) -> str | None:
    words = shlex.split(command)
    if words[0] == "diloco":
        return _check_diloco(words)
    if words[0] == "make":
        targets = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
        missing = [t for t in targets if t not in _make_targets()]
        return f"the Makefile has no target {missing}" if missing else None
    if words[0] == "python" and len(words) > 2 and words[1] == "-m":
        sys.path.insert(0, str(ROOT))
        try:
            found = importlib.util.find_spec(words[2]) is not None
        finally:
            sys.path.remove(str(ROOT))
        return None if found else f"no module {words[2]}"
    if words[:2] == ["pip", "install"]:
        extras = importlib.metadata.metadata("diloco").get_all("Provides-Extra") or []
        for word in words[2:]:
            match = re.fullmatch(r"diloco\[([\w,-]+)\]", word)
            if match and not set(match[1].split(",")) <= set(extras):
                return f"diloco has no extra among {match[1]}"
    return None


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_a_document_prints_is_one_the_tools_take(path: Path) -> None:
    commands = _commands(path)
    wrong = [f"{command}: {problem}" for command in commands for problem in [_check(command)] if problem]
    assert not wrong, f"{path.relative_to(ROOT)} prints commands that do not run as printed:\n" + "\n".join(wrong)


def test_the_command_check_catches_a_misprinted_command() -> None:
    assert _check("diloco launch --replicas 2 --no-such-flag") is not None
    assert _check("diloco lunch") is not None
    assert _check("make no-such-target") is not None
    assert _check("python -m diloco.no_such_module") is not None
    assert _check("diloco logs -f -r 0,2") is None and _check("make docs") is None


def test_readme_and_the_docs_print_commands() -> None:
    """The check above has something to check: README's and the backend pages' commands are found."""
    assert any(c.startswith("make demo") for c in _commands(ROOT / "README.md"))
    assert any(c.startswith("diloco launch") for c in _commands(ROOT / "docs" / "backends" / "sagemaker.md"))
