"""Where CLI output goes: data on stdout, narration and progress on stderr; ``NO_COLOR`` and non-TTYs honoured.

Every read command accepts ``-o table|json``. JSON output is the same pydantic model the table renders, with a
``schema_version`` key, so scripts can rely on it; keys are only ever added.
"""

from __future__ import annotations

import enum
import errno
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

SCHEMA_VERSION = 1


class OutputFormat(str, enum.Enum):
    table = "table"
    json = "json"
    yaml = "yaml"


#: The ``-o/--format`` option every read command takes.
FormatOpt = Annotated[OutputFormat, typer.Option("-o", "--format", help="Output format: table, json or yaml "
                                                 "(yaml: the same data as json).", metavar="table|json|yaml",
                                                 case_sensitive=False)]


def _no_color() -> bool:
    return bool(os.environ.get("NO_COLOR"))


def _width(stream: Any) -> int | None:
    """Rich's own width on a terminal (or with ``COLUMNS``); piped output is not cut to 80 columns."""
    if os.environ.get("COLUMNS") or (hasattr(stream, "isatty") and stream.isatty()):
        return None
    return 200


def _broken_pipe() -> None:
    """Rich's default exits 1 on a closed stdout; raise instead, so ``handled()`` treats every command alike."""
    raise BrokenPipeError(errno.EPIPE, "stdout was closed by the reader")


def stdout_console() -> Console:
    """Console for data. Built per call so tests capturing ``sys.stdout`` see the output."""
    console = Console(file=sys.stdout, no_color=_no_color(), highlight=False, soft_wrap=True, markup=False,
                      emoji=False, width=_width(sys.stdout))
    console.on_broken_pipe = _broken_pipe  # type: ignore[method-assign]
    return console


def stderr_console() -> Console:
    """Console for narration, progress and errors; markup and emoji codes off, so user and trainer text
    (``[r0]``, ``mypkg.train:train:``, ``:smile:``) prints literally."""
    return Console(file=sys.stderr, no_color=_no_color(), highlight=False, markup=False, emoji=False,
                   soft_wrap=True, width=_width(sys.stderr))


def say(message: str) -> None:
    """One line of narration on stderr."""
    stderr_console().print(message)


def to_jsonable(data: Any) -> Any:
    """pydantic models, enums and containers to plain JSON values; NaN and infinities become ``null`` (JSON has
    no such numbers, and ``NaN`` in the output would break every parser; reports flag divergence separately)."""
    if hasattr(data, "model_dump"):
        return to_jsonable(data.model_dump(mode="python"))
    if isinstance(data, dict):
        return {str(k): to_jsonable(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [to_jsonable(v) for v in data]
    if isinstance(data, enum.Enum):
        return data.value
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, Path):
        return str(data)
    return data


def emit(data: Any, fmt: OutputFormat, table: Callable[[Console], None]) -> None:
    """Print ``data`` as JSON (with ``schema_version``) or call ``table`` to render it for humans, on stdout."""
    if fmt in (OutputFormat.json, OutputFormat.yaml):
        payload = to_jsonable(data)
        if isinstance(payload, dict):
            payload = {"schema_version": SCHEMA_VERSION, **payload}
        if fmt == OutputFormat.json:
            sys.stdout.write(json.dumps(payload, indent=2, sort_keys=False, allow_nan=False) + "\n")
        else:
            import yaml

            sys.stdout.write(yaml.safe_dump(payload, sort_keys=False, default_flow_style=False))
        sys.stdout.flush()
    else:
        table(stdout_console())
