"""The object store: a few operations over one URI prefix, implemented once on fsspec.

Replicas never talk to each other; everything they share goes through here. The semantics every caller relies on:

* ``put`` is atomic: a reader sees the whole object or nothing (temp file + rename on local disks, a single PUT
  per key on S3, a dict assignment in ``memory://``).
* ``put_if_absent`` creates a key exactly once across all writers (``If-None-Match: *`` on S3, a hard link on
  local disks) and reports whether this caller won.
* ``exists``/``list`` never answer from a stale listing cache: polling for a peer's object must see it as soon as
  the store does. ``exists`` treats only "not found" as missing; a denied request or a dead endpoint raises, so an
  authentication failure never looks like a slow peer.
* ``put_stream`` is atomic like ``put`` but never joins the object into one buffer: a temp file + rename on local
  disks, and on S3 one PUT when the object fits in one part, else a multipart upload whose parts are sent as they
  fill (the object appears at ``CompleteMultipartUpload``). ``get_range`` reads a byte range (one ranged GET) into one
  preallocated buffer, so reading a range never costs twice its size in memory.
* Every store instance counts its own traffic (``traffic``: bytes written and read, requests per operation, every
  attempt and every multipart part counted where it is made), so a benchmark can subtract two snapshots and see
  exactly what one round cost, without trusting a formula.
* Transient failures (throttling, dropped connections, timeouts) are retried a bounded number of times with
  exponential backoff and jitter; then a ``StoreError`` naming the key and the operation is raised. (On S3 this
  loop sits on top of botocore's per-request retries; ``diloco/store/s3.py`` documents the total bound.)

Keys are ``/``-separated paths relative to the store's root URI. Objects whose basename starts with ``.`` are
in-flight temporaries and are never listed.
"""

from __future__ import annotations

import errno
import io
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from diloco.errors import ObjectNotFound, StoreError
from diloco.store.s3 import Chunk  # what put_stream accepts; the module is light (boto and s3fs load lazily)

T = TypeVar("T")

#: ``memory://`` is one dict shared by the whole process; its exists-then-write is not atomic between threads.
_MEMORY_CREATE_LOCK = threading.Lock()

#: OS errors that will not go away by waiting (a read-only filesystem, a full disk, a name too long).
_PERMANENT_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EACCES, errno.ENAMETOOLONG, errno.EDQUOT})

#: Errors that say "the answer is no", not "try again": they are never retried.
_PERMANENT: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
)


#: The pieces a local read is done in (``readinto``): bounded, so a huge range never needs a second buffer.
_READ_PIECE = 8 * 2**20



@dataclass(frozen=True)
class StoreTraffic:
    """What one ``ObjectStore`` instance sent and received: bytes of object data and requests per operation.

    Counted where each request is made (every retry attempt and every multipart part is a request), so a round's
    cost is measured, not computed. Subtract two snapshots (``after - before``) for the cost of what happened
    between them. Operation names: ``put``, ``put_if_absent``, ``get``, ``get_range``, ``size``, ``exists``,
    ``list``, ``delete``, and for streamed S3 uploads ``create_multipart``, ``put_part``, ``complete_multipart``,
    ``abort_multipart``. On S3 ``size`` and ``exists`` are a HEAD each; a ``size`` of a missing key is also a
    ``miss_list``: s3fs follows the 404 with a ListObjectsV2 (``MaxKeys=1``) to tell a missing key from a
    directory (``S3FileSystem._info``), a request billed at the PUT rate. ``exists`` asks with one HEAD whatever
    the answer (``diloco.store.s3.object_exists``), and the first time a store instance finds nothing, with one
    ``head_bucket`` too (a missing bucket answers a HEAD of a key as a missing key does)."""

    bytes_written: int = 0
    bytes_read: int = 0
    requests: Mapping[str, int] = field(default_factory=dict)

    @property
    def total_requests(self) -> int:
        """All requests, whatever the operation."""
        return sum(self.requests.values())

    def __sub__(self, other: StoreTraffic) -> StoreTraffic:
        names = set(self.requests) | set(other.requests)
        diff = {n: self.requests.get(n, 0) - other.requests.get(n, 0) for n in sorted(names)}
        return StoreTraffic(self.bytes_written - other.bytes_written, self.bytes_read - other.bytes_read,
                            {n: v for n, v in diff.items() if v})


