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
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from diloco.executors import DEFAULT_BACKEND
from diloco.launcher.config import resolve_config

PROBE_DIR = "_diloco_doctor"
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
    """What the checks look at. Built by ``resolve_inputs`` from flags and the run config; also a cache for checks.

    ``section`` is the backend's config section as far as it is known (flags over the config file). It may be
    incomplete, because the doctor runs before a launch would validate it; backends read it with ``option``.
    """

    backend: str = DEFAULT_BACKEND
    s3_uri: str | None = None
    section: Any = None
    #: Whether replicas of this backend can meet in a file:// store (so S3 is optional).
    file_store_ok: bool = True
    #: What a launch would place: ``--gpu`` and ``--procs-per-replica`` (flags, else the run config).
    gpu: str | None = None
    procs_per_replica: int | None = None
    results: dict[str, Check] = field(default_factory=dict)
    _session: Any = None
    _region: tuple[str | None, str | None] | None = None

    @classmethod
    def for_backend(cls, kind: str, s3_uri: str | None = None, **options: Any) -> DoctorContext:
        """A context for backend ``kind`` with ``options`` as its (possibly incomplete) config section."""
        from diloco.executors import config_type

        model = config_type(kind)
        known = {k: v for k, v in options.items() if v is not None and k in model.model_fields}
        return cls(backend=kind, s3_uri=s3_uri, section=model.model_construct(**{**known, "kind": kind}),
                   file_store_ok="file" in model.rendezvous_schemes)

    def option(self, name: str) -> Any:
        """A field of the backend's config section, or None."""
        return getattr(self.section, name, None)

    @property
    def region(self) -> str | None:
        """The region every check works in: ``--region``, ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile's."""
        return self.resolved_region()[0]

    def resolved_region(self) -> tuple[str | None, str | None]:
        """``(region, where it came from)`` (``diloco.store.aws_region``), resolved once."""
        if self._region is None:
            from diloco.store.aws_region import resolve_region

            self._region = resolve_region(self.option("region"))
        return self._region

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

        from diloco.store.s3 import retry_config

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
        from diloco.store.aws_region import REGION_HINT

        return ("no AWS region configured", REGION_HINT)
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


def fail_check(name: str, exc: BaseException, action: str) -> Check:
    """A failed row for an AWS error, with its explanation and fix."""
    detail, fix = explain_aws_error(exc, action)
    return Check(name=name, status=Status.FAIL, detail=detail, fix=fix)


def skip_check(name: str, why: str) -> Check:
    return Check(name=name, status=Status.SKIP, detail=why)


def _failed(ctx: DoctorContext, name: str) -> bool:
    found = ctx.results.get(name)
    return found is not None and found.status == Status.FAIL


# ---------------------------------------------------------------------------------------------- checks
def check_credentials(ctx: DoctorContext) -> Check:
    name = "aws credentials"
    if ctx.file_store_ok and not ctx.s3_uri:
        return skip_check(name, "no --s3: replicas meet in a file:// store")
    try:
        ident = ctx.client("sts").get_caller_identity()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row
        check = fail_check(name, exc, "sts:GetCallerIdentity")
        if ctx.file_store_ok and _custom_endpoint() and "credentials" not in check.detail:
            # An S3-compatible store need not offer STS; the S3 checks below are what count.
            check.status = Status.WARN
        return check
    return Check(name=name, status=Status.PASS, detail=f"{ident.get('Arn')} (account {ident.get('Account')})")


def check_region(ctx: DoctorContext) -> Check:
    name = "aws region"
    if ctx.file_store_ok and not ctx.s3_uri:
        return skip_check(name, "no --s3: replicas meet in a file:// store")
    from diloco.store.aws_region import REGION_HINT

    try:
        region, source = ctx.resolved_region()
    except Exception as exc:  # noqa: BLE001 - e.g. AWS_PROFILE names a profile that does not exist
        return fail_check(name, exc, "a readable AWS config")
    if region:
        return Check(name=name, status=Status.PASS, detail=f"{region} (from {source})")
    return Check(name=name, status=Status.WARN if ctx.file_store_ok else Status.FAIL,
                 detail="no region configured (--region, AWS_REGION, AWS_DEFAULT_REGION and the profile name none)",
                 fix=f"{REGION_HINT}: the region of your bucket and jobs")


