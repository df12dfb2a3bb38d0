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
2. ``ObjectStore.with_retries``, per store operation: 5 retries with capped exponential backoff (0.1 s doubling, at most
   ~4.7 s of sleep in total); it also covers what botocore cannot retry (a body cut off mid-read).

s3fs's own retry loop is switched off (``retries=1`` means one try): left on, it would wrap the botocore layer in
5 more attempts. Worst case per operation: 6 x 3 = 18 HTTP attempts and about 23 s of backoff, plus the connect
(5 s) and read (30 s) timeouts of attempts that hang. Permanent answers (403, 404, 412) are never retried.

Uploads: s3fs's ``pipe_file`` sends one ``PutObject`` below ``2 * chunksize`` (100 MiB by default) and a multipart
upload above it; either way the object becomes visible atomically, when the PUT or the ``CompleteMultipartUpload``
finishes. Conditional create sends ``If-None-Match: *`` on that same request (needs s3fs >= 2025.7).
Above that threshold ``ObjectStore.put`` and every ``put_stream`` use ``put_stream`` below instead: the same
CreateMultipartUpload / UploadPart / CompleteMultipartUpload sequence, but parts sent as views of the caller's
bytes (a file-like body botocore streams: no copy of the part, where a ``bytes`` body costs one and s3fs slices
up to 10 parts at once), ``PARTS_IN_FLIGHT`` at a time, each part retried on its own, a completion whose response
was lost recognised by the object's ETag, and a failed upload aborted so no invisible parts are left to bill.