class _TrafficCounter:
    """The mutable, thread-safe tally behind ``ObjectStore.traffic`` (uploads run on background threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._written = 0
        self._read = 0
        self._requests: dict[str, int] = {}

    def request(self, op: str, n: int = 1) -> None:
        with self._lock:
            self._requests[op] = self._requests.get(op, 0) + n

    def wrote(self, nbytes: int) -> None:
        with self._lock:
            self._written += nbytes

    def read(self, nbytes: int) -> None:
        with self._lock:
            self._read += nbytes

    def snapshot(self) -> StoreTraffic:
        with self._lock:
            return StoreTraffic(self._written, self._read, dict(sorted(self._requests.items())))


def split_uri(uri: str) -> tuple[str, str]:
    """``"s3://b/p"`` -> ``("s3", "b/p")``; a bare path is a local path (``file``)."""
    if "://" not in uri:
        return "file", os.path.abspath(uri)
    protocol, rest = uri.split("://", 1)
    if protocol == "file":
        rest = os.path.abspath(rest) if rest else "/"
    return protocol, rest


#: The S3 filesystems of this process, by settings (see ``_filesystem``), the most recently made last; the lock
#: makes one of each. At most ``_S3_FILESYSTEMS_KEPT`` are kept: a store keeps its own alive as long as it lives.
_S3_FILESYSTEMS: dict[tuple[int, str, tuple[tuple[str, str], ...]], fsspec.AbstractFileSystem] = {}
_S3_FILESYSTEMS_LOCK = threading.Lock()
_S3_FILESYSTEMS_KEPT = 16


def _filesystem(protocol: str, storage_options: dict[str, Any]) -> fsspec.AbstractFileSystem:
    """A filesystem that never serves a stale listing and is not shared through fsspec's instance cache (code
    beside ours, with a listings cache on, would share it).

    The stores of one process on S3 share one filesystem per settings: its botocore client costs 100-300 ms of
    CPU to build (service model, endpoint rules), ten times a request, and a launcher, a waiting command or a
    replica opens several stores on one bucket. The settings are the options and every ``AWS_*`` variable (what
    botocore reads when it builds the client: endpoint, credentials, region, profile); the process id too, since a
    forked child must not use its parent's connections. A filesystem for other settings still builds its own
    client, but on the process's decoded botocore data (``diloco.store.aws_data``)."""
    options = dict(storage_options)
    if protocol == "s3":
        from diloco.store.s3 import s3_storage_options  # lazy: boto/s3fs only when an s3:// URI is used

        options = {**s3_storage_options(), **options}
    options.setdefault("skip_instance_cache", True)
    if protocol not in ("file", "memory"):
        options.setdefault("use_listings_cache", False)
    try:
        if protocol == "s3":
            return _s3_filesystem(options)
        return fsspec.filesystem(protocol, **options)
    except ImportError as exc:  # fsspec names the missing package; add our extra
        raise StoreError(
            f"the {protocol}:// store needs an optional dependency: {exc}",
            hint="pip install 'diloco[aws]'" if protocol == "s3" else None,
        ) from exc


def _s3_filesystem(options: dict[str, Any]) -> fsspec.AbstractFileSystem:
    """This process's S3 filesystem for ``options`` and the ``AWS_*`` environment, made on first use."""
    import json

    from diloco.store.aws_data import aio_session
    from diloco.store.s3 import configure_filesystem

    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    key = (os.getpid(), json.dumps(options, sort_keys=True, default=repr), environment)
    with _S3_FILESYSTEMS_LOCK:
        fs = _S3_FILESYSTEMS.get(key)
        if fs is None:
            fs = fsspec.filesystem("s3", **options)
            configure_filesystem(fs)
            if fs.session is None:  # s3fs would make its session with the kwargs it kept; ours shares the loader
                fs.session = aio_session(**fs.kwargs)
            _S3_FILESYSTEMS[key] = fs
            while len(_S3_FILESYSTEMS) > _S3_FILESYSTEMS_KEPT:
                del _S3_FILESYSTEMS[next(iter(_S3_FILESYSTEMS))]
        return fs


