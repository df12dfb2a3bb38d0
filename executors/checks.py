"""What a doctor check is: the record each check returns, the context checks read, and the helpers every
backend's checks share (an AWS error explained with its fix, a skipped row, the ECR image check).

They sit with the backend contract because a backend's ``doctor_checks`` returns them: a backend imports the
contract, never the launcher. ``diloco.launcher.doctor`` runs the common checks and the backend's, in order.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from diloco.executors import DEFAULT_BACKEND

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
            from diloco.store.aws_data import boto3_session

            self._session = boto3_session(self.region)
        return self._session

    def client(self, service: str, region: str | None = None) -> Any:
        """A boto3 client with short timeouts and 2 attempts (unless AWS_MAX_ATTEMPTS/AWS_RETRY_MODE say else)."""
        from botocore.config import Config

        from diloco.store.s3 import retry_config

        config = Config(connect_timeout=3, read_timeout=10, **retry_config(2))
        return self.session().client(service, region_name=region, config=config)


def custom_endpoint() -> str | None:
    """The S3-compatible endpoint the environment points at (e.g. MinIO, moto), if any."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _endpoint_hint() -> str:
    custom = custom_endpoint()
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


# ---------------------------------------------------------------------------------------------- bucket region
#: AWS's typical price of data transferred between two regions, per GB (EC2 and S3 "Data Transfer to other AWS
#: Regions", https://aws.amazon.com/ec2/pricing/on-demand/#Data_Transfer and https://aws.amazon.com/s3/pricing/;
#: most region pairs, some cost more). An estimate: every byte a replica sends to or reads from a bucket in
#: another region is billed at it, and an all-reduce moves the model several times per round per replica.
INTER_REGION_USD_PER_GB = 0.02
#: Backends whose service refuses a bucket in another region: SageMaker's S3 inputs ("Your input bucket must be in
#: the same Amazon region as your training job", SageMaker API Reference, S3DataSource), which carry the code
#: channel from the run's store, and its outputs.
SAME_REGION_BACKENDS = frozenset({"sagemaker"})


def bucket_region(client: Any, bucket: str) -> str | None:
    """The bucket's region as S3 says it: HeadBucket's ``x-amz-bucket-region`` header, which S3 sends on a 200 and
    on its 301 and 403 answers too. None when it cannot be learned (no such header: an S3-compatible store)."""
    from botocore.exceptions import ClientError

    try:
        out = client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        out = exc.response
    headers = (out.get("ResponseMetadata", {}) or {}).get("HTTPHeaders", {}) or {}
    region = headers.get("x-amz-bucket-region") or out.get("BucketRegion")
    return str(region) if region else None


@dataclass
class RegionFinding:
    """A part's jobs and the bucket in different regions: ``refuse`` when its service requires them together."""

    refuse: bool
    message: str
    fix: str


def region_finding(kind: str, jobs_region: str | None, bucket: str, bucket_region: str | None,
                   where: str = "backend.region") -> RegionFinding | None:
    """Compare where a backend's jobs run with where the run's bucket is; None when they agree or one is unknown.
    SageMaker (``SAME_REGION_BACKENDS``) is refused; any other backend is warned of the transfer price."""
    if not jobs_region or not bucket_region or jobs_region == bucket_region:
        return None
    said = f"the {kind} jobs run in {jobs_region} but bucket {bucket!r} is in {bucket_region}"
    if kind in SAME_REGION_BACKENDS:
        return RegionFinding(True, f"{where}: {said}, and SageMaker reads and writes S3 only in its own region",
                             f"pass --region {bucket_region} (run the jobs next to their bucket), or use a bucket "
                             f"in {jobs_region}")
    return RegionFinding(False, f"{said}: every byte the replicas exchange crosses regions, billed at about "
                                f"${INTER_REGION_USD_PER_GB:.2f}/GB (AWS inter-region transfer, an estimate)",
                         f"use a bucket in {jobs_region}, or run the jobs in {bucket_region}")
