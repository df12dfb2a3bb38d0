"""The environment a user gives every replica (``--env KEY=VALUE``, the run config's ``env:``): which names may be
given, and how the values that look secret are hidden wherever diloco shows or records them.

Why both rules live here, on the backends' side of the layering: the run config validates the names before anything
is planned (the launcher imports this), every backend passes the same mapping on (``LaunchSpec.env``), and the dry
run and the run record mask what a terminal, a CI log or ``$DILOCO_HOME`` must not hold (``masked``). The request a
backend really sends keeps the real values: that is the point of passing them.

Names follow POSIX's portable form, which is also SageMaker's ``Environment`` key pattern
(``^[a-zA-Z_][a-zA-Z0-9_]*$``, ``executors/sagemaker/config.py``) and a valid Kubernetes ``EnvVar.name``. The
variables diloco itself sets for a replica (``diloco.envvars``: its rank, the world size, the rendezvous, ...) are
refused: a user's value would either be overwritten silently or break the replica contract.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from diloco import envvars

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: What a masked value reads as.
MASK = "****"
#: A name that says its value is a credential: HF_TOKEN, AWS_SECRET_ACCESS_KEY, WANDB_API_KEY, PGPASSWORD, ...
SECRET_NAME_RE = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH", re.IGNORECASE)
#: The variables every backend sets for the replica contract (``LaunchSpec.replica_env`` and the backends' own).
RESERVED = frozenset({
    envvars.RUN_ID, envvars.REPLICA_RANK, envvars.WORLD_SIZE, envvars.RENDEZVOUS_URI, envvars.JOB_COMPLETION_INDEX,
    envvars.SM_MODEL_DIR, envvars.RANK_OFFSET, envvars.CHECKPOINT_DIR,
})
#: Every ``DILOCO_*`` name is diloco's: the contract above, the bootstrap's settings, the Kubernetes log shipping.
RESERVED_PREFIX = "DILOCO_"


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be given to the replicas (None: it can), as the rest of a line that names it."""
    if not NAME_RE.match(name):
        return ("not a valid variable name: use letters, digits and underscores, not starting with a digit "
                f"(got {name!r})")
    if name in RESERVED or name.upper().startswith(RESERVED_PREFIX):
        return ("diloco sets this variable for every replica itself (its rank, world size, rendezvous and run "
                "settings come from the run config); choose another name")
    return None


def value_problem(value: str) -> str | None:
    """Why ``value`` cannot be a variable's value (None: it can): a process environment cannot hold a NUL byte."""
    if "\x00" in value:
        return "the value contains a NUL character, which no process environment can hold"
    return None


def looks_secret(name: str) -> bool:
    """Whether a variable's name says its value is a credential (``SECRET_NAME_RE``)."""
    return bool(SECRET_NAME_RE.search(name))


def mask_value(name: str, value: str) -> str:
    """``value`` as diloco shows it: ``MASK`` when the name looks secret; a URL's credentials masked whatever the
    name: the password of ``https://user:password@host/simple``, or the whole user part of
    ``https://TOKEN@host/simple`` (private indexes take a token as the user name); anything else as it is."""
    if looks_secret(name):
        return MASK
    if "@" in value and "://" in value:
        try:
            parts = urlsplit(value)
            password = parts.password
        except ValueError:
            return value
        userinfo, at, host = parts.netloc.rpartition("@")
        if at and userinfo:
            shown = f"{parts.username}:{MASK}" if password else MASK
            return urlunsplit(parts._replace(netloc=f"{shown}@{host}"))
    return value


def masked_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with every value as diloco shows it (``mask_value``)."""
    return {name: mask_value(name, value) for name, value in env.items()}


def masked(data: Any, env: Mapping[str, str]) -> Any:
    """A copy of JSON-like ``data`` (a backend's requests) with the values of ``env``'s variables masked wherever
    a request spells a variable out: a mapping entry named after it (SageMaker's ``Environment``, the local
    backend's ``env``) or a ``{"name": ..., "value": ...}`` item (a Kubernetes container's ``env``). Only the
    user's own variables are touched, so a request field that merely contains ``KEY`` (``KmsKeyId``) stays."""
    hidden = {name: mask_value(name, value) for name, value in env.items() if mask_value(name, value) != value}
    if not hidden:
        return data
    return _mask(data, hidden)


def _mask(data: Any, hidden: Mapping[str, str]) -> Any:
    if isinstance(data, list):
        return [_mask(item, hidden) for item in data]
    if not isinstance(data, dict):
        return data
    named = data.get("name")
    out: dict[Any, Any] = {}
    for key, value in data.items():
        if isinstance(value, str) and key in hidden:
            out[key] = hidden[key]
        elif key == "value" and isinstance(value, str) and isinstance(named, str) and named in hidden:
            out[key] = hidden[named]
        else:
            out[key] = _mask(value, hidden)
    return out
