"""The emulator's control plane and node: job controller, scheduler, kubelet, garbage collector, TTL controller.

One controller thread reconciles everything every tick, under the store's lock, the way the real controllers
converge on the stored state: the job controller creates one pod per pending index and counts finished pods
against ``backoffLimitPerIndex`` / ``maxFailedIndexes`` / ``backoffLimit`` and the ``podFailurePolicy``; the
scheduler binds pods only to nodes whose labels, taints and allocatable fit (``kube_scheduler``), else leaves them
``Unschedulable`` with the real reason; the node lifecycle and taint eviction controllers and PodGC handle lost
nodes (``set_node_ready``, ``remove_node``); the kubelet starts containers as local processes (with their
volumes, ``/dev/shm`` and memory limit: ``kube_runtime``) and stops them with the pod's grace period; the garbage
collector implements the three delete propagation policies; the TTL controller deletes finished Jobs. Upstream
sources are named where they set wording or order (``pkg/controller/job``, ``pkg/kubelet``, ``pkg/controller/garbagecollector``).

Deviation on purpose: the job controller's exponential back-off before recreating a failed pod (10 s, 20 s, ...)
is ``ClusterConfig.pod_backoff_s`` (default 0) so tests do not wait for it; likewise a lost node is marked at once
(not after ``node-monitor-grace-period``), its pods' eviction waits ``ClusterConfig.unreachable_eviction_s`` (the
``tolerationSeconds`` admission gives them, 300 upstream) and PodGC skips its 40 s quarantine.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import kube_kubelet as kubelet
from . import kube_runtime as runtime_limits
from . import kube_scheduler as scheduler
from .kube_errors import (
    ApiError,
    FieldError,
    FieldErrors,
    already_exists,
    bad_request,
    forbidden,
    invalid,
    invalid_object,
    not_found,
)
from .kube_images import (
    DEFAULT_SIZES,
    DISK_PRESSURE_TAINT,
    disk_pressure_condition,
    image_env,
    no_space_message,
    pull_bytes,
)
from .kube_nodes import GPU_RESOURCE, Node, default_node, ready_conditions
from .kube_store import Obj, Store, now_rfc3339, random_suffix
from .kube_validation import admit_job, parse_quantity, validate_job

INDEX_KEY = "batch.kubernetes.io/job-completion-index"
TRACKING_FINALIZER = "batch.kubernetes.io/job-tracking"
FAILURE_COUNT_KEY = "batch.kubernetes.io/job-index-failure-count"
IGNORED_COUNT_KEY = "batch.kubernetes.io/job-index-ignored-failure-count"
ORPHAN_WARNING = ("child pods are preserved by default when jobs are deleted; set propagationPolicy=Background to "
                  "remove them or set propagationPolicy=Orphan to suppress this warning")
TERMINAL = ("Succeeded", "Failed")
#: Waiting reasons a test can hold a pod in, and the stage that reports them.
SCHEDULER_REASONS = frozenset({"Unschedulable"})
KUBELET_REASONS = frozenset({"ContainerCreating", "ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError",
                             "CreateContainerError"})


@dataclass
class ClusterConfig:
    """How the emulated node runs containers."""

    root: Path
    interpreter: str
    node_name: str = "emulator-node"
    #: Variables every container gets, standing for what the node and admission webhooks inject (e.g. the
    #: ``AWS_*`` variables of IRSA or Pod Identity, or an S3 endpoint in tests).
    node_env: dict[str, str] = field(default_factory=dict)
    #: The image's ``WORKDIR``: containers without ``workingDir`` start here (default: a fresh folder per pod).
    image_workdir: Path | None = None
    #: The image's ``ENTRYPOINT``, used when a container sets no ``command``.
    image_entrypoint: list[str] = field(default_factory=list)
    pod_backoff_s: float = 0.0
    tick_s: float = 0.05
    user: str = "emulator-user"
    api_port: int = 0
    #: Image reference glob -> the interpreter ``python`` is in containers of matching images (first match wins);
    #: every other image runs ``interpreter``.
    images: dict[str, str] = field(default_factory=dict)
    #: How containers see their volumes: ``auto`` (namespaces where the machine allows them), ``namespaces``,
    #: ``paths`` (see ``kube_runtime``).
    isolation: str = "auto"
    #: The cluster's nodes; ``None`` is one roomy CPU node named ``node_name``, ``[]`` a cluster with no node.
    nodes: list[Node] | None = None
    #: The ``tolerationSeconds`` the DefaultTolerationSeconds admission plugin gives every pod for the
    #: ``not-ready`` / ``unreachable`` NoExecute taints (300 upstream): how long pods stay on a lost node.
    unreachable_eviction_s: int = 300
    #: The kubelet's ``containerLogMaxSize`` (``10Mi``) and ``containerLogMaxFiles`` (5) defaults.
    log_max_bytes: int = 10 * 1024 * 1024
    log_max_files: int = 5


@dataclass
class Hold:
    """A test's instruction to keep matching pods pending with a reason (``Unschedulable``, ``ImagePullBackOff``)."""

    reason: str
    message: str
    job: str | None = None
    index: int | None = None

    def applies(self, pod: Obj) -> bool:
        labels = pod["metadata"].get("labels") or {}
        if self.job is not None and labels.get("batch.kubernetes.io/job-name") != self.job:
            return False
        return self.index is None or labels.get(INDEX_KEY) == str(self.index)


@dataclass
class KubeletFault:
    """A test's instruction that the API server cannot reach the kubelet of a pod (``None``: of every pod): its
    ``pods/log`` requests fail with the proxy's dial error, after ``hang_s`` seconds when set (a node that drops
    packets, so the dial times out) or at once (a compressed dial timeout), and open log streams are cut."""

    pod: str | None = None
    namespace: str | None = None
    hang_s: float | None = None

    def applies(self, pod: Obj) -> bool:
        meta = pod["metadata"]
        return self.pod in (None, meta["name"]) and self.namespace in (None, meta.get("namespace"))


class KubeletUnreachable(ApiError):
    """The API server's answer when its kubelet proxy cannot dial the node: a 500 ``Status`` with no reason whose
    message is the Go client's error (``ErrorToAPIStatus`` of a plain error); ``hang_s`` says how long the dial
    takes before that answer."""

    def __init__(self, message: str, hang_s: float | None) -> None:
        super().__init__(500, "", message)
        self.hang_s = hang_s

    def status(self) -> dict[str, Any]:
        body = super().status()
        body.pop("reason")  # metav1.StatusReasonUnknown is "" and omitted
        return body


@dataclass
class Denial:
    """An RBAC rule the caller lacks: ``verb`` on ``resource[/subresource]`` in ``group`` (optionally one namespace)."""

    verb: str
    resource: str
    group: str = ""
    subresource: str = ""
    namespace: str | None = None

    def denies(self, verb: str, resource: str, group: str, subresource: str, namespace: str) -> bool:
        return (self.verb in (verb, "*") and self.resource in (resource, "*") and self.group == group
                and self.subresource == subresource and self.namespace in (None, namespace))


@dataclass
class Rejection:
    """An admission-time refusal of creates (a quota, a webhook) that a test installs."""

    resource: str
    error: ApiError
    times: int | None = None


@dataclass
class JobTracker:
    """What the job controller keeps in memory about one Job (upstream keeps it in status and annotations)."""

    started: float = field(default_factory=time.monotonic)
    succeeded: set[int] = field(default_factory=set)
    failed_indexes: set[int] = field(default_factory=set)
    index_failures: dict[int, int] = field(default_factory=dict)
    index_ignored: dict[int, int] = field(default_factory=dict)
    last_failure: dict[int, float] = field(default_factory=dict)
    succeeded_count: int = 0
    failed_count: int = 0
    finishing: tuple[str, str, str] | None = None
    finished_at: float | None = None


@dataclass
class PodRuntime:
    """The kubelet's view of one pod: its container starts, in order, and its termination progress."""

    runs: dict[str, list[kubelet.ContainerRun]] = field(default_factory=dict)
    waiting: dict[str, tuple[str, str]] = field(default_factory=dict)
    started: bool = False
    term_sent_at: float | None = None
    kill_at: float | None = None
    restart_at: dict[str, float] = field(default_factory=dict)
    pull_failures: dict[str, int] = field(default_factory=dict)
    volumes_released: bool = False
    #: An image of this pod does not fit its node's disk (the node has DiskPressure while such a pod waits).
    disk_full: bool = False


def format_intervals(indexes: set[int]) -> str:
    """``orderedIntervals.String``: ``{0,1,2,4}`` -> ``"0-2,4"``, and two neighbours stay ``"1,2"``."""
    parts: list[str] = []
    ordered = sorted(indexes)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        else:
            parts.extend(str(v) for v in ordered[i:j + 1])
        i = j + 1
    return ",".join(parts)


def pod_index(pod: Obj) -> int | None:
    value = (pod["metadata"].get("annotations") or {}).get(INDEX_KEY)
    return int(value) if value is not None and value.isdigit() else None


def is_terminal(pod: Obj) -> bool:
    return pod.get("status", {}).get("phase") in TERMINAL


def condition(kind: str, status: str = "True", reason: str = "", message: str = "") -> dict[str, Any]:
    """A Job or pod condition as the controllers write it."""
    cond: dict[str, Any] = {"type": kind, "status": status, "lastProbeTime": None,
                            "lastTransitionTime": now_rfc3339()}
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    return cond


