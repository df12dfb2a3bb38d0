"""Command-line flags declared on config fields, so each setting is declared once: on its model.

A field becomes a flag of ``diloco launch`` (and, for a backend's config, of ``smoke`` and ``doctor``) by
carrying a declaration in its ``json_schema_extra``; the flag's help is the field's ``description``::

    from pydantic import Field
    from diloco.executors.flags import cli_flag

    class SlurmBackendConfig(BackendConfig):
        kind: Literal["slurm"] = "slurm"
        partition: str | None = Field(None, description="Slurm partition for the replicas.",
                                      json_schema_extra=cli_flag("--partition", metavar="NAME"))

The declaration itself is plain data (``diloco.flags``, re-exported here), so replica-side models carry it too.
This module reads the declarations (standard library and pydantic's ``FieldInfo``); building click options from
them is the CLI's job (``diloco.cli.model_flags``), so a backend never imports the CLI.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from diloco.flags import FLAG_KEY, cli_flag

__all__ = ["FLAG_KEY", "FlagSpec", "cli_flag", "flag_key", "flag_of", "model_flags", "route_backend_flags"]


@dataclass(frozen=True)
class FlagSpec:
    """One field's flag: where it lands (``path``, dotted from the model given to ``model_flags``) and how it
    reads on the command line."""

    path: str  # e.g. "train.sync_every", or a backend config's own field name, e.g. "role_arn"
    name: str  # "--sync-every"
    aliases: tuple[str, ...]
    metavar: str | None
    help: str
    type: str  # "str", "int", "float" or "bool"
    minimum: int | None
    multiple: bool = False  # repeatable: the field gets the list of values

    @property
    def key(self) -> str:
        """The flag as a Python name (``--instance-type`` -> ``instance_type``): a click parameter name, and the
        key backend flags are routed by."""
        return flag_key(self.name)


def flag_key(name: str) -> str:
    """``--instance-type`` -> ``instance_type``."""
    return name.lstrip("-").replace("-", "_")


def flag_of(field: FieldInfo, path: str) -> FlagSpec | None:
    """The flag ``field`` declares, or None."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    spec = extra.get(FLAG_KEY)
    if not isinstance(spec, dict):
        return None
    note = spec.get("note", path)
    description = (field.description or "").strip()
    if note:
        description = f"{description.rstrip('.')} ({note})." if description else f"({note})."
    return FlagSpec(path=path, name=spec["name"], aliases=tuple(spec.get("aliases", ())),
                    metavar=spec.get("metavar"), help=description,
                    type=spec.get("type") or _value_type(field.annotation), minimum=spec.get("minimum"),
                    multiple=bool(spec.get("multiple")))


def model_flags(model: type[BaseModel], prefix: str = "") -> Iterator[FlagSpec]:
    """Every flag ``model`` and its nested models declare, in field order (a section's flags where it stands)."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        found = flag_of(field, path)
        if found is not None:
            yield found
            continue
        nested = field.annotation
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            yield from model_flags(nested, f"{path}.")


def _value_type(annotation: Any) -> str:
    """The flag's value type from a field's annotation (``int | None`` -> ``"int"``); text for anything else."""
    args = [a for a in getattr(annotation, "__args__", (annotation,)) if a is not type(None)]
    for kind in (bool, int, float):
        if args and all(a is kind for a in args):
            return kind.__name__
    return "str"


def route_backend_flags(kind: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """Backend flag values (``{"role": ARN}``, ``None`` meaning not given) as backend ``kind``'s config fields
    (``{"role_arn": ARN}``). A flag that backend does not declare is a one-line ``ConfigError`` naming the flag and
    the installed backends that do take it, so ``--role`` on a local run is refused, never silently dropped."""
    from diloco.errors import ConfigError
    from diloco.executors import backend_names, config_type

    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return {}
    declared = config_type(kind).flags
    out: dict[str, Any] = {}
    for key, value in given.items():
        field = declared.get(key)
        if field is None:
            flag = "--" + key.replace("_", "-")
            takers = [name for name in backend_names() if key in _flags_of(name)]
            who = f"backends that take it: {', '.join(takers)}" if takers else "no installed backend takes it"
            raise ConfigError(f"{flag}: the {kind} backend has no such setting ({who})",
                              hint=f"drop {flag}" + (f", or use --backend {takers[0]}" if takers else ""))
        out[field] = value
    return out


def _flags_of(name: str) -> dict[str, str]:
    """Backend ``name``'s flags, or none if it cannot be imported (a broken package must not hide the answer)."""
    from diloco.errors import ConfigError
    from diloco.executors import config_type

    try:
        return config_type(name).flags
    except ConfigError:
        return {}
