"""Server-side request validation for the SageMaker emulator, with the service's own messages.

Why driven by botocore's model: botocore checks only ``required``, ``min`` and types on the client; the lengths,
patterns, enums and ranges in the same model (``max``, ``pattern``, ``enum``) are enforced by the service alone.
Walking the model that the real client ships gives the emulator every one of those limits for free, and the
messages follow the service's (AWS "Coral") validation format:

    1 validation error detected: Value 'bad_name' at 'trainingJobName' failed to satisfy constraint:
    Member must satisfy regular expression pattern: ^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}

Paths are the lowerCamelCase member names joined by ``.``, with ``.N.member`` (1-based) for list elements.
Several errors are joined with ``; `` after "N validation errors detected:".

The rules the model cannot express (spot wait time, warm pools with spot, the emulator's own limits) are in
``semantic_errors``; their messages are the service's where a real one is on record (see the notes in each).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

#: Java regex classes used in the SageMaker model that Python's ``re`` lacks, and close Python equivalents.
_JAVA_CLASSES = {r"\p{L}": r"\w", r"\p{N}": r"\w", r"\p{Z}": r"\s", r"\p{Alnum}": "a-zA-Z0-9"}

#: The documented ceiling of MaxRuntimeInSeconds (28 days; the model has no ``max``).
MAX_RUNTIME_CEILING_S = 28 * 24 * 3600


class RequestInvalid(Exception):
    """A request the service would refuse with ``ValidationException``; ``str()`` is the service's message."""


@cache
def _service_model() -> Any:
    import botocore.session

    return botocore.session.get_session().get_service_model("sagemaker")


@cache
def _compiled(pattern: str) -> re.Pattern[str]:
    for java, python in _JAVA_CLASSES.items():
        pattern = pattern.replace(java, python)
    return re.compile(pattern)


def _camel(name: str) -> str:
    """``TrainingJobName`` -> ``trainingJobName``: how the service names members in its messages."""
    return name[:1].lower() + name[1:]


def _java_repr(value: Any) -> str:
    """Render a value the way the service's (Java) messages do: ``{K=V, ...}``, ``[a, b]``, ``true``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_java_repr(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_java_repr(v) for v in value) + "]"
    return str(value)


def _scalar_violations(shape: Any, value: Any) -> list[str]:
    """Constraint texts a string/number/enum value breaks (empty when it satisfies its shape)."""
    meta = shape.metadata
    found: list[str] = []
    if shape.type_name == "string":
        if not isinstance(value, str):
            return ["Member must be a string"]
        if "max" in meta and len(value) > meta["max"]:
            found.append(f"Member must have length less than or equal to {meta['max']}")
        if "min" in meta and len(value) < meta["min"]:
            found.append(f"Member must have length greater than or equal to {meta['min']}")
        if "pattern" in meta and not _compiled(meta["pattern"]).fullmatch(value):
            found.append(f"Member must satisfy regular expression pattern: ^{meta['pattern']}")
        if shape.enum and value not in shape.enum:
            found.append(f"Member must satisfy enum value set: [{', '.join(shape.enum)}]")
    elif shape.type_name in ("integer", "long"):
        if isinstance(value, bool) or not isinstance(value, int):
            return ["Member must be an integer"]
        if "max" in meta and value > meta["max"]:
            found.append(f"Member must have value less than or equal to {meta['max']}")
        if "min" in meta and value < meta["min"]:
            found.append(f"Member must have value greater than or equal to {meta['min']}")
    elif shape.type_name == "boolean" and not isinstance(value, bool):
        found.append("Member must be a boolean")
    return found


def _size_violations(shape: Any, size: int) -> list[str]:
    meta = shape.metadata
    found: list[str] = []
    if "max" in meta and size > meta["max"]:
        found.append(f"Member must have length less than or equal to {meta['max']}")
    if "min" in meta and size < meta["min"]:
        found.append(f"Member must have length greater than or equal to {meta['min']}")
    return found


def _error(value: Any, path: str, constraint: str) -> str:
    shown = "null" if value is None else f"'{_java_repr(value)}'"
    return f"Value {shown} at '{path}' failed to satisfy constraint: {constraint}"


def _walk(shape: Any, value: Any, path: str, errors: list[str]) -> None:
    """Collect every model constraint ``value`` breaks, depth first, in member order (as the service reports)."""
    kind = shape.type_name
    if kind == "structure":
        if not isinstance(value, dict):
            errors.append(_error(value, path, "Member must be a structure"))
            return
        for name in shape.required_members:
            if value.get(name) is None:
                errors.append(_error(None, _join(path, name), "Member must not be null"))
        for name, member in shape.members.items():
            if value.get(name) is not None:
                _walk(member, value[name], _join(path, name), errors)
    elif kind == "list":
        if not isinstance(value, list):
            errors.append(_error(value, path, "Member must be a list"))
            return
        errors += [_error(value, path, c) for c in _size_violations(shape, len(value))]
        member = shape.member
        if member.type_name in ("structure", "list", "map"):
            for i, item in enumerate(value, start=1):
                _walk(member, item, f"{path}.{i}.member", errors)
        else:
            broken = sorted({c for item in value for c in _scalar_violations(member, item)})
            if broken:
                errors.append(_error(value, path, f"Member must satisfy constraint: [{', '.join(broken)}]"))
    elif kind == "map":
        if not isinstance(value, dict):
            errors.append(_error(value, path, "Member must be a map"))
            return
        errors += [_error(value, path, c) for c in _size_violations(shape, len(value))]
        bad_keys = sorted({c for k in value for c in _scalar_violations(shape.key, k)})
        if bad_keys:
            errors.append(_error(value, path, f"Map keys must satisfy constraint: [{', '.join(bad_keys)}]"))
        bad_values = sorted({c for v in value.values() for c in _scalar_violations(shape.value, v)})
        if bad_values:
            errors.append(_error(value, path, f"Map value must satisfy constraint: [{', '.join(bad_values)}]"))
    else:
        errors += [_error(value, path, c) for c in _scalar_violations(shape, value)]


def _join(path: str, member: str) -> str:
    return f"{path}.{_camel(member)}" if path else _camel(member)


def model_errors(operation: str, body: dict[str, Any]) -> list[str]:
    """Every constraint of ``operation``'s input shape that ``body`` breaks, as the service words them."""
    shape = _service_model().operation_model(operation).input_shape
    errors: list[str] = []
    if shape is not None:
        _walk(shape, body, "", errors)
    return errors


