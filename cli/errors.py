"""The one place an exception becomes a message, a hint and an exit code.

Every command body runs inside ``handled()``. Output is one line on stderr, ``diloco: error: <message> (<hint>)``
(the replica entrypoint's format too); the traceback only with ``DILOCO_DEBUG=1``.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import typer

from diloco import envvars
from diloco.cli import exit_codes
from diloco.errors import ConfigError, DilocoError, LaunchRefused, RunNotFound, error_line

F = TypeVar("F", bound=Callable[..., Any])

#: Errors that mean "the command was asked for something wrong" (nothing launched); a launch the service refused is
#: 3 (``LaunchRefused``); every other error is 1.
USAGE_ERRORS: tuple[type[BaseException], ...] = (ConfigError, RunNotFound)


def debug_enabled() -> bool:
    return os.environ.get(envvars.DILOCO_DEBUG, "") not in ("", "0")


def exit_code_for(exc: BaseException) -> int:
    if isinstance(exc, USAGE_ERRORS):
        return exit_codes.USAGE
    if isinstance(exc, LaunchRefused):
        return exit_codes.REFUSED
    return exit_codes.FAILED


def report(exc: BaseException) -> int:
    """Print ``exc`` the documented way and return its exit code."""
    if debug_enabled():
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    if isinstance(exc, DilocoError):
        error_line(f"{exc} ({exc.hint})" if exc.hint else str(exc))
    else:
        hint = "" if debug_enabled() else f" (set {envvars.DILOCO_DEBUG}=1 for the traceback)"
        error_line(f"internal error: {type(exc).__name__}: {exc}{hint}")
    return exit_code_for(exc)


@contextmanager
def handled() -> Iterator[None]:
    """Turn any exception from a command body into its documented message and exit code."""
    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        raise typer.Exit(exit_codes.INTERRUPTED) from None
    except BrokenPipeError:  # `diloco logs | head`: the reader has all it wanted; no traceback, no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail
        raise typer.Exit(exit_codes.OK) from None
    except Exception as exc:  # noqa: BLE001 - this is the one place errors are mapped
        raise typer.Exit(report(exc)) from None


def forget_interrupt_in_exec() -> None:
    """Keep the documented exit code 130 under ``python -m diloco.cli.main`` (``main`` calls this before exiting
    130).

    CPython marks the interpreter to end by SIGINT, whatever exit code it is given, when a ``KeyboardInterrupt``
    ends code run from a string by ``exec`` (``dataclasses`` creates every class's methods so, so a Ctrl-C during
    an import can land there), even though the exception was then handled; under ``-m`` that mark is read at exit
    and the process dies of SIGINT (-2) instead of exiting 130. Running any string clears the mark."""
    exec("None", {})  # noqa: S102 - a constant: only the interpreter's side effect is wanted


def command(fn: F) -> F:
    """Decorator form of ``handled`` for Typer commands (keeps the signature Typer reads)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with handled():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