Ranged reads (``read_range``) issue one GET with a ``Range`` header and read the body into one preallocated
buffer: reading the whole body at once (what s3fs does) joins a list of network chunks and briefly holds the
range twice.
"""

from __future__ import annotations

import bisect
import errno
import io
import os
import re
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol, TypeVar

from diloco.errors import ConfigError, StoreError

T = TypeVar("T")

#: A chunk as ``put_stream`` accepts it: anything with the buffer protocol (bytes, bytearray, memoryview).
Chunk = bytes | bytearray | memoryview


class _Tally(Protocol):
    def wrote(self, n: int) -> None: ...

    def request(self, op: str, n: int = 1) -> None: ...


class S3Target(Protocol):
    """What the streaming upload needs of the store it uploads for (an s3:// ``diloco.store.objects.ObjectStore``).
    Declared here, so that this module, which the store imports (lazily, for s3:// URIs only), does not import the
    store back."""

    fs: Any
    put_kwargs: dict[str, Any]
    traffic_counter: _Tally

    def path(self, key: str) -> str: ...

    def url(self, key: str = "") -> str: ...

    def with_retries(self, op: str, key: str, fn: Callable[[], T]) -> T: ...

    def invalidate(self, path: str) -> None: ...

#: S3 allows at most this many parts in one multipart upload.
MAX_PARTS = 10_000
#: Parts of one multipart upload sent at once. They are views of the caller's memory, so parts in flight cost no
#: copy (a stream whose chunks are fresh buffers keeps up to this many parts' worth of them alive).
PARTS_IN_FLIGHT = 4
#: How much of a GET body is read at once into the destination buffer.
_READ_PIECE = 4 * 2**20

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

    ``retries`` counts tries in s3fs, so 1 means a single try; botocore and ``ObjectStore.with_retries`` remain.
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


# ---------------------------------------------------------------------------------------------- streaming I/O
def put_stream(store: S3Target, key: str, chunks: Iterable[Chunk], *, expected_size: int | None = None,
               single_put_max: int | None = None) -> int:
    """Upload the concatenation of ``chunks`` to ``key`` on ``store`` (an s3:// ``ObjectStore``); -> bytes.

    One PutObject when the whole stream fits in ``single_put_max`` bytes (default: one part), else a multipart
    upload with parts of the store's ``multipart_chunksize``, each sent as soon as it is full (``PARTS_IN_FLIGHT``
    at a time, so the stream keeps being produced while parts go up). Nothing is copied: a part is a list of
    views of the chunks themselves, handed to botocore as a file-like body (a ``bytes`` body costs botocore one
    more copy of the part, a ``bytearray`` three), so the caller's chunks must not change until the part holding
    them was sent. Atomic: nothing is visible before CompleteMultipartUpload, and a failed upload is aborted."""
    part_size = int(store.put_kwargs["chunksize"])
    limit = part_size if single_put_max is None else single_put_max
    upload = _MultipartUpload(store, key, part_size)
    pending: list[memoryview] = []
    filled = 0
    total = 0
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while len(view):
                if filled == part_size:  # more data follows a full part: send it
                    upload.send(pending)
                    pending, filled = [], 0
                n = min(len(view), part_size - filled)
                pending.append(view[:n])
                filled += n
                total += n
                view = view[n:]
        if expected_size is not None and total != expected_size:
            raise ValueError(f"put_stream {store.url(key)}: the chunks held {total} bytes, but size={expected_size} "
                             f"was promised")
        if upload.upload_id is None and total <= limit:
            _put_object(store, key, pending)
        else:
            if filled or not upload.part_count:
                upload.send(pending)
            upload.complete()
    except BaseException:
        upload.abort()
        raise
    store.traffic_counter.wrote(total)
    return total


class ViewsReader(io.RawIOBase):
    """A seekable, read-only file over a list of byte views, without joining them: botocore streams a file-like
    body (hashing it, then sending it) in small reads, where a ``bytes`` body would be copied whole."""

    def __init__(self, views: list[memoryview]) -> None:
        super().__init__()
        self._views = views
        self._starts: list[int] = []
        size = 0
        for v in views:
            self._starts.append(size)
            size += len(v)
        self._size = size
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        written = 0
        while written < len(out) and self._pos < self._size:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            view = self._views[i]
            inner = self._pos - self._starts[i]
            n = min(len(out) - written, len(view) - inner)
            out[written : written + n] = view[inner : inner + n]
            written += n
            self._pos += n
        return written

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self._size - self._pos
        buf = bytearray(max(0, min(size, self._size - self._pos)))
        n = self.readinto(buf)
        return bytes(buf[:n])


def _put_object(store: S3Target, key: str, views: list[memoryview]) -> None:
    bucket, s3_key, _ = store.fs.split_path(store.path(key))
    store.with_retries("put", key, lambda: store.fs.call_s3("put_object", Bucket=bucket, Key=s3_key,
                                                      Body=ViewsReader(views)))
    store.invalidate(store.path(key))


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives a completed multipart upload: MD5 of the parts' binary MD5s, ``-`` the part count."""
    import hashlib

    digest = hashlib.md5(b"".join(bytes.fromhex(e.strip('"')) for e in part_etags), usedforsecurity=False)
    return f"{digest.hexdigest()}-{len(part_etags)}"


class _MultipartUpload:
    """One multipart upload, started lazily by its first part; parts go up ``PARTS_IN_FLIGHT`` at a time (S3's
    throughput per connection is limited); every call retried and counted by the store."""

    def __init__(self, store: S3Target, key: str, part_size: int) -> None:
        self.store = store
        self.key = key
        self.part_size = part_size
        self.bucket, self.s3_key, _ = store.fs.split_path(store.path(key))
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []  # PartNumber + ETag of every part, in order, once all were sent
        self.part_count = 0
        self._sending: list[Future[dict[str, Any]]] = []
        self._pool: ThreadPoolExecutor | None = None

    def send(self, views: list[memoryview]) -> None:
        """Start uploading ``views`` (joined) as the next part, starting the upload first if needed; waits while
        ``PARTS_IN_FLIGHT`` parts are already on their way, and raises the first failed part's error."""
        if self.upload_id is None:
            created = self.store.with_retries("create_multipart", self.key, lambda: self.store.fs.call_s3(
                "create_multipart_upload", Bucket=self.bucket, Key=self.s3_key))
            self.upload_id = created["UploadId"]
        if self.part_count >= MAX_PARTS:
            raise StoreError(f"put {self.store.url(self.key)}: more than {MAX_PARTS} parts of {self.part_size} bytes",
                             hint=f"raise {CHUNKSIZE_OPTION}")
        in_flight = [f for f in self._sending if not f.done()]
        while len(in_flight) >= PARTS_IN_FLIGHT:
            wait(in_flight, return_when=FIRST_COMPLETED)
            in_flight = [f for f in in_flight if not f.done()]
        for done in self._sending:
            if done.done() and done.exception() is not None:
                raise done.exception()  # type: ignore[misc]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="diloco-s3-part")
        self.part_count += 1
        self._sending.append(self._pool.submit(self._upload_part, self.part_count, views))

    def _upload_part(self, number: int, views: list[memoryview]) -> dict[str, Any]:
        out = self.store.with_retries("put_part", self.key, lambda: self.store.fs.call_s3(
            "upload_part", Bucket=self.bucket, Key=self.s3_key, UploadId=self.upload_id, PartNumber=number,
            Body=ViewsReader(views)))
        return {"PartNumber": number, "ETag": out["ETag"]}

    def _finish_parts(self) -> None:
        """Wait for every part; the first failure is raised."""
        self.parts = [f.result() for f in self._sending]
        self._close_pool()

    def _close_pool(self) -> None:
        for f in self._sending:
            f.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def complete(self) -> None:
        """CompleteMultipartUpload, idempotent: when an attempt fails after an earlier one (whose response was
        lost, e.g. a read timeout on a large upload) already completed it, S3 answers ``NoSuchUpload``; the
        object's ETag then tells whether it is exactly ours (the multipart ETag is derived from the parts')."""

        self._finish_parts()

        def attempt() -> None:
            try:
                self.store.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.s3_key,
                                      UploadId=self.upload_id, MultipartUpload={"Parts": self.parts})
            except Exception:
                if not self._landed():
                    raise

        self.store.with_retries("complete_multipart", self.key, attempt)
        self.upload_id = None  # completed: nothing to abort
        self.store.invalidate(self.store.path(self.key))

    def _landed(self) -> bool:
        """Whether the object at our key is the one this upload's parts make (its multipart ETag matches)."""
        try:
            head = self.store.fs.call_s3("head_object", Bucket=self.bucket, Key=self.s3_key)
        except Exception:  # noqa: BLE001 - unknown counts as "not ours": the caller re-raises its own error
            return False
        return str(head.get("ETag", "")).strip('"') == multipart_etag([p["ETag"] for p in self.parts])

    def abort(self) -> None:
        """Best effort: parts of an aborted upload are never visible, only billed until S3's lifecycle rules."""
        self._close_pool()  # parts still queued are dropped; those being sent finish first
        if self.upload_id is None:
            return
        try:
            self.store.traffic_counter.request("abort_multipart")
            self.store.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.s3_key,
                                  UploadId=self.upload_id)
        except Exception:  # noqa: BLE001 - the original error is the one worth raising
            pass
        self.upload_id = None


