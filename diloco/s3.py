"""S3 specifics of the object store: client settings, which errors are worth retrying, and clearer failures.

Settings come from the standard AWS places, never from our own flags, so every replica process, SageMaker job and
Kubernetes pod configures itself the way the AWS CLI does: ``AWS_PROFILE``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
credentials from the usual chain, and ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for S3-compatible stores.
botocore >= 1.31 resolves the endpoint variables itself and aiobotocore (under s3fs) inherits that, so we do not
pass ``endpoint_url`` (doing so would override ``AWS_ENDPOINT_URL_S3`` and ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS``).

Retries happen in exactly two layers, so they never multiply into minutes of silent waiting:

1. botocore, per HTTP request: ``standard`` mode, 3 attempts (throttling such as ``503 SlowDown``, 5xx, dropped
   connections, timeouts), backoff ``random(0, 1) * 2**n`` seconds, i.e. at most 1 + 2 s. ``AWS_MAX_ATTEMPTS`` and
   ``AWS_RETRY_MODE`` override both numbers when set.
2. ``ObjectStore._retry``, per store operation: 5 retries with capped exponential backoff (0.1 s doubling, at most
   ~4.7 s of sleep in total); it also covers what botocore cannot retry (a body cut off mid-read).

s3fs's own retry loop is switched off (``retries=1`` means one try): left on, it would wrap the botocore layer in
5 more attempts. Worst case per operation: 6 x 3 = 18 HTTP attempts and about 23 s of backoff, plus the connect
(5 s) and read (30 s) timeouts of attempts that hang. Permanent answers (403, 404, 412) are never retried.

Uploads: s3fs's ``pipe_file`` sends one ``PutObject`` below ``2 * chunksize`` (100 MiB by default) and a multipart
upload above it; either way the object becomes visible atomically, when the PUT or the ``CompleteMultipartUpload``
finishes. Conditional create sends ``If-None-Match: *`` on that same request (needs s3fs >= 2025.7).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from diloco.errors import ConfigError, StoreError

#: s3fs sends a single PutObject below ``2 * MULTIPART_CHUNKSIZE`` bytes, a multipart upload above.
MULTIPART_CHUNKSIZE = 50 * 2**20
#: botocore attempts per HTTP request (1 try + 2 retries).
BOTOCORE_MAX_ATTEMPTS = 3
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 30

#: Our own storage option (not an s3fs one): the multipart part size; tests lower it to exercise multipart.
CHUNKSIZE_OPTION = "multipart_chunksize"

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IP_RE = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
_MISSING_BUCKET_TEXT = "specified bucket does not exist"


class S3AccessDenied(StoreError, PermissionError):
    """S3 answered 403 (or the credentials are missing/invalid): permanent, never retried, never 'not found'."""


class S3BucketNotFound(StoreError):
    """The bucket itself does not exist: a configuration error, not a key that has not been written yet."""


def parse_s3_uri(uri: str, *, field: str = "--s3") -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; ``ConfigError`` naming ``field`` otherwise."""
    if not uri.startswith("s3://"):
        raise ConfigError(f"{field} must be an s3://bucket/prefix URI, got {uri!r}",
                          hint="for example s3://my-sagemaker-bucket/diloco")
    rest = uri[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket or _IP_RE.match(bucket):
        raise ConfigError(
            f"{field} has an invalid bucket name {bucket!r} (3-63 lowercase letters, digits, '-' or '.')",
            hint="bucket names start and end with a lowercase letter or digit, e.g. s3://my-sagemaker-bucket/diloco",
        )
    prefix = prefix.strip("/")
    if "//" in prefix:
        raise ConfigError(f"{field} has an empty path segment in {uri!r}", hint="remove the doubled '/'")
    return bucket, prefix


def retry_config(max_attempts: int) -> dict[str, Any]:
    """botocore ``Config`` retry settings: ``standard`` mode, ``max_attempts`` per request; none when
    ``AWS_MAX_ATTEMPTS`` or ``AWS_RETRY_MODE`` is set (botocore reads those itself, and they win)."""
    if os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE"):
        return {}
    return {"retries": {"mode": "standard", "max_attempts": max_attempts}}


def s3_storage_options() -> dict[str, Any]:
    """s3fs options for every ``s3://`` store: botocore's retry layer and timeouts (see the module docstring)."""
    return {"config_kwargs": {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
                              **retry_config(BOTOCORE_MAX_ATTEMPTS)}}


def configure_filesystem(fs: Any) -> None:
    """Switch off s3fs's own retry loop on ``fs`` (a class attribute, not a constructor option).

    ``retries`` counts tries in s3fs, so 1 means a single try; botocore and ``ObjectStore._retry`` remain.
    """
    fs.retries = 1


def pop_put_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """Remove our own options from ``options`` (s3fs would pass unknown ones to botocore) -> ``pipe_file`` kwargs."""
    chunksize = int(options.pop(CHUNKSIZE_OPTION, MULTIPART_CHUNKSIZE))
    if chunksize < 5 * 2**20:
        raise ConfigError(f"{CHUNKSIZE_OPTION} must be >= 5 MiB (the S3 minimum part size), got {chunksize}")
    return {"chunksize": chunksize}


def transient_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the network or the service hiccuped": worth another try.

    s3fs translates S3 error responses into ``OSError`` subclasses (already retried by the store) but lets
    connection-level errors through untranslated: botocore's (a refused connection, a connection closed before the
    response, a read timeout, a streaming body cut short, a response checksum mismatch) and aiohttp's.
    """
    import aiohttp
    from botocore import exceptions as bx
    from s3fs.core import S3_RETRYABLE_ERRORS

    return (
        *S3_RETRYABLE_ERRORS,
        bx.ConnectionError,
        bx.HTTPClientError,
        bx.IncompleteReadError,
        bx.ChecksumError,
        bx.FlexibleChecksumError,
        aiohttp.ClientError,
    )


def _error_code(exc: BaseException) -> str | None:
    cause = exc.__cause__ or exc.__context__
    response = getattr(cause, "response", None) or getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("Error", {}).get("Code")
    return None


def describe_error(exc: BaseException) -> str:
    """``Type: message`` plus the S3 error code and HTTP status when s3fs's translation dropped them."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    response = getattr(cause, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code or status:
            text += f" (S3 {code or '?'}, HTTP {status or '?'})"
    return text


