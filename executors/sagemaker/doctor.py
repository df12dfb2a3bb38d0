"""``diloco doctor --backend sagemaker``: the execution role and its bucket access, CloudWatch Logs, the image, quotas."""

from __future__ import annotations

import fnmatch
import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diloco.executors.checks import Check, DoctorContext

from diloco.errors import ConfigError
from diloco.executors.sagemaker.config import (
    LOG_GROUP,
    ROLE_CHECK,
    S3_ACTIONS_NEEDED,
    SAGEMAKER_BUCKET_MARKERS,
    SAGEMAKER_FULL_ACCESS,
    SageMakerBackendConfig,
)
from diloco.executors.sagemaker.inputs import check_role_arn


# ---------------------------------------------------------------------------------------------- doctor checks
def _role_name(arn: str) -> str:
    return arn.rsplit("/", 1)[-1]


def check_role(ctx: DoctorContext) -> Check:
    """The execution role exists and SageMaker may assume it."""
    from urllib.parse import unquote

    from diloco.executors.checks import Check, Status, fail_check

    role_arn = ctx.option("role_arn")
    if not role_arn:
        return Check(name=ROLE_CHECK, status=Status.FAIL, detail="no execution role given",
                     fix="pass --role arn:aws:iam::<account>:role/<name> or set backend.role_arn in the config")
    try:
        check_role_arn(role_arn)  # the form a launch would refuse, in the launch's words
    except ConfigError as exc:
        return Check(name=ROLE_CHECK, status=Status.FAIL, detail=str(exc).removeprefix("backend.role_arn: "),
                     fix=exc.hint or "")
    try:
        role = ctx.client("iam").get_role(RoleName=_role_name(role_arn))["Role"]
    except Exception as exc:  # noqa: BLE001
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") == "NoSuchEntity":
            return Check(name=ROLE_CHECK, status=Status.FAIL, detail=f"role {_role_name(role_arn)!r} does not exist",
                         fix="create a SageMaker execution role (IAM console > Roles) or fix the ARN")
        check = fail_check(ROLE_CHECK, exc, "iam:GetRole")
        if check.detail.startswith("denied"):
            check.status = Status.WARN  # you may launch with a role you cannot inspect
            check.detail += " (cannot inspect the role; the launch may still work)"
        return check
    trust = role.get("AssumeRolePolicyDocument", "")
    trust_text = unquote(trust) if isinstance(trust, str) else json.dumps(trust)
    if "sagemaker.amazonaws.com" not in trust_text:
        return Check(name=ROLE_CHECK, status=Status.FAIL,
                     detail=f"{role['Arn']} does not trust sagemaker.amazonaws.com",
                     fix="add sagemaker.amazonaws.com as a trusted principal (the role's trust policy)")
    return Check(name=ROLE_CHECK, status=Status.PASS, detail=f"{role['Arn']} exists and trusts SageMaker")


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value] if value is not None else []


def _document(doc: Any) -> dict[str, Any]:
    from urllib.parse import unquote

    if isinstance(doc, str):
        return json.loads(unquote(doc))
    return doc or {}


def grants_object_access(document: Any, bucket: str, prefix: str) -> bool:
    """Whether some Allow statement covers s3:PutObject on ``bucket/prefix/...`` (IAM wildcards; Deny and
    conditions ignored: it is a hint, which is why a miss is only a warning)."""
    from diloco.executors.checks import PROBE_DIR

    target = f"arn:aws:s3:::{bucket}/{prefix + '/' if prefix else ''}{PROBE_DIR}"
    for st in _as_list(_document(document).get("Statement")):
        if not isinstance(st, dict) or st.get("Effect") != "Allow":
            continue
        actions = [str(a).lower() for a in _as_list(st.get("Action"))]
        if not any(fnmatch.fnmatchcase("s3:putobject", a) for a in actions):
            continue
        if any(fnmatch.fnmatchcase(target, str(r)) for r in _as_list(st.get("Resource"))):
            return True
    return False


def check_role_bucket(ctx: DoctorContext) -> Check:
    """The seed's gotcha: AmazonSageMakerFullAccess covers only buckets named like *sagemaker*."""
    from diloco.executors.checks import Check, Status, skip_check

    name = "role can reach bucket"
    role_arn = ctx.option("role_arn")
    if not ctx.s3_uri or not role_arn:
        return skip_check(name, "needs both an execution role and an S3 URI")
    if ctx.results.get(ROLE_CHECK, Check(name="", status=Status.FAIL)).status != Status.PASS:
        return skip_check(name, "execution role not readable (see above)")
    return check_role_reaches_bucket(ctx, role_arn, name)


