"""Command-line flags declared on model fields, as plain data, so each setting is declared once: on its model.

A field becomes a flag of ``diloco launch`` (and, for a backend's config, of ``smoke`` and ``doctor``) by carrying
``cli_flag(...)`` in its ``json_schema_extra``; a replica setting names its flag of the replica entrypoint with
``replica_flag(...)``. The declaration is data only (standard library), so a model on the
replica side (``diloco.replica.settings``) can carry it too; reading the declarations into flag specs is
``diloco.executors.flags``, building click options from them is the CLI's job (``diloco.cli.model_flags``).
"""

from __future__ import annotations

from typing import Any

#: The key in a field's ``json_schema_extra`` that holds its ``diloco launch`` flag declaration.
FLAG_KEY = "cli_flag"
#: The key that holds a replica setting's entrypoint flag declaration (``replica_flag``).
REPLICA_FLAG_KEY = "replica_flag"

__all__ = ["FLAG_KEY", "REPLICA_FLAG_KEY", "cli_flag", "replica_flag"]


def cli_flag(name: str, *aliases: str, metavar: str | None = None, note: str | None = None,
             type: str | None = None, minimum: int | None = None, multiple: bool = False) -> dict[str, Any]:
    """The ``json_schema_extra`` that makes a field a flag.

    ``name`` is the long flag (``--sync-every``); ``aliases`` are short ones (``-n``). ``note`` is appended to the
    help in parentheses (default: the field's dotted path, so ``--steps`` says it sets ``train.steps``; ``""``
    for none). ``type`` overrides the value type the annotation implies (``"str"``, ``"int"``, ``"float"``,
    ``"bool"``); ``minimum`` refuses smaller integers while parsing; ``multiple``: the flag may be repeated, and the
    field gets the list of values. Plain data, so it also shows in the JSON schema of the config, where a generated
    reference can name each setting's flag."""
    if not name.startswith("--"):
        raise ValueError(f"cli_flag: a flag name starts with '--' (got {name!r})")
    spec: dict[str, Any] = {"name": name, "aliases": list(aliases)}
    for key, value in (("metavar", metavar), ("note", note), ("type", type), ("minimum", minimum)):
        if value is not None:
            spec[key] = value
    if multiple:
        spec["multiple"] = True
    return {FLAG_KEY: spec}


def replica_flag(name: str | None = None, *, metavar: str | None = None, env: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``json_schema_extra`` naming a replica setting's entrypoint flag (``diloco.replica.settings``): ``name``
    (default: the field's name with dashes, ``--world-size``), its ``metavar``, and the environment variables
    read when neither the flag nor a settings object gives the value (first set wins). Every replica setting has
    a flag; declare one only to change these. Combine with ``cli_flag`` as ``{**cli_flag(...),
    **replica_flag(...)}``."""
    return {REPLICA_FLAG_KEY: {"name": name, "metavar": metavar, "env": list(env)}}
