"""The caller's IAM for the emulators' AWS APIs: which actions an identity policy allows, the AccessDenied answer the
services give, and the execution-role check of CreateTrainingJob.

Why: without it every call is answered, so a backend that calls an action its documented least-privilege policy
lacks (``sagemaker:ListTags`` on a relaunch) passes every test and breaks for the first user who follows the docs.
An emulator started with a ``CallerPolicy`` refuses any action outside it, and every emulator records the actions
it evaluated (``ActionLog``), so a test can derive what the backend needs from what it called.

What AWS does, and what is modelled:

* An action is allowed when an ``Allow`` statement names it (IAM wildcards, case-insensitive) and no ``Deny``
  statement does. Resources and conditions are not evaluated (the documented policy scopes them; the emulator
  checks the actions).
* A refused call answers ``AccessDeniedException`` (HTTP 400 on the JSON APIs: SageMaker, CloudWatch Logs, Service
  Quotas) with the message form of the IAM User Guide's "Access denied error messages" page: ``User: <principal> is
  not authorized to perform: <action> on resource: <arn> because no identity-based policy allows the <action>
  action`` (an explicit deny ends "with an explicit deny in an identity-based policy"; SageMaker's own answer in
  wpilibsuite/DetectCoral#20: "... is not authorized to perform: sagemaker:CreateTrainingJob on resource:
  arn:aws:sagemaker:us-east-1:...:training-job/... with an explicit deny"). Actions on no resource (a listing) omit
  the "on resource" part.
* CreateTrainingJob also needs ``iam:PassRole`` on the execution role, and ``sagemaker:AddTags`` when it carries
  ``Tags`` (tag-on-create: SageMaker developer guide, "Provide permissions for tagging SageMaker AI resources").
* The execution role must exist and trust ``sagemaker.amazonaws.com``, else ``ValidationException`` "Could not
  assume role <arn>. Please ensure that the role exists and allows principal 'sagemaker.amazonaws.com' to assume
  the role." (the service's words, quoted in awslabs/predictive-maintenance-using-machine-learning#3). The role is
  looked up where the tests keep IAM: the moto server behind the emulator.
"""

from __future__ import annotations

import fnmatch
import json
import threading
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote

ACCESS_DENIED = "AccessDeniedException"
SAGEMAKER_PRINCIPAL = "sagemaker.amazonaws.com"


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value] if value is not None else []


class CallerPolicy:
    """The identity policy of whoever calls the emulator: ``allows(action)`` and ``denial(action, resource)``."""

    def __init__(self, allow: Iterable[str], *, deny: Iterable[str] = (),
                 principal: str = "arn:aws:iam::000000000000:user/emulator-caller") -> None:
        self.allow = [a.lower() for a in allow]
        self.deny = [a.lower() for a in deny]
        self.principal = principal

    @classmethod
    def from_document(cls, document: str | dict[str, Any], **kwargs: Any) -> CallerPolicy:
        """From an IAM policy document (JSON text or its dict): the actions of its Allow and Deny statements."""
        doc = json.loads(document) if isinstance(document, str) else document
        allow: list[str] = []
        deny: list[str] = []
        for statement in _as_list(doc.get("Statement")):
            if isinstance(statement, dict):
                target = deny if statement.get("Effect") == "Deny" else allow
                target.extend(str(a) for a in _as_list(statement.get("Action")))
        return cls(allow, deny=deny, **kwargs)

    def _names(self, action: str, patterns: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(action.lower(), p) for p in patterns)

    def allows(self, action: str) -> bool:
        return self._names(action, self.allow) and not self._names(action, self.deny)

    def denial(self, action: str, resource: str | None = None) -> str:
        """The message AWS answers a refused ``action`` with."""
        on = f" on resource: {resource}" if resource else ""
        why = ("with an explicit deny in an identity-based policy" if self._names(action, self.deny)
               else f"because no identity-based policy allows the {action} action")
        return f"User: {self.principal} is not authorized to perform: {action}{on} {why}"


class ActionLog:
    """Every IAM action an emulator evaluated, allowed or not, in order (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._actions: list[tuple[str, bool]] = []

    def add(self, action: str, allowed: bool) -> None:
        with self._lock:
            self._actions.append((action, allowed))

    def actions(self) -> set[str]:
        with self._lock:
            return {a for a, _ in self._actions}

    def denied(self) -> list[str]:
        with self._lock:
            return [a for a, allowed in self._actions if not allowed]


def authorize(policy: CallerPolicy | None, log: ActionLog, action: str, resource: str | None = None) -> str | None:
    """Record ``action``; the AccessDenied message when ``policy`` refuses it (None: allowed, or no policy)."""
    allowed = policy is None or policy.allows(action)
    log.add(action, allowed)
    return None if allowed else policy.denial(action, resource)  # type: ignore[union-attr]


def role_problem(iam: Any, role_arn: str) -> str | None:
    """Why SageMaker could not assume ``role_arn`` (the service's ValidationException message), or None. ``iam``:
    a boto3 IAM client of the account (the tests' moto). The ARN's path and name must be the role's (a role under
    ``service-role/`` named without its path is another ARN: aws/sagemaker-python-sdk#43)."""
    message = (f"Could not assume role {role_arn}. Please ensure that the role exists and allows principal "
               f"'{SAGEMAKER_PRINCIPAL}' to assume the role.")
    resource = role_arn.split(":", 5)[-1]  # role/<path>/<name>
    try:
        role = iam.get_role(RoleName=resource.rsplit("/", 1)[-1])["Role"]
    except Exception as exc:  # noqa: BLE001 - NoSuchEntity (or IAM unreachable): it cannot be assumed
        code = (getattr(exc, "response", None) or {}).get("Error", {}).get("Code")
        if code == "NoSuchEntity":
            return message
        raise
    if str(role.get("Arn", "")).split(":", 5)[-1] != resource:
        return message
    trust = role.get("AssumeRolePolicyDocument") or {}
    doc = json.loads(unquote(trust)) if isinstance(trust, str) else trust
    for statement in _as_list(doc.get("Statement")):
        principals = _as_list((statement.get("Principal") or {}).get("Service")) \
            if isinstance(statement.get("Principal"), dict) else []
        if statement.get("Effect") == "Allow" and SAGEMAKER_PRINCIPAL in principals and \
                any(fnmatch.fnmatchcase("sts:assumerole", str(a).lower()) for a in _as_list(statement.get("Action"))):
            return None
    return message