def read_range(fs: Any, path: str, start: int, end: int) -> bytearray:
    """Bytes ``[start, end)`` of the object at ``path`` (``bucket/key``) in one ranged GET, read into a
    preallocated buffer; shorter if the object ends first, empty at or past its end. A body cut short raises
    botocore's ``IncompleteReadError`` (transient: the store retries it)."""
    made: list[bytearray] = []

    def buffer(length: int) -> memoryview:
        made.append(bytearray(length))
        return memoryview(made[0])

    _read_range(fs, path, start, end, buffer)
    return made[0] if made else bytearray()


def object_exists(fs: Any, path: str) -> bool:
    """Whether an object is at ``path``: one HeadObject, a 404 meaning no. s3fs's ``info`` and ``exists`` follow a
    404 with a ListObjectsV2 (to tell a missing key from a directory), which doubles a miss's latency and is billed
    at the PUT rate, 12.5 HEADs; a key diloco asks about is an object's, never a directory's, so the 404 says
    enough. Other errors (a 403: no ``s3:GetObject``, or a missing key without ``s3:ListBucket``) are raised as
    s3fs translates them."""
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(path)

    async def head() -> bool:
        try:
            await fs._call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False
        return True

    return bool(sync(fs.loop, head))


def check_bucket(fs: Any, path: str) -> None:
    """``FileNotFoundError`` (S3's ``NoSuchBucket``, as ``is_missing_bucket`` reads it) unless the bucket of
    ``path`` exists: one HeadBucket. A HEAD of a key answers a missing bucket with the same bodiless 404 as a
    missing key, so ``object_exists`` alone would take a misnamed bucket for an object not written yet."""
    from fsspec.asyn import sync

    bucket, _, _ = fs.split_path(path)

    async def head() -> None:
        try:
            await fs._call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"NoSuchBucket: The {_MISSING_BUCKET_TEXT}: {bucket}") from exc

    sync(fs.loop, head)


def read_range_into(fs: Any, path: str, start: int, into: memoryview) -> int:
    """``read_range`` of ``len(into)`` bytes from ``start``, into ``into``; -> how many arrived (fewer when the
    object ends first, 0 at or past its end)."""
    return _read_range(fs, path, start, start + len(into), lambda length: into[:length])


def _read_range(fs: Any, path: str, start: int, end: int, buffer: Callable[[int], memoryview]) -> int:
    """One ranged GET of ``[start, end)``, its body read into ``buffer(length)`` (the length S3 answers with);
    -> the bytes read (0 at or past the end)."""
    from fsspec.asyn import sync

    if end <= start:
        return 0
    bucket, key, _ = fs.split_path(path)

    async def read() -> int:
        try:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # 416 InvalidRange: the range starts at or past the end
                return 0
            raise
        body = resp["Body"]
        try:
            length = int(resp.get("ContentLength", end - start))
            if length > end - start:
                raise OSError(errno.EIO, f"S3 answered {length} bytes for a range of {end - start}")
            view = buffer(length)
            pos = 0
            while pos < length:
                n = await body.readinto(view[pos : pos + _READ_PIECE])
                if not n:
                    break
                pos += n
            del view
        finally:
            body.close()
        if pos != length:
            from botocore.exceptions import IncompleteReadError

            raise IncompleteReadError(actual_bytes=pos, expected_bytes=length)
        return pos

    return int(sync(fs.loop, read))