def check_role_reaches_bucket(ctx: DoctorContext, role_arn: str, name: str) -> Check:
    """Whether a policy of IAM role ``role_arn`` grants object access under the S3 prefix (the role a replica
    runs as: a SageMaker execution role, an EKS service account's IRSA or Pod Identity role)."""
    from diloco.executors.checks import Check, Status, fail_check

    bucket, role = ctx.bucket or "", _role_name(role_arn)
    iam = ctx.client("iam")
    inline = (f"attach an inline policy to {role} allowing {', '.join(S3_ACTIONS_NEEDED)} on arn:aws:s3:::{bucket} "
              f"and arn:aws:s3:::{bucket}/{ctx.prefix + '/' if ctx.prefix else ''}*")
    try:
        for policy_name in iam.list_role_policies(RoleName=role).get("PolicyNames", []):
            doc = iam.get_role_policy(RoleName=role, PolicyName=policy_name)["PolicyDocument"]
            if grants_object_access(doc, bucket, ctx.prefix):
                return Check(name=name, status=Status.PASS, detail=f"inline policy {policy_name!r} grants it")
        attached = iam.list_attached_role_policies(RoleName=role).get("AttachedPolicies", [])
        for policy in attached:
            arn = policy["PolicyArn"]
            if arn == SAGEMAKER_FULL_ACCESS:
                continue  # judged by the name rule below
            meta = iam.get_policy(PolicyArn=arn)["Policy"]
            doc = iam.get_policy_version(PolicyArn=arn, VersionId=meta["DefaultVersionId"])["PolicyVersion"]
            if grants_object_access(doc["Document"], bucket, ctx.prefix):
                return Check(name=name, status=Status.PASS, detail=f"policy {policy['PolicyName']!r} grants it")
    except Exception as exc:  # noqa: BLE001
        check = fail_check(name, exc, "iam:ListRolePolicies, iam:GetRolePolicy, iam:ListAttachedRolePolicies, "
                                      "iam:GetPolicy, iam:GetPolicyVersion")
        check.status, check.detail = Status.WARN, f"cannot read the role's policies: {check.detail}"
        return check
    full_access = any(p["PolicyArn"] == SAGEMAKER_FULL_ACCESS for p in attached)
    in_scope = any(m in bucket for m in SAGEMAKER_BUCKET_MARKERS)
    if full_access and in_scope:
        return Check(name=name, status=Status.PASS,
                     detail=f"AmazonSageMakerFullAccess covers buckets named like *sagemaker* ({bucket!r})")
    if full_access:  # the gotcha: the policy is there, the bucket's name is outside its scope
        return Check(name=name, status=Status.WARN,
                     detail=f"AmazonSageMakerFullAccess grants S3 only on buckets whose name contains "
                            f"'sagemaker' or 'aws-glue'; {bucket!r} does not, and no other policy of {role} "
                            f"names it: the jobs' first PUT would be denied and every peer would wait",
                     fix=f"{inline}, or use a bucket whose name contains 'sagemaker'")
    # No policy reaches the bucket, and the bucket's name cannot help on its own: say what would.
    other = (f"or attach AmazonSageMakerFullAccess (it covers {bucket!r}: the name contains 'sagemaker')"
             if in_scope else "or attach AmazonSageMakerFullAccess and use a bucket whose name contains 'sagemaker'")
    return Check(name=name, status=Status.WARN, detail=f"no policy of {role} visibly grants S3 access to {bucket!r}",
                 fix=f"{inline}, {other}")


def check_training_image(ctx: DoctorContext) -> Check:
    """The image the jobs would run: ``--image`` is looked up in ECR; without it, AWS's PyTorch training image
    that diloco picks (the newest in sagemaker-core's tables within diloco's torch requirement), named with the
    versions that chose it, since a launch ships the code onto it."""
    from diloco.errors import ConfigError
    from diloco.executors.checks import Check, Status, check_image, skip_check
    from diloco.executors.sagemaker.config import diloco_ranges, training_image_uri

    if ctx.option("image_uri"):
        return check_image(ctx, ctx.option("image_uri"))
    name = "training image"
    region = ctx.region
    if not region:
        return skip_check(name, "no AWS region (see above): the image depends on it")
    instance_type = ctx.option("instance_type") or SageMakerBackendConfig.model_fields["instance_type"].default
    try:
        uri = training_image_uri(region, instance_type, ctx.option("framework_version"), ctx.option("py_version"))
    except ConfigError as exc:
        return Check(name=name, status=Status.FAIL, detail=str(exc), fix=exc.hint)
    version = uri.rsplit(":", 1)[-1].split("-", 1)[0]
    how = f"backend.framework_version {ctx.option('framework_version')}" if ctx.option("framework_version") else \
        f"the newest in sagemaker-core {_sagemaker_core_version()}'s tables that torch{diloco_ranges()[0]} admits"
    return Check(name=name, status=Status.PASS,
                 detail=f"no --image: the jobs run {uri} (PyTorch {version}, {how}); diloco ships its code")