def validation_message(errors: list[str]) -> str:
    """The service's summary line for a non-empty list of constraint errors."""
    noun = "error" if len(errors) == 1 else "errors"
    return f"{len(errors)} validation {noun} detected: " + "; ".join(errors)


def check_model(operation: str, body: dict[str, Any]) -> None:
    """Raise ``RequestInvalid`` with the service's message if ``body`` breaks its model's constraints."""
    errors = model_errors(operation, body)
    if errors:
        raise RequestInvalid(validation_message(errors))


def semantic_errors(body: dict[str, Any]) -> list[str]:
    """CreateTrainingJob rules beyond the model: the service's cross-field checks and the emulator's limits.

    Messages for MaxWaitTimeInSeconds are the service's own (seen in public error reports). The others are
    worded by the emulator (their real wording is not on record) and say "emulator" where the limit is the
    emulator's, not SageMaker's.
    """
    errors: list[str] = []
    stopping = body.get("StoppingCondition") or {}
    spot = bool(body.get("EnableManagedSpotTraining"))
    max_run = stopping.get("MaxRuntimeInSeconds", 86400)
    max_wait = stopping.get("MaxWaitTimeInSeconds")
    if max_wait is not None and not spot:
        errors.append("Invalid MaxWaitTimeInSeconds. It is only supported when EnableManagedSpotTraining is set to true")
    if spot and (max_wait is None or max_wait < max_run):
        errors.append("Invalid MaxWaitTimeInSeconds. It must be present and be greater than or equal to "
                      "MaxRuntimeInSeconds")
    if max_run > MAX_RUNTIME_CEILING_S:
        errors.append(f"Invalid MaxRuntimeInSeconds. It must be less than or equal to {MAX_RUNTIME_CEILING_S}")
    resources = body.get("ResourceConfig") or {}
    if spot and resources.get("KeepAlivePeriodInSeconds"):
        errors.append("KeepAlivePeriodInSeconds is not supported with managed spot training (warm pools)")
    if resources.get("InstanceCount", 1) != 1 or resources.get("InstanceGroups"):
        errors.append("emulator: only single-instance jobs are run (ResourceConfig.InstanceCount must be 1)")
    algorithm = body.get("AlgorithmSpecification") or {}
    if not algorithm.get("TrainingImage"):
        errors.append("emulator: AlgorithmSpecification.TrainingImage is required (algorithms are not emulated)")
    if not algorithm.get("ContainerEntrypoint"):
        errors.append("emulator: AlgorithmSpecification.ContainerEntrypoint is required (the image is not run, "
                      "so its own entrypoint is unknown)")
    if algorithm.get("TrainingInputMode", "File") != "File":
        errors.append("emulator: only TrainingInputMode 'File' is emulated")
    errors += _channel_errors(body.get("InputDataConfig") or [])
    for field, uri in (("OutputDataConfig.S3OutputPath", (body.get("OutputDataConfig") or {}).get("S3OutputPath")),
                       ("CheckpointConfig.S3Uri", (body.get("CheckpointConfig") or {}).get("S3Uri"))):
        if uri is not None and not uri.startswith("s3://"):
            errors.append(f"emulator: {field} must be an s3:// URI (got '{uri}')")
    return errors


def _channel_errors(channels: list[dict[str, Any]]) -> list[str]:
    errors: list[str] = []
    names = [c.get("ChannelName") for c in channels]
    duplicates = sorted({n for n in names if names.count(n) > 1 and n is not None})
    if duplicates:
        errors.append(f"Channel names must be unique: {', '.join(duplicates)} appear more than once")
    for channel in channels:
        source = (channel.get("DataSource") or {}).get("S3DataSource")
        if source is None or source.get("S3DataType") != "S3Prefix" or not str(source.get("S3Uri")).startswith("s3://"):
            errors.append(f"emulator: channel '{channel.get('ChannelName')}' must be an S3DataSource with "
                          "S3DataType 'S3Prefix' and an s3:// S3Uri")
        if channel.get("InputMode", "File") != "File":
            errors.append(f"emulator: channel '{channel.get('ChannelName')}': only InputMode 'File' is emulated")
    return errors
