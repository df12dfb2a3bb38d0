"""What a replica needs installed beyond diloco's own requirements, decided on the launcher for the bootstrap.

A job without a ready image starts on a stock image (AWS's PyTorch training image) that lacks diloco's optional
dependencies. The bootstrap (``executors/bootstrap.py``) installs diloco's own requirements the image lacks by
itself; this module decides the rest, so the request shows it (``diloco launch --dry-run``) in one environment
entry, ``DILOCO_BOOTSTRAP_REQUIREMENTS``, a JSON list of pip arguments:

* the store's extra (``aws``: s3fs with its boto3) when the rendezvous is on S3;
* the extras the trainer declares: a module-level ``DILOCO_EXTRAS = ("hf",)`` in the trainer's module, read
  from its source without importing it (the module may import torch or transformers at the top, which the
  launcher may not have); ``diloco.trainers.hf`` declares ``hf``;
* tensorboard (the requirement diloco declares for it) when the run writes TensorBoard events;
* the extra of each experiment tracker the run logs to (``mlflow``: mlflow-skinny, ``wandb``), which the launcher
  named in the replica settings;
* ``-r requirements.txt`` when the shipped source directory has one (the SageMaker SDK's convention).

Requirement strings come from diloco's installed metadata, the same that the shipped wheel carries, so the
versions are the ones ``pyproject.toml`` names. Standard library only: this runs in the launcher.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diloco.errors import ConfigError

#: The request's environment entry the bootstrap reads.
BOOTSTRAP_REQUIREMENTS_ENV = "DILOCO_BOOTSTRAP_REQUIREMENTS"
#: The module-level name a trainer module declares its extras with.
TRAINER_EXTRAS_ATTR = "DILOCO_EXTRAS"
#: The extra that lets the store reach S3.
STORE_EXTRA = "aws"
#: A requirements file in the source directory's root is installed too (the SageMaker SDK's convention).
REQUIREMENTS_TXT = "requirements.txt"

_EXTRA_MARKER = re.compile(r"""^\s*extra\s*==\s*['"]([\w.-]+)['"]\s*$""")


def diloco_extras() -> dict[str, list[str]]:
    """diloco's extras, each with its requirement strings (from the installed metadata)."""
    extras: dict[str, list[str]] = {}
    for line in importlib.metadata.requires("diloco") or []:
        requirement, _, marker = line.partition(";")
        match = _EXTRA_MARKER.match(marker)
        if match:
            extras.setdefault(match.group(1), []).append(requirement.strip())
    return extras


def requirement_named(name: str) -> str:
    """The requirement diloco declares for distribution ``name`` (in any extra), e.g. ``tensorboard>=2.14``."""
    for requirements in diloco_extras().values():
        for requirement in requirements:
            if re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower() == name.lower():
                return requirement
    return name


def trainer_extras(trainer: str, search_path: Sequence[str | Path] = ()) -> tuple[str, ...]:
    """The extras ``module:function``'s module declares (``DILOCO_EXTRAS``), read from its source; ``()`` when the
    module cannot be found here (it may exist only in an image) or declares none. ``ConfigError`` for a
    declaration that is not a tuple of diloco's extra names."""
    module = trainer.split(":", 1)[0]
    source = _module_source(module, [str(p) for p in search_path])
    if source is None:
        return ()
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return ()  # the replica reports a module it cannot import in its own words
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == TRAINER_EXTRAS_ATTR for t in targets) and node.value is not None:
            return _checked_extras(module, node.value)
    return ()


def _checked_extras(module: str, value: ast.expr) -> tuple[str, ...]:
    known = diloco_extras()
    try:
        extras = ast.literal_eval(value)
    except ValueError:
        extras = None
    if not isinstance(extras, (tuple, list)) or not all(isinstance(e, str) for e in extras):
        raise ConfigError(f"train.trainer: {module}.{TRAINER_EXTRAS_ATTR} must be a literal tuple of diloco extra "
                          f"names, e.g. (\"hf\",)", hint=f"diloco's extras: {', '.join(sorted(known))}")
    unknown = [e for e in extras if e not in known]
    if unknown:
        raise ConfigError(f"train.trainer: {module}.{TRAINER_EXTRAS_ATTR} names {', '.join(map(repr, unknown))}, "
                          f"which diloco does not have", hint=f"diloco's extras: {', '.join(sorted(known))}")
    return tuple(extras)


def _module_source(module: str, search_path: list[str]) -> Path | None:
    """The ``.py`` file of ``module``: in ``search_path`` (the user's source directory) first, then wherever this
    interpreter would import it from. Nothing is executed but, for an installed dotted module, its parent
    packages' ``__init__``."""
    path, spec = list(search_path), None
    for part in module.split(".") if path else []:
        spec = importlib.machinery.PathFinder.find_spec(part, path) if path else None
        if spec is None:
            break
        path = list(spec.submodule_search_locations or [])
    if spec is None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


#: The extra a run streaming a Hugging Face dataset needs (``-k data=hf:NAME``), and the prefix that says so.
HF_DATA_EXTRA, HF_DATA_PREFIX = "hf-data", "hf:"


def streams_hf_data(trainer_kwargs: Mapping[str, Any]) -> bool:
    """Whether the trainer is asked to stream a ``datasets`` dataset (``data=hf:NAME[:CONFIG][@SPLIT]``)."""
    data = trainer_kwargs.get("data")
    return isinstance(data, str) and data.startswith(HF_DATA_PREFIX)


def replica_requirements(*, trainer: str, rendezvous_uri: str, tensorboard: bool,
                         source_dir: Path | None, ships_requirements_txt: bool,
                         trackers: tuple[str, ...] = (), hf_data: bool = False) -> list[str]:
    """The pip arguments the bootstrap installs beyond diloco's own requirements, in order, without repeats.
    ``trackers``: the extras of the experiment trackers the run logs to (``mlflow``, ``wandb``); ``hf_data``:
    the run streams a Hugging Face dataset (``streams_hf_data``), so the ``datasets`` library comes too."""
    extras = diloco_extras()
    wanted: list[str] = []
    if rendezvous_uri.startswith("s3://"):
        wanted += extras.get(STORE_EXTRA, [])
    for extra in trainer_extras(trainer, [source_dir] if source_dir is not None else []):
        wanted += extras[extra]
    if tensorboard:
        wanted.append(requirement_named("tensorboard"))
    for tracker in trackers:
        wanted += extras.get(tracker, [])
    if hf_data:
        wanted += extras.get(HF_DATA_EXTRA, [])
    if ships_requirements_txt:
        wanted.append(f"-r {REQUIREMENTS_TXT}")
    return list(dict.fromkeys(wanted))


def requirements_value(requirements: list[str]) -> str:
    """The environment entry's value: a compact JSON list."""
    return json.dumps(requirements, separators=(",", ":"))
