"""The generated reference pages of the documentation site: every CLI command with its options, and every
configuration field with its type, default and description.

Both pages are written from the code itself (the Typer app through click, the pydantic config models), so they
cannot drift from it: ``python -m diloco.cli.reference --write docs/reference/`` writes them,
``python -m diloco.cli.reference --check docs/reference/`` exits 1 while a page on disk differs from what the code
gives (``tests/project/test_docs.py`` runs the same comparison). A field's description is its ``Field(description=...)``
when it has one, else the comment the model's source gives it (``#:`` lines above it, or a trailing ``#``), which
is where this project's models document their fields.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import re
import sys
import textwrap
import tokenize
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

#: The command that rewrites every generated page; named in every message about a stale page.
REGENERATE = "python -m diloco.cli.reference --write docs/reference/"

_GENERATED_NOTE = f"<!-- generated from the code by `{REGENERATE}`: do not edit by hand -->\n"


# ---------------------------------------------------------------------------------------------------- CLI page
def cli_page() -> str:
    """``docs/reference/cli.md``: every command of ``diloco``, its usage, help and options."""
    import typer

    from diloco.cli.main import app

    root = typer.main.get_command(app)
    lines = [_GENERATED_NOTE, "# CLI reference\n",
             "Every `diloco` command with every option, as `diloco COMMAND --help` prints them.\n"]
    top = root.context_class(root, info_name="diloco")
    lines += _options_table(root, top)
    commands = getattr(root, "commands", {})
    for name in sorted(commands):
        command = commands[name]
        if command.hidden:
            continue
        ctx = command.context_class(command, info_name=name, parent=top)
        lines.append(f"## `diloco {name}`\n")
        lines.append(f"```\n{_usage(command, ctx)}\n```\n")
        if command.help:
            lines.append(_help(inspect.cleandoc(command.help)))
        lines += _arguments(command)
        lines += _options_table(command, ctx)
    return "\n".join(lines).rstrip() + "\n"


def _usage(command: Any, ctx: Any) -> str:
    pieces = command.collect_usage_pieces(ctx)
    return " ".join([ctx.command_path, *pieces])


def _arguments(command: Any) -> list[str]:
    found = [p for p in command.params if p.param_type_name == "argument"]
    if not found:
        return []
    rows = ["| argument | what it is |", "|---|---|"]
    for param in found:
        text = getattr(param, "help", None) or ""
        rows.append(f"| `{(param.metavar or param.name or '').upper()}` | {_cell(text)} |")
    return ["\n".join(rows) + "\n"]


def _options_table(command: Any, ctx: Any) -> list[str]:
    """One row per visible option: its names and metavar, then its help, both as ``--help`` prints them."""
    records = [p.get_help_record(ctx) for p in command.get_params(ctx) if p.param_type_name == "option"]
    found = [r for r in records if r is not None]
    if not found:
        return []
    rows = ["| option | what it does |", "|---|---|"]
    for names, text in found:
        rows.append(f"| `{names}` | {_cell(text)} |")
    return ["\n".join(rows) + "\n"]


# ------------------------------------------------------------------------------------------- configuration page
def configuration_page() -> str:
    """``docs/reference/configuration.md``: every field of ``RunConfig`` (dotted, as ``--set`` takes it) and of
    each built-in backend's ``backend:`` section."""
    from diloco.executors import BUILTIN_BACKENDS, config_type
    from diloco.launcher.config import RunConfig

    lines = [_GENERATED_NOTE, "# Configuration reference\n",
             "Every key of a run's configuration, from the pydantic models that validate it. A YAML file given "
             "with `--config` sets any of them; `--set key=value` sets one by its dotted path (YAML-parsed "
             "value). See [Configuration](../configuration.md) for precedence and validation.\n",
             "## The run (`RunConfig`)\n"]
    lines += _fields_table(RunConfig, prefix="", skip={"backend"})
    for name in BUILTIN_BACKENDS:
        model = config_type(name)
        lines.append(f"## `backend:` with `kind: {name}` (`{model.__name__}`)\n")
        if model.__doc__:
            lines.append(_plain(inspect.cleandoc(model.__doc__)) + "\n")
        lines += _fields_table(model, prefix="backend.", skip=set())
    return "\n".join(lines).rstrip() + "\n"


