"""Every CreateTrainingJob request is checked before anything is sent: botocore's own validation plus the documented limits botocore does not check, and that the instance has a GPU for each of the replica's local processes (``--procs-per-replica``)."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from diloco.errors import ConfigError
from diloco.executors.gpus import GPUS
from diloco.executors.sagemaker.config import (
    CONTAINER_ARG_MAX,
    CONTAINER_ARGS_MAX_ITEMS,
    ENV_KEY_RE,
    ENV_MAX_ENTRIES,
    ENV_VALUE_MAX,
    JOB_NAME_MAX,
    JOB_NAME_RE,
    KEEP_ALIVE_MAX_S,
    MAX_RUNTIME_CEILING_S,
    TAGS_MAX,
)
from diloco.executors.sagemaker.service_model import sagemaker_model


def _gpus_by_family() -> dict[str, dict[str, int]]:
    """GPUs per instance, by family and size, from the GPU table every backend reads (``diloco.executors.gpus``,
    AWS's instance pages). A family not listed whose name starts with g or p is a GPU family of a size this table
    does not know (``instance_gpus`` returns None: not checked); any other family is a CPU one (0 GPUs: local
    processes run on its CPUs)."""
    table: dict[str, dict[str, int]] = {}
    for gpu in GPUS:
        for instance_type, count in gpu.instances.items():
            family, size = instance_type.split(".", 1)
            table.setdefault(family, {})[size] = count
    return table


_GPUS_BY_FAMILY = _gpus_by_family()


def instance_gpus(instance_type: str) -> int | None:
    """GPUs of an ``ml.<family>.<size>`` training instance: 0 for a CPU family, ``None`` for a GPU size this
    table does not know."""
    parts = instance_type.split(".")
    if len(parts) != 3:
        return None
    family, size = parts[1], parts[2]
    if family in _GPUS_BY_FAMILY:
        return _GPUS_BY_FAMILY[family].get(size)
    return None if family[:1] in ("g", "p") else 0


def instance_with_gpus(instance_type: str, gpus: int) -> str | None:
    """The smallest instance of ``instance_type``'s family with at least ``gpus`` GPUs (``ml.g5.xlarge``, 4 ->
    ``ml.g5.12xlarge``): what ``--gpu A10G --procs-per-replica 4`` should run on. ``None`` if the family has none
    that large, or is not a GPU family this table knows."""
    parts = instance_type.split(".")
    if len(parts) != 3 or parts[1] not in _GPUS_BY_FAMILY:
        return None
    sizes = _GPUS_BY_FAMILY[parts[1]]
    fitting = [size for size, n in sizes.items() if n >= gpus]
    if not fitting:
        return None
    return f"ml.{parts[1]}.{min(fitting, key=lambda size: (sizes[size], _size_rank(size)))}"


def _size_rank(size: str) -> float:
    """``xlarge`` < ``2xlarge`` < ... < ``48xlarge`` < ``metal``: the cheaper size first among equal GPU counts."""
    number = size.removesuffix("xlarge")
    return float(number or 1) if number.isdigit() or not number else float("inf")


def _procs_argument(request: Mapping[str, Any]) -> int | None:
    """``--procs-per-replica K`` as the request passes it to the replica entrypoint, if it does."""
    args = list(request["AlgorithmSpecification"].get("ContainerArguments") or [])
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--procs-per-replica" and value.isdigit():
            return int(value)
    return None


def check_procs_per_replica(request: Mapping[str, Any], rank: int, procs: int | None = None) -> None:
    """A GPU instance must have a GPU for each of the replica's local processes (``--procs-per-replica``, given,
    else read from the request's arguments); a CPU instance runs them on its CPUs (gloo). ``ConfigError`` at plan
    time, naming the flag, the instance and one that fits."""
    procs = _procs_argument(request) if procs is None else procs
    instance_type = request["ResourceConfig"]["InstanceType"]
    gpus = instance_gpus(instance_type)
    if procs is None or procs <= 1 or not gpus or procs <= gpus:
        return
    family = instance_type.split(".")[1]
    bigger = instance_with_gpus(instance_type, procs)
    fits = f"{bigger} has {instance_gpus(bigger)}" if bigger else f"no {family} size has {procs}"
    raise ConfigError(f"replica {rank}: --procs-per-replica {procs} needs {procs} GPUs, but {instance_type} has "
                      f"{gpus} GPU{'s' if gpus > 1 else ''}",
                      hint=f"lower --procs-per-replica to {gpus}, or pick a larger instance with --instance-type "
                           f"({fits})")


# ---------------------------------------------------------------------------------------------- request checks
def _limit_error(rank: int, field: str, what: str, fix: str) -> ConfigError:
    return ConfigError(f"replica {rank}'s CreateTrainingJob {field}: {what}", hint=fix)


def check_request(request: Mapping[str, Any], rank: int, *, procs_per_replica: int | None = None) -> None:
    """The documented limits botocore does not check, then botocore's own validation: a one-line ``ConfigError``
    naming the field and the fix, before anything is sent. ``procs_per_replica``: the replica's local processes
    (its arguments name only the spec object that holds them)."""
    name = request["TrainingJobName"]
    if len(name) > JOB_NAME_MAX or not JOB_NAME_RE.match(name):
        raise _limit_error(rank, "TrainingJobName", f"{name!r} is not a valid job name",
                           "use letters, digits and single dashes, at most 63 characters")
    env = request.get("Environment") or {}
    if len(env) > ENV_MAX_ENTRIES:
        raise _limit_error(rank, "Environment", f"{len(env)} entries (SageMaker allows {ENV_MAX_ENTRIES})",
                           "pass fewer variables with --env / env: the others are diloco's own")
    for key, value in env.items():
        if not ENV_KEY_RE.match(key) or len(key) > ENV_VALUE_MAX:
            raise _limit_error(rank, f"Environment[{key!r}]", "not a valid variable name",
                               "use letters, digits and underscores, not starting with a digit")
        if len(value) > ENV_VALUE_MAX:
            from diloco.envvars import RENDEZVOUS_URI

            fix = ("shorten the rendezvous URI (--rendezvous)" if key == RENDEZVOUS_URI else
                   f"shorten env.{key} (--env {key}=...): SageMaker takes at most {ENV_VALUE_MAX} characters a value")
            raise _limit_error(rank, f"Environment[{key!r}]", f"{len(value)} characters (limit {ENV_VALUE_MAX})",
                               fix)
    algorithm = request["AlgorithmSpecification"]
    for field in ("ContainerEntrypoint", "ContainerArguments"):
        items = algorithm.get(field) or []
        if len(items) > CONTAINER_ARGS_MAX_ITEMS:
            raise _limit_error(rank, field, f"{len(items)} items (limit {CONTAINER_ARGS_MAX_ITEMS})",
                               "pass fewer arguments")
        for i, item in enumerate(items):
            if len(item) > CONTAINER_ARG_MAX:
                raise _limit_error(rank, f"{field}[{i}]", f"{len(item)} characters (limit {CONTAINER_ARG_MAX}): "
                                   f"{item[:40]}...", "shorten it; large trainer kwargs belong in a file in your "
                                   "source directory")
            if "\n" in item:
                raise _limit_error(rank, f"{field}[{i}]", f"contains a line break: {item[:40]!r}",
                                   "keep every argument on one line")
    keep_alive = request["ResourceConfig"].get("KeepAlivePeriodInSeconds", 0)
    if not 0 <= keep_alive <= KEEP_ALIVE_MAX_S:
        raise _limit_error(rank, "ResourceConfig.KeepAlivePeriodInSeconds", f"{keep_alive} is outside "
                           f"0..{KEEP_ALIVE_MAX_S}", "set backend.keep_alive_period_s (--keep-alive) within it")
    _check_stopping(request, rank)
    check_procs_per_replica(request, rank, procs_per_replica)
    if len(request.get("Tags") or []) > TAGS_MAX:
        raise _limit_error(rank, "Tags", f"{len(request['Tags'])} tags (limit {TAGS_MAX})", "set fewer backend.tags")
    _botocore_validation(request, rank)


def _check_stopping(request: Mapping[str, Any], rank: int) -> None:
    stopping = request["StoppingCondition"]
    max_run = stopping["MaxRuntimeInSeconds"]
    if not 1 <= max_run <= MAX_RUNTIME_CEILING_S:
        raise _limit_error(rank, "StoppingCondition.MaxRuntimeInSeconds", f"{max_run} is outside "
                           f"1..{MAX_RUNTIME_CEILING_S} (28 days)", "set timeout_s within it")
    max_wait = stopping.get("MaxWaitTimeInSeconds")
    if request.get("EnableManagedSpotTraining"):
        if max_wait is None or max_wait < max_run:
            raise _limit_error(rank, "StoppingCondition.MaxWaitTimeInSeconds", f"{max_wait} is less than "
                               f"MaxRuntimeInSeconds ({max_run})",
                               "set backend.max_wait_s >= timeout_s (spot waits count towards it)")
        if request["ResourceConfig"].get("KeepAlivePeriodInSeconds"):
            raise _limit_error(rank, "ResourceConfig.KeepAlivePeriodInSeconds", "warm pools do not work with "
                               "managed spot training", "drop --keep-alive or --spot")
    elif max_wait is not None:
        raise _limit_error(rank, "StoppingCondition.MaxWaitTimeInSeconds", "only allowed with managed spot "
                           "training", "unset backend.max_wait_s, or pass --spot")


#: Where each CreateTrainingJob field's value comes from: (the setting, how to fix it). A field the service would
#: refuse is the user's input unless it is not listed here (then it is diloco's own doing).
_FIELD_SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("RoleArn", "backend.role_arn", "pass --role arn:aws:iam::<account>:role/<name>"),
    ("ResourceConfig.InstanceType", "backend.instance_type", "pass --instance-type ml.<family>.<size> or --gpu"),
    ("ResourceConfig.VolumeSizeInGB", "backend.volume_size_gb", "set backend.volume_size_gb within the limit"),
    ("ResourceConfig.KeepAlivePeriodInSeconds", "backend.keep_alive_period_s", "set --keep-alive within the limit"),
    ("AlgorithmSpecification.TrainingImage", "backend.image_uri", "pass --image <registry>/<repository>:<tag>"),
    ("AlgorithmSpecification.ContainerArguments", "train", "shorten the trainer settings (-k/--trainer-kwargs)"),
    ("StoppingCondition.MaxRuntimeInSeconds", "timeout_s", "set --timeout within 1..2419200 s"),
    ("StoppingCondition.MaxWaitTimeInSeconds", "backend.max_wait_s", "set backend.max_wait_s >= timeout_s"),
    ("OutputDataConfig", "backend.output_s3_uri", "set backend.output_s3_uri (default: the rendezvous) to s3://..."),
    ("CheckpointConfig", "store.rendezvous", "pass --rendezvous s3://<bucket>/<prefix>/{run_id}"),
    ("InputDataConfig", "store.rendezvous", "pass --rendezvous s3://<bucket>/<prefix>/{run_id}"),
    ("Environment", "store.rendezvous", "shorten the rendezvous URI or the replica environment"),
    ("Tags", "backend.tags", "use tag keys and values AWS accepts (letters, digits, spaces and _.:/=+-@)"),
    ("TrainingJobName", "the run id", "launch again: the run id makes the job names"),
)


def _setting_of(path: str) -> tuple[str, str] | None:
    """The user setting a request field (``Tags[0].Key``, ``ResourceConfig.InstanceType``) comes from."""
    plain = re.sub(r"\[[^\]]*\]| \(key\)", "", path).strip(".")
    for prefix, setting, fix in _FIELD_SETTINGS:
        if plain == prefix or plain.startswith(prefix + "."):
            return setting, fix
    return None


def _refusal(rank: int, path: str, what: str) -> ConfigError:
    """The one line for a field the service would refuse: the setting it comes from and the fix; a field no
    setting feeds is diloco's own mistake, and says so."""
    setting = _setting_of(path)
    if setting is None:
        return ConfigError(f"replica {rank}'s CreateTrainingJob request is invalid: {path}: {what}",
                           hint="this is a bug in the request diloco built; report it with the line above")
    name, fix = setting
    return ConfigError(f"{name}: SageMaker would refuse replica {rank}'s CreateTrainingJob {path}: {what}", hint=fix)


