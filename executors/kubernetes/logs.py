"""One replica's log on Kubernetes: every attempt's pod log read incrementally, and the replica's own shipped copy
(``diloco.store.logs``) for whatever the kubelet can no longer serve.

What real kubelets do, and what this reader does about it:

* **Reads from a time, inclusive, in whole seconds.** A read asks only for the lines since shortly before the last
  line read (``sinceSeconds``, from the API server's clock in its ``Date`` header, so this machine's clock does
  not matter). The kubelet keeps every line at or after that second (``pkg/kubelet/kuberuntime/logs/logs.go``
  skips only lines *before* ``since``; the API server passes a ``sinceTime`` on to the kubelet as RFC 3339 without
  fractional seconds, ``apimachinery`` ``metav1.Time.MarshalQueryParameter``), so the lines up to and at the
  last nanosecond read come again and are dropped (``_Boundary``): nothing is downloaded twice beyond that overlap,
  and no line is dropped by position.
* **Rotates the log** (``containerLogMaxSize``, 10 MiB by default) and serves only the current file, so a re-read
  after a rotation is shorter. Reading from a time never skips a line written after the rotation. When a read no
  longer holds the last line read, the lines between it and the first line of the new file were rotated away
  before they were read: they come from the replica's shipped log when it has them, otherwise one line says what
  is missing.
* **Cannot answer while the node is NotReady** (a spot reclaim, a lost node): the API server's proxy answers 5xx
  or times out. Such a read is retried with a capped backoff and ``logs -f`` keeps following (one line says the
  node does not answer); the replica's shipped lines fill in meanwhile, and once the pod is gone.
* **Deletes the log with the pod** (a cancel, the Job failing fast, its TTL): the shipped log has it.

Following streams the latest attempt while it runs, with a read timeout, so a stream that goes silent (a node
gone, a proxy that never closes) is re-opened from its last line instead of hanging; the replica's state is read
from one Job GET and one pod LIST per round, and the follow ends once the replica is terminal and its last lines
are read.
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from diloco.errors import BackendError
from diloco.executors.base import LogRecord
from diloco.executors.kubernetes.api import _lines, _status_of
from diloco.executors.kubernetes.config import CONTAINER, TIMEOUT, KubernetesRunHandle
from diloco.executors.kubernetes.pods import _Boundary, _PodLog, parse_time, split_log_line
from diloco.store.logs import FLUSH_EVERY_S

if TYPE_CHECKING:
    from diloco.store.logs import ShippedAttempt


class ReplicaLogSource(Protocol):
    """What the reader asks of the cluster (``diloco.executors.kubernetes.backend.KubernetesBackend`` answers):
    declared here, so that this module, which the backend imports, does not import the backend back."""

    @property
    def log_poll_interval_s(self) -> float: ...

    def observe_replica(self, handle: KubernetesRunHandle, index: int, *,
                        with_state: bool) -> tuple[dict[str, Any] | None, list[dict[str, Any]], bool]:
        """(the Job or None when it is gone, the replica's pods in attempt order, whether the replica is
        terminal: asked only ``with_state``)."""

    def read_pod_log(self, name: str, namespace: str, **options: Any) -> Any: ...

    def pod_events(self, handle: KubernetesRunHandle, rank: int, pod: dict[str, Any],
                   log: _PodLog) -> Iterator[None]: ...

    def api_error(self, exc: BaseException, what: str) -> BackendError: ...

#: How far before the last line read a read starts: the kubelet's whole-second ``since`` plus the ``Date``
#: header's second and some clock difference between the API server and the node.
OVERLAP_S = 3.0
#: A followed stream with nothing new for this long is closed and re-opened (a node that stopped answering).
STREAM_IDLE_S = 20.0
#: The longest wait between reads of a pod whose kubelet does not answer.
MAX_BACKOFF_S = 30.0


def _transient(exc: BaseException) -> bool:
    """A failure the next try may not have: 5xx, 429, a timeout, a dropped connection (not 4xx, not auth)."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status > 0:
        return status >= 500 or status == 429
    import urllib3

    return isinstance(exc, (urllib3.exceptions.HTTPError, OSError, TimeoutError))