def check_bucket(ctx: DoctorContext) -> Check:
    name = "s3 bucket"
    if not ctx.s3_uri and not ctx.file_store_ok:
        return Check(name=name, status=Status.FAIL, detail=f"the {ctx.backend} backend needs an s3:// rendezvous",
                     fix="pass --s3 s3://<bucket>/<prefix>, or set store.rendezvous in the config or DILOCO_S3_URI")
    if not ctx.s3_uri:
        return skip_check(name, "no S3 URI (--s3, the config's store.rendezvous or DILOCO_S3_URI)")
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
                         fix=f"pass --region {where} or set AWS_REGION={where} (run the jobs next to their bucket)")
        return fail_check(name, exc, f"s3:ListBucket on {ctx.bucket}")
    except Exception as exc:  # noqa: BLE001
        return fail_check(name, exc, f"s3:ListBucket on {ctx.bucket}")
    region = (out.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}).get("x-amz-bucket-region")
    return Check(name=name, status=Status.PASS, detail=f"{ctx.bucket!r} reachable" + (f" ({region})" if region else ""))


def check_read_write(ctx: DoctorContext) -> list[Check]:
    """put/get/list/delete and conditional create on a fresh probe key under the prefix, through ObjectStore."""
    rw, cc = "s3 read/write", "s3 conditional create"
    if not ctx.s3_uri:
        return [skip_check(rw, "no S3 URI"), skip_check(cc, "no S3 URI")]
    if _failed(ctx, "s3 bucket"):
        return [skip_check(rw, "bucket not reachable (see above)"), skip_check(cc, "bucket not reachable (see above)")]
    from diloco.store.objects import ObjectStore, probe_conditional_create

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
                    skip_check(cc, "read/write failed")]
        step = "list"
        if store.list() != ["probe"]:
            return [Check(name=rw, status=Status.FAIL, detail=f"listing shows {store.list()}, expected ['probe']",
                          fix="the store's listing is not consistent with its writes"), skip_check(cc, "read/write failed")]
        step = "delete"
        store.delete("probe")
        written.remove("probe")
        if store.exists("probe"):
            return [Check(name=rw, status=Status.FAIL, detail="a deleted object still exists",
                          fix="grant s3:DeleteObject on the prefix"), skip_check(cc, "read/write failed")]
        rw_check = Check(name=rw, status=Status.PASS, detail=f"put/get/list/delete under {store.url()}")
        step = "conditional create"
        honoured, detail = probe_conditional_create(store, "lease")  # the probe `diloco launch` runs too
        if honoured:
            cc_check = Check(name=cc, status=Status.PASS, detail=detail)
        else:
            cc_check = Check(name=cc, status=Status.FAIL, detail=detail,
                             fix="use AWS S3 or a store with conditional writes; and s3fs >= 2025.7")
        return [rw_check, cc_check]
    except Exception as exc:  # noqa: BLE001
        detail = f"{step} failed: {type(exc).__name__}: {exc}"
        hint = getattr(exc, "hint", None) or explain_aws_error(exc, "s3:GetObject/PutObject/DeleteObject")[1]
        failed = Check(name=rw if step != "conditional create" else cc, status=Status.FAIL, detail=detail, fix=hint)
        return [failed, skip_check(cc, "read/write failed")] if failed.name == rw else [rw_check, failed]
    finally:
        for key in written:  # only what we wrote
            try:
                store.delete(key)
            except Exception:  # noqa: BLE001 - reported by the checks above when it matters
                pass