class Cluster:
    """The objects, the controllers over them and the local processes they run."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.store = Store()
        self.runtimes: dict[str, PodRuntime] = {}
        self.trackers: dict[str, JobTracker] = {}
        self.holds: list[Hold] = []
        self.image_errors: dict[str, str] = {}
        #: Image glob -> unpacked MiB (``kube_images``), and the images each node holds (what they cost its disk).
        self.image_sizes: dict[str, int] = dict(DEFAULT_SIZES)
        self.node_images: dict[str, set[str]] = {}
        self.denials: list[Denial] = []
        self.rejections: list[Rejection] = []
        #: Declared nodes by name (their GPUs' device ids), when each lost node stopped answering, and the
        #: device ids the device plugin gave each pod's containers (pod uid -> container -> ids).
        self.node_specs: dict[str, Node] = {}
        self.lost_nodes: dict[str, float] = {}
        self.devices: dict[str, dict[str, list[str]]] = {}
        self.kubelet_faults: list[KubeletFault] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bin_dir = config.root / "bin"
        kubelet.python_shim(self.bin_dir, config.interpreter)
        self.images = runtime_limits.ImageTable(config.root, self.bin_dir)
        for pattern, interpreter in config.images.items():
            self.add_image(pattern, interpreter)
        self.isolation = runtime_limits.isolation(config.isolation)
        self.memory = runtime_limits.MemoryWatcher()
        for name in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.add_namespace(name)
        for declared in config.nodes if config.nodes is not None else [default_node(config.node_name)]:
            self.add_node(declared)

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kube-controllers", daemon=True)
        self._thread.start()
        self.memory.start()

    def add_image(self, pattern: str, interpreter: str) -> None:
        """Containers whose image matches ``pattern`` (a glob) run ``interpreter`` as ``python``."""
        with self.store.lock:
            self.images.add(pattern, interpreter, kubelet.python_shim)

    def stop(self) -> None:
        """Stop the controllers and kill every container process that is still running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self.store.lock:
            self.store.closed = True
            self.store.changed.notify_all()
            runs = [run for rt in self.runtimes.values() for rs in rt.runs.values() for run in rs]
        for run in runs:
            run.signal(signal.SIGKILL)
        for run in runs:
            if run.process is not None:
                try:
                    run.process.wait(timeout=5)
                except Exception:  # noqa: BLE001 - best effort on shutdown
                    pass
        self.memory.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self.store.lock:
                self.reconcile()
            self._stop.wait(self.config.tick_s)

    def reconcile(self) -> None:
        """One pass of every controller (caller holds the lock); a lost node's kubelet syncs nothing."""
        self._manage_nodes()
        for pod in self.store.items("pods"):
            if not pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp"):
                self._schedule(pod)
        for pod in self.store.items("pods"):
            if self.kubelet_reachable(pod):
                self._sync_pod(pod)
        for job in self.store.items("jobs"):
            self._sync_job(job)
        self._collect_garbage()
        self._expire_finished_jobs()
        self._rotate_logs()

    # ------------------------------------------------------------------------------------------ namespaces etc.

    def add_namespace(self, name: str) -> Obj:
        """A namespace with its ``default`` service account, as the namespace and token controllers make them."""
        with self.store.lock:
            existing = self.store.get("namespaces", "", name)
            if existing is not None:
                return existing
            ns = self.store.add("namespaces", {"metadata": {"name": name,
                                                            "labels": {"kubernetes.io/metadata.name": name}},
                                               "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}})
            self.add_service_account(name, "default")
            return ns

    def add_service_account(self, namespace: str, name: str, annotations: dict[str, str] | None = None) -> Obj:
        with self.store.lock:
            existing = self.store.get("serviceaccounts", namespace, name)
            if existing is not None:
                self.store.remove("serviceaccounts", existing)
            meta: dict[str, Any] = {"name": name, "namespace": namespace}
            if annotations:
                meta["annotations"] = dict(annotations)
            return self.store.add("serviceaccounts", {"metadata": meta})

    def require_namespace(self, namespace: str) -> None:
        """The ``NamespaceLifecycle`` admission check: a namespaced object needs its namespace."""
        if self.store.get("namespaces", "", namespace) is None:
            raise not_found("namespaces", "", namespace)

    # ------------------------------------------------------------------------------------------ authorization

    def authorize(self, verb: str, resource: str, group: str, subresource: str, namespace: str, name: str) -> None:
        """RBAC's answer: a 403 worded like the authorizer when a test denied this request."""
        if self.is_denied(verb, resource, group, subresource, namespace):
            what = f"{resource}/{subresource}" if subresource else resource
            scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
            raise forbidden(resource, group, name,
                            f'User "{self.config.user}" cannot {verb} resource "{what}" in API group "{group}" {scope}')

    def is_denied(self, verb: str, resource: str, group: str, subresource: str, namespace: str) -> bool:
        return any(d.denies(verb, resource, group, subresource, namespace) for d in self.denials)

    def _admission(self, resource: str, name: str) -> None:
        """Refusals a test installed (``{name}`` in their message becomes the object's name)."""
        for rejection in list(self.rejections):
            if rejection.resource == resource:
                if rejection.times is not None:
                    rejection.times -= 1
                    if rejection.times <= 0:
                        self.rejections.remove(rejection)
                error = rejection.error
                details = {**(error.details or {}), "name": name}
                raise ApiError(error.code, error.reason, error.message.replace("{name}", name), details)

    # ------------------------------------------------------------------------------------------ Jobs (API)

    def create_job(self, namespace: str, body: Obj, dry_run: bool = False,
                   field_validation: str = "Strict") -> tuple[Obj, list[str]]:
        """``POST .../jobs``: the create handler's order: decode, default, validate, admit, store; the stored Job
        and the warnings for the response (unknown fields dropped under ``fieldValidation=Warn``)."""
        meta = body.get("metadata") if isinstance(body, dict) else None
        if isinstance(meta, dict) and meta.get("namespace") not in (None, "", namespace):
            raise bad_request("the namespace of the provided object does not match the namespace sent on the "
                              "request")
        with self.store.lock:
            if isinstance(meta, dict) and not meta.get("name") and meta.get("generateName"):
                meta["name"] = str(meta["generateName"]) + random_suffix()
            job, warnings = admit_job(body, self._prepare_job, field_validation)
            self.require_namespace(namespace)
            name = job["metadata"]["name"]
            self._admission("jobs", name)
            if self.store.get("jobs", namespace, name) is not None:
                raise already_exists("jobs", "batch", name)
            job["metadata"]["namespace"] = namespace
            if dry_run:
                return copy.deepcopy(job), warnings
            self.store.add("jobs", job)
            self.trackers[job["metadata"]["uid"]] = JobTracker()
            return copy.deepcopy(job), warnings

    @staticmethod
    def _prepare_job(job: Obj) -> None:
        """``jobStrategy.PrepareForCreate``: uid, selector and the generated labels, before validation."""
        from .kube_store import new_uid

        meta = job.setdefault("metadata", {})
        uid = meta.setdefault("uid", new_uid())
        name = meta.get("name", "")
        generated = {"batch.kubernetes.io/controller-uid": uid, "batch.kubernetes.io/job-name": name,
                     "controller-uid": uid, "job-name": name}
        spec = job["spec"]
        template_meta = spec["template"].setdefault("metadata", {})
        if not spec.get("manualSelector"):
            if spec.get("selector") is None:
                spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
            template_meta["labels"] = {**(template_meta.get("labels") or {}), **generated}
        if not meta.get("labels"):
            meta["labels"] = dict(template_meta.get("labels") or {})
        meta["annotations"] = {**(meta.get("annotations") or {}), TRACKING_FINALIZER: ""}
        meta["generation"] = 1
        job["status"] = {}
        job.setdefault("apiVersion", "batch/v1")
        job.setdefault("kind", "Job")

    def delete_job(self, namespace: str, name: str, policy: str | None, orphan: bool | None) -> tuple[Obj, list[str]]:
        """``DELETE .../jobs/x``: the object while finalizers run, else a success ``Status``; plus warnings."""
        warnings: list[str] = []
        with self.store.lock:
            job = self.store.get("jobs", namespace, name)
            if job is None:
                raise not_found("jobs", "batch", name)
            if policy is None and orphan is not None:
                policy = "Orphan" if orphan else "Background"
            if policy is None:
                policy = "Orphan"
                warnings.append(ORPHAN_WARNING)
            if policy not in ("Orphan", "Background", "Foreground"):
                raise ApiError(422, "Invalid", f'DeleteOptions.meta.k8s.io "" is invalid: propagationPolicy: '
                                               f'Unsupported value: "{policy}": supported values: "Foreground", '
                                               f'"Background", "Orphan", "nil"', {"kind": "DeleteOptions"})
            meta = job["metadata"]
            finalizers = meta.setdefault("finalizers", [])
            wanted = {"Orphan": "orphan", "Foreground": "foregroundDeletion"}.get(policy)
            if wanted and wanted not in finalizers:
                finalizers.append(wanted)
            if not finalizers:
                self.store.remove("jobs", job)
                self.trackers.pop(meta["uid"], None)
                return self._success(job, "jobs", "batch"), warnings
            meta.setdefault("deletionTimestamp", now_rfc3339())
            meta.setdefault("deletionGracePeriodSeconds", 0)
            self.store.touch("jobs", job)
            return copy.deepcopy(job), warnings

    def patch_job(self, namespace: str, name: str, content_type: str, patch: Any) -> Obj:
        """``PATCH .../jobs/x``: a JSON patch (a list of operations) or a merge patch (an object), then the
        update validation: the mutable fields may change, the others are immutable."""
        with self.store.lock:
            job = self.store.get("jobs", namespace, name)
            if job is None:
                raise not_found("jobs", "batch", name)
            if "json-patch" in content_type or isinstance(patch, list):
                updated = apply_json_patch(job, patch)
            else:
                updated = merge_patch(job, patch)
            errors = FieldErrors()
            for key in IMMUTABLE_JOB_FIELDS:
                if updated["spec"].get(key) != job["spec"].get(key):
                    errors.add(invalid(f"spec.{key}", updated["spec"].get(key), "field is immutable"))
            completions = completions_update_error(updated["spec"], job["spec"])
            if completions is not None:
                errors.add(completions)
            if errors.items:
                raise invalid_object("Job", "batch", name, errors)
            validate_job(updated)
            if updated["spec"] != job["spec"]:
                updated["metadata"]["generation"] = job["metadata"].get("generation", 1) + 1
            for key in ("metadata", "spec"):
                job[key] = updated[key]
            self.store.touch("jobs", job)
            return copy.deepcopy(job)

    @staticmethod
    def _success(obj: Obj, resource: str, group: str) -> Obj:
        details: dict[str, Any] = {"name": obj["metadata"]["name"], "kind": resource, "uid": obj["metadata"]["uid"]}
        if group:
            details["group"] = group
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}

    # ------------------------------------------------------------------------------------------ Pods (API)

    def delete_pod(self, namespace: str, name: str, grace: int | None) -> Obj:
        """``DELETE .../pods/x``: graceful (the kubelet stops the containers), immediate with grace 0."""
        with self.store.lock:
            pod = self.store.get("pods", namespace, name)
            if pod is None:
                raise not_found("pods", "", name)
            self._mark_deleted(pod, grace)
            return copy.deepcopy(pod)

    def evict_pod(self, namespace: str, name: str, reason: str = "EvictionByEvictionAPI",
                  message: str = "Eviction API: evicting") -> None:
        """The Eviction API (and a node drain or spot reclaim): a ``DisruptionTarget`` condition, then delete."""
        with self.store.lock:
            pod = self.store.get("pods", namespace, name)
            if pod is None:
                raise not_found("pods", "", name)
            conditions = pod["status"].setdefault("conditions", [])
            if not any(c["type"] == "DisruptionTarget" for c in conditions):
                conditions.append(condition("DisruptionTarget", "True", reason, message))
            self.store.touch("pods", pod)
            self._mark_deleted(pod, None)

    def _mark_deleted(self, pod: Obj, grace: int | None) -> None:
        meta = pod["metadata"]
        if grace is None:
            grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        if meta.get("deletionTimestamp"):
            if grace < int(meta.get("deletionGracePeriodSeconds", grace)):
                meta["deletionGracePeriodSeconds"] = grace
                runtime = self.runtimes.get(meta["uid"])
                if runtime is not None and runtime.kill_at is not None:
                    runtime.kill_at = min(runtime.kill_at, time.monotonic() + grace)
                self.store.touch("pods", pod)
            return
        meta["deletionTimestamp"] = now_rfc3339()
        meta["deletionGracePeriodSeconds"] = grace
        self.store.touch("pods", pod)

    def fail_container(self, namespace: str, name: str, exit_code: int, reason: str) -> None:
        """Fault: the container dies now with ``exit_code`` and ``reason`` (``OOMKilled``, ``Error``)."""
        with self.store.lock:
            pod = self.store.get("pods", namespace, name)
            if pod is None:
                raise not_found("pods", "", name)
            runtime = self.runtimes.get(pod["metadata"]["uid"])
            live = [rs[-1] for rs in (runtime.runs.values() if runtime else []) if rs and rs[-1].exit_code is None]
            if not live:
                raise bad_request(f"pod {name} has no running container to fail")
            for run in live:
                run.forced = (exit_code, reason)
                run.signal(signal.SIGKILL)

    def kubelet_reachable(self, pod: Obj) -> bool:
        """Whether the API server can reach the kubelet of the pod's node (its logs are served through it); a
        node that is lost (NotReady, or deleted) answers no proxied request. An unbound pod has no kubelet to
        miss (its log request gets the API server's own 400)."""
        node_name = pod["spec"].get("nodeName")
        if not node_name:
            return True
        return self.store.get("nodes", "", node_name) is not None and node_name not in self.lost_nodes

    def _rotate_logs(self) -> None:
        """The kubelet's container log manager: rotate every running container's file that reached the limit."""
        for runtime in self.runtimes.values():
            for runs in runtime.runs.values():
                if runs and runs[-1].exit_code is None and runs[-1].current_bytes >= self.config.log_max_bytes:
                    runs[-1].rotate(self.config.log_max_files)

    def rotate_log(self, namespace: str, name: str, container: str | None = None) -> None:
        """Fault: rotate the current log file of the pod's container now (the first container by default)."""
        with self.store.lock:
            pod = self.store.get("pods", namespace, name)
            if pod is None:
                raise not_found("pods", "", name)
            container = container or pod["spec"]["containers"][0]["name"]
            runtime = self.runtimes.get(pod["metadata"]["uid"])
            runs = runtime.runs.get(container, []) if runtime else []
            if not runs:
                raise bad_request(f"container {container} of pod {name} has no log yet")
            runs[-1].rotate(self.config.log_max_files)

    def kubelet_fault(self, pod: Obj) -> KubeletFault | None:
        """Why the API server cannot reach the pod's kubelet now, if it cannot (a NotReady node, a test's fault)."""
        if not self.kubelet_reachable(pod):
            return KubeletFault(pod["metadata"]["name"], pod["metadata"].get("namespace"))
        return next((f for f in self.kubelet_faults if f.applies(pod)), None)

    def log_stream_fault(self, namespace: str, name: str) -> KubeletFault | None:
        """Why an open log stream of this pod has lost its kubelet (its node is gone or unreachable), if it has."""
        with self.store.lock:
            pod = self.store.get("pods", namespace, name)
            return None if pod is None else self.kubelet_fault(pod)

    def log_source(self, namespace: str, name: str, container: str | None, previous: bool,
                   query: str = "") -> kubelet.ContainerRun:
        """The container start whose log a ``pods/log`` request reads, or the API server's / kubelet's 400, or the
        proxy's 500 when the kubelet cannot be reached (after the API server's own checks, before the kubelet's:
        ``pkg/registry/core/pod/strategy.go`` ``LogLocation`` builds ``https://<node>:10250/containerLogs/...``)."""
        with self.store.lock:
            pod = self.store.get("pods", namespace, name)
            if pod is None:
                raise not_found("pods", "", name)
            names = [c["name"] for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]]
            if not container:
                if len(pod["spec"]["containers"]) != 1:
                    raise bad_request(f"a container name must be specified for pod {name}, choose one of: "
                                      f"[{' '.join(c['name'] for c in pod['spec']['containers'])}]")
                container = pod["spec"]["containers"][0]["name"]
            elif container not in names:
                raise bad_request(f"container {container} is not valid for pod {name}")
            if not pod["spec"].get("nodeName"):
                raise bad_request(f"pod {name} does not have a host assigned")
            fault = self.kubelet_fault(pod)
            if fault is not None:
                host = f'{pod.get("status", {}).get("hostIP") or "10.0.0.1"}:10250'
                url = f"https://{host}/containerLogs/{namespace}/{name}/{container}" + (f"?{query}" if query else "")
                raise KubeletUnreachable(f'Get "{url}": dial tcp {host}: i/o timeout', fault.hang_s)
            runtime = self.runtimes.get(pod["metadata"]["uid"])
            runs = [r for r in (runtime.runs.get(container, []) if runtime else []) if r.container_id]
            if previous:
                if len(runs) < 2:
                    raise bad_request(f'previous terminated container "{container}" in pod "{name}" not found')
                return runs[-2]
            if runs:
                return runs[-1]
            status = next((s for s in pod["status"].get("containerStatuses", []) + pod["status"].get(
                "initContainerStatuses", []) if s["name"] == container), None)
            if status is None:
                raise bad_request(f'container "{container}" in pod "{name}" is not available')
            waiting = status["state"].get("waiting")
            if waiting is not None:
                reason = waiting.get("reason", "")
                why = {"ErrImagePull": "image can't be pulled",
                       "ImagePullBackOff": "trying and failing to pull image"}.get(reason, reason)
                raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: {why}')
            raise bad_request(f'container "{container}" in pod "{name}" is terminated')

    # ------------------------------------------------------------------------------------------ events

    def record_event(self, kind: str, obj: Obj, event_type: str, reason: str, message: str,
                     component: str) -> None:
        """An ``Event`` about an object; a repeat of the same reason and message bumps ``count`` (the correlator)."""
        meta = obj["metadata"]
        namespace = meta.get("namespace", "default")
        for event in self.store.items("events", namespace):
            involved = event["involvedObject"]
            if involved.get("uid") == meta["uid"] and event["reason"] == reason and event["message"] == message:
                event["count"] += 1
                event["lastTimestamp"] = now_rfc3339()
                self.store.touch("events", event)
                return
        stamp = now_rfc3339()
        api_version = "batch/v1" if kind == "Job" else "v1"
        host = (obj.get("spec") or {}).get("nodeName") or self.config.node_name if kind == "Pod" else \
            self.config.node_name
        self.store.add("events", {
            "metadata": {"name": f"{meta['name']}.{os.urandom(8).hex()}", "namespace": namespace},
            "involvedObject": {"kind": kind, "namespace": namespace, "name": meta["name"], "uid": meta["uid"],
                               "apiVersion": api_version, "resourceVersion": meta.get("resourceVersion", "")},
            "reason": reason, "message": message, "type": event_type, "count": 1,
            "source": {"component": component, **({"host": host} if component == "kubelet" else {})},
            "firstTimestamp": stamp, "lastTimestamp": stamp, "eventTime": None,
            "reportingComponent": component, "reportingInstance": host if component == "kubelet" else ""})

    # ------------------------------------------------------------------------------------------ scheduler

    def _schedule(self, pod: Obj) -> None:
        """The default scheduler (``kube_scheduler``): bind to the best node every filter passes, else leave the
        pod Pending ``Unschedulable`` with the scheduler's reason; a test's ``hold_pending`` wins over both.
        Every tick is a new attempt, so a pod binds as soon as capacity frees or a node appears."""
        hold = next((h for h in self.holds if h.reason in SCHEDULER_REASONS and h.applies(pod)), None)
        if hold is not None:
            self._unschedulable(pod, hold.message)
            return
        usage = self._node_usage()
        feasible: list[Obj] = []
        verdicts: list[scheduler.Verdict] = []
        for node in self.store.items("nodes"):
            used, count = usage.get(node["metadata"]["name"], ({}, 0))
            verdict = scheduler.filter_node(pod["spec"], node, used, count)
            if verdict is None:
                feasible.append(node)
            else:
                verdicts.append(verdict)
        if not feasible:
            self._unschedulable(pod, scheduler.failed_scheduling_message(verdicts, pod["spec"]))
            return
        requests = scheduler.pod_requests(pod["spec"])
        best = max(feasible, key=lambda n: scheduler.least_allocated_score(
            requests, n, usage.get(n["metadata"]["name"], ({}, 0))[0]))
        node_name = best["metadata"]["name"]
        pod["spec"]["nodeName"] = node_name
        conditions = pod["status"].setdefault("conditions", [])
        conditions[:] = [c for c in conditions if c["type"] != "PodScheduled"]
        conditions.append(condition("PodScheduled"))
        self.store.touch("pods", pod)
        self.record_event("Pod", pod, "Normal", "Scheduled", f"Successfully assigned "
                          f"{pod['metadata']['namespace']}/{pod['metadata']['name']} to {node_name}",
                          "default-scheduler")

    def _unschedulable(self, pod: Obj, message: str) -> None:
        """``PodScheduled=False`` reason ``Unschedulable`` and a ``FailedScheduling`` event, once per message."""
        conditions = pod["status"].setdefault("conditions", [])
        scheduled = next((c for c in conditions if c["type"] == "PodScheduled"), None)
        if scheduled is not None and scheduled.get("message") == message:
            return
        conditions[:] = [c for c in conditions if c["type"] != "PodScheduled"]
        conditions.append(condition("PodScheduled", "False", "Unschedulable", message))
        self.store.touch("pods", pod)
        self.record_event("Pod", pod, "Warning", "FailedScheduling", message, "default-scheduler")

    def _node_usage(self) -> dict[str, tuple[dict[str, Any], int]]:
        """Per node: the summed requests and the count of its non-terminal pods (the scheduler's cache holds no
        terminal pod: its pod informer selects ``status.phase!=Succeeded,status.phase!=Failed``)."""
        usage: dict[str, tuple[dict[str, Any], int]] = {}
        for pod in self.store.items("pods"):
            name = pod["spec"].get("nodeName")
            if not name or is_terminal(pod):
                continue
            used, count = usage.get(name, ({}, 0))
            for key, value in scheduler.pod_requests(pod["spec"]).items():
                used[key] = used.get(key, 0) + value
            usage[name] = (used, count + 1)
        return usage

    # ------------------------------------------------------------------------------------------ nodes

    def add_node(self, node: Node) -> Obj:
        """Register a node (the kubelet's first status: Ready); replaces a node of the same name."""
        with self.store.lock:
            existing = self.store.get("nodes", "", node.name)
            if existing is not None:
                self.store.remove("nodes", existing)
            self.node_specs[node.name] = node
            self.lost_nodes.pop(node.name, None)
            return self.store.add("nodes", node.to_object())

    def remove_node(self, name: str) -> None:
        """The Node object is deleted (the cloud node lifecycle controller or Karpenter after the instance is
        gone); its containers die with it, and PodGC fails and deletes its pods on the next pass."""
        with self.store.lock:
            node = self.store.get("nodes", "", name)
            if node is None:
                raise not_found("nodes", "", name)
            self._kill_node_processes(name)
            self.store.remove("nodes", node)
            self.node_specs.pop(name, None)
            self.lost_nodes.pop(name, None)

    def set_node_ready(self, name: str, ready: bool) -> None:
        """Lose a node (``ready=False``: its kubelet stops posting status, as after a spot reclaim or a crash) or
        bring it back.

        Losing it does what the node lifecycle controller does once ``node-monitor-grace-period`` has passed
        (``pkg/controller/nodelifecycle``, at once here): the kubelet-owned conditions become ``Unknown``
        (``NodeStatusUnknown``, "Kubelet stopped posting node status."), the ``node.kubernetes.io/unreachable``
        taints are added (``NoSchedule`` by TaintNodesByCondition, ``NoExecute`` with ``timeAdded`` for taint-based
        eviction), and its pods' ``Ready`` condition turns ``False`` (``MarkPodsNotReady``, event ``NodeNotReady``).
        The node's container processes are killed (the machine is gone) but the API objects keep their last status:
        nobody reports for them. The taint eviction controller then deletes each pod once its toleration of the
        taint runs out (see ``_evict_tainted``), yet a deleted pod stays ``Terminating`` in its last phase while no
        kubelet confirms it, so a Job with a ``podFailurePolicy`` (which replaces only ``Failed`` pods) waits until
        the node comes back (``ready=True``: its kubelet reports again, the dead containers as terminated, and the
        deleted pods end ``Failed``) or its Node object is deleted (``remove_node``: PodGC fails them)."""
        with self.store.lock:
            node = self.store.get("nodes", "", name)
            if node is None:
                raise not_found("nodes", "", name)
            stamp = now_rfc3339()
            taints = [t for t in node["spec"].get("taints", []) if t.get("key") != "node.kubernetes.io/unreachable"]
            if ready:
                node["status"]["conditions"] = ready_conditions(stamp)
                self.lost_nodes.pop(name, None)
                status = "NodeReady"
            else:
                for cond in node["status"]["conditions"]:
                    if cond["status"] != "Unknown":
                        cond.update({"status": "Unknown", "reason": "NodeStatusUnknown",
                                     "message": "Kubelet stopped posting node status.",
                                     "lastTransitionTime": stamp})
                taints += [{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
                           {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": stamp}]
                self.lost_nodes.setdefault(name, time.monotonic())
                status = "NodeNotReady"
                self._kill_node_processes(name)
                self._mark_pods_not_ready(name)
            if taints:
                node["spec"]["taints"] = taints
            else:
                node["spec"].pop("taints", None)
            self.store.touch("nodes", node)
            self.record_event("Node", node, "Normal", status, f"Node {name} status is now: {status}",
                              "node-controller")

    def _pods_on(self, node_name: str) -> list[Obj]:
        return [p for p in self.store.items("pods") if p["spec"].get("nodeName") == node_name]

    def _kill_node_processes(self, node_name: str) -> None:
        for pod in self._pods_on(node_name):
            runtime = self.runtimes.get(pod["metadata"]["uid"])
            for runs in (runtime.runs.values() if runtime else []):
                for run in runs:
                    run.signal(signal.SIGKILL)

    def _mark_pods_not_ready(self, node_name: str) -> None:
        """``MarkPodsNotReady``: the node controller's ``Ready=False`` on every pod of a lost node."""
        for pod in self._pods_on(node_name):
            if is_terminal(pod):
                continue
            for cond in pod["status"].get("conditions", []):
                if cond["type"] == "Ready" and cond["status"] != "False":
                    cond.update({"status": "False", "lastTransitionTime": now_rfc3339()})
                    self.store.touch("pods", pod)
                    self.record_event("Pod", pod, "Warning", "NodeNotReady", "Node is not ready", "node-controller")

    def _manage_nodes(self) -> None:
        """The taint eviction controller for lost nodes, PodGC for pods whose node is gone, device bookkeeping."""
        existing = {n["metadata"]["name"] for n in self.store.items("nodes")}
        now = time.monotonic()
        for pod in self.store.items("pods"):
            node_name = pod["spec"].get("nodeName")
            if not node_name:
                continue
            if node_name not in existing:
                self._collect_orphan(pod)
            elif node_name in self.lost_nodes and not is_terminal(pod):
                self._evict_tainted(pod, now - self.lost_nodes[node_name])
        live = {p["metadata"]["uid"] for p in self.store.items("pods") if not is_terminal(p)}
        for uid in [u for u in self.devices if u not in live]:
            del self.devices[uid]

    def _evict_tainted(self, pod: Obj, lost_for: float) -> None:
        """Taint-based eviction (``pkg/controller/tainteviction``): a pod that does not tolerate every NoExecute
        taint of its node is deleted at once, else after the smallest ``tolerationSeconds`` of the tolerations
        that match (never, if none of them has one), with ``DisruptionTarget`` reason ``DeletionByTaintManager``
        first, so a Job's ``podFailurePolicy`` can ignore the failure."""
        if pod["metadata"].get("deletionTimestamp"):
            return
        node = self.store.get("nodes", "", pod["spec"]["nodeName"])
        taints = [t for t in (node or {}).get("spec", {}).get("taints", []) if t.get("effect") == "NoExecute"]
        tolerations = pod["spec"].get("tolerations") or []
        if scheduler.untolerated_taint(taints, tolerations, ("NoExecute",)) is None:
            matching = [t for t in tolerations if any(scheduler.tolerates(t, taint) for taint in taints)]
            seconds = [t["tolerationSeconds"] for t in matching if t.get("tolerationSeconds") is not None]
            if not seconds or lost_for < max(0, min(seconds)):
                return
        meta = pod["metadata"]
        conditions = pod["status"].setdefault("conditions", [])
        conditions[:] = [c for c in conditions if c["type"] != "DisruptionTarget"]
        conditions.append(condition("DisruptionTarget", "True", "DeletionByTaintManager",
                                    "Taint manager: deleting due to NoExecute taint"))
        self.store.touch("pods", pod)
        self.record_event("Pod", pod, "Normal", "TaintManagerEviction",
                          f"Marking for deletion Pod {meta['namespace']}/{meta['name']}", "taint-eviction-controller")
        self._mark_deleted(pod, None)

    def _collect_orphan(self, pod: Obj) -> None:
        """PodGC's ``gcOrphaned`` (``pkg/controller/podgc``): a pod bound to a node that no longer exists is
        patched ``Failed`` with ``DisruptionTarget`` ``DeletionByPodGC`` "PodGC: node no longer exists" (unless it
        already ended) and force-deleted. Upstream waits a 40 s quarantine first; here it is at once."""
        meta = pod["metadata"]
        if meta.get("deletionTimestamp") and meta.get("deletionGracePeriodSeconds") == 0:
            return
        if not is_terminal(pod):
            pod["status"]["phase"] = "Failed"
            conditions = pod["status"].setdefault("conditions", [])
            conditions[:] = [c for c in conditions if c["type"] != "DisruptionTarget"]
            conditions.append(condition("DisruptionTarget", "True", "DeletionByPodGC", "PodGC: node no longer exists"))
            self.store.touch("pods", pod)
        self._mark_deleted(pod, 0)
        runtime = self.runtimes.get(meta["uid"])
        for runs in (runtime.runs.values() if runtime else []):
            for run in runs:
                run.signal(signal.SIGKILL)
                if run.process is not None:
                    try:
                        run.process.wait(timeout=5)
                    except Exception:  # noqa: BLE001 - a killed process that will not be reaped stays listed
                        pass
                run.poll()

    def _device_env(self, pod: Obj, container: Obj) -> dict[str, str]:
        """The NVIDIA device plugin's ``Allocate`` answer for a container that asks for ``nvidia.com/gpu``:
        ``NVIDIA_VISIBLE_DEVICES`` with that many of the node's free GPU ids (a restart keeps its devices; init
        containers may reuse what the app containers get, as the kubelet's device manager allows)."""
        limits = (container.get("resources") or {}).get("limits") or {}
        wanted = int(scheduler.quantity(limits.get(GPU_RESOURCE, "0")))
        spec = self.node_specs.get(pod["spec"].get("nodeName") or "")
        if not wanted or spec is None or not spec.gpu_ids:
            return {}
        uid, name = pod["metadata"]["uid"], container["name"]
        mine = self.devices.setdefault(uid, {})
        if name not in mine:
            app = {c["name"] for c in pod["spec"]["containers"]}
            held = {d for other in self._pods_on(spec.name) if other["metadata"]["uid"] != uid
                    and not is_terminal(other) for ids in self.devices.get(other["metadata"]["uid"], {}).values()
                    for d in ids}
            if name in app:
                held |= {d for c, ids in mine.items() if c in app for d in ids}
            mine[name] = [d for d in spec.gpu_ids if d not in held][:wanted]
        return {"NVIDIA_VISIBLE_DEVICES": ",".join(mine[name])}

    # ------------------------------------------------------------------------------------------ kubelet

    def _sync_pod(self, pod: Obj) -> None:
        """The kubelet's pod worker: start, watch and stop the pod's containers, then report its status."""
        if not pod["spec"].get("nodeName"):
            if pod["metadata"].get("deletionTimestamp") and not is_terminal(pod):
                pod["status"]["phase"] = "Failed"
                self.store.touch("pods", pod)
            return
        runtime = self.runtimes.setdefault(pod["metadata"]["uid"], PodRuntime())
        if runtime.disk_full and (pod["metadata"].get("deletionTimestamp") or is_terminal(pod)):
            runtime.disk_full = False
            self._refresh_disk_pressure(pod["spec"]["nodeName"])
        if pod["metadata"].get("deletionTimestamp"):
            self._terminate(pod, runtime)
        elif not is_terminal(pod):
            if not runtime.started:
                self._try_start(pod, runtime)
            else:
                self._watch_containers(pod, runtime)
        self._write_pod_status(pod, runtime)
        self._release_volumes(pod, runtime)

    def _try_start(self, pod: Obj, runtime: PodRuntime) -> None:
        hold = next((h for h in self.holds if h.reason in KUBELET_REASONS and h.applies(pod)), None)
        runtime.waiting = {}
        if hold is not None:
            for c in pod["spec"]["containers"]:
                runtime.waiting[c["name"]] = (hold.reason, hold.message)
            return
        for c in pod["spec"]["containers"]:
            message = next((m for pattern, m in self.image_errors.items() if fnmatch.fnmatchcase(c["image"], pattern)),
                           None)
            if message is not None:
                self._image_pull_failure(pod, runtime, c, message)
        if runtime.waiting:
            return
        for c in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
            if not self._pull_fits(pod, runtime, c):
                if pod["spec"].get("initContainers") and c["name"] not in {x["name"] for x in pod["spec"]["containers"]}:
                    for main in pod["spec"]["containers"]:
                        runtime.waiting[main["name"]] = ("PodInitializing", "")
                return
        runtime.started = True
        for c in pod["spec"].get("initContainers", [])[:1] or pod["spec"]["containers"]:
            self._start_container(pod, runtime, c)
        if pod["spec"].get("initContainers"):
            for c in pod["spec"]["containers"]:
                runtime.waiting[c["name"]] = ("PodInitializing", "")

    def _pull_fits(self, pod: Obj, runtime: PodRuntime, container: Obj) -> bool:
        """Pull the container's image onto the pod's node if it is not there; False (the kubelet's pull error, the
        node's DiskPressure) when it does not fit the disk (``kube_images``)."""
        node_name, image = pod["spec"]["nodeName"], container["image"]
        present = self.node_images.setdefault(node_name, set())
        if image in present:
            return True
        node = self.store.get("nodes", "", node_name) or {}
        raw = (node.get("status") or {}).get("capacity", {}).get("ephemeral-storage")
        used = sum(pull_bytes(i, self.image_sizes) for i in present)
        if raw is not None and used + pull_bytes(image, self.image_sizes) > runtime_limits.quantity_bytes(raw):
            self._image_pull_failure(pod, runtime, container, no_space_message(image))
            runtime.disk_full = True
            self._refresh_disk_pressure(node_name)
            return False
        present.add(image)
        return True

    def _refresh_disk_pressure(self, node_name: str) -> None:
        """The node's ``DiskPressure`` condition and ``disk-pressure`` taint: set while a pod on it waits for an
        image that does not fit, cleared when none does."""
        node = self.store.get("nodes", "", node_name)
        if node is None:
            return
        pressure = any(self.runtimes.get(p["metadata"]["uid"], PodRuntime()).disk_full for p in self._pods_on(node_name)
                       if not is_terminal(p) and not p["metadata"].get("deletionTimestamp"))
        conditions = node["status"].setdefault("conditions", [])
        current = next((c for c in conditions if c["type"] == "DiskPressure"), None)
        if current is not None and (current["status"] == "True") == pressure:
            return
        stamp = now_rfc3339()
        conditions[:] = [disk_pressure_condition(stamp, pressure) if c["type"] == "DiskPressure" else c
                         for c in conditions] if current is not None else [*conditions,
                                                                           disk_pressure_condition(stamp, pressure)]
        taints = [t for t in node["spec"].get("taints", []) if t.get("key") != DISK_PRESSURE_TAINT]
        if pressure:
            taints.append({"key": DISK_PRESSURE_TAINT, "effect": "NoSchedule"})
        if taints:
            node["spec"]["taints"] = taints
        else:
            node["spec"].pop("taints", None)
        self.store.touch("nodes", node)
        status = "NodeHasDiskPressure" if pressure else "NodeHasNoDiskPressure"
        self.record_event("Node", node, "Normal", status, f"Node {node_name} status is now: {status}", "kubelet")

    def _image_pull_failure(self, pod: Obj, runtime: PodRuntime, container: Obj, message: str) -> None:
        """``ErrImagePull`` on the first attempt, ``ImagePullBackOff`` after, with the kubelet's events."""
        image = container["image"]
        attempts = runtime.pull_failures[container["name"]] = runtime.pull_failures.get(container["name"], 0) + 1
        if attempts == 1:
            self.record_event("Pod", pod, "Normal", "Pulling", f'Pulling image "{image}"', "kubelet")
            self.record_event("Pod", pod, "Warning", "Failed", f'Failed to pull image "{image}": {message}',
                              "kubelet")
            self.record_event("Pod", pod, "Warning", "Failed", "Error: ErrImagePull", "kubelet")
            runtime.waiting[container["name"]] = ("ErrImagePull", message)
        else:
            self.record_event("Pod", pod, "Normal", "BackOff", f'Back-off pulling image "{image}"', "kubelet")
            self.record_event("Pod", pod, "Warning", "Failed", "Error: ImagePullBackOff", "kubelet")
            runtime.waiting[container["name"]] = ("ImagePullBackOff", f'Back-off pulling image "{image}"')

    def _start_container(self, pod: Obj, runtime: PodRuntime, container: Obj) -> None:
        name = container["name"]
        runtime.waiting.pop(name, None)
        try:
            env = self._container_env(pod, container)
        except LookupError as exc:
            runtime.waiting[name] = ("CreateContainerConfigError", str(exc))
            self.record_event("Pod", pod, "Warning", "Failed", f"Error: {exc}", "kubelet")
            runtime.started = False
            return
        argv = [kubelet.expand(a, env) for a in (container.get("command") or self.config.image_entrypoint)]
        argv += [kubelet.expand(a, env) for a in container.get("args") or []]
        if not argv:
            runtime.waiting[name] = ("CreateContainerError", "no command specified")
            self.record_event("Pod", pod, "Warning", "Failed", "Error: no command specified", "kubelet")
            return
        view = runtime_limits.container_view(pod, container, self.config.root, self._node_memory_bytes(pod))
        if container.get("workingDir"):
            cwd = container["workingDir"]
        else:
            default = self.config.image_workdir or self.config.root / "pods" / pod["metadata"]["name"]
            default.mkdir(parents=True, exist_ok=True)  # the image's WORKDIR exists in the image
            cwd = str(default)
        if self.isolation == "paths":
            argv = [runtime_limits.rewrite_paths(a, view.mounts) for a in argv]
            env = {k: runtime_limits.rewrite_paths(v, view.mounts) for k, v in env.items()}
            cwd = runtime_limits.rewrite_paths(cwd, view.mounts)
        self.record_event("Pod", pod, "Normal", "Pulled",
                          f'Container image "{container["image"]}" already present on machine', "kubelet")
        runtime_limits.make_volume_dirs(pod, self.config.root)
        starts = len(runtime.runs.get(name, []))
        scratch = runtime_limits.volume_root(self.config.root, pod["metadata"]["uid"]).parent.parent / \
            "containers" / f"{name}-{starts}"
        run = kubelet.launch(name, argv, env, cwd, view, self.isolation, scratch)
        run.fallback_to_logs = container.get("terminationMessagePolicy") == "FallbackToLogsOnError"
        runtime.runs.setdefault(name, []).append(run)
        if run.reason == "StartError":
            self.record_event("Pod", pod, "Warning", "Failed", f"Error: {run.message}", "kubelet")
            return
        self.memory.watch(run, view, self.isolation)
        self.record_event("Pod", pod, "Normal", "Created", f"Created container: {name}", "kubelet")
        self.record_event("Pod", pod, "Normal", "Started", f"Started container {name}", "kubelet")

    def _node_memory_bytes(self, pod: Obj) -> int:
        """The allocatable memory of the pod's node (a declared Node's, else this machine's)."""
        node = self.store.get("nodes", "", pod["spec"].get("nodeName", ""))
        raw = ((node or {}).get("status") or {}).get("allocatable", {}).get("memory")
        return runtime_limits.quantity_bytes(raw) if raw is not None else runtime_limits.host_memory_bytes()

    def _release_volumes(self, pod: Obj, runtime: PodRuntime) -> None:
        """A finished pod's emptyDirs are deleted once none of its containers runs (the kubelet's volume
        teardown); the logs stay, they are the runtime's."""
        if is_terminal(pod) and runtime.runs and not runtime.volumes_released and all(
                r.terminated for rs in runtime.runs.values() for r in rs):
            runtime.volumes_released = True
            runtime_limits.remove_volume_dirs(pod["metadata"]["uid"], self.config.root)

    def _container_env(self, pod: Obj, container: Obj) -> dict[str, str]:
        """The process environment: inherited basics, the image's ``ENV`` lines, the node's injections, then the
        pod's ``env`` in order."""
        env = {k: os.environ[k] for k in kubelet.INHERITED_ENV if k in os.environ}
        env.update(image_env(container["image"]))
        env["PATH"] = f"{self.images.bin_dir(container['image'])}{os.pathsep}{env.get('PATH', os.defpath)}"
        env["HOSTNAME"] = pod["spec"].get("hostname") or pod["metadata"]["name"]
        env["KUBERNETES_SERVICE_HOST"] = "127.0.0.1"
        env["KUBERNETES_SERVICE_PORT"] = str(self.config.api_port)
        env.update(self.config.node_env)
        env.update(self._device_env(pod, container))
        defined: dict[str, str] = {}
        for var in container.get("env") or []:
            source = var.get("valueFrom")
            value = self._env_value(pod, container, source) if source else kubelet.expand(var.get("value", ""),
                                                                                            defined)
            defined[var["name"]] = value
        env.update(defined)
        return env

    def _env_value(self, pod: Obj, container: Obj, source: Obj) -> str:
        """A ``valueFrom``: the downward API from the pod object; secrets and config maps do not exist here."""
        if source.get("fieldRef"):
            return self._field_ref(pod, source["fieldRef"]["fieldPath"])
        if source.get("resourceFieldRef"):
            ref = source["resourceFieldRef"]
            section, _, resource = ref["resource"].partition(".")
            raw = (container.get("resources") or {}).get(section, {}).get(resource)
            if raw is None:
                return "0"
            value, _ = parse_quantity(raw)
            divisor, _ = parse_quantity(ref.get("divisor", "1"))
            return str(int((value / divisor).to_integral_value(rounding="ROUND_CEILING")))
        for kind, what in (("secretKeyRef", "secret"), ("configMapKeyRef", "configmap")):
            if source.get(kind):
                if source[kind].get("optional"):
                    return ""
                raise LookupError(f'{what} "{source[kind].get("name", "")}" not found')
        return ""

    def _field_ref(self, pod: Obj, path: str) -> str:
        meta, spec = pod["metadata"], pod["spec"]
        for section in ("labels", "annotations"):
            prefix = f"metadata.{section}['"
            if path.startswith(prefix):
                return (meta.get(section) or {}).get(path[len(prefix):-2], "")
        simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
                  "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName": spec.get(
                      "serviceAccountName", ""), "status.hostIP": "127.0.0.1", "status.hostIPs": "127.0.0.1",
                  "status.podIP": "127.0.0.1", "status.podIPs": "127.0.0.1"}
        return simple.get(path, "")

    def _watch_containers(self, pod: Obj, runtime: PodRuntime) -> None:
        """Notice exits; run init containers in order; restart failed containers under ``OnFailure``."""
        spec = pod["spec"]
        inits = spec.get("initContainers", [])
        for i, c in enumerate(inits):
            runs = runtime.runs.get(c["name"], [])
            if not runs:
                self._start_container(pod, runtime, c)
                return
            if not runs[-1].poll():
                return
            if runs[-1].exit_code != 0:
                if spec.get("restartPolicy") == "OnFailure":
                    self._start_container(pod, runtime, c)
                return
            if i == len(inits) - 1:
                for main in spec["containers"]:
                    if main["name"] not in runtime.runs:
                        self._start_container(pod, runtime, main)
        for c in spec["containers"]:
            runs = runtime.runs.get(c["name"], [])
            if runs and runs[-1].poll() and runs[-1].exit_code != 0 and spec.get("restartPolicy") == "OnFailure":
                due = runtime.restart_at.setdefault(c["name"], time.monotonic() + self.config.pod_backoff_s)
                if time.monotonic() >= due:
                    runtime.restart_at.pop(c["name"], None)
                    self._start_container(pod, runtime, c)

    def _terminate(self, pod: Obj, runtime: PodRuntime) -> None:
        """A deleted pod: SIGTERM every container's group, SIGKILL when the grace period is over."""
        live = [rs[-1] for rs in runtime.runs.values() if rs and not rs[-1].poll()]
        if not live:
            return
        now = time.monotonic()
        grace = int(pod["metadata"].get("deletionGracePeriodSeconds", 30))
        if runtime.term_sent_at is None:
            runtime.term_sent_at, runtime.kill_at = now, now + grace
            for run in live:
                self.record_event("Pod", pod, "Normal", "Killing", f"Stopping container {run.name}", "kubelet")
                run.signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        elif runtime.kill_at is not None and now >= runtime.kill_at:
            for run in live:
                run.signal(signal.SIGKILL)

    def _container_status(self, pod: Obj, runtime: PodRuntime, container: Obj) -> dict[str, Any]:
        """One entry of ``containerStatuses`` from the container's starts (the last one, and the one before)."""
        name, image = container["name"], container["image"]
        runs = runtime.runs.get(name, [])
        status: dict[str, Any] = {"name": name, "image": image, "imageID": "", "ready": False,
                                  "restartCount": max(0, len([r for r in runs if r.container_id]) - 1),
                                  "started": False, "lastState": {}}
        if len(runs) >= 2:
            status["lastState"] = runs[-2].state()
        current = runs[-1] if runs else None
        if current is not None and runtime.restart_at.get(name) and current.terminated and \
                pod["spec"].get("restartPolicy") == "OnFailure":
            status["lastState"] = current.state()
            status["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": (
                f"back-off {self.config.pod_backoff_s:g}s restarting failed container={name} pod="
                f"{pod['metadata']['name']}_{pod['metadata']['namespace']}({pod['metadata']['uid']})")}}
            status["restartCount"] += 1
            return status
        if current is None:
            if pod["metadata"].get("deletionTimestamp") or is_terminal(pod):
                status["state"] = {"terminated": {
                    "exitCode": 137, "reason": "ContainerStatusUnknown",
                    "message": "The container could not be located when the pod was terminated",
                    "startedAt": None, "finishedAt": now_rfc3339()}}
                return status
            reason, message = runtime.waiting.get(name, ("ContainerCreating", ""))
            status["state"] = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
            return status
        status["state"] = current.state()
        if current.container_id:
            status["containerID"] = current.container_id
            status["imageID"] = f"{image.split('@')[0]}@sha256:{'0' * 64}"
        running = "running" in status["state"]
        status["ready"] = status["started"] = running
        return status

    def _write_pod_status(self, pod: Obj, runtime: PodRuntime) -> None:
        """``generateAPIPodStatus``: container statuses, phase (``getPhase``) and conditions; stored if changed."""
        spec, old = pod["spec"], pod["status"]
        if is_terminal(pod) and old.get("containerStatuses") and all(
                "terminated" in s["state"] for s in old["containerStatuses"]):
            return
        statuses = [self._container_status(pod, runtime, c) for c in spec["containers"]]
        inits = [self._container_status(pod, runtime, c) for c in spec.get("initContainers", [])]
        phase = self._phase(pod, statuses, inits)
        status = copy.deepcopy(old)
        status["phase"] = phase
        status["containerStatuses"] = statuses
        if inits:
            status["initContainerStatuses"] = inits
        status.setdefault("qosClass", qos_class(spec))
        status["hostIP"] = status["podIP"] = "127.0.0.1"
        status["hostIPs"] = status["podIPs"] = [{"ip": "127.0.0.1"}]
        if runtime.started or runtime.runs:
            status.setdefault("startTime", now_rfc3339())
        ready = phase == "Running" and all(s["ready"] for s in statuses)
        inits_done = all("terminated" in s["state"] and s["state"]["terminated"]["exitCode"] == 0 for s in inits)
        self._set_condition(status, "PodReadyToStartContainers", phase == "Running" or runtime.started)
        self._set_condition(status, "Initialized", inits_done, "" if inits_done else "ContainersNotInitialized")
        reason = "" if ready else ("PodCompleted" if phase in TERMINAL else "ContainersNotReady")
        self._set_condition(status, "Ready", ready, reason)
        self._set_condition(status, "ContainersReady", ready, reason)
        if status != old:
            pod["status"] = status
            self.store.touch("pods", pod)

    @staticmethod
    def _set_condition(status: Obj, kind: str, true: bool, reason: str = "") -> None:
        conditions = status.setdefault("conditions", [])
        value = "True" if true else "False"
        existing = next((c for c in conditions if c["type"] == kind), None)
        if existing is not None and existing["status"] == value and existing.get("reason", "") == reason:
            return
        conditions[:] = [c for c in conditions if c["type"] != kind]
        conditions.append(condition(kind, value, reason))

    @staticmethod
    def _phase(pod: Obj, statuses: list[dict[str, Any]], inits: list[dict[str, Any]]) -> str:
        """The kubelet's ``getPhase`` for ``restartPolicy`` ``Never`` / ``OnFailure``."""
        never = pod["spec"].get("restartPolicy") == "Never"
        if is_terminal(pod):
            return pod["status"]["phase"]
        failed_init = any("terminated" in s["state"] and s["state"]["terminated"]["exitCode"] != 0 for s in inits)
        if failed_init and never:
            return "Failed"
        if any("terminated" not in s["state"] for s in inits):
            return "Pending" if not pod["metadata"].get("deletionTimestamp") else "Failed"
        states = [s["state"] for s in statuses]
        if any("waiting" in st for st in states) and not any(s["lastState"] for s in statuses):
            return "Failed" if pod["metadata"].get("deletionTimestamp") else "Pending"
        if any("running" in st for st in states):
            return "Running"
        if all("terminated" in st for st in states):
            if all(st["terminated"]["exitCode"] == 0 for st in states):
                return "Succeeded"
            return "Failed" if never or pod["metadata"].get("deletionTimestamp") else "Running"
        return "Running"

    # ------------------------------------------------------------------------------------------ job controller

    def _owned_pods(self, job: Obj) -> list[Obj]:
        uid = job["metadata"]["uid"]
        return [p for p in self.store.items("pods", job["metadata"]["namespace"])
                if any(ref.get("uid") == uid for ref in p["metadata"].get("ownerReferences", []))]

    def _sync_job(self, job: Obj) -> None:
        """``syncJob``: count finished pods, decide success or failure, create or delete pods, write status."""
        tracker = self.trackers.setdefault(job["metadata"]["uid"], JobTracker())
        spec = job["spec"]
        pods = self._owned_pods(job)
        for pod in pods:
            finalizers = pod["metadata"].get("finalizers", [])
            if TRACKING_FINALIZER in finalizers and is_terminal(pod):
                self._account(job, tracker, pod)
                finalizers.remove(TRACKING_FINALIZER)
                self.store.touch("pods", pod)
        if tracker.finished_at is not None:
            return
        deleting = bool(job["metadata"].get("deletionTimestamp"))
        if tracker.finishing is None and not deleting:
            tracker.finishing = self._verdict(job, tracker, pods)
            if tracker.finishing is not None:
                self._start_finishing(job, tracker)
        active = [p for p in pods if not is_terminal(p)]
        if tracker.finishing is not None:
            for pod in active:
                if not pod["metadata"].get("deletionTimestamp"):
                    self._mark_deleted(pod, None)
                    self.record_event("Job", job, "Normal", "SuccessfulDelete",
                                      f"Deleted pod: {pod['metadata']['name']}", "job-controller")
            if not active:
                self._finish(job, tracker)
        elif not deleting and not spec.get("suspend"):
            self._create_missing_pods(job, tracker, pods)
        self._write_job_status(job, tracker)

    def _account(self, job: Obj, tracker: JobTracker, pod: Obj) -> None:
        """Count one finished pod: success, or a failure the ``podFailurePolicy`` ignores, counts or escalates."""
        spec = job["spec"]
        indexed = spec["completionMode"] == "Indexed"
        index = pod_index(pod)
        if pod["status"]["phase"] == "Succeeded":
            if not indexed:
                tracker.succeeded_count += 1
            elif index is not None and index not in tracker.succeeded | tracker.failed_indexes:
                tracker.succeeded.add(index)
                tracker.succeeded_count += 1
            return
        action, message = self._failure_action(job, pod, index)
        if action == "Ignore":
            if index is not None:
                tracker.index_ignored[index] = tracker.index_ignored.get(index, 0) + 1
            return
        tracker.failed_count += 1
        if index is not None:
            tracker.last_failure[index] = time.monotonic()
        if action == "FailJob" and tracker.finishing is None:
            tracker.finishing = ("Failed", "PodFailurePolicy", message)
            self._start_finishing(job, tracker)
        elif action == "FailIndex" and index is not None:
            tracker.failed_indexes.add(index)
        elif action == "Count" and index is not None and spec.get("backoffLimitPerIndex") is not None:
            tracker.index_failures[index] = tracker.index_failures.get(index, 0) + 1
            if tracker.index_failures[index] > spec["backoffLimitPerIndex"]:
                tracker.failed_indexes.add(index)

    @staticmethod
    def _failure_action(job: Obj, pod: Obj, index: int | None) -> tuple[str, str]:
        """The first ``podFailurePolicy`` rule that matches the failed pod (``pod_failure_policy.go``), or Count."""
        policy = job["spec"].get("podFailurePolicy") or {}
        meta, status = pod["metadata"], pod["status"]
        where = f"{meta['namespace']}/{meta['name']}"
        statuses = status.get("initContainerStatuses", []) + status.get("containerStatuses", [])
        for i, rule in enumerate(policy.get("rules") or []):
            codes = rule.get("onExitCodes")
            if codes:
                for cs in statuses:
                    terminated = cs.get("state", {}).get("terminated")
                    if not terminated or terminated["exitCode"] == 0:
                        continue
                    if codes.get("containerName") not in (None, cs["name"]):
                        continue
                    inside = terminated["exitCode"] in codes["values"]
                    if inside == (codes["operator"] == "In"):
                        return rule["action"], (f"Container {cs['name']} for pod {where} failed with exit code "
                                                f"{terminated['exitCode']} matching FailJob rule at index {i}")
            for pattern in rule.get("onPodConditions") or []:
                for cond in status.get("conditions", []):
                    if cond["type"] == pattern["type"] and cond["status"] == pattern.get("status", "True"):
                        return rule["action"], f"Pod {where} has condition {cond['type']} matching FailJob rule " \
                                               f"at index {i}"
        return "Count", ""

    def _verdict(self, job: Obj, tracker: JobTracker, pods: list[Obj]) -> tuple[str, str, str] | None:
        """Whether the Job has now succeeded or failed, with the condition's reason and message."""
        spec = job["spec"]
        restarts = sum(s.get("restartCount", 0) for p in pods if not is_terminal(p)
                       for s in p["status"].get("containerStatuses", []))
        if tracker.failed_count + restarts > spec["backoffLimit"]:
            return "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        if spec.get("maxFailedIndexes") is not None and len(tracker.failed_indexes) > spec["maxFailedIndexes"]:
            return "Failed", "MaxFailedIndexesExceeded", \
                "Job has exceeded the specified maximal number of failed indexes"
        deadline = spec.get("activeDeadlineSeconds")
        if deadline is not None and time.monotonic() - tracker.started >= deadline:
            return "Failed", "DeadlineExceeded", "Job was active longer than specified deadline"
        completions = spec.get("completions")
        if spec["completionMode"] == "Indexed":
            if len(tracker.succeeded | tracker.failed_indexes) >= completions:
                if tracker.failed_indexes:
                    return "Failed", "FailedIndexes", "Job has failed indexes"
                return "Complete", "CompletionsReached", "Reached expected number of succeeded pods"
        elif tracker.succeeded_count >= (completions if completions is not None else 1):
            return "Complete", "CompletionsReached", "Reached expected number of succeeded pods"
        return None

    def _start_finishing(self, job: Obj, tracker: JobTracker) -> None:
        """The interim condition (``FailureTarget`` / ``SuccessCriteriaMet``) that precedes the terminal one."""
        assert tracker.finishing is not None
        outcome, reason, message = tracker.finishing
        interim = "FailureTarget" if outcome == "Failed" else "SuccessCriteriaMet"
        job["status"].setdefault("conditions", []).append(condition(interim, "True", reason, message))
        self.store.touch("jobs", job)

    def _finish(self, job: Obj, tracker: JobTracker) -> None:
        """The terminal ``Complete`` / ``Failed`` condition, once no pod of the Job is left running."""
        assert tracker.finishing is not None
        outcome, reason, message = tracker.finishing
        job["status"]["conditions"].append(condition(outcome, "True", reason, message))
        if outcome == "Complete":
            job["status"]["completionTime"] = now_rfc3339()
            self.record_event("Job", job, "Normal", "Completed", "Job completed", "job-controller")
        else:
            self.record_event("Job", job, "Warning", reason, message, "job-controller")
        tracker.finished_at = time.monotonic()
        self._write_job_status(job, tracker)

    def _create_missing_pods(self, job: Obj, tracker: JobTracker, pods: list[Obj]) -> None:
        """One pod per index that has none running, up to ``parallelism`` (``manageJob``)."""
        spec = job["spec"]
        replace_when_failed = spec["podReplacementPolicy"] == "Failed"
        blocking = [p for p in pods if not is_terminal(p)
                    and (replace_when_failed or not p["metadata"].get("deletionTimestamp"))]
        active = [p for p in pods if not is_terminal(p) and not p["metadata"].get("deletionTimestamp")]
        room = spec["parallelism"] - len(active)
        if spec["completionMode"] != "Indexed":
            wanted = (spec.get("completions") or spec["parallelism"]) - tracker.succeeded_count - len(blocking)
            for _ in range(max(0, min(room, wanted))):
                self._create_pod(job, tracker, None)
            return
        busy = {pod_index(p) for p in blocking}
        now = time.monotonic()
        for index in range(spec["completions"]):
            if room <= 0:
                return
            if index in busy or index in tracker.succeeded or index in tracker.failed_indexes:
                continue
            if now - tracker.last_failure.get(index, -1e9) < self.config.pod_backoff_s:
                continue
            self._create_pod(job, tracker, index)
            room -= 1

    def _create_pod(self, job: Obj, tracker: JobTracker, index: int | None) -> None:
        """A pod from the template with everything the job controller and admission add to it."""
        meta, spec = job["metadata"], job["spec"]
        template = copy.deepcopy(spec["template"])
        labels = dict(template.get("metadata", {}).get("labels") or {})
        annotations = dict(template.get("metadata", {}).get("annotations") or {})
        pod_spec = template["spec"]
        prefix = f"{meta['name']}-"
        if index is not None:
            labels[INDEX_KEY] = annotations[INDEX_KEY] = str(index)
            prefix = f"{meta['name']}-{index}-"
            pod_spec.setdefault("hostname", f"{meta['name']}-{index}")
            if spec.get("backoffLimitPerIndex") is not None:
                annotations[FAILURE_COUNT_KEY] = str(tracker.index_failures.get(index, 0))
                annotations[IGNORED_COUNT_KEY] = str(tracker.index_ignored.get(index, 0))
            self._add_index_env(pod_spec)
        name = prefix + random_suffix()
        while self.store.get("pods", meta["namespace"], name) is not None:
            name = prefix + random_suffix()
        self._admit_pod_spec(pod_spec, self.config.unreachable_eviction_s)
        account = pod_spec["serviceAccountName"]
        if self.store.get("serviceaccounts", meta["namespace"], account) is None:
            # The ServiceAccount admission plugin refuses the pod, naming it by its generateName (name generation
            # comes later: plugin/pkg/admission/serviceaccount/admission.go, admission.NewForbidden); the job
            # controller reports that on the Job and tries again later (controller_utils.go, FailedCreate).
            self.record_event("Job", job, "Warning", "FailedCreate",
                              f'Error creating: pods "{prefix}" is forbidden: error looking up service account '
                              f'{meta["namespace"]}/{account}: serviceaccount "{account}" not found',
                              "job-controller")
            return
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "generateName": prefix, "namespace": meta["namespace"],
                            "labels": labels, "annotations": annotations, "finalizers": [TRACKING_FINALIZER],
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                                 "uid": meta["uid"], "controller": True,
                                                 "blockOwnerDeletion": True}]},
               "spec": pod_spec, "status": {"phase": "Pending", "qosClass": qos_class(pod_spec)}}
        self.store.add("pods", pod)
        self.record_event("Job", job, "Normal", "SuccessfulCreate", f"Created pod: {name}", "job-controller")

    @staticmethod
    def _add_index_env(pod_spec: Obj) -> None:
        """``JOB_COMPLETION_INDEX`` from the index label, on every container that does not set it already."""
        ref = {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
            "apiVersion": "v1", "fieldPath": f"metadata.labels['{INDEX_KEY}']"}}}
        for container in pod_spec.get("initContainers", []) + pod_spec["containers"]:
            env = container.setdefault("env", [])
            if not any(e.get("name") == "JOB_COMPLETION_INDEX" for e in env):
                env.append(copy.deepcopy(ref))

    @staticmethod
    def _admit_pod_spec(pod_spec: Obj, toleration_s: int = 300) -> None:
        """Pod defaults and admission: requests from limits, the service account, and DefaultTolerationSeconds'
        ``not-ready`` / ``unreachable`` NoExecute tolerations for ``toleration_s`` seconds."""
        for container in pod_spec.get("initContainers", []) + pod_spec["containers"]:
            resources = container.setdefault("resources", {})
            limits = resources.get("limits") or {}
            if limits:
                requests = resources.setdefault("requests", {})
                for key, value in limits.items():
                    requests.setdefault(key, value)
        pod_spec.setdefault("serviceAccountName", "default")
        pod_spec["serviceAccount"] = pod_spec["serviceAccountName"]
        pod_spec.setdefault("enableServiceLinks", True)
        pod_spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
        pod_spec.setdefault("priority", 0)
        tolerations = pod_spec.setdefault("tolerations", [])
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            if not any(t.get("key") == key for t in tolerations):
                tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute",
                                    "tolerationSeconds": toleration_s})

    def _write_job_status(self, job: Obj, tracker: JobTracker) -> None:
        """``.status`` from the pods and the tracker; zero counters omitted as the API server does."""
        spec = job["spec"]
        pods = self._owned_pods(job)
        old = job["status"]
        status: dict[str, Any] = {k: v for k, v in old.items() if k in ("conditions", "completionTime")}
        status["startTime"] = old.get("startTime") or now_rfc3339()
        live = [p for p in pods if not is_terminal(p)]
        counts = {"active": len([p for p in live if not p["metadata"].get("deletionTimestamp")]),
                  "succeeded": tracker.succeeded_count, "failed": tracker.failed_count}
        status.update({k: v for k, v in counts.items() if v})
        status["terminating"] = len([p for p in live if p["metadata"].get("deletionTimestamp")])
        status["ready"] = len([p for p in live if not p["metadata"].get("deletionTimestamp") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))])
        if spec["completionMode"] == "Indexed":
            if tracker.succeeded:
                status["completedIndexes"] = format_intervals(tracker.succeeded)
            if spec.get("backoffLimitPerIndex") is not None:
                status["failedIndexes"] = format_intervals(tracker.failed_indexes)
        status["uncountedTerminatedPods"] = {}
        if status != old:
            job["status"] = status
            self.store.touch("jobs", job)

    # ------------------------------------------------------------------------------------------ GC and TTL

    def _collect_garbage(self) -> None:
        """The garbage collector: the three propagation policies, orphaned dependents, finished deletions."""
        job_uids = {j["metadata"]["uid"] for j in self.store.items("jobs")}
        for job in self.store.items("jobs"):
            if job["metadata"].get("deletionTimestamp"):
                self._finalize_job_deletion(job)
        for pod in self.store.items("pods"):
            meta = pod["metadata"]
            owners = [r for r in meta.get("ownerReferences", []) if r.get("kind") == "Job"]
            owner_gone = bool(owners) and all(r["uid"] not in job_uids for r in owners)
            if owner_gone and not meta.get("deletionTimestamp"):
                self._mark_deleted(pod, None)
            if TRACKING_FINALIZER in meta.get("finalizers", []) and (owner_gone or not owners) and (
                    is_terminal(pod) or not owners):
                meta["finalizers"].remove(TRACKING_FINALIZER)
                self.store.touch("pods", pod)
            if meta.get("deletionTimestamp") and not meta.get("finalizers") and self._stopped(pod):
                self.store.remove("pods", pod)

    def _stopped(self, pod: Obj) -> bool:
        runtime = self.runtimes.get(pod["metadata"]["uid"])
        return is_terminal(pod) and (runtime is None or all(r.terminated for rs in runtime.runs.values() for r in rs))

    def _finalize_job_deletion(self, job: Obj) -> None:
        finalizers = job["metadata"].setdefault("finalizers", [])
        owned = self._owned_pods(job)
        changed = False
        if "orphan" in finalizers:
            for pod in owned:
                pod["metadata"]["ownerReferences"] = [r for r in pod["metadata"]["ownerReferences"]
                                                      if r.get("uid") != job["metadata"]["uid"]]
                self.store.touch("pods", pod)
            finalizers.remove("orphan")
            changed = True
        if "foregroundDeletion" in finalizers:
            for pod in owned:
                if not pod["metadata"].get("deletionTimestamp"):
                    self._mark_deleted(pod, None)
            if not owned:
                finalizers.remove("foregroundDeletion")
                changed = True
        if not finalizers:
            self.store.remove("jobs", job)
            self.trackers.pop(job["metadata"]["uid"], None)
        elif changed:
            self.store.touch("jobs", job)

    def _expire_finished_jobs(self) -> None:
        """The TTL-after-finished controller: a foreground delete once ``ttlSecondsAfterFinished`` has passed."""
        now = time.monotonic()
        for job in self.store.items("jobs"):
            ttl = job["spec"].get("ttlSecondsAfterFinished")
            tracker = self.trackers.get(job["metadata"]["uid"])
            if ttl is None or tracker is None or tracker.finished_at is None or job["metadata"].get(
                    "deletionTimestamp"):
                continue
            if now - tracker.finished_at >= ttl:
                self.delete_job(job["metadata"]["namespace"], job["metadata"]["name"], "Foreground", None)

    # ------------------------------------------------------------------------------------------ inspection

    def live_processes(self) -> list[int]:
        """Process ids of containers still running (for tests that prove nothing is left behind)."""
        with self.store.lock:
            runs = [r for rt in self.runtimes.values() for rs in rt.runs.values() for r in rs]
        alive = []
        for run in runs:
            if run.process is not None and run.process.poll() is None:
                alive.append(run.process.pid)
        return alive