class ReplicaLogReader:
    """The records of one replica, every attempt in order; ``records(follow)`` yields them once each.

    ``index`` is the replica's index in its Job (its pods'); ``rank`` its global rank, which its records carry and
    its shipped log is kept under (the same unless the Job runs one part of a run split over backends)."""

    def __init__(self, backend: ReplicaLogSource, handle: KubernetesRunHandle, index: int,
                 history: dict[str, _PodLog]) -> None:
        self.backend, self.handle, self.index = backend, handle, index
        self.rank = index + handle.own_ranks[0]
        self.history = history  # pod (attempt) name -> what was read of it, shared by calls in one process
        self.sent: dict[str, int] = {}
        self.server_offset = 0.0  # the API server's clock minus this machine's, from the last Date header
        self.shipped: dict[str, ShippedAttempt] = {}
        self._store: Any = None
        self.job_gone = False

    # ------------------------------------------------------------------ the loop
    def records(self, *, follow: bool, since: float | None) -> Iterator[LogRecord]:
        outage = 0
        while True:
            try:
                done, pods = self._observe(follow)
            except BackendError as exc:  # the API server did not answer: follow on, or make do with the store
                status = _status_of(exc)
                if status is not None and status < 500 and status != 429:
                    raise  # refused (RBAC, a missing namespace): the one-line error says what to fix
                before = sum(self.sent.values())
                yield from self._from_store_only(since)
                if not follow:
                    if sum(self.sent.values()) == before:
                        raise
                    return
                outage += 1
                if outage == 1:
                    yield LogRecord(self._cluster_now(), self.rank, "err", f"[diloco] {exc}; retrying")
                time.sleep(min(MAX_BACKOFF_S, self.backend.log_poll_interval_s * 2 ** outage))
                continue
            outage = 0
            stream_latest = follow and not done
            for pod in pods:
                self.history.setdefault(pod["metadata"]["name"], _PodLog())
            current = {pod["metadata"]["name"]: pod for pod in pods}
            self._add_shipped_attempts(pods, need=not pods or any(
                name not in current or log.failures for name, log in self.history.items()))
            for name in self._attempt_order():
                log = self.history[name]
                pod = current.get(name)
                if pod is not None and not log.complete:
                    latest = bool(pods) and pod is pods[-1]
                    for _ in self._read_pod(pod, log, stream=stream_latest and latest, done=done):
                        yield from self._unsent(name, log, since)
                if pod is None or log.failures:
                    self._fill_from_store(name, log)
                yield from self._unsent(name, log, since)
            if done:
                yield from self._explain_empty()
                return
            time.sleep(self.backend.log_poll_interval_s)

    def _observe(self, follow: bool) -> tuple[bool, list[dict[str, Any]]]:
        """Whether the replica is terminal, and its pods in attempt order (one Job GET, one pod LIST)."""
        job, pods, terminal = self.backend.observe_replica(self.handle, self.index, with_state=follow)
        if job is None:
            self.job_gone = True
            return True, []
        return (terminal if follow else True), pods

    def _attempt_order(self) -> list[str]:
        """The attempts by when they started (a pod's creation, a shipped attempt's first line)."""
        def start(name: str) -> tuple[float, str]:
            log = self.history[name]
            shipped = self.shipped.get(name)
            first = log.started_at or (shipped.started_at if shipped else None) or (
                log.records[0].ts if log.records else math.inf)
            return first, name
        return sorted(self.history, key=start)

    def _unsent(self, name: str, log: _PodLog, since: float | None) -> Iterator[LogRecord]:
        start = self.sent.get(name, 0)
        self.sent[name] = len(log.records)
        for record in log.records[start:]:
            if since is None or record.ts >= since:
                yield record

    # ------------------------------------------------------------------ the kubelet
    def _since_seconds(self, log: _PodLog) -> int | None:
        if log.last_ns is None:
            return None
        server_now = time.time() + self.server_offset
        return max(1, math.ceil(server_now - log.last_ns / 1e9 + OVERLAP_S))

    def _read_pod(self, pod: dict[str, Any], log: _PodLog, *, stream: bool, done: bool) -> Iterator[None]:
        """Append the pod's new lines (or, without a log yet, its new events) to ``log``; yields after each, so a
        followed stream is passed on line by line. A pod that had ended before this read is complete after it."""
        from kubernetes.client.rest import ApiException

        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        ended = status.get("phase") in ("Succeeded", "Failed")
        if log.started_at is None:
            log.started_at = parse_time(pod["metadata"].get("creationTimestamp"))
        if log.retry_at > time.monotonic():
            return
        stream = stream and status.get("phase") == "Running"
        options: dict[str, Any] = {"container": CONTAINER, "timestamps": True,
                                   "_request_timeout": (TIMEOUT[0], STREAM_IDLE_S) if stream else TIMEOUT}
        since_seconds = self._since_seconds(log)
        if since_seconds is not None:
            options["since_seconds"] = since_seconds
        try:
            response = self.backend.read_pod_log(name, self.handle.namespace, follow=stream,
                                                 _preload_content=False, **options)
        except ApiException as exc:
            if exc.status == 400:  # no log yet (pending, pulling its image): say why instead
                yield from self.backend.pod_events(self.handle, self.rank, pod, log)
            elif exc.status == 404:
                log.complete = True  # the pod is gone: its shipped log stands in
            elif _transient(exc):
                yield from self._unreachable(name, log, exc)
            else:
                raise self._log_error(exc, name) from exc
            return
        except Exception as exc:  # noqa: BLE001 - the API server could not be reached this time
            if not _transient(exc):
                raise self._log_error(exc, name) from exc
            yield from self._unreachable(name, log, exc)
            return
        self._note_server_clock(response)
        boundary = _Boundary(log)
        try:
            for line in _lines(response):
                ns, text = split_log_line(line)
                if ns is None:
                    ns = max(int(self._cluster_now() * 1e9), (log.last_ns or 0) + 1)
                if not boundary.is_new(ns, text):
                    continue
                if not boundary.overlapped:
                    boundary.overlapped = True  # once: the gap lies before this first line of the new file
                    self._rotated_away(name, log, ns, text)
                if log.from_store and log.from_store[0] == text:  # already passed on from the shipped log
                    log.from_store.popleft()
                    log.advance(ns, text)
                    continue
                log.from_store.clear()
                log.add_line(ns, text, self.rank)
                yield None
        except Exception as exc:  # noqa: BLE001 - a stream cut or gone silent: read on from its last line
            if not _transient(exc):
                raise self._log_error(exc, name) from exc
            if not stream:
                yield from self._unreachable(name, log, exc)
            return
        finally:
            response.release_conn()
        if log.failures:
            log.failures, log.retry_at = 0, 0.0
        if ended:
            log.complete = True

    def _log_error(self, exc: BaseException, pod: str) -> BackendError:
        return self.backend.api_error(exc, f"could not read the log of pod {self.handle.namespace}/{pod}")

    def _cluster_now(self) -> float:
        """Now on the cluster's clock (the lines' timestamps), so a note sorts among them whatever this machine's
        clock says."""
        return time.time() + self.server_offset

    def _note_server_clock(self, response: Any) -> None:
        try:
            stamp = email.utils.parsedate_to_datetime(response.headers.get("Date"))
            self.server_offset = stamp.timestamp() - time.time()
        except (TypeError, ValueError, AttributeError):
            pass

    def _unreachable(self, name: str, log: _PodLog, exc: BaseException) -> Iterator[None]:
        """A read that failed for now: back off (1 s, 2 s, ... 30 s) and say so once per outage."""
        log.failures += 1
        log.retry_at = time.monotonic() + min(MAX_BACKOFF_S, 2.0 ** (log.failures - 1))
        if log.failures == 1:
            why = " ".join(str(getattr(exc, "reason", "") or type(exc).__name__).split())
            log.records.append(LogRecord(self._cluster_now(), self.rank, "err",
                                         f"[diloco] the log of pod {name} cannot be read now ({why}: its node may "
                                         f"be NotReady); retrying"))
            yield None

    def _rotated_away(self, name: str, log: _PodLog, first_ns: int, first_text: str) -> None:
        """The kubelet rotated the log since the last read: the lines in between come from the shipped log (which
        may be a flush behind: it is given until it holds a line as late as the new file's first, a few seconds at
        most), or one line says they are missing."""
        assert log.last_ns is not None
        before, until = len(log.records), first_ns / 1e9
        deadline = time.monotonic() + 2 * FLUSH_EVERY_S + 1.0
        while True:
            self._add_shipped_attempts([], need=True)
            shipped = self.shipped.get(name)
            caught_up = shipped is not None and (shipped.ended or (
                bool(shipped.lines) and shipped.lines[-1][0] >= until - 0.5))
            if shipped is None or caught_up or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        self._fill_from_store(name, log, until=until, stop_text=first_text)
        if len(log.records) == before:
            start = time.strftime("%H:%M:%S", time.gmtime(log.last_ns / 1e9))
            end = time.strftime("%H:%M:%S", time.gmtime(until))
            log.records.append(LogRecord(until - 1e-6, self.rank, "err",
                                         f"[diloco] gap: the kubelet rotated pod {name}'s log before these lines "
                                         f"were read; lines written between {start} and {end} UTC are missing"))
        log.from_store.clear()  # what was filled lies before the new file's first line

    # ------------------------------------------------------------------ the replica's shipped log
    def _store_handle(self) -> Any:
        if self._store is None and self.handle.log_uri:
            from diloco.store.objects import ObjectStore

            self._store = ObjectStore(self.handle.log_uri, retries=1)
        return self._store

    def _add_shipped_attempts(self, pods: list[dict[str, Any]], *, need: bool) -> None:
        """Read the shipped attempts (only when some attempt needs them: its pod is gone or does not answer)."""
        store = self._store_handle()
        if store is None or not need:
            return
        from diloco.store.logs import read_attempts

        try:
            self.shipped = read_attempts(store, self.rank, known=self.shipped)
        except Exception:  # noqa: BLE001 - the store is a fallback; its absence must not stop the reader
            return
        for name in self.shipped:
            self.history.setdefault(name, _PodLog())

    def _fill_from_store(self, name: str, log: _PodLog, until: float | None = None,
                         stop_text: str | None = None) -> None:
        """Append the shipped lines of this attempt that come after the last line ``log`` has, up to ``until``.
        The last line is found in the shipped copy by its text near its time (the replica stamps a line a moment
        before the container runtime does); a shipped copy that has not caught up with it yet gives nothing now."""
        shipped = self.shipped.get(name)
        if shipped is None:
            return
        lines = shipped.lines
        last = next((r for r in reversed(log.records) if not r.text.startswith(("[diloco]", "[event]"))), None)
        start = 0
        if last is not None:
            start = next((i + 1 for i in range(len(lines) - 1, -1, -1)
                          if lines[i][1] == last.text and lines[i][0] <= last.ts + 0.5), -1)
            if start < 0:
                start = next((i for i, (ts, _) in enumerate(lines) if ts > last.ts + 0.5), len(lines))
        for ts, text in lines[start:]:
            if (until is not None and ts >= until) or (stop_text is not None and text == stop_text):
                break
            log.records.append(LogRecord(ts, self.rank, "out", text))
            log.from_store.append(text)

    def _from_store_only(self, since: float | None) -> Iterator[LogRecord]:
        self._add_shipped_attempts([], need=True)
        for name in self._attempt_order():
            log = self.history[name]
            self._fill_from_store(name, log)
            yield from self._unsent(name, log, since)

    def _explain_empty(self) -> Iterator[LogRecord]:
        """One line instead of nothing, when nothing of this replica could be found anywhere."""
        if not self.job_gone or any(self.sent.values()):
            return
        where = (f"and the run's store has no shipped log under {self.handle.log_uri}" if self.handle.log_uri
                 else "and this run's replicas did not ship their logs to its store")
        yield LogRecord(self._cluster_now(), self.rank, "err",
                        f"[diloco] no log of replica {self.rank}: its pods are gone (cancelled, or deleted with "
                        f"the Job by its TTL) {where}")
        self.sent["[none]"] = 1
