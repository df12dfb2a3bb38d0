"""How an AWS error becomes the one line a user reads: every call the SageMaker backend makes goes through
``aws_call`` (or builds its error with ``aws_error`` where it first decides whether to wait and try again).

Why one place: a botocore ``ClientError`` that escapes a backend method is not a ``DilocoError``, so the launcher's
wait loop does not catch it and the CLI prints it as an internal error, ending a relaunch that would have
recovered the run. And the two errors a least-privilege user meets first deserve their fix, not just their code:
an action the identity's policy does not allow (AWS names it in the message: "... is not authorized to perform:
sagemaker:ListTags on resource: ...") and an execution role SageMaker cannot assume ("Could not assume role ...").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from diloco.errors import BackendError

T = TypeVar("T")

#: Where the launching identity's policy is documented (the actions every command needs).
IAM_DOC = "docs/backends/sagemaker.md, section IAM"
_DENIED_ACTION = re.compile(r"not authorized to perform:? ([A-Za-z0-9-]+:[A-Za-z0-9*]+)")
_DENIED_CODES = frozenset({"AccessDenied", "AccessDeniedException", "UnauthorizedOperation"})


def client_error(exc: BaseException) -> tuple[str, str]:
    """(code, message) of a botocore error, or the exception's class and text."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        return str(err.get("Code") or type(exc).__name__), str(err.get("Message") or exc)
    return type(exc).__name__, str(exc)


def is_aws_error(exc: BaseException) -> bool:
    """A botocore ``ClientError`` (the service answered with an error) or ``BotoCoreError`` (no credentials, no
    connection, a parameter botocore refused)."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # pragma: no cover - botocore is there whenever a client exists
        return False
    return isinstance(exc, (BotoCoreError, ClientError))


def denied_action(exc: BaseException) -> str | None:
    """The IAM action an access-denied answer names (``sagemaker:ListTags``), or None for any other error."""
    code, message = client_error(exc)
    found = _DENIED_ACTION.search(message)
    if code in _DENIED_CODES or found:
        return found.group(1) if found else "the action"
    return None


def fix_for(exc: BaseException) -> str | None:
    """The fix of the errors whose cause the answer names: a denied action, an execution role SageMaker cannot
    assume; None for the rest."""
    action = denied_action(exc)
    if action is not None:
        return f"allow {action} to your AWS identity: the policy in {IAM_DOC}"
    _, message = client_error(exc)
    if "could not assume role" in message.lower():
        return ("the execution role (--role / backend.role_arn) must exist, with its path, and trust "
                "sagemaker.amazonaws.com; `diloco doctor --backend sagemaker --role <arn>` checks both")
    return None


def aws_error(doing: str, exc: BaseException, *, hint: str) -> BackendError:
    """``BackendError("<doing>: <code>: <message>")`` on one line, with the fix the answer calls for before
    ``hint`` (what to do in general)."""
    code, message = client_error(exc)
    fix = fix_for(exc)
    one_line = " ".join(message.split())
    return BackendError(f"{doing}: {code}: {one_line}", hint=f"{fix}; {hint}" if fix else hint)


def aws_call(doing: str, call: Callable[[], T], *, hint: str = "check your AWS credentials and region") -> T:
    """``call()``, with a botocore error raised as ``aws_error(doing, ...)``; anything else propagates as it is."""
    try:
        return call()
    except Exception as exc:
        if not is_aws_error(exc):
            raise
        raise aws_error(doing, exc, hint=hint) from exc
