"""A ``backend:`` section validated by its own backend's model, looked up in the registry: the run config's
section, and each part of a run split over backends (``diloco.executors.mixed``), which says where it stands
(``backend.parts[1]``) so every error names the field a user has to fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from diloco.config_errors import format_validation_error, placeholder_problem, short
from diloco.errors import ConfigError

if TYPE_CHECKING:
    from diloco.executors.base import BackendConfig

__all__ = ["backend_section", "relocate"]


def backend_section(section: Mapping[str, Any], where: str = "backend") -> BackendConfig:
    """``section`` validated by backend ``section["kind"]``'s own model (the default backend without one).

    Raises ``ValueError`` with the one-line message, its field named from ``where`` (``backend.role_arn``, or
    ``backend.parts[1].role_arn`` for a part), so a model that holds the section reports it as is."""
    from diloco.executors import DEFAULT_BACKEND, backend_names, config_type

    kind = section.get("kind", DEFAULT_BACKEND)
    problem = placeholder_problem(dict(section), where)  # before the backend's own checks of the value's shape
    if problem:
        raise ValueError(problem)
    if not isinstance(kind, str) or kind not in backend_names():
        field = where if where == "backend" else f"{where}.kind"  # a part names its backend in its kind
        raise ValueError(f"{field}: must be one of {', '.join(backend_names())} (got {short(kind)})")
    try:
        model = config_type(kind)
        return model.model_validate({**section, "kind": kind})
    except ValidationError as exc:
        line = format_validation_error(exc, root=model, prefix=tuple(where.split(".")), kind=kind)
        raise ValueError(relocate(line, where)) from None
    except ConfigError as exc:
        raise ValueError(relocate(str(exc), where)) from None


def relocate(message: str, where: str) -> str:
    """A backend's own message about its section (``backend.namespace: ...``, ``backend: ...``) as about the
    section at ``where`` (``backend.parts[1].namespace: ...``); other messages unchanged."""
    if where == "backend" or message.startswith(where):
        return message
    for head in ("backend.", "backend:"):
        if message.startswith(head):
            return where + message[len("backend"):]
    return message