class ObjectStore:
    """Atomic, retried byte objects under one root URI (``file://``, ``memory://``, ``s3://``)."""

    def __init__(
        self,
        uri: str,
        *,
        retries: int = 5,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.uri = uri.rstrip("/")
        self.protocol, self._root = split_uri(self.uri)
        self._root = self._root.rstrip("/") or "/"
        if self.protocol == "memory":  # fsspec's memory paths always start with "/"
            self._root = "/" + self._root.lstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._storage_options = dict(storage_options or {})
        options = dict(self._storage_options)
        # S3 only (diloco/store/s3.py): extra transient error types, clearer permanent errors, multipart part size.
        self._transient: tuple[type[BaseException], ...] = (OSError, ConnectionError, TimeoutError)
        self.put_kwargs: dict[str, Any] = {}
        if self.protocol == "s3":
            from diloco.store import s3

            self._transient += s3.transient_errors()
            self.put_kwargs = s3.pop_put_kwargs(options)
        self.fs = _filesystem(self.protocol, options)
        self._bucket_seen = False  # S3: the bucket answered a HeadBucket once (``exists``)
        self._local = isinstance(self.fs, LocalFileSystem)
        #: Public, with ``put_kwargs``, ``with_retries`` and ``invalidate``: ``diloco.store.s3``'s upload paths count,
        #: size, retry and invalidate through the same store instance.
        self.traffic_counter = _TrafficCounter()

    @property
    def traffic(self) -> StoreTraffic:
        """A snapshot of this instance's traffic so far (see ``StoreTraffic``)."""
        return self.traffic_counter.snapshot()

    # ---------------------------------------------------------------- paths
    def path(self, key: str) -> str:
        """The filesystem path of ``key`` (no protocol)."""
        key = key.strip("/")
        return f"{self._root}/{key}" if key else self._root

    def url(self, key: str = "") -> str:
        """The full URI of ``key``, for messages and for handing to other processes."""
        key = key.strip("/")
        return f"{self.uri}/{key}" if key else self.uri

    def child(self, prefix: str) -> ObjectStore:
        """A store rooted at ``prefix`` under this one, with its settings (on S3 its filesystem too: ``_filesystem``)."""
        return ObjectStore(self.url(prefix), retries=self.retries, backoff_s=self.backoff_s,
                           max_backoff_s=self.max_backoff_s, storage_options=self._storage_options)

    # ---------------------------------------------------------------- retries
    def with_retries(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn``; retry transient errors with capped exponential backoff and full jitter."""
        attempt = 0
        while True:
            try:
                self.traffic_counter.request(op)
                return fn()
            except _PERMANENT as exc:
                self._raise_explained(op, key, exc)
            except self._transient as exc:
                if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
                    self._raise_explained(op, key, exc)
                if attempt >= self.retries:
                    raise StoreError(f"{op} {self.url(key)} failed after {attempt + 1} attempt(s): "
                                     f"{self._describe(exc)}") from exc
                delay = min(self.max_backoff_s, self.backoff_s * (2**attempt))
                time.sleep(random.uniform(0, delay) + delay / 2)
                attempt += 1
            except Exception as exc:  # neither, e.g. botocore's NoCredentialsError: permanent
                self._raise_explained(op, key, exc)

    def _raise_explained(self, op: str, key: str, exc: BaseException) -> NoReturn:
        """Re-raise a permanent error, as a clearer ``StoreError`` where the backend can say more (S3: 403,
        missing bucket, no credentials), so a denied or misnamed bucket never reads as "not written yet"."""
        better = self._explain(op, key, exc)
        if better is not None:
            raise better from exc
        raise exc

    def _describe(self, exc: BaseException) -> str:
        if self.protocol == "s3":
            from diloco.store.s3 import describe_error

            return describe_error(exc)
        return f"{type(exc).__name__}: {exc}"

    def _explain(self, op: str, key: str, exc: BaseException) -> BaseException | None:
        if self.protocol != "s3":
            return None
        from diloco.store.s3 import explain_error

        return explain_error(op, self.url(key), exc)

    def invalidate(self, path: str) -> None:
        """Drop the filesystem's cached listing of ``path``: called after a write that went around ``fs`` (the S3
        conditional create and multipart upload in ``diloco.store.s3``), so the next read sees it."""
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # noqa: BLE001 - a cache that cannot be cleared is not an error
            pass

    # ---------------------------------------------------------------- operations
    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` atomically (overwrites)."""
        path = self.path(key)
        if self._local:
            self.with_retries("put", key, lambda: write_file_atomic(path, data))
        elif self.protocol == "s3" and len(data) >= 2 * self.put_kwargs["chunksize"]:
            # Above s3fs's own threshold: the same multipart sequence, but the parts are views of ``data`` (s3fs
            # copies up to 10 parts at once, and botocore copies a bytes body again), and every part is counted.
            from diloco.store import s3

            s3.put_stream(self, key, [data], single_put_max=0)
            return
        else:
            self.with_retries("put", key, lambda: self.fs.pipe_file(path, data, **self.put_kwargs))
        self.traffic_counter.wrote(len(data))

    def put_stream(self, key: str, chunks: Iterable[Chunk], size: int | None = None) -> int:
        """Write the concatenation of ``chunks`` at ``key`` atomically, without ever holding all of it; -> bytes.

        Local disks: a temp file (fsync) renamed into place. S3: one PUT if everything fits in one part, else a
        multipart upload whose parts (``multipart_chunksize`` bytes) are sent as they fill, a few at a time, as
        views of the chunks themselves (no copy: a producer must not reuse a buffer it yielded), and the object
        becomes visible only when the upload completes (an upload that fails is aborted). ``size``, when given,
        is checked against what ``chunks`` held (a mismatch is a ``ValueError`` and nothing is published).
        ``chunks`` is consumed once, so a failure half way is raised, not retried from the start (S3 parts are
        retried individually)."""
        if self._local:
            written = self._write_local_stream(key, _size_checked(chunks, size, self.url(key)))
        elif self.protocol == "s3":
            from diloco.store import s3

            written = s3.put_stream(self, key, chunks, expected_size=size)
            return written
        else:  # memory:// holds whole objects anyway
            data = b"".join(bytes(c) for c in chunks)
            _checked_size(len(data), size, self.url(key))
            self.with_retries("put", key, lambda: self.fs.pipe_file(self.path(key), data))
            written = len(data)
        self.traffic_counter.wrote(written)
        return written

    def _write_local_stream(self, key: str, chunks: Iterable[Chunk]) -> int:
        """One attempt (an iterator cannot be replayed): temp file, fsync, then rename (``write_file_atomic``)."""
        path = self.path(key)
        self.traffic_counter.request("put")
        try:
            return write_file_atomic(path, chunks)
        except _PERMANENT as exc:
            self._raise_explained("put", key, exc)
        except OSError as exc:
            raise StoreError(f"put {self.url(key)} failed: {self._describe(exc)}") from exc

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if no writer created it before; ``True`` if this call created it.

        On S3 a create whose response was lost is retried and then meets its own object (412): it counts as ours
        when the object holds exactly our bytes, so give each writer a distinct payload (e.g. its id) when the
        answer elects one of them."""
        path = self.path(key)

        def create() -> bool:
            try:
                if self._local:
                    write_file_atomic(path, data, exclusive=True)
                elif self.protocol == "memory":
                    with _MEMORY_CREATE_LOCK:
                        if self.fs.exists(path):
                            return False
                        self.fs.pipe_file(path, data)
                else:
                    self.fs.pipe_file(path, data, mode="create", **self.put_kwargs)
            except FileExistsError:
                # On S3 an earlier attempt (ours, or botocore's own retry) may have landed before its response
                # was lost: the object is ours if it holds exactly our bytes (see the docstring).
                return (self.protocol == "s3" and self.fs.info(path).get("size") == len(data)
                        and self.fs.cat_file(path) == data)
            return True

        created = self.with_retries("put_if_absent", key, create)
        if created:
            self.traffic_counter.wrote(len(data))
        return created

    def get(self, key: str) -> bytes:
        """The bytes of ``key``; ``ObjectNotFound`` if it does not exist."""
        path = self.path(key)
        try:
            data = self.with_retries("get", key, lambda: self.fs.cat_file(path))
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object at {self.url(key)}") from exc
        self.traffic_counter.read(len(data))
        return data

    def get_range(self, key: str, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` of ``key`` in one request (shorter if the object ends first; empty past its
        end), read into one preallocated, writable buffer; ``ObjectNotFound`` if ``key`` does not exist.

        A ``bytearray`` rather than ``bytes``: it compares equal to bytes and is writable, so
        ``torch.frombuffer`` can view it without a copy or a warning."""
        if start < 0 or end < start:
            raise ValueError(f"get_range {self.url(key)}: invalid range [{start}, {end})")
        path = self.path(key)
        if self._local:
            read: Callable[[], bytearray] = lambda: _read_local_range(path, start, end)  # noqa: E731
        elif self.protocol == "s3":
            from diloco.store import s3

            read = lambda: s3.read_range(self.fs, path, start, end)  # noqa: E731
        else:
            read = lambda: bytearray(self.fs.cat_file(path, start=start, end=end) if end > start else b"")  # noqa: E731
        try:
            data = self.with_retries("get_range", key, read)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object at {self.url(key)}") from exc
        self.traffic_counter.read(len(data))
        return data

    def get_range_into(self, key: str, start: int, into: bytearray | memoryview) -> int:
        """Bytes ``[start, start + len(into))`` of ``key`` in one request (counted as a ``get_range``), read into
        the writable buffer ``into``; -> how many (fewer if the object ends first, 0 past its end).
        ``ObjectNotFound`` if ``key`` does not exist. For a reader of many ranges (a round reading its peers): one
        buffer reused, where a fresh one per read costs a page fault per 4 KiB, more than the copy itself."""
        view = memoryview(into).cast("B")
        if start < 0:
            raise ValueError(f"get_range_into {self.url(key)}: invalid start {start}")
        path = self.path(key)
        if self._local:
            read: Callable[[], int] = lambda: _read_local_into(path, start, view)  # noqa: E731
        elif self.protocol == "s3":
            from diloco.store import s3

            read = lambda: s3.read_range_into(self.fs, path, start, view)  # noqa: E731
        else:
            def read() -> int:
                data = self.fs.cat_file(path, start=start, end=start + len(view)) if len(view) else b""
                view[: len(data)] = data
                return len(data)
        try:
            n = self.with_retries("get_range", key, read)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object at {self.url(key)}") from exc
        self.traffic_counter.read(n)
        return n

    def size(self, key: str) -> int:
        """The size of ``key`` in bytes (one HEAD on S3); ``ObjectNotFound`` if it does not exist."""
        path = self.path(key)

        def info() -> int:
            self.invalidate(path)
            try:
                found = self.fs.info(path)
            except FileNotFoundError:
                self._count_miss_list()
                raise
            if found.get("type") == "directory":
                self._count_miss_list()
                raise FileNotFoundError(path)
            return int(found["size"])

        try:
            return self.with_retries("size", key, info)
        except FileNotFoundError as exc:
            if (better := self._explain("size", key, exc)) is not None:
                raise better from exc
            raise ObjectNotFound(f"no object at {self.url(key)}") from exc

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists now, asked of the store itself (never of a cached listing): on S3 one HEAD
        (``diloco.store.s3.object_exists``: no ListObjectsV2 after a 404), which is what a waiting replica polls."""
        path = self.path(key)
        if self.protocol == "s3":
            from diloco.store import s3

            def head() -> bool:
                found = s3.object_exists(self.fs, path)
                if not found and not self._bucket_seen:  # a misnamed bucket must not read as "not written yet"
                    self.traffic_counter.request("head_bucket")
                    s3.check_bucket(self.fs, path)
                    self._bucket_seen = True
                return found

            return self.with_retries("exists", key, head)

        def probe() -> bool:
            self.invalidate(path)
            try:
                info = self.fs.info(path)
            except FileNotFoundError:
                return False
            return info.get("type") != "directory"

        return self.with_retries("exists", key, probe)

    def _count_miss_list(self) -> None:
        """A HEAD that found no object was followed by s3fs's ListObjectsV2 (``S3FileSystem._info``): count it."""
        if self.protocol == "s3":
            self.traffic_counter.request("miss_list")

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` (recursive), relative to the root, sorted; temporaries excluded."""
        base = self.path(prefix)

        def find() -> list[str]:
            self.invalidate(base)
            try:
                paths: Iterable[str] = self.fs.find(base)
            except FileNotFoundError as exc:
                if (better := self._explain("list", prefix, exc)) is not None:
                    raise better from exc
                return []
            return list(paths)

        root = self._root.rstrip("/") + "/"
        keys = []
        for p in self.with_retries("list", prefix, find):
            if self.protocol == "memory":
                p = "/" + p.lstrip("/")
            rel = p[len(root):] if p.startswith(root) else p
            if not os.path.basename(rel).startswith("."):
                keys.append(rel)
        return sorted(keys)

    def delete(self, key: str) -> None:
        """Delete one object; missing is fine (deletion is idempotent)."""
        path = self.path(key)

        def rm() -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self.with_retries("delete", key, rm)

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix`` (and the prefix itself on local disks)."""
        for key in self.list(prefix):
            self.delete(key)
        if self._local:
            path = self.path(prefix)
            if os.path.isdir(path):
                import shutil

                shutil.rmtree(path, ignore_errors=True)


def probe_conditional_create(store: ObjectStore, key: str) -> tuple[bool, str]:
    """Whether ``store`` really creates a key only once (what ``put_if_absent`` promises: ``If-None-Match: *`` on
    S3, which some S3-compatible stores accept and ignore): create ``key`` twice with different bytes and read it
    back. Returns ``(honoured, detail)``; ``key`` is deleted afterwards however it ends; store errors propagate.
    Three requests and a delete: cheap enough to run before every launch that relies on it."""
    mine = f"first {uuid.uuid4().hex}".encode()
    try:
        first = store.put_if_absent(key, mine)
        second = store.put_if_absent(key, b"second")
        kept = store.get(key)
    finally:
        try:
            store.delete(key)
        except Exception:  # noqa: BLE001 - the answer (or the error above) matters more than this probe key
            pass
    if first and not second and kept == mine:
        return True, "If-None-Match: * honoured"
    return False, (f"If-None-Match: * not honoured (first create {first}, second {second}, "
                   f"{'the first' if kept == mine else 'the second'} write kept)")


def _checked_size(written: int, expected: int | None, url: str) -> int:
    if expected is not None and written != expected:
        raise ValueError(f"put_stream {url}: the chunks held {written} bytes, but size={expected} was promised")
    return written


def _size_checked(chunks: Iterable[Chunk], expected: int | None, url: str) -> Iterable[Chunk]:
    """``chunks``, raising at their end (before anything is published) when they did not hold ``expected`` bytes."""
    total = 0
    for chunk in chunks:
        total += memoryview(chunk).nbytes
        yield chunk
    _checked_size(total, expected, url)


def _read_local_range(path: str, start: int, end: int) -> bytearray:
    """``[start, end)`` of a local file into one buffer, in bounded ``readinto`` pieces."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(max(0, min(end, size) - start))
        n = _read_open_into(f, start, memoryview(buf))
    if n < len(buf):  # the file shrank under us (it never does: objects are replaced by rename)
        del buf[n:]
    return buf


def _read_local_into(path: str, start: int, view: memoryview) -> int:
    """``[start, start + len(view))`` of a local file into ``view``; -> bytes read (fewer at the file's end)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return _read_open_into(f, start, view[: max(0, min(len(view), size - start))])


def _read_open_into(f: io.BufferedReader, start: int, view: memoryview) -> int:
    """Fill ``view`` from ``start`` of the open file ``f`` in bounded ``readinto`` pieces; -> bytes read."""
    if not len(view):
        return 0
    f.seek(start)
    pos = 0
    while pos < len(view):
        n = f.readinto(view[pos : pos + _READ_PIECE])
        if not n:
            break
        pos += n
    return pos


def write_file_atomic(path: str, data: bytes | Iterable[Chunk], *, exclusive: bool = False) -> int:
    """Write a local file so a reader sees all of it or nothing: a temp file in the same directory (created with
    its parents), fsync, then rename; ``exclusive`` hard-links instead and raises ``FileExistsError`` if ``path``
    exists. ``data`` may be bytes or an iterable of chunks (written one by one, never joined). -> bytes written."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    written = 0
    try:
        with open(tmp, "wb") as f:
            pieces: Iterable[Chunk] = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
            for piece in pieces:
                written += f.write(piece)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        if exclusive:
            try:
                os.link(tmp, path)
            except OSError as exc:
                if exc.errno == errno.EEXIST:
                    raise FileExistsError(path) from exc
                raise
        else:
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return written