def _fields_table(model: type[BaseModel], prefix: str, skip: set[str]) -> list[str]:
    rows = ["| key | type | default | what it sets |", "|---|---|---|---|"]
    for key, annotation, default, text in _walk(model, prefix, skip):
        rows.append(f"| `{key}` | {_cell(annotation)} | {default} | {_cell(text)} |")
    return ["\n".join(rows) + "\n"]


def _walk(model: type[BaseModel], prefix: str, skip: set[str]) -> Iterator[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for each field; a nested model's fields follow under its key."""
    comments = _source_comments(model)
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        nested = _nested_model(info)
        if nested is not None:
            yield from _walk(nested, f"{prefix}{name}.", set())
            continue
        text = info.description or comments.get(name, "")
        yield f"{prefix}{name}", f"`{_type_name(info.annotation)}`", _field_default(info), text


def _nested_model(info: FieldInfo) -> type[BaseModel] | None:
    annotation = info.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    import re

    return re.sub(r"\b(?:[a-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", str(annotation))  # list[pkg.mod.Part] -> list[Part]


def _field_default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        try:
            value = info.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return ""
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`" if isinstance(value, (dict, list)) else f"`{value}`"


def _source_comments(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the comment the class body gives it, for every class of ``model``'s MRO that is a model."""
    found: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if isinstance(cls, type) and issubclass(cls, BaseModel) and cls is not BaseModel:
            found.update(_class_comments(cls))
    return found


def _class_comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    lines = source.splitlines()
    found: dict[str, str] = {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = comments.get(node.lineno, "")
        if trailing and not lines[node.lineno - 1].lstrip().startswith("#"):
            found[node.target.id] = trailing.lstrip("#:").strip()
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line].lstrip("#:").strip())
            line -= 1
        if above:
            found[node.target.id] = " ".join(above)
    return found


# ------------------------------------------------------------------------------------------------------ shared
def _plain(text: str) -> str:
    """Help text as Markdown: click's ``\\b`` no-rewrap markers dropped."""
    return "\n".join(line for line in text.splitlines() if line.strip() != "\b")


def _help(text: str) -> str:
    """A command's help as Markdown: its paragraphs as text, an indented block (its examples) as code."""
    out: list[str] = []
    for paragraph in _plain(text).split("\n\n"):
        lines = paragraph.splitlines()
        indented = [line for line in lines[1:] if line.startswith("  ")]
        if indented and len(indented) == len(lines) - 1:
            body = "\n".join(line[2:] for line in indented)
            out.append(f"{_escape(lines[0])}\n\n```\n{body}\n```")
        else:
            out.append(_escape(" ".join(paragraph.split())))
    return "\n\n".join(out) + "\n"


def _cell(text: str) -> str:
    """``text`` fit for one table cell: one line, pipes escaped."""
    return _escape(" ".join(_plain(text).split())).replace("|", "\\|")


def _escape(text: str) -> str:
    """``<`` and ``>`` outside code spans as entities, so ``<run_id>`` shows instead of vanishing as a tag."""
    parts = re.split(r"(`+[^`]*`+)", text)
    return "".join(part if part.startswith("`") else part.replace("<", "&lt;").replace(">", "&gt;")
                   for part in parts)


#: Every generated page: file name under ``docs/reference/`` -> what writes its text.
PAGE_WRITERS: dict[str, Callable[[], str]] = {"cli.md": cli_page, "configuration.md": configuration_page}


def pages() -> dict[str, str]:
    """Every generated page: file name under ``docs/reference/`` -> its text."""
    return {name: write() for name, write in PAGE_WRITERS.items()}


def stale(directory: Path) -> list[str]:
    """The generated pages that are missing from ``directory`` or differ from what the code gives."""
    return [name for name, text in pages().items()
            if not (directory / name).is_file() or (directory / name).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco.cli.reference", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="DIR", type=Path, help="write every generated page into DIR")
    mode.add_argument("--check", metavar="DIR", type=Path, help="exit 1 when a page in DIR is stale")
    args = parser.parse_args(argv)
    if args.write is not None:
        args.write.mkdir(parents=True, exist_ok=True)
        for name, text in pages().items():
            (args.write / name).write_text(text)
        return 0
    behind = stale(args.check)
    if behind:
        print(f"stale: {', '.join(behind)} in {args.check}; regenerate with {REGENERATE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