def check_image(ctx: DoctorContext, image: str | None) -> Check:
    """An ECR image reference exists (other registries are not checked). Used by the container backends."""
    name = "training image"
    if not image:
        return skip_check(name, "no image given (--image, or the config's backend section)")
    m = _ECR_RE.match(image)
    if not m:
        return skip_check(name, f"not an ECR image, not checked: {image}")
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
            return Check(name=name, status=Status.FAIL, detail=f"{image} not found in ECR",
                         fix=f"docker build -f docker/Dockerfile -t {image} . && docker push "
                             f"{image} (after `aws ecr get-login-password | docker login ...`)")
        check = fail_check(name, exc, "ecr:DescribeImages")
        if check.detail.startswith("denied"):
            check.status = Status.WARN  # e.g. AWS's own DLC registry: pullable, not describable
        return check
    return Check(name=name, status=Status.PASS, detail=f"{image} exists")


def check_run_directory(ctx: DoctorContext) -> Check:
    """Where runs are recorded (and local replicas log and meet): writable, with room to spare. Creates nothing
    that was not there: a missing directory is judged by its nearest existing parent."""
    import shutil
    import tempfile

    from diloco.launcher.runs import runs_dir

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
    check_run_directory, check_credentials, check_region, check_bucket, check_read_write,
]


# ---------------------------------------------------------------------------------------------- entry
def resolve_inputs(
    *, backend: str | None, s3_uri: str | None, config_path: str | None, options: dict[str, Any] | None = None,
    gpu: str | None = None, procs_per_replica: int | None = None,
) -> DoctorContext:
    """Flags win over the run config; ``ConfigError`` (exit 2) for a bad backend, URI or config.

    ``options`` are flag values for the backend's config fields (e.g. ``{"role_arn": ...}``); a flag a backend
    has no field for is ignored, so one ``--image`` serves backends that call the field differently.
    """
    from diloco.store.s3 import resolve_s3_uri

    cfg = resolve_config(config_path) if config_path is not None else None
    kind = backend or (cfg.backend.kind if cfg is not None else DEFAULT_BACKEND)
    data: dict[str, Any] = cfg.backend.model_dump(exclude={"kind"}) if cfg is not None and cfg.backend.kind == kind else {}
    data.update({k: v for k, v in (options or {}).items() if v is not None})
    # The section stays unvalidated on purpose: the doctor reports what is missing, row by row.
    ctx = DoctorContext.for_backend(kind, resolve_s3_uri(s3_uri, cfg.store.rendezvous if cfg else None), **data)
    ctx.gpu = gpu if gpu is not None else (cfg.gpu if cfg is not None else None)
    ctx.procs_per_replica = procs_per_replica if procs_per_replica is not None else (
        cfg.train.procs_per_replica if cfg is not None else None)
    return ctx


def run_doctor(ctx: DoctorContext) -> DoctorReport:
    """Run every common check, then the backend's own, in order (later checks may read earlier results)."""
    from diloco.executors import backend_class

    checks: list[Check] = []
    steps: list[Callable[[DoctorContext], Check | list[Check]]] = [
        *CHECKS, backend_class(ctx.backend).doctor_checks]
    for fn in steps:
        try:
            out = fn(ctx)
        except Exception as exc:  # noqa: BLE001 - a broken check is a failed row, not a crash
            out = Check(name=getattr(fn, "__name__", "check").removeprefix("check_").replace("_", " "),
                        status=Status.FAIL, detail=f"the check itself failed: {type(exc).__name__}: {exc}",
                        fix="set DILOCO_DEBUG=1 and report it")
        for check in out if isinstance(out, list) else [out]:
            ctx.results[check.name] = check
            checks.append(check)
    return DoctorReport(backend=ctx.backend, s3_uri=ctx.s3_uri, checks=checks,
                        ok=not any(c.status == Status.FAIL for c in checks))
