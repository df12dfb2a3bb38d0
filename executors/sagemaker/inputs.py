"""The user's SageMaker settings checked the way the service would check them, before anything is uploaded.

Why: the service refuses a malformed role ARN or an unknown instance type only when CreateTrainingJob arrives, after
the code was shipped, with its raw pattern or a list of every instance type; an unknown region is not refused at
all until some call fails to connect. The same rules ship with botocore, offline: the ``RoleArn`` pattern and the
``TrainingInstanceType`` enum in SageMaker's service model, and the regions SageMaker is offered in in its endpoint
data. Each check names the setting and, where one is close, the value that was probably meant.

botocore's data ages with the installed version: a region or an instance type newer than it is refused with a hint
to upgrade boto3 (nothing is lost by refusing; a job the service refuses costs an upload and a wait).

Hint lookups (the account's roles, a bare role name's ARN) go to the network: ``hint_client`` makes them one short
attempt, so an unreachable endpoint delays an error by seconds, never by botocore's minutes of retries.
"""

from __future__ import annotations

import difflib
import functools
import re
from typing import Any

from diloco.errors import ConfigError
from diloco.executors.sagemaker.service_model import botocore_session, sagemaker_model

#: What a role ARN looks like where no account is known yet.
ROLE_ARN_FORM = "arn:aws:iam::<account>:role/<name>"
#: A bare IAM role name (IAM's own RoleName pattern, botocore's iam model: ``[\w+=,.@-]+``).
_ROLE_NAME_RE = re.compile(r"^[\w+=,.@-]{1,64}$")


@functools.cache
def role_arn_pattern() -> re.Pattern[str]:
    """The ``RoleArn`` pattern of CreateTrainingJob in botocore's SageMaker model (matched whole, as the service
    does; the model's patterns carry no anchors)."""
    shape = sagemaker_model().operation_model("CreateTrainingJob").input_shape.members["RoleArn"]
    return re.compile(shape.metadata["pattern"])


@functools.cache
def training_instance_types() -> tuple[str, ...]:
    """Every training instance type botocore's SageMaker model knows (the ``TrainingInstanceType`` enum)."""
    return tuple(sagemaker_model().shape_for("TrainingInstanceType").enum)


@functools.cache
def sagemaker_regions() -> tuple[str, ...]:
    """The regions SageMaker is offered in, every partition, from botocore's endpoint data (no network)."""
    session = botocore_session()
    regions: set[str] = set()
    for partition in session.get_available_partitions():
        regions.update(session.get_available_regions("sagemaker", partition_name=partition))
    return tuple(sorted(regions))


def _closest(value: str, known: tuple[str, ...]) -> str | None:
    found = difflib.get_close_matches(value, known, n=1, cutoff=0.6)
    return found[0] if found else None


def _botocore_version() -> str:
    import botocore

    return str(botocore.__version__)


def check_role_arn(role_arn: str, *, full_arn: str | None = None) -> None:
    """``ConfigError`` unless ``role_arn`` has the form the service accepts. ``full_arn``: the role's real ARN
    when a bare name could be looked up (``lookup_role_arn``), offered as the fix."""
    if role_arn_pattern().fullmatch(role_arn):
        return
    if _ROLE_NAME_RE.match(role_arn):
        raise ConfigError(f"backend.role_arn: {role_arn!r} is a role name, not its ARN",
                          hint=f"pass --role {full_arn or ROLE_ARN_FORM.replace('<name>', role_arn)}")
    found = re.match(r"^arn:aws[a-z-]*:iam::(?:(?P<account>[^:/]*):)?role/?(?P<name>.*)$", role_arn)
    if found and not re.fullmatch(r"\d{12}", found.group("account") or ""):
        name = found.group("name") or "<name>"
        raise ConfigError(f"backend.role_arn: {role_arn!r} lacks the 12-digit account an IAM role ARN names",
                          hint=f"pass --role {ROLE_ARN_FORM.replace('<name>', name)} (`aws sts "
                               "get-caller-identity` prints the account)")
    raise ConfigError(f"backend.role_arn: {role_arn!r} is not an IAM role ARN",
                      hint=f"pass --role {ROLE_ARN_FORM} (the role's ARN in the IAM console)")


