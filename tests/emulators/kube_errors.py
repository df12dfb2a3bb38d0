"""Kubernetes API errors as the API server words them: ``Status`` bodies and field errors.

The real client turns any non-2xx answer into ``ApiException(status, reason, body)``; code that handles errors
(the backend's one-line messages, ``diloco doctor``) reads ``body["reason"]`` and ``body["message"]``. So the
emulator must produce the same ``Status`` objects, with the same wording, as ``k8s.io/apimachinery``'s
``pkg/api/errors`` and ``pkg/util/validation/field``; each constructor below names the Go function it mirrors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

#: Marks a field error that prints no value (Go's ``field.OmitValueType{}``).
OMIT: Any = object()


class ApiError(Exception):
    """An API answer other than success: an HTTP code plus the ``Status`` body the client will parse."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        """The ``metav1.Status`` JSON object (``details`` only when the server sends it)."""
        body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                "message": self.message, "reason": self.reason}
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _qualified(resource: str, group: str) -> str:
    """``schema.GroupResource.String()``: ``jobs.batch``, or bare ``pods`` for the core group."""
    return f"{resource}.{group}" if group else resource


def go_quote(value: str) -> str:
    """Go's ``%q`` for the printable strings the API deals in (JSON escaping agrees with it there)."""
    return json.dumps(value, ensure_ascii=False)


def not_found(resource: str, group: str, name: str) -> ApiError:
    """``errors.NewNotFound``: ``jobs.batch "x" not found``."""
    return ApiError(404, "NotFound", f"{_qualified(resource, group)} {go_quote(name)} not found",
                    {"name": name, "group": group, "kind": resource} if group else {"name": name, "kind": resource})


def already_exists(resource: str, group: str, name: str) -> ApiError:
    """``errors.NewAlreadyExists``: ``jobs.batch "x" already exists``."""
    details = {"name": name, "group": group, "kind": resource} if group else {"name": name, "kind": resource}
    return ApiError(409, "AlreadyExists", f"{_qualified(resource, group)} {go_quote(name)} already exists", details)


def forbidden(resource: str, group: str, name: str, why: str) -> ApiError:
    """``errors.NewForbidden``: ``jobs.batch "x" is forbidden: <why>`` (no name: ``jobs.batch is forbidden``)."""
    what = _qualified(resource, group)
    message = f"{what} {go_quote(name)} is forbidden: {why}" if name else f"{what} is forbidden: {why}"
    details: dict[str, Any] = {"kind": resource}
    if name:
        details["name"] = name
    if group:
        details["group"] = group
    return ApiError(403, "Forbidden", message, details)


def bad_request(message: str) -> ApiError:
    """``errors.NewBadRequest``: no details, only the message."""
    return ApiError(400, "BadRequest", message)


def route_not_found() -> ApiError:
    """What the API server answers for a path it does not serve."""
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def unauthorized() -> ApiError:
    """A request whose bearer token the server does not accept."""
    return ApiError(401, "Unauthorized", "Unauthorized")


@dataclass
class FieldError:
    """One ``field.Error``: a type, the field path, the offending value and a detail."""

    type: str
    field: str
    bad_value: Any = OMIT
    detail: str = ""

    _TITLES = {"FieldValueRequired": "Required value", "FieldValueInvalid": "Invalid value",
               "FieldValueNotSupported": "Unsupported value", "FieldValueDuplicate": "Duplicate value",
               "FieldValueForbidden": "Forbidden", "FieldValueTooLong": "Too long",
               "FieldValueTooMany": "Too many", "FieldValueNotFound": "Not found"}
    _NO_VALUE = frozenset({"FieldValueRequired", "FieldValueForbidden", "FieldValueTooLong"})

    def body(self) -> str:
        """``Error.ErrorBody()``: the type's title, the value Go-formatted, then the detail."""
        text = self._TITLES[self.type]
        if self.type not in self._NO_VALUE and self.bad_value is not OMIT:
            text += f": {format_bad_value(self.bad_value)}"
        if self.detail:
            text += f": {self.detail}"
        return text

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


def format_bad_value(value: Any) -> str:
    """A bad value the way ``ErrorBody`` prints it: numbers and bools bare, strings quoted, the rest as JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return go_quote(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def required(path: str, detail: str = "") -> FieldError:
    return FieldError("FieldValueRequired", path, "", detail)


def invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError("FieldValueInvalid", path, value, detail)


def not_supported(path: str, value: Any, supported: list[str]) -> FieldError:
    """``field.NotSupported``: the detail lists the allowed values, each quoted."""
    return FieldError("FieldValueNotSupported", path, value,
                      "supported values: " + ", ".join(go_quote(v) for v in supported) if supported else "")


def duplicate(path: str, value: Any) -> FieldError:
    return FieldError("FieldValueDuplicate", path, value)


def too_many(path: str, actual: int, limit: int) -> FieldError:
    return FieldError("FieldValueTooMany", path, actual, f"must have at most {limit} items")


@dataclass
class FieldErrors:
    """An ``ErrorList`` being collected by the validation functions."""

    items: list[FieldError] = field(default_factory=list)

    def add(self, *errors: FieldError) -> None:
        self.items.extend(errors)

    def aggregate(self) -> str:
        """``ErrorList.ToAggregate().Error()``: one message bare, several deduplicated inside ``[...]``."""
        seen: list[str] = []
        for error in self.items:
            if str(error) not in seen:
                seen.append(str(error))
        return seen[0] if len(seen) == 1 else "[" + ", ".join(seen) + "]"


def invalid_object(kind: str, group: str, name: str, errors: FieldErrors) -> ApiError:
    """``errors.NewInvalid``: 422 ``Job.batch "x" is invalid: <errors>`` with one cause per field error."""
    qualified = f"{kind}.{group}" if group else kind
    causes = [{"reason": e.type, "message": e.body(), "field": e.field} for e in errors.items]
    details: dict[str, Any] = {"name": name, "kind": kind, "causes": causes}
    if group:
        details["group"] = group
    return ApiError(422, "Invalid", f"{qualified} {go_quote(name)} is invalid: {errors.aggregate()}", details)