def is_missing_bucket(exc: BaseException) -> bool:
    """Whether a ``FileNotFoundError`` from s3fs is about the bucket, not the key (S3's ``NoSuchBucket``)."""
    return _error_code(exc) == "NoSuchBucket" or _MISSING_BUCKET_TEXT in str(exc).lower()


def explain_error(op: str, url: str, exc: BaseException) -> BaseException | None:
    """A clearer exception for a permanent S3 failure of ``op`` on ``url``, or ``None`` to re-raise ``exc`` as is."""
    bucket = url[len("s3://"):].split("/", 1)[0] if url.startswith("s3://") else url
    if isinstance(exc, PermissionError) and not isinstance(exc, StoreError):
        return S3AccessDenied(
            f"{op} {url} was denied by S3 (403): {exc}",
            hint=f"grant s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket on bucket {bucket!r} to the "
                 f"identity in use (SageMaker: the execution role); `diloco doctor --s3 {url}` checks this",
        )
    if isinstance(exc, FileNotFoundError) and is_missing_bucket(exc):
        return S3BucketNotFound(
            f"{op} {url}: bucket {bucket!r} does not exist (or not in this account/endpoint)",
            hint="create the bucket, or fix the URI / AWS_ENDPOINT_URL / AWS_PROFILE",
        )
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return S3AccessDenied(
            f"{op} {url}: no usable AWS credentials ({exc})",
            hint="set AWS_PROFILE (or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), or run on a role; check with "
                 "`diloco doctor`",
        )
    return None


def resolve_s3_uri(explicit: str | None, config_rendezvous: str | None = None,
                   env: Mapping[str, str] | None = None) -> str | None:
    """The S3 prefix for `smoke`/`doctor`: ``--s3``, else the config's s3:// ``store.rendezvous`` (``{run_id}``
    dropped), else ``$DILOCO_S3_URI``; ``None`` when none is set. ``ConfigError`` naming the source if malformed."""
    from diloco.envvars import DILOCO_S3_URI

    env = os.environ if env is None else env
    candidates = [
        ("--s3", explicit),
        ("store.rendezvous", config_rendezvous if config_rendezvous and config_rendezvous.startswith("s3://")
         else None),
        (DILOCO_S3_URI, env.get(DILOCO_S3_URI) or None),
    ]
    for source, uri in candidates:
        if uri:
            if source == "store.rendezvous":  # s3://b/diloco/{run_id}/x -> s3://b/diloco/x
                uri = re.sub(r"(?<!:)/{2,}", "/", uri.replace("{run_id}", ""))
            bucket, prefix = parse_s3_uri(uri, field=source)
            return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return None
