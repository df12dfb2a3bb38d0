"""A Kubernetes API server on loopback that really runs Indexed Jobs as local processes.

The official ``kubernetes`` client and ``kubectl`` talk to it through an ordinary kubeconfig
(``KubernetesEmulator.kubeconfig``: an ``https://`` server, the cluster CA as ``certificate-authority-data`` and a
bearer token, see ``kube_tls``), so a backend is tested with no patched client and no cluster: Jobs (``batch/v1``),
Pods with list/watch by label selector, pod logs (``follow``, ``timestamps``, ``previous``, ``tailLines``,
``sinceSeconds``, ``sinceTime``, ``limitBytes``, rotated like the kubelet's, see ``kube_kubelet``), Events,
Namespaces, ServiceAccounts and SelfSubjectAccessReview, answering errors with the API server's own ``Status``
bodies; legacy discovery (``kube_discovery``) and server-side ``Table`` printing (``kube_tables``) for ``kubectl``.
Writes follow the real default ``fieldValidation=Warn`` (unknown fields dropped, a ``Warning`` header each);
``?fieldValidation=Strict`` refuses them (``kube_validation``).
Each Job index becomes a pod whose container is a real process (its own process group) started from the pod
template's command, args and env; ``python`` in the container means the interpreter the emulator was given, or
the one ``add_image`` maps the container's image to. A container has its pod's ``emptyDir`` volumes at their
mountPaths, a 64 MiB ``/dev/shm`` unless a memory-backed emptyDir is mounted there, and is OOMKilled over its
memory limit, as on a real node (``kube_runtime``).

Nodes (``kube_nodes``): ``KubernetesEmulator(root, nodes=[eks_node("gpu-1", "g5.12xlarge"), ...])`` declares the
cluster's nodes, with the labels, taints and allocatable a stock EKS or Karpenter node has; pods bind only where
their nodeSelector, required node affinity, tolerations and resource requests fit (else they stay Pending with
the scheduler's ``FailedScheduling`` reason), and a container that asked for ``nvidia.com/gpu`` gets the device
plugin's ``NVIDIA_VISIBLE_DEVICES``. Without ``nodes`` there is one roomy CPU node, so any CPU pod binds. EKS and
Karpenter nodes have the stock 20 GiB disk unless declared bigger, and images their real size (``kube_images``:
AWS's PyTorch training images, ``image_size`` for others): a pull that does not fit leaves the pod in
``ErrImagePull``/``ImagePullBackOff`` with containerd's "no space left on device" and the node under DiskPressure.

Faults a test can inject: evict a pod (``DisruptionTarget``), kill a container with an exit code or as
``OOMKilled``, keep pods pending (``Unschedulable``, ``ImagePullBackOff``, ...), deny RBAC verbs, refuse creates
at admission (a quota, a webhook), lose a node (``set_node_ready(name, False)``: its kubelet stops answering, its
pods are evicted after ``unreachable_eviction_s``) or delete it (``remove_node``: PodGC fails its pods), rotate
a container's log now (``rotate_log``), make a pod's kubelet unreachable without losing its node
(``kubelet_unreachable``). A pod whose kubelet cannot be reached (a NotReady node, or that fault) answers
``pods/log`` with the API server's 500 for a failed kubelet dial, at once or after a hang, and its open log
streams end, cleanly, as the API server's ``StreamObject`` ends a copy whose source broke.

Use from a test::

    with KubernetesEmulator(tmp_path) as kube:
        config.load_kube_config(config_file=str(kube.kubeconfig))

or on its own, from the repository root::

    python -m tests.emulators.kubernetes --port 8766 --kubeconfig /tmp/kc.yaml

with nodes (repeat ``--node``; ``eks:TYPE[@DISK]``, ``karpenter:TYPE[@DISK]`` (the stock 20Gi disk unless
``@100Gi``) or ``plain:CPU,MEMORY[,GPUS]``, each optionally ``:NAME``; the types are ``kube_nodes.INSTANCE_TYPES``)::

    python -m tests.emulators.kubernetes --kubeconfig /tmp/kc.yaml --node eks:m5.xlarge --node eks:g5.12xlarge@100Gi:gpu-1
"""

from __future__ import annotations

import argparse
import base64
import copy
import itertools
import json
import re
import signal
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlencode, urlsplit

from . import kube_discovery as discovery
from . import kube_kubelet as kubelet
from . import kube_tables as tables
from . import kube_tls as tls
from .kube_cluster import Cluster, ClusterConfig, Denial, Hold, KubeletFault, KubeletUnreachable, Rejection
from .kube_errors import (
    ApiError,
    FieldError,
    FieldErrors,
    already_exists,
    bad_request,
    go_quote,
    invalid,
    invalid_object,
    not_found,
    required,
    route_not_found,
    unauthorized,
)
from .kube_nodes import Node, parse_node_flag
from .kube_store import Obj, field_selector, label_selector, matches, now_rfc3339
from .kube_validation import check_field_validation, dns1123_label_errors

#: The version the emulator reports and validates against.
SERVER_VERSION = {"major": "1", "minor": "33", "gitVersion": "v1.33.0-emulator", "gitCommit": "0" * 40,
                  "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24.0",
                  "compiler": "gc", "platform": "linux/amd64"}

