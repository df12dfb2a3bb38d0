"""`diloco doctor`: check, before launching, everything a launch on a backend needs, each failure with its fix.

Why: the expensive failures of a DiLoCo run happen late and far away. A replica job that cannot write to the
rendezvous prefix blocks every peer until the all-reduce timeout (30 minutes by default); an execution role whose
policies do not cover the bucket fails the same way, only after SageMaker has provisioned every instance. The
doctor finds these in seconds, from where you launch.

Rules it keeps:

* It only reads. The exceptions are probes, deleted again: a few objects under a fresh ``_diloco_doctor/<uuid>/``
  key under the prefix (only those keys, never anything else), and a temporary file in the run directory.
* Each check is a small function returning a ``Check``; a check that does not apply to the chosen backend is
  ``skip`` with the reason. ``warn`` means "could not prove it works, might still": it does not fail the run.
* boto3 and the Kubernetes client are imported inside the checks; clients get short timeouts and few retries.
"""

from __future__ import annotations

import enum
import fnmatch
import json
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from pydantic import BaseModel

from diloco.config import BACKENDS, resolve_config
from diloco.errors import ConfigError

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
PROBE_DIR = "_diloco_doctor"
#: AmazonSageMakerFullAccess grants S3 only on buckets whose name contains one of these (case-sensitive; bucket
#: names are lower case, so in practice "sagemaker" or "aws-glue").
SAGEMAKER_BUCKET_MARKERS = ("SageMaker", "Sagemaker", "sagemaker", "aws-glue")
SAGEMAKER_FULL_ACCESS = "arn:aws:iam::aws:policy/AmazonSageMakerFullAccess"
S3_ACTIONS_NEEDED = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket")
_ECR_RE = re.compile(
    r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/"
    r"(?P<repo>[a-z0-9._/-]+?)(?::(?P<tag>[\w.-]+))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)


class Status(str, enum.Enum):
    """``pass`` works; ``fail`` blocks a launch; ``warn`` could not be proven; ``skip`` does not apply."""

    PASS = "pass"
    FAIL = "fail"
    WARN = "warn"
    SKIP = "skip"


class Check(BaseModel):
    """One line of the doctor's table."""

    name: str
    status: Status
    detail: str = ""
    fix: str | None = None


class DoctorReport(BaseModel):
    """Every check, in order; ``ok`` is False when any check failed."""

    backend: str
    s3_uri: str | None = None
    checks: list[Check]
    ok: bool


@dataclass
class DoctorContext:
    """What the checks look at. Built by ``run_doctor`` from flags and the run config; also a cache for checks."""

    backend: str = "local"
    s3_uri: str | None = None
    role_arn: str | None = None
    image_uri: str | None = None
    region: str | None = None  # explicit region (the sagemaker config's); else the SDK's
    namespace: str = "default"
    kube_context: str | None = None
    python: str | None = None  # the local backend's interpreter for replicas (default: this one)
    results: dict[str, Check] = field(default_factory=dict)
    _session: Any = None

    @property
    def bucket(self) -> str | None:
        return self.s3_uri[len("s3://"):].split("/", 1)[0] if self.s3_uri else None

    @property
    def prefix(self) -> str:
        return self.s3_uri[len("s3://"):].partition("/")[2].strip("/") if self.s3_uri else ""

    def session(self) -> Any:
        if self._session is None:
            import boto3

            self._session = boto3.Session(region_name=self.region) if self.region else boto3.Session()
        return self._session

    def client(self, service: str, region: str | None = None) -> Any:
        """A boto3 client with short timeouts and 2 attempts (unless AWS_MAX_ATTEMPTS/AWS_RETRY_MODE say else)."""
        from botocore.config import Config

        from diloco.s3 import retry_config

        config = Config(connect_timeout=3, read_timeout=10, **retry_config(2))
        return self.session().client(service, region_name=region, config=config)


# ---------------------------------------------------------------------------------------------- failures
def _custom_endpoint() -> str | None:
    """The S3-compatible endpoint the environment points at (e.g. MinIO, moto), if any."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _endpoint_hint() -> str:
    custom = _custom_endpoint()
    if custom:
        return f"check AWS_ENDPOINT_URL (now {custom}): is the S3-compatible service running and reachable?"
    return "check the network/proxy settings (HTTPS_PROXY) and that the region's endpoints are reachable"


def explain_aws_error(exc: BaseException, action: str) -> tuple[str, str]:
    """``(detail, fix)`` for an exception from a boto3 call that needed IAM permission ``action``."""
    from botocore import exceptions as bx

    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return ("no AWS credentials found",
                "configure credentials: `aws configure`, AWS_PROFILE=<profile> (then `aws sso login`), or "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
    if isinstance(exc, bx.ProfileNotFound):
        return (str(exc), "set AWS_PROFILE to a profile in ~/.aws/config (`aws configure list-profiles`)")
    if isinstance(exc, bx.NoRegionError):
        return ("no AWS region configured", "set AWS_REGION (or `aws configure set region <region>`)")
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ConnectionClosedError,
                        bx.ReadTimeoutError, bx.ConnectionError, bx.HTTPClientError)):
        return (f"cannot reach the AWS endpoint: {exc}", _endpoint_hint())
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        message = err.get("Message") or str(exc)
        if code in ("InvalidClientTokenId", "SignatureDoesNotMatch", "ExpiredToken", "ExpiredTokenException",
                    "UnrecognizedClientException", "InvalidAccessKeyId", "AuthFailure"):
            return (f"credentials rejected ({code}): {message}",
                    "refresh or fix the credentials (`aws sso login`, or new access keys)")
        if code in ("AccessDenied", "AccessDeniedException", "403", "Forbidden") or status == 403:
            return (f"denied ({code or status}): {message}",
                    f"grant {action} to the identity you launch with (`aws sts get-caller-identity` shows it)")
        return (f"{code or status}: {message}", f"check the request; it needs {action}")
    return (f"{type(exc).__name__}: {exc}", "set DILOCO_DEBUG=1 and rerun for the traceback")


def _fail(name: str, exc: BaseException, action: str) -> Check:
    detail, fix = explain_aws_error(exc, action)
    return Check(name=name, status=Status.FAIL, detail=detail, fix=fix)


def _skip(name: str, why: str) -> Check:
    return Check(name=name, status=Status.SKIP, detail=why)


def _failed(ctx: DoctorContext, name: str) -> bool:
    found = ctx.results.get(name)
    return found is not None and found.status == Status.FAIL


# ---------------------------------------------------------------------------------------------- checks
def check_credentials(ctx: DoctorContext) -> Check:
    name = "aws credentials"
    if ctx.backend == "local" and not ctx.s3_uri:
        return _skip(name, "local backend without --s3: replicas meet in a file:// store")
    try:
        ident = ctx.client("sts").get_caller_identity()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row
        check = _fail(name, exc, "sts:GetCallerIdentity")
        if ctx.backend == "local" and _custom_endpoint() and "credentials" not in check.detail:
            # An S3-compatible store need not offer STS; the S3 checks below are what count.
            check.status = Status.WARN
        return check
    return Check(name=name, status=Status.PASS, detail=f"{ident.get('Arn')} (account {ident.get('Account')})")


def check_region(ctx: DoctorContext) -> Check:
    name = "aws region"
    if ctx.backend == "local" and not ctx.s3_uri:
        return _skip(name, "local backend without --s3")
    try:
        region = ctx.session().region_name
    except Exception as exc:  # noqa: BLE001
        return _fail(name, exc, "a readable AWS config")
    if region:
        source = "the run config" if ctx.region else next(
            (v for v in ("AWS_REGION", "AWS_DEFAULT_REGION") if os.environ.get(v)), "the AWS config file")
        return Check(name=name, status=Status.PASS, detail=f"{region} (from {source})")
    return Check(name=name, status=Status.FAIL if ctx.backend != "local" else Status.WARN,
                 detail="no region configured",
                 fix="set AWS_REGION (or `aws configure set region <region>`), the region of your bucket and jobs")


def check_bucket(ctx: DoctorContext) -> Check:
    name = "s3 bucket"
    if not ctx.s3_uri and ctx.backend != "local":
        return Check(name=name, status=Status.FAIL, detail=f"the {ctx.backend} backend needs an s3:// rendezvous",
                     fix="pass --s3 s3://<bucket>/<prefix>, or set store.rendezvous in the config or DILOCO_S3_URI")
    if not ctx.s3_uri:
        return _skip(name, "no S3 URI (--s3, the config's store.rendezvous or DILOCO_S3_URI)")
    from botocore.exceptions import ClientError

    try:
        out = ctx.client("s3").head_bucket(Bucket=ctx.bucket)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        if code in ("404", "NoSuchBucket", "NotFound"):
            return Check(name=name, status=Status.FAIL, detail=f"bucket {ctx.bucket!r} does not exist",
                         fix=f"create it (`aws s3 mb s3://{ctx.bucket}`) or fix the S3 URI")
        if code in ("403", "AccessDenied", "Forbidden"):
            return Check(name=name, status=Status.FAIL, detail=f"access to bucket {ctx.bucket!r} denied (403)",
                         fix=f"grant s3:ListBucket on arn:aws:s3:::{ctx.bucket} (and object access on the "
                             f"prefix) to the identity in use, or check the bucket policy")
        if code in ("301", "PermanentRedirect"):
            where = headers.get("x-amz-bucket-region", "another region")
            return Check(name=name, status=Status.FAIL, detail=f"bucket {ctx.bucket!r} is in {where}",
                         fix=f"set AWS_REGION={where} (run the jobs next to their bucket)")
        return _fail(name, exc, f"s3:ListBucket on {ctx.bucket}")
    except Exception as exc:  # noqa: BLE001
        return _fail(name, exc, f"s3:ListBucket on {ctx.bucket}")
    region = (out.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}).get("x-amz-bucket-region")
    return Check(name=name, status=Status.PASS, detail=f"{ctx.bucket!r} reachable" + (f" ({region})" if region else ""))


def check_read_write(ctx: DoctorContext) -> list[Check]:
    """put/get/list/delete and conditional create on a fresh probe key under the prefix, through ObjectStore."""
    rw, cc = "s3 read/write", "s3 conditional create"
    if not ctx.s3_uri:
        return [_skip(rw, "no S3 URI"), _skip(cc, "no S3 URI")]
    if _failed(ctx, "s3 bucket"):
        return [_skip(rw, "bucket not reachable (see above)"), _skip(cc, "bucket not reachable (see above)")]
    from diloco.store import ObjectStore

    probe_dir = "/".join(p for p in (ctx.prefix, PROBE_DIR, uuid.uuid4().hex) if p)
    store = ObjectStore(f"s3://{ctx.bucket}/{probe_dir}", retries=1, backoff_s=0.2)
    written: list[str] = []
    step = "put"
    try:
        payload = os.urandom(64)
        store.put("probe", payload)
        written.append("probe")
        step = "get"
        if store.get("probe") != payload:
            return [Check(name=rw, status=Status.FAIL, detail="read back different bytes than written",
                          fix="the store does not return what it stored; use AWS S3 or a conformant store"),
                    _skip(cc, "read/write failed")]
        step = "list"
        if store.list() != ["probe"]:
            return [Check(name=rw, status=Status.FAIL, detail=f"listing shows {store.list()}, expected ['probe']",
                          fix="the store's listing is not consistent with its writes"), _skip(cc, "read/write failed")]
        step = "delete"
        store.delete("probe")
        written.remove("probe")
        if store.exists("probe"):
            return [Check(name=rw, status=Status.FAIL, detail="a deleted object still exists",
                          fix="grant s3:DeleteObject on the prefix"), _skip(cc, "read/write failed")]
        rw_check = Check(name=rw, status=Status.PASS, detail=f"put/get/list/delete under {store.url()}")
        step = "conditional create"
        first = store.put_if_absent("lease", b"first")
        written.append("lease")
        second = store.put_if_absent("lease", b"second")
        if first and not second and store.get("lease") == b"first":
            cc_check = Check(name=cc, status=Status.PASS, detail="If-None-Match: * honoured")
        else:
            cc_check = Check(name=cc, status=Status.FAIL,
                             detail=f"If-None-Match: * not honoured (first create {first}, second {second})",
                             fix="use AWS S3 or a store with conditional writes; and s3fs >= 2025.7")
        return [rw_check, cc_check]
    except Exception as exc:  # noqa: BLE001
        detail = f"{step} failed: {type(exc).__name__}: {exc}"
        hint = getattr(exc, "hint", None) or explain_aws_error(exc, "s3:GetObject/PutObject/DeleteObject")[1]
        failed = Check(name=rw if step != "conditional create" else cc, status=Status.FAIL, detail=detail, fix=hint)
        return [failed, _skip(cc, "read/write failed")] if failed.name == rw else [rw_check, failed]
    finally:
        for key in written:  # only what we wrote
            try:
                store.delete(key)
            except Exception:  # noqa: BLE001 - reported by the checks above when it matters
                pass


def _role_name(arn: str) -> str:
    return arn.rsplit("/", 1)[-1]


def check_role(ctx: DoctorContext) -> Check:
    name = "sagemaker execution role"
    if ctx.backend != "sagemaker":
        return _skip(name, f"not used by the {ctx.backend} backend")
    if not ctx.role_arn:
        return Check(name=name, status=Status.FAIL, detail="no execution role given",
                     fix="pass --role arn:aws:iam::<account>:role/<name> or set backend.role_arn in the config")
    if not re.match(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+$", ctx.role_arn):
        return Check(name=name, status=Status.FAIL, detail=f"not an IAM role ARN: {ctx.role_arn!r}",
                     fix="use the role's full ARN, e.g. arn:aws:iam::<account>:role/service-role/<name>")
    try:
        role = ctx.client("iam").get_role(RoleName=_role_name(ctx.role_arn))["Role"]
    except Exception as exc:  # noqa: BLE001
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") == "NoSuchEntity":
            return Check(name=name, status=Status.FAIL, detail=f"role {_role_name(ctx.role_arn)!r} does not exist",
                         fix="create a SageMaker execution role (IAM console > Roles) or fix the ARN")
        check = _fail(name, exc, "iam:GetRole")
        if check.detail.startswith("denied"):
            check.status = Status.WARN  # you may launch with a role you cannot inspect
            check.detail += " (cannot inspect the role; the launch may still work)"
        return check
    trust = role.get("AssumeRolePolicyDocument", "")
    trust_text = unquote(trust) if isinstance(trust, str) else json.dumps(trust)
    if "sagemaker.amazonaws.com" not in trust_text:
        return Check(name=name, status=Status.FAIL, detail=f"{role['Arn']} does not trust sagemaker.amazonaws.com",
                     fix="add sagemaker.amazonaws.com as a trusted principal (the role's trust policy)")
    return Check(name=name, status=Status.PASS, detail=f"{role['Arn']} exists and trusts SageMaker")


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value] if value is not None else []


def _document(doc: Any) -> dict[str, Any]:
    if isinstance(doc, str):
        return json.loads(unquote(doc))
    return doc or {}


def grants_object_access(document: Any, bucket: str, prefix: str) -> bool:
    """Whether some Allow statement covers s3:PutObject on ``bucket/prefix/...`` (IAM wildcards; Deny and
    conditions ignored: it is a hint, which is why a miss is only a warning)."""
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
    name = "role can reach bucket"
    if ctx.backend != "sagemaker":
        return _skip(name, f"not used by the {ctx.backend} backend")
    if not ctx.s3_uri or not ctx.role_arn:
        return _skip(name, "needs both an execution role and an S3 URI")
    if ctx.results.get("sagemaker execution role", Check(name="", status=Status.FAIL)).status != Status.PASS:
        return _skip(name, "execution role not readable (see above)")
    bucket, role = ctx.bucket or "", _role_name(ctx.role_arn)
    iam = ctx.client("iam")
    fix = (f"attach an inline policy to {role} allowing {', '.join(S3_ACTIONS_NEEDED)} on arn:aws:s3:::{bucket} "
           f"and arn:aws:s3:::{bucket}/{ctx.prefix + '/' if ctx.prefix else ''}*, or use a bucket whose name "
           f"contains 'sagemaker'")
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
        check = _fail(name, exc, "iam:ListRolePolicies, iam:GetRolePolicy, iam:ListAttachedRolePolicies, "
                                 "iam:GetPolicy, iam:GetPolicyVersion")
        check.status, check.detail = Status.WARN, f"cannot read the role's policies: {check.detail}"
        return check
    if any(p["PolicyArn"] == SAGEMAKER_FULL_ACCESS for p in attached):
        if any(m in bucket for m in SAGEMAKER_BUCKET_MARKERS):
            return Check(name=name, status=Status.PASS,
                         detail=f"AmazonSageMakerFullAccess covers buckets named like *sagemaker* ({bucket!r})")
        return Check(name=name, status=Status.WARN,
                     detail=f"AmazonSageMakerFullAccess grants S3 only on buckets whose name contains "
                            f"'sagemaker' or 'aws-glue'; {bucket!r} does not, and no other policy of {role} "
                            f"names it: the jobs' first PUT would be denied and every peer would wait",
                     fix=fix)
    return Check(name=name, status=Status.WARN, detail=f"no policy of {role} visibly grants S3 access to {bucket!r}",
                 fix=fix)


def check_logs(ctx: DoctorContext) -> Check:
    name = "cloudwatch logs"
    if ctx.backend != "sagemaker":
        return _skip(name, f"not used by the {ctx.backend} backend")
    try:
        groups = ctx.client("logs").describe_log_groups(logGroupNamePrefix=LOG_GROUP, limit=1).get("logGroups", [])
    except Exception as exc:  # noqa: BLE001
        check = _fail(name, exc, "logs:DescribeLogGroups, logs:DescribeLogStreams, logs:GetLogEvents")
        check.status = Status.WARN  # launching works without it; `diloco logs` does not
        check.detail += " (`diloco logs` will not work)"
        return check
    state = "exists" if any(g.get("logGroupName") == LOG_GROUP for g in groups) else \
        "not created yet (the first training job creates it)"
    return Check(name=name, status=Status.PASS, detail=f"can read {LOG_GROUP}: {state}")


def check_image(ctx: DoctorContext) -> Check:
    name = "training image"
    if ctx.backend == "local":
        return _skip(name, "the local backend runs this Python environment")
    if not ctx.image_uri:
        return _skip(name, "no image given (--image, or the config's backend.image_uri / backend.image)")
    m = _ECR_RE.match(ctx.image_uri)
    if not m:
        return _skip(name, f"not an ECR image, not checked: {ctx.image_uri}")
    image_id = {"imageDigest": m["digest"]} if m["digest"] else {"imageTag": m["tag"] or "latest"}
    try:
        ctx.client("ecr", region=m["region"]).describe_images(
            registryId=m["account"], repositoryName=m["repo"], imageIds=[image_id])
    except Exception as exc:  # noqa: BLE001
        from botocore.exceptions import ClientError

        code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
        if code == "RepositoryNotFoundException":
            return Check(name=name, status=Status.FAIL, detail=f"ECR repository {m['repo']!r} does not exist",
                         fix=f"aws ecr create-repository --repository-name {m['repo']} --region {m['region']}, "
                             f"then build and push docker/Dockerfile")
        if code == "ImageNotFoundException":
            return Check(name=name, status=Status.FAIL, detail=f"{ctx.image_uri} not found in ECR",
                         fix=f"docker build -f docker/Dockerfile -t {ctx.image_uri} . && docker push "
                             f"{ctx.image_uri} (after `aws ecr get-login-password | docker login ...`)")
        check = _fail(name, exc, "ecr:DescribeImages")
        if check.detail.startswith("denied"):
            check.status = Status.WARN  # e.g. AWS's own DLC registry: pullable, not describable
        return check
    return Check(name=name, status=Status.PASS, detail=f"{ctx.image_uri} exists")


def check_kubernetes(ctx: DoctorContext) -> list[Check]:
    names = ("kubernetes client", "kubernetes context", "kubernetes namespace")
    if ctx.backend != "eks":
        return [_skip(n, f"not used by the {ctx.backend} backend") for n in names]
    try:
        from kubernetes import client as kclient
        from kubernetes import config as kconfig
    except ImportError:
        return [Check(name=names[0], status=Status.FAIL, detail="the kubernetes package is not installed",
                      fix="pip install 'diloco[k8s]'"),
                _skip(names[1], "no kubernetes client"), _skip(names[2], "no kubernetes client")]

    client_check = Check(name=names[0], status=Status.PASS, detail="installed")
    try:
        kconfig.load_kube_config(context=ctx.kube_context)
        _, active = kconfig.list_kube_config_contexts()
    except Exception as exc:  # noqa: BLE001 - ConfigException, missing file
        return [client_check,
                Check(name=names[1], status=Status.FAIL, detail=f"no usable kubeconfig context: {exc}",
                      fix="aws eks update-kubeconfig --name <cluster> --region <region> (or pass --context)"),
                _skip(names[2], "no kubernetes context")]
    context_check = Check(name=names[1], status=Status.PASS,
                          detail=str(ctx.kube_context or (active or {}).get("name", "current")))
    try:
        kclient.CoreV1Api().read_namespace(ctx.namespace, _request_timeout=5)
    except Exception as exc:  # noqa: BLE001
        status = getattr(exc, "status", None)
        if status == 404:
            detail, fix = f"namespace {ctx.namespace!r} does not exist", f"kubectl create namespace {ctx.namespace}"
        elif status in (401, 403):
            detail, fix = f"not allowed to read namespace {ctx.namespace!r} ({status})", \
                "ask for RBAC access to create Jobs and read Pods/logs in that namespace"
        else:
            detail, fix = f"cluster API not reachable: {type(exc).__name__}: {exc}", \
                "check the cluster endpoint, VPN/network, and `kubectl get ns`"
        return [client_check, context_check, Check(name=names[2], status=Status.FAIL, detail=detail, fix=fix)]
    return [client_check, context_check, Check(name=names[2], status=Status.PASS, detail=f"{ctx.namespace!r} readable")]


def check_replica_environment(ctx: DoctorContext) -> Check:
    """Local replicas run ``python -m diloco.replica_entrypoint`` with this interpreter: can it import the
    replica side (torch included), the way a replica will, in a fresh process?"""
    import subprocess
    import sys

    name = "replica environment"
    if ctx.backend != "local":
        return _skip(name, f"{ctx.backend} replicas run in the training image (see 'training image')")
    python = ctx.python or sys.executable
    code = "import torch, safetensors, diloco.replica_entrypoint, diloco.trainer; print(torch.__version__)"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(name=name, status=Status.FAIL, detail=f"cannot run {python}: {exc}",
                     fix="set backend.python to a working interpreter, or leave it unset to use this one")
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return Check(name=name, status=Status.FAIL, detail=f"{python} cannot import the replica side: {last}",
                     fix="install diloco into that environment (`make demo` does, or `pip install -e .`)")
    return Check(name=name, status=Status.PASS,
                 detail=f"{python}: torch {out.stdout.strip()}, {os.cpu_count()} CPU core(s) to share")


def check_run_directory(ctx: DoctorContext) -> Check:
    """Where runs are recorded (and local replicas log and meet): writable, with room to spare. Creates nothing
    that was not there: a missing directory is judged by its nearest existing parent."""
    import shutil
    import tempfile

    from diloco.runs import runs_dir

    name = "run directory"
    target = runs_dir()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return Check(name=name, status=Status.FAIL, detail=f"{existing} is not a directory",
                     fix="set DILOCO_HOME to a writable directory")
    try:
        if existing == target:
            with tempfile.NamedTemporaryFile(dir=target, prefix=".doctor-"):
                pass
        elif not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(f"{existing} is not writable")
    except OSError as exc:
        return Check(name=name, status=Status.FAIL, detail=f"cannot write under {target}: {exc}",
                     fix="set DILOCO_HOME to a writable directory")
    free_gb = shutil.disk_usage(existing).free / 2**30
    detail = f"{target} writable{'' if existing == target else ' (will be created)'}, {free_gb:.1f} GiB free"
    if free_gb < 1:
        return Check(name=name, status=Status.WARN, detail=detail,
                     fix="free some space, or set DILOCO_HOME elsewhere: local runs keep logs and the store there")
    return Check(name=name, status=Status.PASS, detail=detail)


#: In order; each takes the context and returns one check or several.
CHECKS: list[Callable[[DoctorContext], Check | list[Check]]] = [
    check_replica_environment, check_run_directory, check_credentials, check_region, check_bucket, check_read_write,
    check_role, check_role_bucket, check_logs, check_image, check_kubernetes,
]


# ---------------------------------------------------------------------------------------------- entry
def resolve_inputs(
    *, backend: str | None, s3_uri: str | None, config_path: str | None, role_arn: str | None,
    image_uri: str | None, namespace: str | None, kube_context: str | None,
) -> DoctorContext:
    """Flags win over the run config; ``ConfigError`` (exit 2) for a bad backend, URI or config."""
    from diloco.s3 import resolve_s3_uri

    cfg = resolve_config(config_path) if config_path is not None else None
    kind = backend or (cfg.backend.kind if cfg is not None else "local")
    if kind not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)} (got {kind!r})")
    section: Any = cfg.backend if cfg is not None and cfg.backend.kind == kind else None
    ctx = DoctorContext(
        backend=kind,
        s3_uri=resolve_s3_uri(s3_uri, cfg.store.rendezvous if cfg is not None else None),
        role_arn=role_arn or getattr(section, "role_arn", None),
        image_uri=image_uri or getattr(section, "image_uri", None) or getattr(section, "image", None),
        region=getattr(section, "region", None),
        namespace=namespace or getattr(section, "namespace", None) or "default",
        kube_context=kube_context or getattr(section, "kube_context", None),
        python=getattr(section, "python", None),
    )
    return ctx


def run_doctor(ctx: DoctorContext) -> DoctorReport:
    """Run every check in order (later checks may read earlier results) and collect the report."""
    checks: list[Check] = []
    for fn in CHECKS:
        try:
            out = fn(ctx)
        except Exception as exc:  # noqa: BLE001 - a broken check is a failed row, not a crash
            out = Check(name=fn.__name__.removeprefix("check_").replace("_", " "), status=Status.FAIL,
                        detail=f"the check itself failed: {type(exc).__name__}: {exc}",
                        fix="set DILOCO_DEBUG=1 and report it")
        for check in out if isinstance(out, list) else [out]:
            ctx.results[check.name] = check
            checks.append(check)
    return DoctorReport(backend=ctx.backend, s3_uri=ctx.s3_uri, checks=checks,
                        ok=not any(c.status == Status.FAIL for c in checks))