#: ``ValidateJobSpecUpdate``: what a patch may not change (``maxFailedIndexes``, ``parallelism``, ``suspend``,
#: ``activeDeadlineSeconds``, labels and annotations may; ``completions`` has its own rule,
#: ``completions_update_error``).
IMMUTABLE_JOB_FIELDS = ("selector", "template", "completionMode", "podFailurePolicy", "backoffLimitPerIndex")


def completions_update_error(spec: Obj, old: Obj) -> FieldError | None:
    """``validateCompletions`` (kubernetes/kubernetes pkg/apis/batch/validation/validation.go), with the
    ElasticIndexedJob gate on (KEP-3715, GA and locked on since 1.31): ``completions`` is immutable unless the Job
    is Indexed, and an Indexed Job's may change only together with ``parallelism``, to the same value (scaling an
    elastic Indexed Job); the error, otherwise, is the API server's."""
    new, before = spec.get("completions"), old.get("completions")
    if new == before:
        return None
    if spec.get("completionMode") != "Indexed":
        return invalid("spec.completions", new, "field is immutable")
    if new is None:  # an Indexed Job without completions is refused by the spec's own validation
        return None
    if new != spec.get("parallelism"):
        return invalid("spec.completions", new, "can only be modified in tandem with spec.parallelism")
    return None