#: resource -> (group, apiVersion, kind, namespaced)
RESOURCES: dict[str, tuple[str, str, str, bool]] = {
    "namespaces": ("", "v1", "Namespace", False),
    "serviceaccounts": ("", "v1", "ServiceAccount", True),
    "pods": ("", "v1", "Pod", True),
    "events": ("", "v1", "Event", True),
    "jobs": ("batch", "batch/v1", "Job", True),
    "nodes": ("", "v1", "Node", False),
}

T = TypeVar("T")


@dataclass
class Request:
    """One API request, parsed: path parameters, query (last value wins) and the body."""

    method: str
    path: str
    query: dict[str, str]
    body: bytes
    headers: Any
    params: dict[str, str] = field(default_factory=dict)

    def flag(self, name: str) -> bool:
        """A boolean query parameter (the 36.x client sends ``True``, 37.x ``true``)."""
        return self.query.get(name, "").lower() in ("true", "1")

    def number(self, name: str) -> int | None:
        raw = self.query.get(name)
        if raw is None or raw == "":
            return None
        try:
            return int(raw)
        except ValueError:
            raise bad_request(f'invalid value for {name}: strconv.ParseInt: parsing "{raw}": invalid syntax') from None

    def json(self) -> Any:
        """The JSON body (a missing ``Content-Type`` means JSON, as for the API server)."""
        if not self.body:
            return None
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise bad_request(f"couldn't get version/kind; json parse error: {exc}") from None


@dataclass
class Reply:
    """What a route answers: a JSON object, plain text, or a stream of chunks."""

    body: Any = None
    code: int = 200
    text: bytes | None = None
    stream: Iterator[bytes] | None = None
    content_type: str = "application/json"
    warnings: list[str] = field(default_factory=list)


Route = tuple[str, re.Pattern[str], Callable[[Request], Reply]]