def _sagemaker_core_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("sagemaker-core")


def check_logs(ctx: DoctorContext) -> Check:
    """``diloco logs`` reads the jobs' output from CloudWatch Logs."""
    from diloco.executors.checks import Check, Status, fail_check

    name = "cloudwatch logs"
    try:
        groups = ctx.client("logs").describe_log_groups(logGroupNamePrefix=LOG_GROUP, limit=1).get("logGroups", [])
    except Exception as exc:  # noqa: BLE001
        check = fail_check(name, exc, "logs:DescribeLogGroups, logs:DescribeLogStreams, logs:GetLogEvents")
        check.status = Status.WARN  # launching works without it; `diloco logs` does not
        check.detail += " (`diloco logs` will not work)"
        return check
    state = "exists" if any(g.get("logGroupName") == LOG_GROUP for g in groups) else \
        "not created yet (the first training job creates it)"
    return Check(name=name, status=Status.PASS, detail=f"can read {LOG_GROUP}: {state}")


def check_quotas(ctx: DoctorContext) -> list[Check]:
    """The account's SageMaker quotas for the chosen instance type (Service Quotas): training jobs (spot ones with
    --spot) and, with a keep-alive, warm pools, whose default quota of 0 makes SageMaker ignore the setting."""
    from diloco.executors.checks import Check, Status, fail_check

    instance_type = ctx.option("instance_type") or SageMakerBackendConfig.model_fields["instance_type"].default
    spot = bool(ctx.option("use_spot"))
    keep_alive = int(ctx.option("keep_alive_period_s") or 0)
    wanted = {"training quota": f"{instance_type} for {'spot ' if spot else ''}training job usage"}
    if keep_alive:
        wanted["warm pool quota"] = f"{instance_type} for training warm pool usage"
    client = ctx.client("service-quotas")
    try:
        quotas = {q.get("QuotaName"): q.get("Value") for page in client.get_paginator(
            "list_service_quotas").paginate(ServiceCode="sagemaker") for q in page.get("Quotas", [])}
    except Exception as exc:  # noqa: BLE001
        check = _not_the_quotas_api(exc, client.meta.endpoint_url) or \
            fail_check("training quota", exc, "servicequotas:ListServiceQuotas")
        check.status = Status.WARN  # a launch may still work; it just cannot be foreseen
        check.detail = f"cannot read the SageMaker quotas: {check.detail}"
        return [check]
    checks = []
    for name, quota in wanted.items():
        value = quotas.get(quota)
        if value is None:
            checks.append(Check(name=name, status=Status.WARN, detail=f"no quota named {quota!r} is visible",
                                fix="check Service Quotas > Amazon SageMaker in the console"))
        elif value < 1 and name == "warm pool quota":
            checks.append(Check(name=name, status=Status.WARN,
                                detail=f"{quota!r} is 0: --keep-alive {keep_alive} would be ignored (no warm pool)",
                                fix="request a warm-pool quota increase (Service Quotas), or drop --keep-alive"))
        elif value < 1:
            checks.append(Check(name=name, status=Status.FAIL,
                                detail=f"{quota!r} is 0: every job would be refused (ResourceLimitExceeded)",
                                fix=f"request an increase of {quota!r} in Service Quotas, or pick another "
                                    "--instance-type"))
        else:
            checks.append(Check(name=name, status=Status.PASS,
                                detail=f"{quota!r} is {value:g}: at most {int(value)} replica(s) of this type at "
                                       "once, across all your running jobs"))
    return checks


def _not_the_quotas_api(exc: BaseException, endpoint: str) -> Check | None:
    """A row for an endpoint that answered with a server error or a web page instead of the Service Quotas API
    (``AWS_ENDPOINT_URL`` pointing every service at an S3-compatible store or an emulator does that): one line
    naming the status and the page's title, never the page."""
    from diloco.executors.checks import Check, Status

    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    message = str(response.get("Error", {}).get("Message") or "")
    page = re.search(r"<\s*(?:!doctype|html)", message, re.IGNORECASE)
    if not page and not (isinstance(status, int) and status >= 500):
        return None
    title = re.search(r"<title>(.*?)</title>", message, re.IGNORECASE | re.DOTALL)
    said = " ".join((title.group(1) if title else re.sub(r"<[^>]+>", " ", message)).split())[:120]
    return Check(name="training quota", status=Status.WARN,
                 detail=f"{endpoint} answered HTTP {status}" + (f" ({said})" if said else "") +
                        (", a web page, not the Service Quotas API" if page else ""),
                 fix="set AWS_ENDPOINT_URL_SERVICE_QUOTAS to a Service Quotas endpoint (AWS_ENDPOINT_URL sends every "
                     "service to one endpoint), or read them in the console: Service Quotas > Amazon SageMaker")
