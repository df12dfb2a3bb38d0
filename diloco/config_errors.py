"""How a configuration error reads: the one line a user sees, naming the field by its dotted path in the run config,
what is allowed and what was given.

Both programs' configuration goes through pydantic models: the run config (``diloco.launcher.config``) and every
backend's section (``diloco.executors.sections``, which a composite backend uses for each of its parts), so the
formatting lives here, among the basics both sides share (pydantic only).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from pydantic import ValidationError

#: A value still holding a template's placeholder (``<bucket>``, ``<account-id>``).
PLACEHOLDER_RE = re.compile(r"<[a-z0-9][a-z0-9-]*>")

__all__ = ["PLACEHOLDER_RE", "format_validation_error", "model_at", "placeholder_problem", "short", "strings"]


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def strings(data: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Every string value in a nested dict, with its dotted path."""
    out: list[tuple[str, str]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            out += strings(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(data, str):
        out.append((prefix, data))
    return out


def placeholder_problem(data: Any, prefix: str = "") -> str | None:
    """The first string in ``data`` that still holds a template placeholder, as the line that says so; None."""
    for path, value in strings(data, prefix):
        found = PLACEHOLDER_RE.search(value)
        if found:
            return f"{path}: replace the placeholder {found.group(0)!r} with a real value (got {value!r})"
    return None


def model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class owning the fields at ``loc``."""
    model: Any = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            model = field.annotation
        else:
            return None
    return model


def format_validation_error(exc: ValidationError, *, root: type[BaseModel], prefix: tuple[str, ...] = (),
                            kind: str | None = None) -> str:
    """The first error as one line: ``field.path: what is allowed (got what)``; ``(+N more)`` if there are more.

    ``root`` is the validated model; ``prefix`` is where it sits in the run config (``("backend",)`` for a backend
    section, whose errors also name the backend ``kind``)."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    inner = tuple(err["loc"])
    loc = (*prefix, *inner)
    path = ".".join(str(p) for p in loc)
    typ, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    if typ == "extra_forbidden":
        owner = model_at(root, inner[:-1])
        allowed = ", ".join(f for f in owner.model_fields if f != "kind") if owner else ""
        where = f" for the {kind} backend" if kind else ""
        msg = f"{path}: unknown key{where}" + (f" (allowed: {allowed})" if allowed else "")
    elif typ == "missing":
        where = f" for the {kind} backend" if kind else ""
        msg = f"{path}: required{where}"
    elif typ in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[typ]
        bound = next(iter(ctx.values()), "?")
        bound = f"{bound:g}" if isinstance(bound, float) else bound
        msg = f"{path}: must be {op} {bound} (got {short(got)})"
    elif typ in ("int_parsing", "int_type", "int_from_float"):
        msg = f"{path}: must be an integer (got {short(got)})"
    elif typ in ("float_parsing", "float_type"):
        msg = f"{path}: must be a number (got {short(got)})"
    elif typ in ("bool_parsing", "bool_type"):
        msg = f"{path}: must be true or false (got {short(got)})"
    elif typ == "string_type":
        msg = f"{path}: must be a string (got {short(got)})"
    elif typ in ("dict_type", "model_type", "model_attributes_type"):
        msg = f"{path or 'config'}: must be a mapping of keys to values (got {short(got)})"
    elif typ == "literal_error":
        msg = f"{path}: must be {ctx.get('expected', '?')} (got {short(got)})"
    elif typ == "value_error":
        text = str(ctx.get("error", err["msg"]))
        if not inner:  # the model's own rules name their fields in full
            msg = text
        elif model_at(root, inner) is not None:  # a section's rule names the field it is about
            msg = f"{path}.{text}"
        else:  # a field's own rule
            msg = f"{path}: {text}"
    else:
        msg = f"{path}: {err['msg']} (got {short(got)})"
    if len(errors) > 1:
        msg += f" (+{len(errors) - 1} more)"
    return msg