def is_role_name(role_arn: str) -> bool:
    """Whether ``role_arn`` is a bare role name (whose ARN ``lookup_role_arn`` may find)."""
    return not role_arn_pattern().fullmatch(role_arn) and bool(_ROLE_NAME_RE.match(role_arn))


def check_instance_type(instance_type: str) -> None:
    """``ConfigError`` unless SageMaker trains on ``instance_type``, with the closest known one."""
    known = training_instance_types()
    if instance_type in known:
        return
    prefixed = f"ml.{instance_type}"
    guess = prefixed if prefixed in known else _closest(instance_type, known)
    mean = f"did you mean {guess}? " if guess else ""
    raise ConfigError(f"backend.instance_type: {instance_type!r} is not a SageMaker training instance type",
                      hint=f"{mean}pass --instance-type ml.<family>.<size> (or --gpu); the known types are botocore "
                           f"{_botocore_version()}'s: upgrade boto3 if the type is newer")


def check_region(region: str) -> None:
    """``ConfigError`` unless SageMaker is offered in ``region``, with the closest known one."""
    known = sagemaker_regions()
    if region in known:
        return
    guess = _closest(region, known)
    mean = f"did you mean {guess}? " if guess else ""
    raise ConfigError(f"backend.region: {region!r} is not a region SageMaker is offered in",
                      hint=f"{mean}pass --region (or set AWS_REGION) to one of its regions; the known regions are "
                           f"botocore {_botocore_version()}'s: upgrade boto3 if the region is newer")


def bucket_scope_warning(bucket: str) -> str | None:
    """A warning when ``bucket`` is outside ``AmazonSageMakerFullAccess``' S3 scope (buckets whose name contains
    "sagemaker" or "aws-glue"). Whether the role relies on that policy cannot be told offline: doctor reads the
    role's policies; a launch only says what follows if it does."""
    from diloco.executors.sagemaker.config import S3_ACTIONS_NEEDED, SAGEMAKER_BUCKET_MARKERS

    if any(marker in bucket for marker in SAGEMAKER_BUCKET_MARKERS):
        return None
    return (f"if the execution role relies on AmazonSageMakerFullAccess for S3, the jobs cannot use bucket "
            f"{bucket!r}: that policy covers only buckets whose name contains 'sagemaker' or 'aws-glue', so the "
            f"first write is denied and every peer waits until the all-reduce timeout; grant the role "
            f"{', '.join(S3_ACTIONS_NEEDED)} on it, or use a sagemaker-named bucket "
            f"(`diloco doctor --backend sagemaker --role ... --s3 s3://{bucket}/...` reads the role's policies)")


# ---------------------------------------------------------------------------------------------- hint lookups
#: One attempt, short timeouts: a hint must never hold an error back for long.
HINT_CONNECT_TIMEOUT_S = 2
HINT_READ_TIMEOUT_S = 3


def hint_client(service: str, region: str | None) -> Any:
    """A boto3 client for best-effort lookups: one attempt (``total_max_attempts`` counts the first one;
    botocore's ``max_attempts`` would not), 2 s to connect, 3 s to read."""
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=HINT_CONNECT_TIMEOUT_S, read_timeout=HINT_READ_TIMEOUT_S,
                    retries={"total_max_attempts": 1, "mode": "standard"})
    return boto3.client(service, region_name=region or "us-east-1", config=config)


def lookup_role_arn(name: str, region: str | None) -> str | None:
    """The ARN of the role called ``name`` in this account (one bounded IAM call), or None."""
    try:
        return str(hint_client("iam", region).get_role(RoleName=name)["Role"]["Arn"])
    except Exception:  # noqa: BLE001 - a hint is best effort
        return None