class Api:
    """The REST surface: routes requests to the cluster and turns objects into responses."""

    def __init__(self, cluster: Cluster, token: str | None, stopping: threading.Event) -> None:
        self.cluster = cluster
        self.token = token
        self.stopping = stopping
        ns, name = r"(?P<ns>[^/]+)", r"(?P<name>[^/]+)"
        self.routes: list[Route] = [
            ("GET", re.compile(r"/version"), lambda r: Reply(SERVER_VERSION)),
            ("GET", re.compile(r"/(healthz|livez|readyz)"), lambda r: Reply(text=b"ok", content_type="text/plain")),
            ("GET", re.compile(r"/api"), lambda r: Reply(discovery.api_versions(r.headers.get("Host", "")))),
            ("GET", re.compile(r"/api/v1"), lambda r: self._resources("")),
            ("GET", re.compile(r"/apis"), lambda r: Reply(discovery.api_groups(RESOURCES))),
            ("GET", re.compile(r"/apis/(?P<group>[^/]+)/v1"), lambda r: self._resources(r.params["group"])),
            ("GET", re.compile(r"/api/v1/namespaces"), lambda r: self._list(r, "namespaces", None)),
            ("POST", re.compile(r"/api/v1/namespaces"), self._create_namespace),
            ("GET", re.compile(rf"/api/v1/namespaces/{name}"), lambda r: self._get(r, "namespaces", "")),
            ("GET", re.compile(rf"/api/v1/namespaces/{ns}/serviceaccounts"),
             lambda r: self._list(r, "serviceaccounts", r.params["ns"])),
            ("GET", re.compile(rf"/api/v1/namespaces/{ns}/serviceaccounts/{name}"),
             lambda r: self._get(r, "serviceaccounts", r.params["ns"])),
            ("GET", re.compile(r"/api/v1/pods"), lambda r: self._list(r, "pods", None)),
            ("GET", re.compile(rf"/api/v1/namespaces/{ns}/pods"), lambda r: self._list(r, "pods", r.params["ns"])),
            ("GET", re.compile(rf"/api/v1/namespaces/{ns}/pods/{name}(/status)?"),
             lambda r: self._get(r, "pods", r.params["ns"])),
            ("DELETE", re.compile(rf"/api/v1/namespaces/{ns}/pods/{name}"), self._delete_pod),
            ("GET", re.compile(rf"/api/v1/namespaces/{ns}/pods/{name}/log"), self._pod_log),
            ("POST", re.compile(rf"/api/v1/namespaces/{ns}/pods/{name}/eviction"), self._evict),
            ("GET", re.compile(r"/api/v1/nodes"), lambda r: self._list(r, "nodes", None)),
            ("GET", re.compile(rf"/api/v1/nodes/{name}(/status)?"), lambda r: self._get(r, "nodes", "")),
            ("GET", re.compile(r"/api/v1/events"), lambda r: self._list(r, "events", None)),
            ("GET", re.compile(rf"/api/v1/namespaces/{ns}/events"), lambda r: self._list(r, "events", r.params["ns"])),
            ("GET", re.compile(r"/apis/batch/v1/jobs"), lambda r: self._list(r, "jobs", None)),
            ("GET", re.compile(rf"/apis/batch/v1/namespaces/{ns}/jobs"), lambda r: self._list(r, "jobs",
                                                                                              r.params["ns"])),
            ("POST", re.compile(rf"/apis/batch/v1/namespaces/{ns}/jobs"), self._create_job),
            ("GET", re.compile(rf"/apis/batch/v1/namespaces/{ns}/jobs/{name}(/status)?"),
             lambda r: self._get(r, "jobs", r.params["ns"])),
            ("DELETE", re.compile(rf"/apis/batch/v1/namespaces/{ns}/jobs/{name}"), self._delete_job),
            ("PATCH", re.compile(rf"/apis/batch/v1/namespaces/{ns}/jobs/{name}"), self._patch_job),
            ("POST", re.compile(r"/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"), self._access_review),
        ]

    # ------------------------------------------------------------------------------------------ dispatch

    def handle(self, request: Request) -> Reply:
        """Authenticate, route, and turn an ``ApiError`` into its ``Status`` answer."""
        try:
            if self.token is not None and not re.fullmatch(r"/(healthz|livez|readyz)", request.path):
                if request.headers.get("Authorization", "") != f"Bearer {self.token}":
                    raise unauthorized()
            matched_path = False
            for method, pattern, handler in self.routes:
                match = pattern.fullmatch(request.path)
                if match is None:
                    continue
                matched_path = True
                if method == request.method:
                    request.params = {k: v for k, v in match.groupdict().items() if v is not None}
                    return handler(request)
            if matched_path:
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested "
                                                        "resource", {})
            raise route_not_found()
        except ApiError as error:
            return Reply(error.status(), error.code)

    def _authorize(self, request: Request, verb: str, resource: str, subresource: str = "") -> None:
        group = RESOURCES[resource][0] if resource in RESOURCES else ""
        self.cluster.authorize(verb, resource, group, subresource, request.params.get("ns", ""),
                               request.params.get("name", ""))

    @staticmethod
    def _typed(resource: str, obj: Obj) -> Obj:
        _, api_version, kind, _ = RESOURCES[resource]
        return {"kind": kind, "apiVersion": api_version, **{k: v for k, v in obj.items()
                                                             if k not in ("kind", "apiVersion")}}

    # ------------------------------------------------------------------------------------------ generic reads

    def _get(self, request: Request, resource: str, namespace: str) -> Reply:
        self._authorize(request, "get", resource)
        store = self.cluster.store
        with store.lock:
            name = request.params["name"]
            obj = store.get(resource, namespace, name)
            if obj is None:
                raise not_found(resource, RESOURCES[resource][0], name)
            if tables.wants_table(request.headers.get("Accept")):
                return Reply(self._table(request, resource, [copy.deepcopy(obj)], str(store.rv)))
            return Reply(self._typed(resource, copy.deepcopy(obj)))

    def _list(self, request: Request, resource: str, namespace: str | None) -> Reply:
        """A list, or with ``watch=true`` a stream of watch events (one JSON object per line)."""
        watching = request.flag("watch")
        self._authorize(request, "watch" if watching else "list", resource)
        labels = label_selector(request.query.get("labelSelector"))
        fields = field_selector(resource, request.query.get("fieldSelector"))
        store = self.cluster.store

        def current() -> list[Obj]:
            return [o for o in store.items(resource, namespace) if matches(o, namespace, labels, fields)]

        if watching:
            rv_text = request.query.get("resourceVersion") or ""
            timeout = request.number("timeoutSeconds") or 1800
            rv = int(rv_text) if rv_text.isdigit() else None
            events = store.watch(resource, rv, lambda o: matches(o, namespace, labels, fields), current,
                                 time.monotonic() + timeout)
            as_table = request if tables.wants_table(request.headers.get("Accept")) else None
            return Reply(stream=self._watch_lines(resource, events, rv or 0, as_table))
        with store.lock:
            items = [copy.deepcopy(o) for o in current()]
            version = str(store.rv)
        if tables.wants_table(request.headers.get("Accept")):
            return Reply(self._table(request, resource, items, version))
        _, api_version, kind, _ = RESOURCES[resource]
        return Reply({"kind": f"{kind}List", "apiVersion": api_version, "metadata": {"resourceVersion": version},
                      "items": items})

    def _watch_lines(self, resource: str, events: Iterator[tuple[str, Obj] | None], rv: int,
                     as_table: Request | None = None) -> Iterator[bytes]:
        """Watch events, one JSON object per line; for ``kubectl get -w`` each object is a one-row ``Table``."""
        for event in events:
            if self.stopping.is_set():
                return
            if event is None:
                status = ApiError(410, "Expired", f"too old resource version: {rv} ({self.cluster.store.rv})")
                yield _dumps({"type": "ERROR", "object": status.status()}) + b"\n"
                return
            kind, obj = event
            shown = self._table(as_table, resource, [obj], obj["metadata"].get("resourceVersion", "")) \
                if as_table is not None else self._typed(resource, obj)
            yield _dumps({"type": kind, "object": shown}) + b"\n"

    @staticmethod
    def _table(request: Request, resource: str, objects: list[Obj], resource_version: str) -> Obj:
        _, api_version, kind, _ = RESOURCES[resource]
        return tables.table(resource, objects, api_version, kind, resource_version,
                            request.query.get("includeObject"))

    # ------------------------------------------------------------------------------------------ discovery

    @staticmethod
    def _resources(group: str) -> Reply:
        listing = discovery.resource_list(group, RESOURCES)
        if listing is None:
            raise route_not_found()
        return Reply(listing)

    # ------------------------------------------------------------------------------------------ writes

    def _create_namespace(self, request: Request) -> Reply:
        self._authorize(request, "create", "namespaces")
        body = request.json() or {}
        name = (body.get("metadata") or {}).get("name") or ""
        errors = FieldErrors()
        if not name:
            errors.add(required("metadata.name", "name or generateName is required"))
        else:
            errors.add(*(invalid("metadata.name", name, m) for m in dns1123_label_errors(name)))
        if errors.items:
            raise invalid_object("Namespace", "", name, errors)
        with self.cluster.store.lock:
            if self.cluster.store.get("namespaces", "", name) is not None:
                raise already_exists("namespaces", "", name)
            return Reply(self._typed("namespaces", copy.deepcopy(self.cluster.add_namespace(name))), 201)

    def _create_job(self, request: Request) -> Reply:
        self._authorize(request, "create", "jobs")
        dry_run = request.query.get("dryRun") == "All"
        directive = check_field_validation(request.query.get("fieldValidation"))
        job, warnings = self.cluster.create_job(request.params["ns"], request.json(), dry_run=dry_run,
                                                field_validation=directive)
        return Reply(self._typed("jobs", job), 201, warnings=warnings)

    @staticmethod
    def _delete_options(request: Request) -> dict[str, Any]:
        """Delete options from the query (``propagation_policy=``) or the body (``body=V1DeleteOptions``)."""
        options = request.json() or {}
        if not isinstance(options, dict):
            raise bad_request("the body of the request was in an unknown format")
        for key in ("propagationPolicy", "gracePeriodSeconds", "orphanDependents", "dryRun"):
            if key in request.query:
                options[key] = request.query[key]
        if "gracePeriodSeconds" in options and options["gracePeriodSeconds"] is not None:
            options["gracePeriodSeconds"] = int(options["gracePeriodSeconds"])
        orphan = options.get("orphanDependents")
        if isinstance(orphan, str):
            options["orphanDependents"] = orphan.lower() == "true"
        return options

    def _delete_job(self, request: Request) -> Reply:
        self._authorize(request, "delete", "jobs")
        options = self._delete_options(request)
        result, warnings = self.cluster.delete_job(request.params["ns"], request.params["name"],
                                                   options.get("propagationPolicy"), options.get("orphanDependents"))
        body = result if result.get("kind") == "Status" else self._typed("jobs", result)
        return Reply(body, 200, warnings=warnings)

    def _patch_job(self, request: Request) -> Reply:
        self._authorize(request, "patch", "jobs")
        content_type = request.headers.get("Content-Type") or "application/json-patch+json"
        job = self.cluster.patch_job(request.params["ns"], request.params["name"], content_type, request.json())
        return Reply(self._typed("jobs", job))

    def _delete_pod(self, request: Request) -> Reply:
        self._authorize(request, "delete", "pods")
        options = self._delete_options(request)
        pod = self.cluster.delete_pod(request.params["ns"], request.params["name"], options.get("gracePeriodSeconds"))
        return Reply(self._typed("pods", pod))

    def _evict(self, request: Request) -> Reply:
        self._authorize(request, "create", "pods", "eviction")
        self.cluster.evict_pod(request.params["ns"], request.params["name"])
        return Reply({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, 201)

    def _access_review(self, request: Request) -> Reply:
        """``SelfSubjectAccessReview``: RBAC's answer for the caller, from the same rules that guard requests."""
        review = request.json() or {}
        spec = review.get("spec") or {}
        attrs = spec.get("resourceAttributes")
        allowed = True
        if attrs:
            allowed = not self.cluster.is_denied(attrs.get("verb", ""), attrs.get("resource", ""),
                                                 attrs.get("group", ""), attrs.get("subresource", ""),
                                                 attrs.get("namespace", ""))
        status: dict[str, Any] = {"allowed": allowed}
        if allowed:
            status["reason"] = f'RBAC: allowed by ClusterRoleBinding "emulator-admin" of ClusterRole ' \
                               f'"cluster-admin" to User "{self.cluster.config.user}"'
        return Reply({"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                      "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}, 201)

    # ------------------------------------------------------------------------------------------ logs

    def _pod_log(self, request: Request) -> Reply:
        """``pods/log``: the current log file of the container, filtered, timestamped, or followed to its end.

        ``sinceTime`` reaches the kubelet with whole seconds only: ``LogLocation`` re-encodes it as
        ``time.RFC3339``, so a fractional part is dropped (rounded down) and the boundary second is read again."""
        self._authorize(request, "get", "pods", "log")
        namespace, name = request.params["ns"], request.params["name"]
        timestamps, tail = request.flag("timestamps"), request.number("tailLines")
        since_seconds, limit = request.number("sinceSeconds"), request.number("limitBytes")
        _validate_log_options(name, tail, limit, since_seconds, request.query.get("sinceTime"))
        since_ns = time.time_ns() - since_seconds * 1_000_000_000 if since_seconds is not None else None
        if request.query.get("sinceTime"):
            since_ns = _parse_rfc3339_ns(request.query["sinceTime"]) // 1_000_000_000 * 1_000_000_000
        try:
            run = self.cluster.log_source(namespace, name, request.query.get("container"), request.flag("previous"),
                                          _kubelet_query(request))
        except KubeletUnreachable as error:
            if error.hang_s:
                self.stopping.wait(error.hang_s)
            raise
        current, end = run.current_file()
        selected = kubelet.select_lines(current, tail=tail, since_ns=since_ns)
        if not request.flag("follow"):
            text = b"".join(kubelet.format_line(entry, timestamps) for entry in selected)
            return Reply(text=text[:limit] if limit is not None else text, content_type="text/plain")

        def cut() -> bool:
            return self.cluster.log_stream_fault(namespace, name) is not None

        def stream() -> Iterator[bytes]:
            sent = 0
            later = (e for e in run.follow(end, self.stopping, cut) if since_ns is None or e[0] >= since_ns)
            for entry in itertools.chain(selected, later):
                chunk = kubelet.format_line(entry, timestamps)
                if limit is not None:
                    chunk = chunk[:max(0, limit - sent)]
                    if not chunk:
                        return
                sent += len(chunk)
                yield chunk
            fault = self.cluster.log_stream_fault(namespace, name)
            if fault is not None and fault.hang_s:
                self.stopping.wait(fault.hang_s)  # a dead node: the stream stays open and silent, then ends

        return Reply(stream=stream(), content_type="text/plain")


def _validate_log_options(pod: str, tail: int | None, limit: int | None, since_seconds: int | None,
                          since_time: str | None) -> None:
    """``ValidatePodLogOptions``: the API server's 422 before it asks the kubelet anything."""
    errors = FieldErrors()
    if tail is not None and tail < 0:
        errors.add(invalid("tailLines", tail, "must be greater than or equal to 0"))
    if limit is not None and limit < 1:
        errors.add(invalid("limitBytes", limit, "must be greater than 0"))
    if since_seconds is not None and since_time:
        errors.add(FieldError("FieldValueForbidden", "", detail="at most one of `sinceTime` or `sinceSeconds` may "
                                                                "be specified"))
    elif since_seconds is not None and since_seconds < 1:
        errors.add(invalid("sinceSeconds", since_seconds, "must be greater than 0"))
    if errors.items:
        raise invalid_object("PodLogOptions", "", pod, errors)


def _kubelet_query(request: Request) -> str:
    """The query the API server sends on to the kubelet (``LogLocation``: only the options set, sorted by key)."""
    params: dict[str, str] = {}
    for key in ("follow", "previous", "timestamps"):
        if request.flag(key):
            params[key] = "true"
    for key in ("sinceSeconds", "sinceTime", "tailLines", "limitBytes"):
        if request.query.get(key):
            params[key] = request.query[key]
    return urlencode(sorted(params.items()))


def _dumps(body: Any) -> bytes:
    """Compact JSON, as Go's encoder writes it."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def _parse_rfc3339_ns(text: str) -> int:
    import datetime as dt

    try:
        stamp = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise bad_request(f'invalid value for sinceTime: parsing time "{text}" as "2006-01-02T15:04:05Z07:00": '
                          "cannot parse") from None
    return int(stamp.timestamp() * 1_000_000_000)


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive for plain answers and chunked encoding for watches and followed logs."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if self.server.verbose:
            sys.stderr.write(f"kube-emulator: {format % args}\n")

    def _serve(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        path = parts.path.rstrip("/") or "/"
        reply = self.server.api.handle(Request(self.command, path, query, body, self.headers))
        self.send_response(reply.code)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Audit-Id", now_rfc3339())
        for warning in reply.warnings:
            self.send_header("Warning", f"299 - {go_quote(warning)}")  # net.NewWarningHeader: strconv.Quote
        if reply.stream is not None:
            self._send_stream(reply.stream)
            return
        data = reply.text if reply.text is not None else _dumps(reply.body)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_stream(self, chunks: Iterator[bytes]) -> None:
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        try:
            for chunk in chunks:
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client went away (a broken pipe, a reset, a TLS connection closed mid-stream)
            self.close_connection = True

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve


class _Server(ThreadingHTTPServer):
    """One thread per connection; the TLS handshake happens in that thread, so a stalled client blocks no one."""

    daemon_threads = True
    allow_reuse_address = True
    api: Api
    verbose: bool = False
    tls_context: ssl.SSLContext | None = None

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-answer (a timeout, a cancelled follow) is routine: say nothing."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls_context is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(10)
        try:
            secure = self.tls_context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return  # a client that does not trust the CA, or gave up: nothing to answer
        secure.settimeout(None)
        try:
            super().finish_request(secure, client_address)
        finally:
            try:
                secure.close()
            except OSError:
                pass


class KubernetesEmulator:
    """The emulator as a test (or a user) uses it: start, a kubeconfig, fault knobs, stop."""

    def __init__(self, root: Path | str | None = None, *, port: int = 0, host: str = "127.0.0.1",
                 namespace: str = "default", interpreter: str = sys.executable, token: str | None = "emulator-token",
                 node_env: dict[str, str] | None = None, image_workdir: Path | str | None = None,
                 image_entrypoint: list[str] | None = None, pod_backoff_s: float = 0.0, tick_s: float = 0.05,
                 nodes: list[Node] | None = None, unreachable_eviction_s: int = 300, verbose: bool = False,
                 images: dict[str, str] | None = None, isolation: str = "auto",
                 log_max_bytes: int = 10 * 1024 * 1024, log_max_files: int = 5) -> None:
        self._tmp = None if root is not None else tempfile.TemporaryDirectory(prefix="kube-emulator-")
        self.root = Path(root if root is not None else self._tmp.name)  # type: ignore[union-attr]
        self.root.mkdir(parents=True, exist_ok=True)
        self.host, self.port, self.namespace, self.token = host, port, namespace, token
        self.cluster = Cluster(ClusterConfig(
            root=self.root, interpreter=interpreter, node_env=dict(node_env or {}),
            image_workdir=Path(image_workdir) if image_workdir else None,
            image_entrypoint=list(image_entrypoint or []), pod_backoff_s=pod_backoff_s, tick_s=tick_s,
            nodes=list(nodes) if nodes is not None else None, unreachable_eviction_s=unreachable_eviction_s,
            images=dict(images or {}), isolation=isolation, log_max_bytes=log_max_bytes,
            log_max_files=log_max_files))
        self.cluster.add_namespace(namespace)
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._verbose = verbose
        self.kubeconfig = self.root / "kubeconfig.yaml"
        #: The cluster CA and serving certificate, new for every emulator (``kube_tls``).
        self.certificates = tls.issue([host])

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> KubernetesEmulator:
        """Bind the port, start serving and the controllers, and write ``self.kubeconfig``."""
        server = _Server((self.host, self.port), _Handler)
        server.api = Api(self.cluster, self.token, self._stopping)
        server.verbose = self._verbose
        server.tls_context = self.certificates.server_context(self.root / "pki")
        self._server = server
        self.port = server.server_address[1]
        self.cluster.config.api_port = self.port
        threading.Thread(target=server.serve_forever, name="kube-api", daemon=True).start()
        self.cluster.start()
        self.write_kubeconfig(self.kubeconfig)
        return self

    def stop(self) -> None:
        """Stop serving, end open watches and log streams, kill every container process."""
        self._stopping.set()
        self.cluster.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> KubernetesEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context that verifies the emulator's certificate, for requests no client library makes."""
        return self.certificates.client_context()

    def write_kubeconfig(self, path: Path | str, *, context: str = "emulator", namespace: str | None = None,
                         server: str | None = None) -> Path:
        """A kubeconfig with one cluster (the server and its CA), one user (a bearer token) and one context that
        selects ``namespace``."""
        user: dict[str, Any] = {"token": self.token} if self.token is not None else {}
        cluster = {"server": server or self.url,
                   "certificate-authority-data": base64.b64encode(self.certificates.ca_pem).decode()}
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": context, "cluster": cluster}],
            "users": [{"name": self.cluster.config.user, "user": user}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": self.cluster.config.user,
                                                      "namespace": namespace or self.namespace}}],
            "current-context": context,
        }
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML: no PyYAML needed here
        return target

    # ------------------------------------------------------------------------------------------ set-up

    def add_namespace(self, name: str) -> None:
        self.cluster.add_namespace(name)

    def add_image(self, pattern: str, interpreter: str | Path) -> None:
        """Containers whose image matches the glob ``pattern`` run ``interpreter`` as ``python`` (first match in
        the order added; images matching none run the emulator's ``interpreter``), e.g. the PyTorch training
        image's stand-in: ``kube.add_image("*pytorch-training:*", str(image_python()))``."""
        self.cluster.add_image(pattern, str(interpreter))

    def add_service_account(self, name: str, namespace: str | None = None,
                            annotations: dict[str, str] | None = None) -> None:
        """A service account, e.g. with ``eks.amazonaws.com/role-arn`` for IRSA."""
        self.cluster.add_service_account(namespace or self.namespace, name, annotations)

    def deny(self, verb: str, resource: str, *, group: str = "", subresource: str = "",
             namespace: str | None = None) -> None:
        """Take an RBAC permission away: requests get 403 and SelfSubjectAccessReview says not allowed."""
        with self.cluster.store.lock:
            self.cluster.denials.append(Denial(verb, resource, group, subresource, namespace))

    def allow_all(self) -> None:
        with self.cluster.store.lock:
            self.cluster.denials.clear()

    def reject_creates(self, resource: str, message: str, *, code: int = 403, reason: str = "Forbidden",
                       times: int | None = None) -> None:
        """Admission refuses creates of ``resource`` (a quota, a webhook) with this exact answer (``{name}`` in
        ``message`` becomes the refused object's name); ``times`` refusals, or all of them."""
        with self.cluster.store.lock:
            self.cluster.rejections.append(Rejection(resource, ApiError(code, reason, message, {"kind": resource}),
                                                     times))

    def deny_quota(self, resource: str, name_hint: str = "compute", times: int | None = None) -> None:
        """``ResourceQuota`` admission's refusal, worded like the quota plugin."""
        what = "jobs.batch" if resource == "jobs" else resource
        self.reject_creates(resource, f'{what} "{{name}}" is forbidden: exceeded quota: {name_hint}, requested: '
                                      f"count/{what}=1, used: count/{what}=1, limited: count/{what}=1", times=times)

    def add_node(self, node: Node) -> None:
        """Declare one more node (``kube_nodes.eks_node``, ``karpenter_node``, ``node``); pending pods may bind."""
        self.cluster.add_node(node)

    # ------------------------------------------------------------------------------------------ faults

    def set_node_ready(self, name: str, ready: bool) -> None:
        """Lose a node (its kubelet stops answering, its processes die, its pods get ``DisruptionTarget`` and are
        deleted after ``unreachable_eviction_s`` but stay Terminating until the node is back or removed) or bring it
        back; see ``Cluster.set_node_ready``."""
        self.cluster.set_node_ready(name, ready)

    def remove_node(self, name: str) -> None:
        """Delete the Node (the instance is gone): PodGC fails its pods with ``DisruptionTarget`` and deletes them."""
        self.cluster.remove_node(name)

    def evict(self, pod: str, *, namespace: str | None = None, reason: str = "EvictionByEvictionAPI",
              message: str = "Eviction API: evicting") -> None:
        """A disruption: ``DisruptionTarget`` condition, then a graceful delete (drain, spot reclaim)."""
        self.cluster.evict_pod(namespace or self.namespace, pod, reason, message)

    def fail_pod(self, pod: str, exit_code: int = 1, *, reason: str = "Error", namespace: str | None = None) -> None:
        """The running container dies with ``exit_code`` (SIGKILL to its group, the status says ``reason``)."""
        self.cluster.fail_container(namespace or self.namespace, pod, exit_code, reason)

    def oom_kill(self, pod: str, *, namespace: str | None = None) -> None:
        self.fail_pod(pod, 137, reason="OOMKilled", namespace=namespace)

    def rotate_log(self, pod: str, *, container: str | None = None, namespace: str | None = None) -> None:
        """The kubelet rotates the container's log now, whatever its size (``log_max_bytes`` does it by size)."""
        self.cluster.rotate_log(namespace or self.namespace, pod, container)

    def kubelet_unreachable(self, pod: str | None = None, *, namespace: str | None = None,
                            hang_s: float | None = None) -> KubeletFault:
        """The API server can no longer reach the kubelet of ``pod`` (of every pod when None): ``pods/log``
        answers 500 with the dial error (after ``hang_s`` seconds of silence when set), open log streams end."""
        fault = KubeletFault(pod, namespace, hang_s)
        with self.cluster.store.lock:
            self.cluster.kubelet_faults.append(fault)
        return fault

    def kubelet_reachable_again(self, fault: KubeletFault) -> None:
        with self.cluster.store.lock:
            if fault in self.cluster.kubelet_faults:
                self.cluster.kubelet_faults.remove(fault)

    def hold_pending(self, *, job: str | None = None, index: int | None = None, reason: str = "Unschedulable",
                     message: str | None = None) -> Hold:
        """Keep matching pods (now and future) pending: ``Unschedulable`` at the scheduler, others at the kubelet."""
        default = {"Unschedulable": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: 0/1 nodes "
                                    "are available: 1 No preemption victims found for incoming pod.",
                   "ImagePullBackOff": "Back-off pulling image", "ContainerCreating": ""}.get(reason, reason)
        hold = Hold(reason, default if message is None else message, job, index)
        with self.cluster.store.lock:
            self.cluster.holds.append(hold)
        return hold

    def release(self, hold: Hold) -> None:
        with self.cluster.store.lock:
            if hold in self.cluster.holds:
                self.cluster.holds.remove(hold)

    def image_pull_error(self, pattern: str, message: str | None = None) -> None:
        """Images matching ``pattern`` cannot be pulled: ``ErrImagePull``, then ``ImagePullBackOff``."""
        with self.cluster.store.lock:
            self.cluster.image_errors[pattern] = message or "rpc error: code = NotFound desc = failed to pull and " \
                                                            "unpack image: not found"

    def image_size(self, pattern: str, unpacked_mib: int) -> None:
        """Images matching ``pattern`` take ``unpacked_mib`` unpacked on a node's disk (checked before the sizes
        ``kube_images.DEFAULT_SIZES`` knows, e.g. the DLC training images'); a pull that does not fit fails the
        way containerd's does and puts the node under DiskPressure."""
        with self.cluster.store.lock:
            self.cluster.image_sizes = {pattern: unpacked_mib, **self.cluster.image_sizes}

    # ------------------------------------------------------------------------------------------ inspection

    def pods(self, job: str | None = None, namespace: str | None = None) -> list[Obj]:
        with self.cluster.store.lock:
            items = self.cluster.store.items("pods", namespace or self.namespace)
            return [copy.deepcopy(p) for p in items
                    if job is None or p["metadata"].get("labels", {}).get("batch.kubernetes.io/job-name") == job]

    def nodes(self) -> list[Obj]:
        """The Node objects as the API serves them."""
        with self.cluster.store.lock:
            return [copy.deepcopy(n) for n in self.cluster.store.items("nodes")]

    def job(self, name: str, namespace: str | None = None) -> Obj | None:
        with self.cluster.store.lock:
            obj = self.cluster.store.get("jobs", namespace or self.namespace, name)
            return copy.deepcopy(obj) if obj is not None else None

    def events(self, namespace: str | None = None) -> list[Obj]:
        with self.cluster.store.lock:
            return [copy.deepcopy(e) for e in self.cluster.store.items("events", namespace or self.namespace)]

    def pod_log(self, pod: str, namespace: str | None = None) -> str:
        """What the pod's container has printed so far ("" before it starts)."""
        try:
            run = self.cluster.log_source(namespace or self.namespace, pod, None, False)
        except ApiError:
            return ""
        with run.cond:
            return b"".join(line for _, line in run.lines).decode(errors="replace")

    def live_processes(self) -> list[int]:
        """Container processes still running: after a cancel, a test asserts this is empty."""
        return self.cluster.live_processes()

    def wait_for(self, check: Callable[[], T], timeout: float = 30.0, interval: float = 0.05) -> T:
        """Poll ``check`` until it returns something truthy; ``TimeoutError`` naming the check otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {timeout:g}s: {getattr(check, '__name__', check)}")
            time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    """Run the emulator until Ctrl-C (``python -m tests.emulators.kubernetes --kubeconfig /tmp/kc.yaml``)."""
    parser = argparse.ArgumentParser(prog="python -m tests.emulators.kubernetes", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8766, help="loopback port (0 picks a free one)")
    parser.add_argument("--kubeconfig", type=Path, help="where to write the kubeconfig (default: under --root)")
    parser.add_argument("--namespace", default="default", help="the context's namespace (created if missing)")
    parser.add_argument("--service-account", action="append", default=[], metavar="NAME[=ROLE_ARN]",
                        help="create a service account in the namespace, with an IRSA role annotation if given")
    parser.add_argument("--node-env", action="append", default=[], metavar="KEY=VALUE",
                        help="a variable every container gets (what the node or a webhook would inject)")
    parser.add_argument("--node", action="append", default=[], metavar="KIND:SPEC[:NAME]",
                        help="a node: eks:g5.12xlarge, karpenter:g5.xlarge, plain:8,32Gi[,GPUS]; repeat for more "
                             "(default: one roomy CPU node)")
    parser.add_argument("--unreachable-eviction-s", type=int, default=300, metavar="SECONDS",
                        help="how long pods stay on a lost node before the taint manager evicts them")
    parser.add_argument("--interpreter", default=sys.executable, help="what `python` means inside containers")
    parser.add_argument("--image", action="append", default=[], metavar="PATTERN=INTERPRETER",
                        help="containers whose image matches the glob PATTERN run INTERPRETER as `python`")
    parser.add_argument("--isolation", choices=("auto", "namespaces", "paths"), default="auto",
                        help="how containers see their volumes: user+mount namespaces, or rewritten paths")
    parser.add_argument("--root", type=Path, help="working folder (default: a temporary one)")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    args = parser.parse_args(argv)
    node_env = dict(item.split("=", 1) for item in args.node_env)
    try:
        nodes = [parse_node_flag(text, i) for i, text in enumerate(args.node)] or None
    except ValueError as exc:
        parser.error(str(exc))
    names = [n.name for n in nodes or []]
    if len(set(names)) != len(names):
        parser.error(f"--node: two nodes named {next(n for n in names if names.count(n) > 1)!r}; give each its own "
                     ":NAME")
    images = dict(item.split("=", 1) for item in args.image)
    emulator = KubernetesEmulator(args.root, port=args.port, namespace=args.namespace, interpreter=args.interpreter,
                                  node_env=node_env, nodes=nodes, unreachable_eviction_s=args.unreachable_eviction_s,
                                  verbose=args.verbose, images=images, isolation=args.isolation)
    for item in args.service_account:
        name, _, role = item.partition("=")
        emulator.add_service_account(name, annotations={"eks.amazonaws.com/role-arn": role} if role else None)
    emulator.start()
    if args.kubeconfig:
        emulator.write_kubeconfig(args.kubeconfig)
    print(f"Kubernetes API emulator on {emulator.url}; kubeconfig: {args.kubeconfig or emulator.kubeconfig}",
          flush=True)
    for item in emulator.nodes():
        allocatable = item["status"]["allocatable"]
        kind = item["metadata"]["labels"].get("node.kubernetes.io/instance-type", "plain")
        gpus = f", {allocatable['nvidia.com/gpu']} nvidia.com/gpu" if "nvidia.com/gpu" in allocatable else ""
        print(f"node {item['metadata']['name']} ({kind}): cpu {allocatable['cpu']}, memory {allocatable['memory']}"
              f"{gpus}", flush=True)
    print(f"export KUBECONFIG={args.kubeconfig or emulator.kubeconfig}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        emulator.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