def _pointer(path: str) -> list[str]:
    """An RFC 6901 JSON pointer as its unescaped parts (``~1`` is ``/``, ``~0`` is ``~``)."""
    if not path.startswith("/"):
        raise bad_request(f"the server rejected our request due to an error in our request: invalid JSON "
                          f"pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def apply_json_patch(obj: Obj, operations: Any) -> Obj:
    """RFC 6902 ``add``, ``replace``, ``remove`` and ``test`` on a copy of ``obj``."""
    doc = copy.deepcopy(obj)
    if not isinstance(operations, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    for op in operations:
        parts = _pointer(str(op.get("path", "")))
        parent: Any = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.get(part)
            if parent is None:
                raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: "
                                               f"doc is missing path: {op.get('path')}", {})
        last, kind = parts[-1], op.get("op")
        if kind == "test":
            if parent.get(last) != op.get("value"):
                raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: "
                                               f"testing value {op.get('path')} failed", {})
        elif kind in ("add", "replace"):
            if kind == "replace" and last not in parent:
                raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: "
                                               f"replace operation does not apply: doc is missing key: "
                                               f"{op.get('path')}", {})
            parent[last] = copy.deepcopy(op.get("value"))
        elif kind == "remove":
            parent.pop(last, None)
        else:
            raise bad_request(f"Unexpected kind: {kind}")
    return doc


def merge_patch(obj: Any, patch: Any) -> Any:
    """RFC 7386 merge patch (what a strategic merge patch is for the maps and scalars a Job update touches)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(obj) if isinstance(obj, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def qos_class(pod_spec: Obj) -> str:
    """``GetPodQOS``: Guaranteed when every container's cpu and memory requests equal limits, BestEffort if none."""
    containers = pod_spec.get("initContainers", []) + pod_spec.get("containers", [])
    requests_any = limits_any = False
    guaranteed = True
    for c in containers:
        resources = c.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        for name in ("cpu", "memory"):
            limit, request = limits.get(name), requests.get(name, limits.get(name))
            limits_any |= limit is not None
            requests_any |= request is not None
            if limit is None or parse_quantity(limit)[0] != parse_quantity(request)[0]:
                guaranteed = False
    if not requests_any and not limits_any:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


__all__ = ["Cluster", "ClusterConfig", "Denial", "Hold", "Rejection", "format_intervals", "qos_class"]