def _botocore_validation(request: Mapping[str, Any], rank: int) -> None:
    """botocore's client-side validation (required members, types, minimum lengths), then the constraints of the
    same model that only the service enforces (maximum lengths, patterns, enums, ranges)."""
    from botocore.validate import ParamValidator

    shape = sagemaker_model().operation_model("CreateTrainingJob").input_shape
    report = ParamValidator().validate(dict(request), shape)
    if report.has_errors():
        first = report.generate_report().splitlines()[0].strip()
        found = re.search(r"parameter (?:in )?([\w.\[\]]+)", first)
        raise _refusal(rank, found.group(1) if found else "", first)
    violation = _first_violation(shape, request, "")
    if violation is not None:
        raise _refusal(rank, *violation)


#: Java regex classes in SageMaker's model that Python's ``re`` lacks, and close equivalents.
_JAVA_CLASSES = {r"\p{L}": r"\w", r"\p{N}": r"\w", r"\p{Z}": r"\s", r"\p{Alnum}": "a-zA-Z0-9"}


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str] | None:
    for java, python in _JAVA_CLASSES.items():
        pattern = pattern.replace(java, python)
    try:
        return re.compile(pattern)
    except re.error:  # a construct Python's re lacks: the service checks it, we cannot
        return None


def _scalar_violation(shape: Any, value: Any) -> str | None:
    meta = shape.metadata
    if shape.type_name == "string" and isinstance(value, str):
        if "max" in meta and len(value) > meta["max"]:
            return f"{len(value)} characters (at most {meta['max']})"
        if shape.enum and value not in shape.enum:
            return f"{value!r} is not one of the {len(shape.enum)} values it allows"
        pattern = _compiled(meta["pattern"]) if "pattern" in meta else None
        if pattern is not None and not pattern.fullmatch(value):
            return f"{value[:60]!r} does not match ^{meta['pattern']}$"
    elif shape.type_name in ("integer", "long") and isinstance(value, int) and not isinstance(value, bool):
        if "max" in meta and value > meta["max"]:
            return f"{value} is more than {meta['max']}"
        if "min" in meta and value < meta["min"]:
            return f"{value} is less than {meta['min']}"
    return None


def _first_violation(shape: Any, value: Any, path: str) -> tuple[str, str] | None:
    """The first (field path, what is wrong) of the model's constraints ``value`` breaks, depth first."""
    kind = shape.type_name
    if kind == "structure" and isinstance(value, Mapping):
        for name, member in shape.members.items():
            if value.get(name) is not None:
                found = _first_violation(member, value[name], f"{path}.{name}" if path else name)
                if found:
                    return found
        return None
    if kind in ("list", "map") and isinstance(value, (list, Mapping)):
        if "max" in shape.metadata and len(value) > shape.metadata["max"]:
            return path, f"{len(value)} entries (at most {shape.metadata['max']})"
        if kind == "list":
            items = [(f"{path}[{i}]", shape.member, item) for i, item in enumerate(value)]
        else:
            items = [entry for k, v in value.items()
                     for entry in ((f"{path}[{k!r}] (key)", shape.key, k), (f"{path}[{k!r}]", shape.value, v))]
        for item_path, item_shape, item in items:
            found = _first_violation(item_shape, item, item_path)
            if found:
                return found
        return None
    what = _scalar_violation(shape, value)
    return (path, what) if what else None
