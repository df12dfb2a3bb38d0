"""One error hierarchy, so the CLI can map each failure to a message, a hint and an exit code in one place; and
the one-line format every error is printed in, by the CLI and the replicas alike."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

#: Starts every error line; the CLI finds a replica's own error in its stderr by it.
ERROR_PREFIX = "diloco: error: "


def error_line(message: object) -> None:
    """``diloco: error: <message>`` on stderr, collapsed to one line."""
    sys.stderr.write(f"{ERROR_PREFIX}{' '.join(str(message).split())}\n")
    sys.stderr.flush()


def validation_line(exc: ValidationError, *, names: Mapping[str, str] | None = None) -> str:
    """``field: message`` for the first problem pydantic found, the one line a user reads. ``names`` says how to
    name a top-level field (the replica entrypoint names each by the flag or environment variable that gave it);
    a rule across fields names its field first in its message (``"min_replicas: ..."``)."""
    first = exc.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ())]
    message = str((first.get("ctx") or {}).get("error") or first.get("msg"))
    names = names or {}
    if not loc:
        field, _, rest = message.partition(": ")
        return f"{names[field]}: {rest}" if field in names else message
    where = names.get(loc[0], ".".join(loc)) if len(loc) == 1 else ".".join(loc)
    if first.get("type") == "missing":
        return f"{where}: required"
    if first.get("type") != "value_error":
        message += f" (got {first.get('input')!r})"
    return f"{where}: {message}"


class DilocoError(Exception):
    """Base of every error diloco raises on purpose. ``hint`` says what the user can do about it."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class ConfigError(DilocoError, ValueError):
    """Invalid user input (flag, YAML, environment). Raised before anything is launched."""


class StoreError(DilocoError):
    """The object store failed after bounded retries; carries the underlying error as ``__cause__``."""


class ObjectNotFound(StoreError, FileNotFoundError):
    """A key that was expected to exist does not."""


class CorruptObjectError(StoreError):
    """An object was truncated, corrupted or is not what it claims to be. It is never averaged."""


class AllReduceTimeout(DilocoError, TimeoutError):
    """Peers did not publish their contribution for a round in time.

    Names the round and the exact missing ranks so the orchestrator (or a human) knows whom to relaunch,
    and the last store error seen while polling, so a denied bucket is not mistaken for a slow peer.
    """

    def __init__(
        self, *, round_: int, missing_ranks: list[int], timeout_s: float, last_error: BaseException | None = None
    ) -> None:
        ranks = ", ".join(str(r) for r in missing_ranks)
        msg = f"all-reduce round {round_} timed out after {timeout_s:g}s waiting for rank(s) {ranks}"
        if last_error is not None:
            msg += f"; last store error: {type(last_error).__name__}: {last_error}"
        super().__init__(msg, hint="check those replicas' logs (`diloco logs -r <rank>`) and the store's permissions")
        self.round = round_
        self.missing_ranks = missing_ranks
        self.timeout_s = timeout_s
        self.last_error = last_error


class BackendError(DilocoError):
    """A backend (local processes, SageMaker, Kubernetes) refused or failed a request."""


class LaunchRefused(DilocoError):
    """A launch that did not get under way: the backend's service, the cluster or the store refused it (a quota, a
    missing bucket or namespace, a request the service rejects) or could not be reached. Whatever the launch had
    created was stopped and whatever it had written was removed before this is raised; the message is the refusal's
    own. ``left_behind`` names what could not be removed (empty when nothing was left)."""

    def __init__(self, message: str, *, hint: str | None = None, left_behind: list[str] | None = None) -> None:
        super().__init__(message, hint=hint)
        self.left_behind = list(left_behind or [])


class RunNotFound(DilocoError):
    """No run with that id is recorded in the local registry."""
